"""MCP elicitation: a real server subprocess (`tests/mcp_server.py`) asks for the user's input mid-call.

Its `erase` tool asks "Erase <path>?" with a form (`sure`, `why`) before it answers. Over the 2026-07-28
protocol (`auto`) the question comes back as the call's `input_required` answer, and the SDK calls again
with the host's answer; over the 2025 one (`legacy`) it is a request of the server's own during the call.
Either way the host's `on_elicitation` handler answers it.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from queryloop import (
    McpElicitation,
    McpElicitationAnswer,
    McpStdioServer,
    QueryOptions,
    Runtime,
    ScriptedModel,
)
from tests.helpers import log_records, text_reply, tool_use, tools_reply
from tests.test_mcp import STDIO, WAIT_S, ask, result_of

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
    # The 2026-07-28 protocol asks within the call, so the handler is told which call asked; the 2025
    # protocol's request of the server's own names none.
    assert request.tool_use_id == ("e1" if protocol == "auto" else None)


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
