"""MCP elicitation: a real server subprocess (`tests/mcp/server.py`) asks for the user's input mid-call.

Its `erase` tool asks "Erase <path>?" with a form (`sure`, `why`) before it answers. Over the 2026-07-28
protocol (`auto`) the question comes back as the call's `input_required` answer, and the SDK calls again
with the host's answer; over the 2025 one (`legacy`) it is a request of the server's own during the call.
Either way the host's `on_elicitation` handler answers it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import trio

from queryloop import (
    BlockingRuntime,
    McpElicitation,
    McpElicitationAnswer,
    McpStdioServer,
    QueryOptions,
    Runtime,
    ScriptedModel,
    UserMessage,
)
from queryloop.aio import AsyncioRuntime
from queryloop.runtime.host.aio_bridge import Mode
from tests.helpers import log_records, text_reply, tool_use, tools_reply
from tests.mcp.test_mcp import STDIO, WAIT_S, ask, result_of

PROTOCOLS = ["auto", "legacy"]
ERASE = "mcp__fx__erase"


def server(protocol: str) -> McpStdioServer:
    return STDIO.model_copy(update={"protocol": protocol})


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_mcp_servers_elicitation_is_answered_by_the_hosts_handler(protocol: str) -> None:
    asked: list[McpElicitation] = []

    async def confirm(request: McpElicitation) -> McpElicitationAnswer:
        asked.append(request)
        return McpElicitationAnswer(action="accept", content={"sure": True, "why": "obsolete"})

    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", server(protocol), on_elicitation=confirm)
        ran = await ask(runtime, tools, tool_use("e1", ERASE, {"path": "a.txt"}))
    assert result_of(ran, "e1") == ("erased a.txt (obsolete)", False)
    assert len(asked) == 1
    request = asked[0]
    assert (request.server, request.message, request.mode) == ("fx", "Erase a.txt?", "form")
    assert request.requested_schema is not None
    assert set(request.requested_schema["properties"]) == {"sure", "why"}
    # The 2026-07-28 protocol asks within the call; the 2025 protocol's request of the server's own names
    # no call, but one call alone was in flight: either way the handler is told which call asked.
    assert request.tool_use_id == "e1"


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_declined_or_cancelled_elicitation_reaches_the_server_as_such(protocol: str) -> None:
    answers = iter(["decline", "cancel"])

    async def refuse(request: McpElicitation) -> McpElicitationAnswer:
        return McpElicitationAnswer(action=next(answers))

    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", server(protocol), on_elicitation=refuse)
        declined = await ask(runtime, tools, tool_use("e1", ERASE, {"path": "a.txt"}))
        cancelled = await ask(runtime, tools, tool_use("e2", ERASE, {"path": "b.txt"}))
    assert result_of(declined, "e1") == ("declined: a.txt kept", False)
    assert result_of(cancelled, "e2") == ("cancelled: b.txt kept", False)


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_without_a_handler_an_elicitation_is_refused_and_the_call_is_an_error_result(protocol: str) -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", server(protocol))
        ran = await ask(runtime, tools, tool_use("e1", ERASE, {"path": "a.txt"}))
    content, is_error = result_of(ran, "e1")
    assert is_error
    assert "MCP server fx: Client did not declare the form elicitation capability" in content


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_failing_elicitation_handler_is_an_error_answer_logged_and_the_session_goes_on(protocol: str) -> None:
    async def broken(request: McpElicitation) -> Any:
        if request.message == "Erase bad?":
            msg = "the host's form crashed"
            raise RuntimeError(msg)
        return {"action": "decline", "content": {"sure": False}}  # content with a decline: refused too

    with log_records() as records:
        async with Runtime.open() as runtime:
            tools = await runtime.open_mcp("fx", server(protocol), on_elicitation=broken)
            ran = await ask(runtime, tools, tool_use("e1", ERASE, {"path": "bad"}))
            odd = await ask(runtime, tools, tool_use("e2", ERASE, {"path": "odd"}))
            after = await ask(runtime, tools, tool_use("p1", "mcp__fx__pid"))
    content, is_error = result_of(ran, "e1")
    failed = "MCP server fx: the client's elicitation handler failed: RuntimeError: the host's form crashed"
    assert is_error and failed in content
    content, is_error = result_of(odd, "e2")
    assert is_error and "only 'accept' carries content" in content
    assert not result_of(after, "p1")[1]
    warnings = [r["message"] for r in records if r["level"] == "WARNING"]
    assert any("the host's form crashed" in w for w in warnings)
    assert any("only 'accept' carries content" in w for w in warnings)


async def test_an_abort_cancels_a_waiting_elicitation_handler_and_the_server_stays_usable() -> None:
    entered = trio.Event()
    unwound: list[str] = []

    async def wait_for_a_person(request: McpElicitation) -> McpElicitationAnswer:
        entered.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            unwound.append(request.message)
            raise
        raise AssertionError  # unreachable

    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO, on_elicitation=wait_for_a_person)
        model = ScriptedModel([tools_reply(tool_use("e1", ERASE, {"path": "a.txt"})), text_reply("never")])
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
        with trio.fail_after(WAIT_S):
            async with session.query("Go") as handle, trio.open_nursery() as nursery:

                async def abort_when_asked() -> None:
                    await entered.wait()
                    await session.abort("user")

                nursery.start_soon(abort_when_asked)
                events = [event async for event in handle]
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        assert session.live_tasks() == 0
        assert unwound == ["Erase a.txt?"]
        assert events[-1].label == "result"
        after = await ask(runtime, tools, tool_use("p1", "mcp__fx__pid"))
    assert not result_of(after, "p1")[1]


def erase_then_done() -> ScriptedModel:
    return ScriptedModel([tools_reply(tool_use("e1", ERASE, {"path": "a.txt"})), text_reply("Done.")])


def erase_result(events: list[Any]) -> tuple[Any, bool]:
    results = [b for e in events if isinstance(e, UserMessage) for b in e.content if isinstance(b, dict)]
    [block] = [b for b in results if b.get("tool_use_id") == "e1"]
    return block["content"], block["is_error"]


@pytest.mark.parametrize("mode", ["guest", "thread"])
def test_an_asyncio_hosts_elicitation_handler_runs_on_its_own_loop(mode: Mode) -> None:
    async def main() -> None:
        host_loop = asyncio.get_running_loop()
        ran_on: list[object] = []

        async def confirm(request: McpElicitation) -> McpElicitationAnswer:
            ran_on.append(asyncio.get_running_loop())
            await asyncio.sleep(0)  # a host's own asyncio objects are usable here
            return McpElicitationAnswer(action="accept", content={"sure": True, "why": request.server})

        async with AsyncioRuntime.open(mode=mode) as rt:
            tools = await rt.open_mcp("fx", STDIO, on_elicitation=confirm)
            session = await rt.open_session(QueryOptions(provider=erase_then_done(), tools=tools))
            query = session.query("Go")
            async with asyncio.timeout(WAIT_S), query:
                events = [event async for event in query]
        assert erase_result(events) == ("erased a.txt (fx)", False)
        assert ran_on == [host_loop]

    asyncio.run(main())


def test_an_abort_cancels_an_asyncio_hosts_waiting_elicitation_handler() -> None:
    async def main() -> None:
        entered = asyncio.Event()
        unwound: list[str] = []

        async def wait_for_a_person(request: McpElicitation) -> McpElicitationAnswer:
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                unwound.append(request.message)
                raise
            raise AssertionError  # unreachable

        async with AsyncioRuntime.open() as rt:
            tools = await rt.open_mcp("fx", STDIO, on_elicitation=wait_for_a_person)
            session = await rt.open_session(QueryOptions(provider=erase_then_done(), tools=tools))
            query = session.query("Go")
            async with asyncio.timeout(WAIT_S), query:
                await entered.wait()
                await session.abort("user")
                events = [event async for event in query]
            assert query.terminal is not None and query.terminal.reason == "aborted_tools"
            assert events[-1].label == "result"
            assert unwound == ["Erase a.txt?"]
            assert rt.host_tasks == 0 and session.live_tasks() == 0

    asyncio.run(main())


def test_a_blocking_hosts_elicitation_handler_runs_on_a_worker_thread_and_an_abort_stops_waiting_for_it() -> None:
    threads: list[int] = []
    entered, release = threading.Event(), threading.Event()

    def confirm(request: McpElicitation) -> McpElicitationAnswer:
        threads.append(threading.get_ident())
        if request.message == "Erase slow.txt?":
            entered.set()
            release.wait(WAIT_S)  # a person who does not answer until the query is aborted
        return McpElicitationAnswer(action="accept", content={"sure": True, "why": "asked"})

    with BlockingRuntime() as rt:
        tools = rt.open_mcp("fx", STDIO, on_elicitation=confirm)
        session = rt.open_session(QueryOptions(provider=erase_then_done(), tools=tools))
        assert erase_result(list(session.query("Go"))) == ("erased a.txt (asked)", False)

        slow = ScriptedModel([tools_reply(tool_use("e1", ERASE, {"path": "slow.txt"})), text_reply("never")])
        session = rt.open_session(QueryOptions(provider=slow, tools=tools))
        query = session.query("Go")
        assert entered.wait(WAIT_S)
        session.abort("user")
        events = list(query)
        assert query.terminal is not None and query.terminal.reason == "aborted_tools"
        assert events[-1].label == "result" and rt.call_sync(session.session.live_tasks) == 0
        release.set()
    assert len(threads) == 2 and threading.get_ident() not in threads
