"""Sync tools: a plain `def` runs in a worker thread, its result reaches the model, an abort or a timeout
answers it at once and abandons the thread, whose late result and progress reach no one.

No sleeps: the tests hold a tool's thread on a `threading.Event` they set themselves, and let trio
settle with `wait_all_tasks_blocked` (the thread is blocked on the event meanwhile, so nothing races).
A tool that finds itself on the trio thread (the old behaviour) returns at once instead of blocking
it, so that a regression fails the test instead of hanging it.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import pydantic
import pytest
import trio
import trio.testing

from queryloop import Runtime
from queryloop.runtime.loop.events import ProgressEvent, QueryEvent, ResultMessage, StreamEvent, UserMessage
from queryloop.runtime.loop.tools import Tool, ToolContext, tool
from queryloop.runtime.loop.transcript import INTERRUPT_MESSAGE_FOR_TOOL_USE, INTERRUPTED_BY_USER
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import Ran, assert_settled, open_session, run_query, text_reply, tool_use, tools_reply


class WordsArgs(pydantic.BaseModel):
    text: str


@tool(description="Count the words of a text")
def count_words(args: WordsArgs, ctx: ToolContext) -> str:
    return f"{len(args.text.split())} words"


@dataclass
class Blocker:
    """A sync tool's body that blocks its thread until the test releases it, then tries to report late."""

    trio_thread: threading.Thread
    started: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    late: list[str] = field(default_factory=list)

    def __call__(self, args: Any, ctx: ToolContext) -> str:
        try:
            self.started.set()
            if threading.current_thread() is self.trio_thread:
                return "ran on the trio thread"  # blocking here would hang the runtime (and the test)
            self.release.wait()
            ctx.progress_from_thread("late progress")  # abandoned: returns at once, emits nothing
            self.late.append("progress_from_thread returned")
            return "late result"
        finally:
            self.finished.set()


async def test_sync_tool_result_reaches_the_model() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "count_words", {"text": "one two three"})), text_reply("Three.")],
            tools=[count_words],
        )
        result = ran.tool_results()["t1"]
        assert result["content"] == "3 words" and not result["is_error"]
        sent = ran.model.requests[1].messages[-1]["content"][0]
        assert (sent["type"], sent["tool_use_id"], sent["content"]) == ("tool_result", "t1", "3 words")
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_sync_tool_runs_in_a_worker_thread() -> None:
    trio_thread = threading.current_thread()
    ran_on: list[threading.Thread] = []

    @tool()
    def where(args: WordsArgs, ctx: ToolContext) -> str:
        ran_on.append(threading.current_thread())
        return "here"

    assert where.runs_in_thread
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime, [tools_reply(tool_use("t1", "where", {"text": "x"})), text_reply()], tools=[where]
        )
        assert len(ran_on) == 1 and ran_on[0] is not trio_thread
        assert ran.tool_results()["t1"]["content"] == "here"
        await assert_settled(ran)


async def test_sync_tool_failure_becomes_an_error_result_and_the_loop_goes_on() -> None:
    @tool()
    def broken(args: WordsArgs, ctx: ToolContext) -> str:
        raise OSError("disk full")

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime, [tools_reply(tool_use("t1", "broken", {"text": "x"})), text_reply()], tools=[broken]
        )
        result = ran.tool_results()["t1"]
        assert result["is_error"] and result["content"] == "<tool_use_error>Error: disk full</tool_use_error>"
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_sync_tool_progress_from_its_thread_reaches_the_consumer_before_its_result() -> None:
    @tool()
    def steps(args: WordsArgs, ctx: ToolContext) -> str:
        for word in args.text.split():
            ctx.progress_from_thread(word)
        return "walked"

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime, [tools_reply(tool_use("t1", "steps", {"text": "a b c"})), text_reply()], tools=[steps]
        )
        progress = [e for e in ran.events if isinstance(e, ProgressEvent)]
        assert [(p.tool_use_id, p.data) for p in progress] == [("t1", "a"), ("t1", "b"), ("t1", "c")]
        result_at = next(i for i, e in enumerate(ran.events) if isinstance(e, UserMessage))
        assert all(ran.events.index(p) < result_at for p in progress)
        await assert_settled(ran)


def test_progress_from_thread_refuses_the_trio_thread() -> None:
    async def report(tool_use_id: str, data: Any) -> None:
        raise AssertionError("never reached")

    async def main() -> None:
        with pytest.raises(RuntimeError, match="thread"):
            ToolContext("t1", report).progress_from_thread("x")  # it would deadlock

    trio.run(main)


