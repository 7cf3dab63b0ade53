"""The blocking facade, driven from plain threads (no trio in the test)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from queryloop.runtime.errors import BlockingCallOnTrioThread
from queryloop.runtime.host.blocking import BlockingRuntime
from queryloop.runtime.loop.events import UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.loop.transcript import INTERRUPTED_BY_USER, transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import scripted_tool, text_reply, tool_use, tools_reply


def test_a_query_is_iterated_from_sync_code_and_continues_the_conversation() -> None:
    model = ScriptedModel([tools_reply(tool_use("t1", "read")), text_reply("Done."), text_reply("Again.")])
    with BlockingRuntime() as rt:
        session = rt.open_session(QueryOptions(provider=model, tools=[scripted_tool("read", result="text")]))
        query = session.query("Fix the bug")
        labels = [event.label for event in query]
        assert labels[-1] == "result" and "user" in labels
        assert query.terminal is not None and query.terminal.reason == "completed"
        assert query.transitions == ["next_turn"]
        second = session.query("And again")
        assert second.wait().result == "Again."
        assert transcript_problems(session.transcript()) == []
        session.close()


def test_abort_from_another_thread_mid_tool_ends_aborted_tools() -> None:
    started = threading.Event()

    async def slow(args: Any, ctx: ToolContext) -> ToolOutput:
        started.set()
        import trio

        await trio.sleep(60)
        return "never"

    model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply()])
    with BlockingRuntime() as rt:
        session = rt.open_session(QueryOptions(provider=model, tools=[Tool(name="slow", call=slow)]))
        query = session.query("go")
        aborter = threading.Thread(target=lambda: (started.wait(10), session.abort("user")))
        aborter.start()
        events = list(query)
        aborter.join()
        assert query.terminal is not None and query.terminal.reason == "aborted_tools"
        results = [b for e in events if isinstance(e, UserMessage) and isinstance(e.content, list) for b in e.content]
        assert results[0]["content"] == INTERRUPTED_BY_USER
        assert transcript_problems(session.transcript()) == []


def test_queries_from_several_threads_at_once() -> None:
    with BlockingRuntime() as rt:
        outcomes: dict[int, str] = {}

        def worker(i: int) -> None:
            model = ScriptedModel([text_reply(f"answer {i}")])
            session = rt.open_session(QueryOptions(provider=model))
            outcomes[i] = session.query(f"question {i}").wait().result

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert outcomes == {i: f"answer {i}" for i in range(8)}


def test_it_works_inside_a_running_asyncio_loop() -> None:
    async def notebook_cell() -> str:
        with BlockingRuntime() as rt:
            session = rt.open_session(QueryOptions(provider=ScriptedModel([text_reply("from asyncio")])))
            return session.query("hi").wait().result

    assert asyncio.run(notebook_cell()) == "from asyncio"


async def test_using_it_from_a_trio_thread_raises_instead_of_deadlocking() -> None:
    with BlockingRuntime() as rt, pytest.raises(BlockingCallOnTrioThread):
        rt.open_session(QueryOptions(provider=ScriptedModel([text_reply()])))


def test_the_runtime_thread_ends_on_close() -> None:
    rt = BlockingRuntime().start()
    session = rt.open_session(QueryOptions(provider=ScriptedModel([text_reply()])))
    query = session.query("hi")
    assert next(iter(query)).label == "system:init"
    rt.close()  # the query is still open: closing the runtime ends it too
    assert not any(t.name == "queryloop-runtime" for t in threading.enumerate())
    with pytest.raises(Exception, match="not running"):
        rt.open_session(QueryOptions(provider=ScriptedModel([text_reply()])))
