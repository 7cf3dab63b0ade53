"""MCP tools against a real MCP server subprocess (`tests/mcp/server.py`), over stdio and streamable HTTP.

No sleeps: the server's `cancellations` and `meet` tools wait (bounded) for what the test expects on
the server's side, and every wait of the test itself is bounded with `trio.fail_after`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from mcp_types import (
    AudioContent,
    BlobResourceContents,
    CallToolResult,
    EmbeddedResource,
    ImageContent,
    ResourceLink,
    TextContent,
    TextResourceContents,
)

from queryloop import (
    McpHttpServer,
    McpServerUnavailable,
    McpStdioServer,
    ProgressEvent,
    QueryOptions,
    Runtime,
    ScriptedModel,
    Tool,
    ToolContext,
)
from queryloop.runtime.mcp.content import error_text, result_output
from queryloop.runtime.mcp.names import tool_name
from tests import helpers
from tests.helpers import Ran, assert_settled, consume, log_records, text_reply, tool_use, tools_reply

SERVER = helpers.TESTS / "mcp" / "server.py"
STDIO = McpStdioServer(command=[sys.executable, str(SERVER), "stdio"])
WAIT_S = 20.0
"""Bound for anything a test awaits (a server starts in well under a second)."""

ECHO_SCHEMA = {
    "type": "object",
    "properties": {"text": {"title": "Text", "type": "string"}},
    "required": ["text"],
    "title": "echoArguments",
}


async def ask(runtime: Runtime, tools: list[Tool], *uses: dict[str, Any]) -> Ran:
    """One query whose first response makes `uses` (all at once), then ends; its events, all read."""
    model = ScriptedModel([tools_reply(*uses), text_reply("Done.")])
    session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
    with trio.fail_after(WAIT_S):
        ran = await consume(session, session.query("Go"), model)
    await assert_settled(ran)
    return ran


def result_of(ran: Ran, tool_use_id: str) -> tuple[Any, bool]:
    block = ran.tool_results()[tool_use_id]
    return block["content"], block["is_error"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
async def http_url() -> AsyncIterator[str]:
    """The test server over streamable HTTP on 127.0.0.1, a port the system picked; stopped after the test."""
    process = await trio.lowlevel.open_process([sys.executable, str(SERVER), "http"], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(WAIT_S):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(1)
                assert chunk, "the HTTP server exited before it listened"
                line += chunk
        word, port = line.split()
        assert word == b"port"
        yield f"http://127.0.0.1:{int(port)}/mcp"
    finally:
        process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()


# ---------------------------------------------------------------- the Tool type takes a raw schema


def test_a_tool_takes_a_raw_json_schema_passed_as_is_and_its_input_unvalidated() -> None:
    async def call(args: dict[str, Any], ctx: ToolContext) -> str:
        return str(args)

    raw = Tool(name="raw", call=call, description="d", input_schema=ECHO_SCHEMA)
    assert raw.api_schema() == {"name": "raw", "description": "d", "input_schema": ECHO_SCHEMA}
    assert raw.parse_input({"anything": 1}) == {"anything": 1}
    with pytest.raises(ValueError, match="not both"):
        Tool(name="both", call=call, input_schema=ECHO_SCHEMA, input_model=Tool)


def test_mcp_results_become_blocks_the_messages_api_takes() -> None:
    assert tool_name("my server", "read.file") == "mcp__my_server__read_file"
    assert result_output(CallToolResult(content=[TextContent(text="a"), TextContent(text="b")])) == "a\nb"
    assert result_output(CallToolResult(content=[], structured_content={"n": 1})) == '{"n": 1}'
    blocks = result_output(
        CallToolResult(
            content=[
                ImageContent(data="AAAA", mime_type="image/png"),
                ImageContent(data="AAAA", mime_type="image/tiff"),
                EmbeddedResource(resource=TextResourceContents(uri="file:///a.txt", text="hello")),
                EmbeddedResource(
                    resource=BlobResourceContents(uri="file:///b.jpg", blob="AAAA", mime_type="image/jpeg")
                ),
                EmbeddedResource(resource=BlobResourceContents(uri="file:///c.bin", blob="AAAA")),
                AudioContent(data="AAAA", mime_type="audio/wav"),
                ResourceLink(name="d", uri="file:///d.txt"),
            ]
        )
    )
    png = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    jpeg = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}
    assert isinstance(blocks, list) and blocks[0] == png and blocks[3] == jpeg
    texts = [block["text"] for block in blocks if block["type"] == "text"]
    assert texts == [
        "[image/tiff image, not shown: the model cannot read it]",
        "[resource file:///a.txt]\nhello",
        "[resource file:///c.bin: application/octet-stream content, not shown]",
        "[audio/wav audio, not shown: the model cannot read it]",
        "[resource link d file:///d.txt]",
    ]
    assert error_text(CallToolResult(content=[], is_error=True)) == "the tool reported an error without a message"


# ---------------------------------------------------------------- stdio


async def test_mcp_tools_join_a_session_as_mcp__server__tool_with_the_schema_as_is() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO)
        by_name = {t.name: t for t in tools}
        assert set(by_name) == {
            f"mcp__fx__{name}"
            for name in ("echo", "slow", "cancellations", "meet", "fail", "picture", "pid", "die", "erase")
        }
        echo = by_name["mcp__fx__echo"]
        assert echo.api_schema() == {
            "name": "mcp__fx__echo",
            "description": "Return the text as it came.",
            "input_schema": ECHO_SCHEMA,
        }
        ran = await ask(runtime, tools, tool_use("t1", "mcp__fx__echo", {"text": "hello"}))
        assert result_of(ran, "t1") == ("hello", False)
        assert {"name": "mcp__fx__echo", "description": "Return the text as it came.", "input_schema": ECHO_SCHEMA} in (
            ran.model.requests[0].tools
        )
        assert ran.handle.result is not None and ran.handle.result.subtype == "success"


async def test_mcp_text_and_images_become_tool_result_blocks() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO)
        ran = await ask(runtime, tools, tool_use("t1", "mcp__fx__picture"))
    content, is_error = result_of(ran, "t1")
    assert not is_error
    assert content[0] == {"type": "text", "text": "a pixel"}
    assert content[1]["type"] == "image" and content[1]["source"]["media_type"] == "image/png"


async def test_mcp_progress_becomes_progress_events() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO)
        ran = await ask(runtime, tools, tool_use("t1", "mcp__fx__slow", {"steps": 3}))
    progress = [e for e in ran.events if isinstance(e, ProgressEvent)]
    assert [(e.tool_use_id, e.data) for e in progress] == [
        ("t1", {"progress": float(step), "total": 3.0, "message": f"step {step}"}) for step in (1, 2, 3)
    ]
    assert ran.events.index(progress[-1]) < ran.labels.index("user")  # all before the tool's result
    assert result_of(ran, "t1") == ("done after 3 steps", False)


async def test_is_error_result_is_an_error_tool_result() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO)
        ran = await ask(runtime, tools, tool_use("t1", "mcp__fx__fail", {"reason": "disk full"}))
    content, is_error = result_of(ran, "t1")
    assert is_error
    assert "disk full" in content and content.startswith("<tool_use_error>")
    assert ran.handle.result is not None and ran.handle.result.subtype == "success"  # the loop went on


async def test_read_only_hint_makes_an_mcp_tool_concurrency_safe() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO)
        safe = {t.name for t in tools if t.concurrency_safe}
        assert safe == {"mcp__fx__meet", "mcp__fx__cancellations", "mcp__fx__picture", "mcp__fx__pid"}
        # `meet` answers only once both calls are in at once: run one after the other, the first would fail.
        meet = {"group": "g", "count": 2}
        ran = await ask(runtime, tools, tool_use("t1", "mcp__fx__meet", meet), tool_use("t2", "mcp__fx__meet", meet))
    assert result_of(ran, "t1") == ("g: met 2", False)
    assert result_of(ran, "t2") == ("g: met 2", False)


async def test_an_abort_cancels_an_mcp_call_and_the_server_gets_notifications_cancelled_and_stays_usable() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO)
        before = await ask(runtime, tools, tool_use("p1", "mcp__fx__pid"))
        slow = tool_use("t1", "mcp__fx__slow", {"steps": 1, "wait_for_cancel": True})
        model = ScriptedModel([tools_reply(slow), text_reply("never")])
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
        with trio.fail_after(WAIT_S):
            async with session.query("Go") as handle:
                async for event in handle:
                    if isinstance(event, ProgressEvent):  # the call is running on the server
                        await session.abort("user")
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        after = await ask(runtime, tools, tool_use("c1", "mcp__fx__cancellations"), tool_use("p2", "mcp__fx__pid"))
    records, is_error = result_of(after, "c1")
    assert not is_error
    cancelled = [r.split()[-1] for r in records.splitlines() if r.startswith("slow cancelled")]
    notified = [r.split()[-1] for r in records.splitlines() if r.startswith("notifications/cancelled")]
    assert len(cancelled) == 1 and notified == cancelled  # the notification named the call it cancelled
    assert result_of(after, "p2") == result_of(before, "p1")  # the same server process, still serving


async def test_a_dead_mcp_server_gives_error_results_and_is_restarted_on_next_use() -> None:
    with log_records() as records:
        async with Runtime.open() as runtime:
            tools = await runtime.open_mcp("fx", STDIO)
            first = await ask(runtime, tools, tool_use("p1", "mcp__fx__pid"))
            died = await ask(runtime, tools, tool_use("d1", "mcp__fx__die"))
            again = await ask(runtime, tools, tool_use("p2", "mcp__fx__pid"))
    content, is_error = result_of(died, "d1")
    assert is_error and "closed the connection" in content
    assert died.handle.result is not None and died.handle.result.subtype == "success"  # the session lived on
    old_pid, new_pid = int(result_of(first, "p1")[0]), int(result_of(again, "p2")[0])
    assert result_of(again, "p2")[1] is False
    assert new_pid != old_pid and not alive(old_pid) and not alive(new_pid)
    assert [r for r in records if r["level"] in ("ERROR", "CRITICAL") or r["exception"] is not None] == []
    assert any(r["level"] == "WARNING" and "closed the connection during die" in r["message"] for r in records)


async def test_one_mcp_client_per_server_is_shared_by_every_session() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", STDIO)
        with pytest.raises(ValueError, match="already open"):
            await runtime.open_mcp("fx", STDIO)
        pids: list[Any] = []

        async def one_session(tool_use_id: str) -> None:
            ran = await ask(runtime, tools, tool_use(tool_use_id, "mcp__fx__pid"))
            pids.append(result_of(ran, tool_use_id))

        async with trio.open_nursery() as nursery:
            for number in range(3):
                nursery.start_soon(one_session, f"p{number}")
    assert len(pids) == 3 and len(set(pids)) == 1


async def test_closing_the_runtime_stops_its_mcp_servers_even_mid_call() -> None:
    with trio.fail_after(WAIT_S):
        async with Runtime.open() as runtime:
            tools = await runtime.open_mcp("fx", STDIO)
            ran = await ask(runtime, tools, tool_use("p1", "mcp__fx__pid"))
            pid = int(result_of(ran, "p1")[0])
            assert alive(pid)
            slow = tool_use("t1", "mcp__fx__slow", {"steps": 1, "wait_for_cancel": True})
            model = ScriptedModel([tools_reply(slow), text_reply("never")])
            session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
            handle = session.query("Go")
            async for event in handle:
                if isinstance(event, ProgressEvent):
                    break  # the call runs on the server: the runtime closes now
    assert not alive(pid)  # stopped and reaped: no process (not even a zombie) is left


async def test_a_server_that_cannot_start_is_refused_by_open_mcp() -> None:
    exits = McpStdioServer(command=[sys.executable, "-c", "pass"])
    async with Runtime.open() as runtime:
        with pytest.raises(McpServerUnavailable, match="'gone'"):
            await runtime.open_mcp("gone", exits)
        with pytest.raises(McpServerUnavailable, match="'missing'"):
            await runtime.open_mcp("missing", McpStdioServer(command=["/nonexistent/mcp-server"]))
        tools = await runtime.open_mcp("gone", STDIO)  # the name is free again
        assert tools


def test_importing_queryloop_does_not_import_the_mcp_sdk() -> None:
    code = "import sys, queryloop; print(sorted(m for m in sys.modules if m.split('.')[0] in ('mcp', 'mcp_types')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_open_mcp_without_the_sdk_names_the_extra_to_install() -> None:
    code = """
