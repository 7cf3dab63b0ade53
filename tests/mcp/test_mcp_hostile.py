"""An MCP server's tools, results and questions never crash, hang or flood a session: against the real
test server subprocess (`tests/mcp/server.py --hostile`), whose tools a careless client trips on.

- names that clean up alike (`a.b`, `a_b`) or run past 128 characters get names of their own, each
  routed to its own tool;
- a result too large is saved to a file (the model gets a preview and the path), one over
  `MAX_MCP_OUTPUT_TOKENS` is cut with a note, a tool's declared size limit is honoured;
- an elicitation handler still waiting when its call ends is cancelled, even when the server never
  cancels its request.

No sleeps: waits are bounded with `trio.fail_after`, and what must have happened once everything has
settled is checked after `trio.testing.wait_all_tasks_blocked`.
"""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from loguru import logger

from queryloop import McpElicitation, McpElicitationAnswer, McpStdioServer, QueryOptions, Runtime, ScriptedModel, Tool
from queryloop.runtime.mcp.calls import Call, CallsInFlight
from queryloop.runtime.mcp.limits import MAX_ERROR_CHARS, MAX_IMAGE_BYTES, LargeResults, without_oversized_images
from queryloop.runtime.mcp.names import MAX_NAME, tool_names
from queryloop.runtime.mcp.servers import Protocol
from tests.helpers import Ran, assert_settled, consume, text_reply, tool_use, tools_reply
from tests.mcp.test_mcp import SERVER, WAIT_S, result_of

LINE = "abcdefghijklmnopqrstuvwxyz\n"


