"""`QueryOptions.mcp_servers` against the real MCP server subprocess (`tests/mcp/server.py`): each query
takes the server's tools as listed then (a server whose tools change, `--grow`, is listed again), and
the server's resources through `ListMcpResourcesTool` and `ReadMcpResourceTool`.

No sleeps: `Runtime.mcp_tools_after` waits (bounded) for the listing that follows a change.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest
import trio

from queryloop import (
    BlockingRuntime,
    McpRequestFailed,
    McpStdioServer,
    QueryOptions,
    Runtime,
    ScriptedModel,
    UserMessage,
)
from queryloop.aio import AsyncioRuntime
from queryloop.runtime.host.aio_bridge import Mode
from queryloop.runtime.mcp.resources import LIST_TOOL, READ_TOOL
from queryloop.runtime.mcp.servers import Protocol
from tests import helpers
from tests.helpers import Ran, assert_settled, consume, text_reply, tool_use, tools_reply

SERVER = helpers.TESTS / "mcp" / "server.py"
WAIT_S = 20.0


def growing(protocol: Protocol) -> McpStdioServer:
    return McpStdioServer(command=[sys.executable, str(SERVER), "stdio", "--grow"], protocol=protocol)


def grow_then_shout() -> ScriptedModel:
    """Two queries: the first has the server grow a tool `shout`, the second calls it."""
    return ScriptedModel(
        [
            tools_reply(tool_use("g1", "mcp__fx__grow", {"name": "shout"})),
            text_reply("Grown."),
            tools_reply(tool_use("s1", "mcp__fx__shout", {"text": "hi"})),
            text_reply("Shouted."),
        ]
    )


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
        model = grow_then_shout()
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


PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="


async def test_mcp_resources_are_listed_and_read_through_claude_codes_two_tools() -> None:
    async with Runtime.open() as runtime:
        await runtime.open_mcp("fx", growing("auto"))
        model = ScriptedModel(
            [
                tools_reply(
                    tool_use("l1", LIST_TOOL),
                    tool_use("r1", READ_TOOL, {"server": "fx", "uri": "notes://today"}),
                    tool_use("r2", READ_TOOL, {"server": "fx", "uri": "pictures://pixel"}),
                    tool_use("r3", READ_TOOL, {"server": "fx", "uri": "notes://nowhere"}),
                    tool_use("r4", READ_TOOL, {"server": "elsewhere", "uri": "notes://today"}),
                ),
                text_reply("Read."),
            ]
        )
        session = await runtime.open_session(QueryOptions(provider=model, mcp_servers=["fx"]))
        ran = await query(session, model)
        offered = {t["name"] for t in model.requests[0].tools}
        assert {LIST_TOOL, READ_TOOL} <= offered
        results = ran.tool_results()
        listed = json.loads(results["l1"]["content"])
        assert {"uri": "notes://today", "name": "today", "server": "fx", "mimeType": "text/plain"}.items() <= (
            next(r for r in listed if r["uri"] == "notes://today").items()
        )
        assert {r["uri"] for r in listed} == {"notes://today", "pictures://pixel"}
        assert results["r1"]["content"] == "[resource notes://today]\nBuy milk. Ship the release."
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PIXEL}}
        assert results["r2"]["content"] == [image] and results["r2"]["is_error"] is False
        assert results["r3"]["is_error"] is True and "notes://nowhere" in str(results["r3"]["content"])
        assert results["r4"]["is_error"] is True and "no MCP server named 'elsewhere'" in str(results["r4"]["content"])


async def test_a_session_without_mcp_servers_is_not_offered_the_resource_tools() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", growing("auto"))
        model = ScriptedModel([text_reply("Nothing to read.")])
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
        await query(session, model)
        offered = {t["name"] for t in model.requests[0].tools}
        assert not offered & {LIST_TOOL, READ_TOOL}
        assert "mcp__fx__echo" in offered


@pytest.mark.parametrize("mode", ["guest", "thread"])
def test_an_asyncio_host_opens_an_mcp_server_and_follows_its_tools(mode: Mode) -> None:
    async def main() -> None:
        async with AsyncioRuntime.open(mode=mode) as rt:
            first = await rt.open_mcp("fx", growing("auto"))
            model = grow_then_shout()
            session = await rt.open_session(QueryOptions(provider=model, mcp_servers=["fx"]))
            assert (await session.query("Grow").wait()).result == "Grown."
            async with asyncio.timeout(WAIT_S):
                now = await rt.mcp_tools_after("fx", first)
            assert "mcp__fx__shout" in {t.name for t in now} and rt.mcp_tools("fx") is now
            query = session.query("Shout")
            async with query:
                events = [event async for event in query]
            results = [b for e in events if isinstance(e, UserMessage) for b in e.content if isinstance(b, dict)]
            assert {"type": "tool_result", "tool_use_id": "s1", "content": "shout: hi", "is_error": False} in results

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["guest", "thread"])
def test_an_asyncio_host_calls_the_mcp_tools_open_mcp_returned(mode: Mode) -> None:
    """The tools `open_mcp` returns, given as `QueryOptions.tools`, call through the runtime's trio client:
    the asyncio host does not move them to its own loop, as it does the host's unmarked async tools."""

    async def main() -> None:
        async with AsyncioRuntime.open(mode=mode) as rt:
            tools = await rt.open_mcp("fx", growing("auto"))
            assert {t.runs_on for t in tools} == {"trio"}
            model = ScriptedModel([tools_reply(tool_use("e1", "mcp__fx__echo", {"text": "hi"})), text_reply("Done.")])
            session = await rt.open_session(QueryOptions(provider=model, tools=tools))
            query = session.query("Echo")
            async with asyncio.timeout(WAIT_S), query:
                events = [event async for event in query]
            results = [b for e in events if isinstance(e, UserMessage) for b in e.content if isinstance(b, dict)]
            assert {"type": "tool_result", "tool_use_id": "e1", "content": "hi", "is_error": False} in results
            assert rt.host_tasks == 0

    asyncio.run(main())