import sys, trio
sys.modules["mcp"] = None  # as if the extra were not installed
from queryloop import McpStdioServer, Runtime

async def main() -> None:
    async with Runtime.open() as runtime:
        try:
            await runtime.open_mcp("x", McpStdioServer(command=["unused"]))
        except ModuleNotFoundError as error:
            print(error)

trio.run(main)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert "pip install 'queryloop[mcp]'" in done.stdout


# ---------------------------------------------------------------- streamable HTTP


async def test_a_streamable_http_server_serves_tools_progress_errors_and_aborts(http_url: str) -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("web", McpHttpServer(url=http_url))
        ran = await ask(
            runtime,
            tools,
            tool_use("e1", "mcp__web__echo", {"text": "over http"}),
            tool_use("s1", "mcp__web__slow", {"steps": 2}),
            tool_use("f1", "mcp__web__fail", {"reason": "nope"}),
        )
        assert result_of(ran, "e1") == ("over http", False)
        assert result_of(ran, "s1") == ("done after 2 steps", False)
        assert [e.data["progress"] for e in ran.events if isinstance(e, ProgressEvent)] == [1.0, 2.0]
        assert result_of(ran, "f1")[1] is True

        slow = tool_use("t1", "mcp__web__slow", {"steps": 1, "wait_for_cancel": True})
        model = ScriptedModel([tools_reply(slow), text_reply("never")])
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
        with trio.fail_after(WAIT_S):
            async with session.query("Go") as handle:
                async for event in handle:
                    if isinstance(event, ProgressEvent):
                        await session.abort("user")
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        # A 2026-07-28 HTTP connection cancels by closing the request's stream: no notification to wait for.
        after = await ask(runtime, tools, tool_use("c1", "mcp__web__cancellations", {"notified": False}))
    records, is_error = result_of(after, "c1")
    assert not is_error and "slow cancelled" in records


