"""A host on asyncio: `Runtime.open()` says what to do instead (`queryloop.aio`, tested in test_aio.py);
`BlockingRuntime` works from a coroutine too."""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest
import trio

from queryloop import BlockingRuntime, LocalMessagesAPI, NotInTrio, QueryloopError, Runtime
from queryloop.runtime.loop.events import QueryEvent, ResultMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import text_reply, tool_use, tools_reply

MESSAGE = (
    "queryloop runs on trio: call Runtime.open() inside trio.run(...); from asyncio use"
    " queryloop.aio.AsyncioRuntime (a trio guest on the asyncio loop), from threads BlockingRuntime"
)


def test_opening_a_runtime_under_asyncio_raises_not_in_trio_saying_what_to_do() -> None:
    async def host() -> None:
        async with Runtime.open() as _:
            pytest.fail("a runtime opened under asyncio")

    with pytest.raises(NotInTrio) as caught:
        asyncio.run(host())
    assert str(caught.value) == MESSAGE
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, QueryloopError) and isinstance(caught.value, RuntimeError)


def test_a_tuned_runtime_refused_under_asyncio_leaves_the_collector_alone() -> None:
    before = gc.get_threshold()

    async def host() -> None:
        async with Runtime.open(tune_gc=True) as _:
            pass

    with pytest.raises(NotInTrio):
        asyncio.run(host())
    assert gc.get_threshold() == before


def test_the_local_messages_api_under_asyncio_raises_not_in_trio() -> None:
    async def host() -> None:
        async with LocalMessagesAPI([]) as _:
            pass

    with pytest.raises(NotInTrio, match=r"^queryloop runs on trio: call `async with LocalMessagesAPI\(\.\.\.\)`"):
        asyncio.run(host())


async def test_inside_trio_the_same_entry_points_open() -> None:
    async with LocalMessagesAPI([]) as api, Runtime.open() as runtime:
        assert api.port is not None and runtime.groups == {}


def test_from_a_coroutine_the_blocking_runtime_keeps_the_loop_serving_through_worker_threads() -> None:
    # The tool finishes only once the asyncio loop has run another task: if waiting for the query's
    # events blocked the loop, that task could not run and the tool would report False.
    tool_started = threading.Event()
    loop_ran = threading.Event()

    async def waits_for_the_loop(args: Any, ctx: ToolContext) -> ToolOutput:
        tool_started.set()
        return str(await trio.to_thread.run_sync(loop_ran.wait, 10.0))

    async def other_work() -> None:
        await asyncio.to_thread(tool_started.wait, 10.0)
        loop_ran.set()

    async def host() -> list[QueryEvent]:
        model = ScriptedModel([tools_reply(tool_use("t1", "wait")), text_reply("done")])
        options = QueryOptions(provider=model, tools=[Tool(name="wait", call=waits_for_the_loop)])
        rt = await asyncio.to_thread(BlockingRuntime().start)
        try:
            session = await asyncio.to_thread(rt.open_session, options)
            query = session.query("go")
            other = asyncio.create_task(other_work())
            events: list[QueryEvent] = []
            while (event := await asyncio.to_thread(next, query, None)) is not None:
                events.append(event)
            await other
            return events
        finally:
            await asyncio.to_thread(rt.close)

    events = asyncio.run(host())
    tool_results = [
        block["content"]
        for event in events
        if event.label == "user" and isinstance(content := getattr(event, "content", None), list)
        for block in content
    ]
    assert tool_results == ["True"]
    assert isinstance(events[-1], ResultMessage) and events[-1].result == "done"