async def test_abort_while_a_sync_tool_blocks_ends_aborted_tools_at_once_and_discards_its_late_result() -> None:
    blocker = Blocker(threading.current_thread())
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "blocking")), text_reply("unused")])
        session = await open_session(runtime, model, tools=[Tool(name="blocking", call=blocker)])
        handle = session.query("go")
        seen: list[QueryEvent] = []
        rest: list[QueryEvent] = []
        try:
            async for event in handle:
                seen.append(event)
                if isinstance(event, StreamEvent) and event.event["type"] == "message_stop":
                    break
            await trio.to_thread.run_sync(blocker.started.wait)
            await trio.testing.wait_all_tasks_blocked()  # the tool's thread blocks; the loop waits on its turn
            session.abort_nowait("user")
            # At once: the abort's own call has written the ending while the thread still blocks.
            ready = list(handle._events.items)
            assert isinstance(ready[-1], ResultMessage) and ready[-1].subtype == "error_during_execution"

            async def drain() -> None:
                rest.extend([event async for event in handle])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                await trio.testing.wait_all_tasks_blocked()
                # The executor's work has unwound without the thread: the stream ended, nothing runs.
                stream_ended_while_blocked = not blocker.finished.is_set() and bool(rest)
                live_while_blocked = session.live_tasks()
                blocker.release.set()  # lets a drain stuck on the thread end, so that a regression fails here
            assert stream_ended_while_blocked and live_while_blocked == 0
        finally:
            blocker.release.set()
        await trio.to_thread.run_sync(blocker.finished.wait)  # the thread has returned its late result
        await trio.testing.wait_all_tasks_blocked()  # and whatever it handed to trio has run

        ran = Ran(session, handle, [*seen, *rest], model)
        assert ran.reason == "aborted_tools"
        assert ran.tool_results()["t1"] == {
            "type": "tool_result",
            "tool_use_id": "t1",
            "content": INTERRUPTED_BY_USER,
            "is_error": True,
        }
        assert ran.texts_of_user_events()[-1] == INTERRUPT_MESSAGE_FOR_TOOL_USE
        assert blocker.late == ["progress_from_thread returned"]
        assert not any(isinstance(e, ProgressEvent) for e in ran.events)
        assert not list(handle._events.items)  # nothing reached the consumer after the result
        transcript = await session.transcript()
        assert "late result" not in json.dumps([m.model_dump() for m in transcript])
        assert len(model.requests) == 1
        await assert_settled(ran)


async def test_sync_tool_timeout_answers_at_once_while_its_thread_still_blocks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    blocker = Blocker(threading.current_thread())
    try:
        async with Runtime.open() as runtime:
            # Virtual time: were the query to wait for the thread, the clock would jump here at once.
            with trio.move_on_after(3600) as guard:
                ran = await run_query(
                    runtime,
                    [tools_reply(tool_use("t1", "blocking")), text_reply()],
                    tools=[Tool(name="blocking", call=blocker, timeout_s=30)],
                )
            ended_while_blocked = not guard.cancelled_caught and not blocker.finished.is_set()
            blocker.release.set()
            assert ended_while_blocked
            result = ran.tool_results()["t1"]
            assert result["is_error"] and "timed out after 30s" in result["content"]
            assert ran.reason == "completed"
            await assert_settled(ran)
    finally:
        blocker.release.set()
    await trio.to_thread.run_sync(blocker.finished.wait)
    assert blocker.late == ["progress_from_thread returned"]


async def test_an_abandoned_sync_tool_blocked_on_a_slow_consumer_is_released() -> None:
    sending = trio.Event()
    returned = threading.Event()

    async def never_read(tool_use_id: str, data: Any) -> None:
        sending.set()
        await trio.sleep_forever()  # a consumer that never takes the event

    @tool()
    def reports(args: Any, ctx: ToolContext) -> str:
        ctx.progress_from_thread("step")  # blocks until sent, or until the tool is abandoned
        returned.set()
        return "done"

    context = ToolContext("t1", never_read)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(reports.run, {}, context)
        await sending.wait()
        nursery.cancel_scope.cancel()  # an abort: the tool is answered, its thread abandoned
    with trio.fail_after(10):  # a guard against a regression hanging the suite, not a wait for a race
        await trio.to_thread.run_sync(returned.wait, abandon_on_cancel=True)


def test_tool_kind_is_decided_when_the_tool_is_made() -> None:
    async def async_fn(args: Any, ctx: ToolContext) -> str:
        return "a"

    def sync_fn(args: Any, ctx: ToolContext) -> str:
        return "s"

    class AsyncCallable:
        async def __call__(self, args: Any, ctx: ToolContext) -> str:
            return "a"

    class SyncCallable:
        def __call__(self, args: Any, ctx: ToolContext) -> str:
            return "s"

    assert not Tool(name="a", call=async_fn).runs_in_thread
    assert not Tool(name="p", call=functools.partial(async_fn)).runs_in_thread
    assert not Tool(name="o", call=AsyncCallable()).runs_in_thread
    assert Tool(name="s", call=sync_fn).runs_in_thread
    assert Tool(name="c", call=SyncCallable()).runs_in_thread
    assert not tool()(async_fn).runs_in_thread
    assert tool()(sync_fn).runs_in_thread
    assert tool()(SyncCallable()).name == "SyncCallable"


def test_tool_decorator_refuses_what_is_neither_a_sync_nor_an_async_function() -> None:
    with pytest.raises(TypeError, match=r"function \(def or async def\), not of str"):
        tool()("not a function")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"function \(def or async def\), not int"):
        tool(name="n")(42)  # type: ignore[arg-type]

    def lines(args: Any, ctx: ToolContext) -> Any:
        yield "a line"

    async def chunks(args: Any, ctx: ToolContext) -> AsyncGenerator[str, None]:
        yield "a chunk"

    generators: list[Any] = [lines, chunks]
    for generator in generators:
        with pytest.raises(TypeError, match="generator"):
            tool()(generator)
        with pytest.raises(TypeError, match="generator"):
            Tool(name="g", call=generator)