async def test_a_dead_http_server_gives_error_results_never_a_crashed_session(http_url: str) -> None:
    with log_records() as records:
        async with Runtime.open() as runtime:
            tools = await runtime.open_mcp("web", McpHttpServer(url=http_url))
            died = await ask(runtime, tools, tool_use("d1", "mcp__web__die"))
            later = await ask(runtime, tools, tool_use("e1", "mcp__web__echo", {"text": "anyone?"}))
    assert result_of(died, "d1")[1] is True
    content, is_error = result_of(later, "e1")
    assert is_error and "unavailable" in content  # connecting again failed: the server is not ours to restart
    assert later.handle.result is not None and later.handle.result.subtype == "success"
    assert [r for r in records if r["level"] in ("ERROR", "CRITICAL") or r["exception"] is not None] == []


def test_the_blocking_runtime_opens_an_mcp_server_for_its_sessions() -> None:
    from queryloop import BlockingRuntime

    with BlockingRuntime() as runtime:
        tools = runtime.open_mcp("fx", STDIO)
        model = ScriptedModel([tools_reply(tool_use("t1", "mcp__fx__echo", {"text": "hi"})), text_reply("Done.")])
        session = runtime.open_session(QueryOptions(provider=model, tools=tools))
        events = list(session.query("Go"))
        results = [b for e in events if e.type == "user" for b in e.content if isinstance(b, dict)]
        assert [(b["tool_use_id"], b["content"], b["is_error"]) for b in results] == [("t1", "hi", False)]
        session.close()
