"""Backfill observable input, as Claude Code does it: before an assistant message is yielded, a tool's
`backfillObservableInput` adds derived fields to a copy of its tool_use input, for hooks and SDK
consumers; the message that goes back to the API keeps the input as the model wrote it (prompt caching),
and the copy is shown only when the backfill added fields, not when it only overwrote some."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from queryloop import AssistantMessage, PostToolUseInput, QueryOptions, Runtime, ScriptedModel, ToolContext, tool
from queryloop.runtime.loop.hooks import HookDecision
from queryloop.runtime.loop.restore import load_transcript
from tests.helpers import log_records, text_reply, tool_use, tools_reply


class EditArgs(BaseModel):
    path: str


def edit_tool(backfill: Any, received: list[EditArgs]) -> Any:
    @tool(description="Edit a file.", backfill_observable_input=backfill)
    async def edit(args: EditArgs, ctx: ToolContext) -> str:
        received.append(args)
        return f"edited {args.path}"

    return edit


def with_absolute_path(tool_input: dict[str, Any]) -> None:
    tool_input["absolute_path"] = f"/repo/{tool_input['path']}"


def expanding_path(tool_input: dict[str, Any]) -> None:
    tool_input["path"] = f"/repo/{tool_input['path']}"


async def run_edit(backfill: Any, transcript: Path | None = None) -> tuple[list[Any], ScriptedModel, list[Any], Any]:
    model = ScriptedModel([tools_reply(tool_use("t1", "edit", {"path": "a.py"})), text_reply("done")])
    received: list[EditArgs] = []
    hooked: list[dict[str, Any]] = []

    async def audit(hook_input: PostToolUseInput) -> HookDecision | None:
        hooked.append(hook_input.tool_input)
        return None

    options = QueryOptions(provider=model, tools=[edit_tool(backfill, received)], post_tool_use_hooks=[audit])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options, transcript=transcript)
        handle = session.query("Edit a.py")
        events = [event async for event in handle]
        await session.close()
    calls = [b for e in events if isinstance(e, AssistantMessage) for b in e.content if b["type"] == "tool_use"]
    return calls, model, hooked, received


def api_tool_uses(model: ScriptedModel) -> list[dict[str, Any]]:
    """The tool_use blocks of the conversation the second request sent back to the API."""
    return [
        b
        for m in model.requests[1].messages
        if m["role"] == "assistant" and isinstance(m["content"], list)
        for b in m["content"]
        if b["type"] == "tool_use"
    ]


async def test_backfill_observable_input_adds_fields_for_observers_and_leaves_the_api_input_as_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    calls, model, hooked, received = await run_edit(with_absolute_path, path)
    assert [c["input"] for c in calls] == [{"path": "a.py", "absolute_path": "/repo/a.py"}]
    assert [b["input"] for b in api_tool_uses(model)] == [{"path": "a.py"}]  # byte for byte, as the model wrote it
    assert hooked == [{"path": "a.py", "absolute_path": "/repo/a.py"}]
    assert received == [EditArgs(path="a.py")]  # the tool runs on the model's input
    logged = [b for m in load_transcript(path).messages if isinstance(m, AssistantMessage) for b in m.content]
    assert {"absolute_path": "/repo/a.py", "path": "a.py"} in [b.get("input") for b in logged]


async def test_backfill_observable_input_that_only_overwrites_is_not_shown_to_the_consumer() -> None:
    calls, model, hooked, received = await run_edit(expanding_path)
    assert [c["input"] for c in calls] == [{"path": "a.py"}]
    assert [b["input"] for b in api_tool_uses(model)] == [{"path": "a.py"}]
    assert hooked == [{"path": "/repo/a.py"}]  # hooks get the expanded input (Claude Code's toolExecution)
    assert received == [EditArgs(path="a.py")]


async def test_a_backfill_that_raises_is_logged_and_the_call_runs_on_its_input_as_sent() -> None:
    def broken(tool_input: dict[str, Any]) -> None:
        raise KeyError("no such field")

    with log_records() as records:
        calls, _, hooked, received = await run_edit(broken)
    assert [c["input"] for c in calls] == [{"path": "a.py"}] and hooked == [{"path": "a.py"}]
    assert received == [EditArgs(path="a.py")]
    assert any("backfill_observable_input raised" in r["message"] for r in records)


def test_a_tool_without_backfill_shows_its_message_as_it_is() -> None:
    @tool(description="Read.")
    async def read(args: EditArgs, ctx: ToolContext) -> str:
        return ""

    block = tool_use("t1", "read", {"path": "a.py"})
    message = AssistantMessage(message_id="msg_1", model="claude-sonnet-5-5", content=[block])
    assert read.observed_message(message, block) is message
    assert read.observable_input({"path": "a.py"}) is None