def test_a_blocking_host_follows_an_mcp_servers_tools() -> None:
    with BlockingRuntime() as rt:
        first = rt.open_mcp("fx", growing("auto"))
        model = grow_then_shout()
        session = rt.open_session(QueryOptions(provider=model, mcp_servers=["fx"]))
        assert session.query("Grow").wait().result == "Grown."
        now = rt.mcp_tools_after("fx", first, timeout_s=WAIT_S)
        assert {t.name for t in now} == {t.name for t in first} | {"mcp__fx__shout"}
        assert rt.mcp_tools("fx") is now
        assert session.query("Shout").wait().result == "Shouted."
        with pytest.raises(TimeoutError, match="did not list its tools again"):
            rt.mcp_tools_after("fx", now, timeout_s=0)  # nothing has changed since


async def test_mcp_prompts_are_listed_and_filled_in_as_the_blocks_of_a_user_message() -> None:
    async with Runtime.open() as runtime:
        await runtime.open_mcp("fx", growing("auto"))
        prompts = await runtime.mcp_prompts("fx")
        assert [p["name"] for p in prompts] == ["review"] and prompts[0]["description"] == "Review one file"
        assert {(a["name"], a["required"]) for a in prompts[0]["arguments"]} == {("file", True), ("focus", False)}
        blocks = await runtime.mcp_prompt("fx", "review", {"file": "a.py"})
        assert blocks == [{"type": "text", "text": "Review a.py, looking for bugs."}]
        model = ScriptedModel([text_reply("Looks fine.")])
        session = await runtime.open_session(QueryOptions(provider=model))
        assert (await session.query(blocks).wait()).result == "Looks fine."
        sent = model.requests[0].messages[-1]["content"]
        assert {"type": "text", "text": "Review a.py, looking for bugs."} in sent
        # The server's refusals, in its words (this one answers both with its generic internal error).
        with pytest.raises(McpRequestFailed, match=r"^MCP server fx: .* \(error -?\d+\)$"):
            await runtime.mcp_prompt("fx", "nope")
        with pytest.raises(McpRequestFailed, match=r"^MCP server fx: .* \(error -?\d+\)$"):
            await runtime.mcp_prompt("fx", "review")  # its required argument missing
        # The connection survives the server's refusals: the next request is answered.
        assert await runtime.mcp_prompt("fx", "review", {"file": "b.py", "focus": "typos"}) == [
            {"type": "text", "text": "Review b.py, looking for typos."}
        ]


def test_the_asyncio_and_blocking_hosts_fill_in_mcp_prompts() -> None:
    async def on_asyncio() -> list[Any]:
        async with AsyncioRuntime.open() as rt:
            await rt.open_mcp("fx", growing("auto"))
            return [await rt.mcp_prompts("fx"), await rt.mcp_prompt("fx", "review", {"file": "a.py"})]

    with BlockingRuntime() as rt:
        rt.open_mcp("fx", growing("auto"))
        blocking = [rt.mcp_prompts("fx"), rt.mcp_prompt("fx", "review", {"file": "a.py"})]
    assert asyncio.run(on_asyncio()) == blocking
    assert blocking[1] == [{"type": "text", "text": "Review a.py, looking for bugs."}]
