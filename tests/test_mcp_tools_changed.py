"""An MCP server whose tools change (`tests/mcp_server.py --grow`, a real subprocess): listed again, and
`QueryOptions.mcp_servers` gives each query the list as it is then.

No sleeps: `Runtime.mcp_tools_after` waits (bounded) for the listing that follows the change.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from queryloop import McpStdioServer, QueryOptions, Runtime, ScriptedModel
from queryloop.runtime.mcp.servers import Protocol
from tests.helpers import Ran, assert_settled, consume, text_reply, tool_use, tools_reply

SERVER = Path(__file__).with_name("mcp_server.py")
WAIT_S = 20.0


def growing(protocol: Protocol) -> McpStdioServer:
    return McpStdioServer(command=[sys.executable, str(SERVER), "stdio", "--grow"], protocol=protocol)


async def query(session: Any, model: ScriptedModel) -> Ran:
    with trio.fail_after(WAIT_S):
        ran = await consume(session, session.query("Go"), model)
    await assert_settled(ran)
    return ran


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
async def test_mcp_tools_listed_again_when_the_server_says_they_changed(protocol: Protocol) -> None:
    async with Runtime.open() as runtime:
        first = await runtime.open_mcp("fx", growing(protocol))
        assert "mcp__fx__shout" not in {t.name for t in first}
        model = ScriptedModel(
            [
                tools_reply(tool_use("g1", "mcp__fx__grow", {"name": "shout"})),
                text_reply("Grown."),
                tools_reply(tool_use("s1", "mcp__fx__shout", {"text": "hi"})),
                text_reply("Shouted."),
            ]
        )
        session = await runtime.open_session(QueryOptions(provider=model, mcp_servers=["fx"]))
        grown = await query(session, model)
        assert grown.tool_results()["g1"]["content"] == "added shout"
        with trio.fail_after(WAIT_S):
            now = await runtime.mcp_tools_after("fx", first)
        assert {t.name for t in now} == {t.name for t in first} | {"mcp__fx__shout"}
        assert runtime.mcp_tools("fx") is now
        # The session's next query takes the new list: the model is offered the new tool, and it runs.
        shouted = await query(session, model)
        assert "mcp__fx__shout" in {t["name"] for t in model.requests[2].tools}
        assert "mcp__fx__shout" not in {t["name"] for t in model.requests[0].tools}
        assert shouted.tool_results()["s1"]["content"] == "shout: hi"
        assert shouted.tool_results()["s1"]["is_error"] is False


async def test_a_static_list_from_open_mcp_keeps_what_it_had() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", growing("auto"))
        names = [t.name for t in tools]
        model = ScriptedModel([tools_reply(tool_use("g1", "mcp__fx__grow", {"name": "shout"})), text_reply("ok")])
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
        await query(session, model)
        with trio.fail_after(WAIT_S):
            await runtime.mcp_tools_after("fx", tools)
        assert [t.name for t in tools] == names  # the host's list is its own; the runtime's is new


async def test_mcp_servers_naming_an_unknown_server_is_refused_when_the_session_opens() -> None:
    async with Runtime.open() as runtime:
        with pytest.raises(ValueError, match="no MCP server named 'nope'"):
            await runtime.open_session(QueryOptions(provider=ScriptedModel([]), mcp_servers=["nope"]))
        with pytest.raises(ValueError, match="no MCP server named 'nope'"):
            runtime.mcp_tools("nope")