def flood_text(chars: int) -> str:
    """What the server's `flood` tools return (`tests/mcp/server.py`)."""
    return (LINE * (chars // len(LINE) + 1))[:chars]


def hostile(results_dir: Path | None = None, protocol: Protocol = "auto") -> McpStdioServer:
    command = [sys.executable, str(SERVER), "stdio", "--hostile"]
    return McpStdioServer(command=command, results_dir=results_dir, protocol=protocol)


async def ask(tools: list[Tool], runtime: Runtime, *uses: dict[str, Any], **options: Any) -> Ran:
    """One query whose first response makes `uses`, then ends; its events, all read."""
    model = ScriptedModel([tools_reply(*uses), text_reply("Done.")])
    session = await runtime.open_session(QueryOptions(provider=model, tools=tools, **options))
    with trio.fail_after(WAIT_S):
        ran = await consume(session, session.query("Go"), model)
    await assert_settled(ran)
    return ran


def only(tools: list[Tool], *names: str) -> list[Tool]:
    """The tools named (the others of the hostile server are beside the point of a test)."""
    return [t for t in tools if t.name.removeprefix("mcp__fx__") in names]


def sent_result(ran: Ran, tool_use_id: str) -> Any:
    """The tool_result content the model was sent for `tool_use_id` (its second request)."""
    request = ran.model.requests[1]
    blocks = [b for m in request.messages if isinstance(m["content"], list) for b in m["content"]]
    [block] = [b for b in blocks if b.get("type") == "tool_result" and b["tool_use_id"] == tool_use_id]
    return block["content"]


def saved_path(preview: str) -> Path:
    found = re.search(r"Full output saved to: (\S+)\n", preview)
    assert found is not None, preview[:300]
    return Path(found[1])


# ---------------------------------------------------------------- names


async def test_tools_whose_names_clean_up_alike_get_names_of_their_own_each_reaching_its_own_tool() -> None:
    warnings: list[Any] = []
    sink = logger.add(lambda m: warnings.append(m.record), level="WARNING", filter="queryloop")
    logger.enable("queryloop")
    try:
        async with Runtime.open() as runtime:
            tools = await runtime.open_mcp("clash", hostile())
            names = [t.name for t in tools]
            dotted = next(n for n in names if n.startswith("mcp__clash__a_b_"))
            ran = await ask(tools, runtime, tool_use("u", "mcp__clash__a_b"), tool_use("d", dotted))
    finally:
        logger.remove(sink)
        logger.disable("queryloop")
    assert len(names) == len(set(names)), "two tools share a name: the API refuses the request"
    assert result_of(ran, "u") == ("I am a_b", False)  # the name already clean keeps the plain name
    assert result_of(ran, "d") == ("I am a.b", False)
    renamed = [r for r in warnings if "'a.b'" in r["message"] and dotted in r["message"]]
    assert renamed and renamed[0]["extra"]["mcp_server"] == "clash"


async def test_tool_names_past_128_characters_are_cut_to_distinct_valid_names_each_reaching_its_own_tool() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", hostile())
        long = sorted(t.name for t in tools if t.name.startswith("mcp__fx__long_"))
        ran = await ask(tools, runtime, *(tool_use(f"l{i}", name) for i, name in enumerate(long)))
    assert len(long) == 2 and long[0] != long[1]
    assert all(len(name) <= MAX_NAME for name in long)
    assert sorted(result_of(ran, f"l{i}")[0] for i in range(2)) == ["I am the long x", "I am the long y"]


def test_mcp_tool_names_are_the_same_whatever_order_the_server_lists_them_in() -> None:
    listed = ["a.b", "a_b", "a/b", "x" * 200, "x" * 199 + "y", "read", "re ad"]
    first = tool_names("srv", listed)
    for order in itertools.permutations(listed):
        assert tool_names("srv", order) == first
    assert len(set(first.values())) == len(listed)
    assert first["a_b"] == "mcp__srv__a_b" and first["read"] == "mcp__srv__read"
    assert all(len(name) <= MAX_NAME for name in first.values())


# ---------------------------------------------------------------- results


async def test_a_5_mb_result_is_saved_to_a_file_and_the_model_gets_a_preview_and_its_path(tmp_path: Path) -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", hostile(tmp_path))
        ran = await ask(only(tools, "flood"), runtime, tool_use("fx-call", "mcp__fx__flood", {"chars": 5_000_000}))
    content, is_error = result_of(ran, "fx-call")
    assert not is_error and isinstance(content, str)
    assert len(content) < 3_000, "the 5 MB result reached the consumer whole"
    assert content.startswith("<persisted-output>\nOutput too large (5000000 characters).")
    assert flood_text(2_000) in content
    path = saved_path(content)
    assert path.parent == (tmp_path / "tool-results").resolve()
    # Named by the project, never by an id from outside (one that no hex digest can contain by chance).
    assert "fx-call" not in path.name
    assert path.read_text() == flood_text(5_000_000)
    assert sent_result(ran, "fx-call") == content


async def test_a_result_over_max_mcp_output_tokens_is_cut_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAX_MCP_OUTPUT_TOKENS", "1000")
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", hostile())
        use = tool_use("f1", "mcp__fx__flood", {"chars": 10_000, "image": True})
        ran = await ask(only(tools, "flood"), runtime, use)
    content, is_error = result_of(ran, "f1")
    assert not is_error
    assert [block["type"] for block in content] == ["text", "text"]  # the image past the limit left out
    assert content[0]["text"] == flood_text(4_000)  # 1,000 tokens at 4 characters a token
    note = content[1]["text"]
    assert "OUTPUT TRUNCATED" in note and "1,000-token limit" in note and "MAX_MCP_OUTPUT_TOKENS" in note
    assert "1 of its 2 blocks, the last of them cut" in note


async def test_a_tools_declared_size_limit_is_honoured_smaller_and_larger(tmp_path: Path) -> None:
    uses = [
        tool_use("plain", "mcp__fx__flood", {"chars": 60_000}),
        tool_use("large", "mcp__fx__flood_declared", {"chars": 60_000}),  # declares 200,000
        tool_use("small", "mcp__fx__flood_small", {"chars": 5_000}),  # declares 1,000
    ]
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", hostile(tmp_path))
        # The session's own budget is raised so that only the MCP limits act here.
        flooding = only(tools, "flood", "flood_declared", "flood_small")
        ran = await ask(flooding, runtime, *uses, max_tool_result_chars=1_000_000)
    plain, large, small = (result_of(ran, i)[0] for i in ("plain", "large", "small"))
    assert plain.startswith("<persisted-output>") and saved_path(plain).read_text() == flood_text(60_000)
    assert large == flood_text(60_000) == sent_result(ran, "large")
    assert small.startswith("<persisted-output>\nOutput too large (5000 characters).")
    assert saved_path(small).read_text() == flood_text(5_000)


async def test_a_result_that_cannot_be_saved_is_cut_never_sent_whole(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("its tool-results folder cannot be made")
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", hostile(blocked))
        ran = await ask(only(tools, "flood"), runtime, tool_use("f1", "mcp__fx__flood", {"chars": 5_000_000}))
    content, is_error = result_of(ran, "f1")
    assert not is_error and content.startswith(flood_text(100_000))
    assert len(content) < 101_000 and "OUTPUT TRUNCATED" in content


async def test_an_error_result_of_a_megabyte_is_cut() -> None:
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", hostile())
        ran = await ask(only(tools, "yell"), runtime, tool_use("y1", "mcp__fx__yell", {"chars": 1_000_000}))
    content, is_error = result_of(ran, "y1")
    assert is_error and flood_text(MAX_ERROR_CHARS - 100) in content  # the server's words, from the start
    assert len(content) < MAX_ERROR_CHARS + 500
    assert re.search(r"error message truncated: 1,000,\d{3} characters, the first 10,000 shown", content)


# ---------------------------------------------------------------- elicitation


class Person:
    """An elicitation handler waiting for a person who never answers; it records being cancelled."""

    def __init__(self) -> None:
        self.asked: list[McpElicitation] = []
        self.entered = trio.Event()
        self.unwound: list[str] = []

    async def __call__(self, request: McpElicitation) -> McpElicitationAnswer:
        self.asked.append(request)
        self.entered.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            self.unwound.append(request.message)
            raise
        raise AssertionError  # unreachable


async def test_a_handler_waiting_when_its_call_is_aborted_is_cancelled_though_the_server_never_cancels() -> None:
    person = Person()
    async with Runtime.open() as runtime:
        # `hold` keeps its request open when its call is cancelled: only the client can end the wait.
        listed = await runtime.open_mcp("fx", hostile(protocol="legacy"), on_elicitation=person)
        tools = [t for t in listed if t.name in ("mcp__fx__hold", "mcp__fx__pid")]
        model = ScriptedModel([tools_reply(tool_use("h1", "mcp__fx__hold", {"path": "a.txt"})), text_reply("never")])
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools))
        with trio.fail_after(WAIT_S):
            async with session.query("Go") as handle:
                await person.entered.wait()
                await session.abort("user")
                events = [event async for event in handle]
            await trio.testing.wait_all_tasks_blocked()
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        assert events[-1].label == "result"
        assert person.unwound == ["Hold a.txt?"], "the handler still waits for an answer nobody needs"
        assert person.asked[0].tool_use_id == "h1"  # the one call in flight asked
        after = await ask(tools, runtime, tool_use("p1", "mcp__fx__pid"))
    assert not result_of(after, "p1")[1]


async def test_a_handler_waiting_when_its_call_times_out_is_cancelled(mock_clock: trio.testing.MockClock) -> None:
    person = Person()
    async with Runtime.open() as runtime:
        try:
            listed = await runtime.open_mcp("fx", hostile(protocol="legacy"), on_elicitation=person)
            [hold] = [t.model_copy(update={"timeout_s": 60.0}) for t in listed if t.name == "mcp__fx__hold"]
            model = ScriptedModel([tools_reply(tool_use("h1", hold.name, {"path": "b.txt"})), text_reply("Done.")])
            session = await runtime.open_session(QueryOptions(provider=model, tools=[hold]))
            async with session.query("Go") as handle:
                await person.entered.wait()
                mock_clock.jump(61)  # past the tool's timeout: time of the mock clock only, no sleep
                events = [event async for event in handle]
            await trio.testing.wait_all_tasks_blocked()
            unwound = list(person.unwound)  # before the runtime's close cancels whatever is left
        finally:
            mock_clock.rate = 1.0  # the SDK's stdio shutdown polls for the process's exit with sleeps
    content, is_error = result_of(Ran(session, handle, events, model), "h1")
    assert is_error and "timed out after 60s" in content
    assert unwound == ["Hold b.txt?"], "the handler still waits for an answer nobody needs"


async def test_a_question_no_call_names_is_cancelled_once_every_call_that_may_have_asked_has_ended() -> None:
    calls = CallsInFlight()
    outcomes: list[bool] = []

    async def handler(callers: list[Call], *, task_status: trio.TaskStatus[None]) -> None:
        with calls.asking(callers) as scope:
            task_status.started()
            await trio.sleep_forever()
        outcomes.append(scope.cancelled_caught)

    async with trio.open_nursery() as nursery:
        with calls.call("a"):
            with calls.call("b"):
                callers = calls.who_may_ask(None)  # the 2025 protocol: the request names no call
                assert sorted(c.tool_use_id for c in callers) == ["a", "b"]
                await nursery.start(handler, callers)
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == [], "cancelled while a call that may have asked still runs"
        await trio.testing.wait_all_tasks_blocked()
        assert outcomes == [True]
    assert calls.who_may_ask(None) == []


def _image(size_bytes: int) -> dict[str, Any]:
    data = "A" * (size_bytes * 4 // 3)
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


async def test_an_image_over_the_apis_5_mb_is_left_out_with_a_note_and_the_rest_kept(tmp_path: Path) -> None:
    small, huge = _image(1024), _image(MAX_IMAGE_BYTES + 3_000)
    output = [{"type": "text", "text": "two screenshots"}, huge, small]
    capped = await LargeResults("shots", tmp_path).capped(output, "toolu_1", None)
    assert isinstance(capped, list) and [b["type"] for b in capped] == ["text", "text", "image"]
    assert capped[0] == output[0] and capped[2] is small
    assert capped[1]["text"].startswith("[IMAGE LEFT OUT: the tool returned an image of 5.0 MB")
    assert without_oversized_images([small, {"type": "text", "text": "x"}]) == [small, {"type": "text", "text": "x"}]
    assert without_oversized_images("plain text") == "plain text"


async def test_a_rename_is_warned_once_however_often_the_tools_are_listed_again() -> None:
    from mcp_types import Tool as McpTool

    from queryloop.runtime.mcp.connection import McpConnection

    listed = [McpTool(name=n, inputSchema={"type": "object"}) for n in ("a.b", "a_b")]
    warnings: list[Any] = []
    sink = logger.add(lambda m: warnings.append(m.record), level="WARNING", filter="queryloop")
    logger.enable("queryloop")
    try:
        async with trio.open_nursery() as nursery:
            connection = McpConnection("clash", McpStdioServer(command=["true"]), nursery)
            first = [t.name for t in connection._tools_of(listed)]
            again = [t.name for t in connection._tools_of(listed)]  # a list_changed, a restart
    finally:
        logger.remove(sink)
        logger.disable("queryloop")
    assert first == again and len(set(first)) == 2
    assert len([r for r in warnings if "'a.b'" in r["message"]]) == 1
