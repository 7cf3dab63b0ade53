"""PostToolUse and PostToolUseFailure hooks in the Agent SDK's shape, run by real scripted queries: which one
fires (a call that succeeded, one that failed, one that never ran), what Claude Code does with their answers
(block, updatedToolOutput, additionalContext, continue: false), the older `post_tool_use_hooks` running as
PostToolUse hooks, and a hook that fails being a non-blocking hook error.
"""

from __future__ import annotations

from typing import Any

import pytest

from queryloop import (
    Deny,
    HookContext,
    HookDecision,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    PostToolUseInput,
    Runtime,
)
from queryloop.runtime.loop.events import AttachmentMessage
from tests.actors.test_pre_tool_use_hooks import hook_errors, run_write
from tests.helpers import Ran, assert_settled, run_query, scripted_tool, text_reply, tool_use, tools_reply


def attachments(ran: Ran, kind: str) -> list[dict[str, Any]]:
    return [e.attachment for e in ran.events if isinstance(e, AttachmentMessage) and e.attachment["type"] == kind]


class Seen:
    """A hook recording each `input_data` it is given, answering `answer`."""

    def __init__(self, answer: HookJSONOutput | None = None) -> None:
        self.inputs: list[dict[str, Any]] = []
        self.answer: HookJSONOutput = answer or {}

    async def __call__(self, input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        self.inputs.append(dict(input_data))
        return self.answer


async def run_failing_write(hooks: dict[str, Any]) -> Ran:
    """One `write` call (t1) whose tool raises, then the model's answer, with `hooks`."""
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "write", {"path": "a.txt"})), text_reply("Answered.")],
            tools=[scripted_tool("write", raises="disk on fire")],
            hooks=hooks,
        )
        await assert_settled(ran)
        return ran


async def test_post_tool_use_fires_after_a_call_that_succeeded_with_its_response() -> None:
    post, failure = Seen(), Seen()
    await run_write(
        {"hooks": {"PostToolUse": [HookMatcher(hooks=[post])], "PostToolUseFailure": [HookMatcher(hooks=[failure])]}}
    )
    assert failure.inputs == []
    ((data,),) = [post.inputs]
    assert data["hook_event_name"] == "PostToolUse" and data["tool_name"] == "write"
    assert data["tool_input"] == {"path": "a.txt"} and data["tool_use_id"] == "t1"
    assert data["tool_response"] == "wrote" and isinstance(data["duration_ms"], int)


async def test_post_tool_use_failure_fires_instead_for_a_call_that_failed() -> None:
    post, failure = Seen(), Seen()
    await run_failing_write(
        {"PostToolUse": [HookMatcher(hooks=[post])], "PostToolUseFailure": [HookMatcher(hooks=[failure])]}
    )
    assert post.inputs == []
    ((data,),) = [failure.inputs]
    assert data["hook_event_name"] == "PostToolUseFailure" and data["tool_use_id"] == "t1"
    assert "disk on fire" in data["error"] and "<tool_use_error>" not in data["error"]
    assert data["is_interrupt"] is False


async def test_a_call_that_never_ran_fires_neither_event() -> None:
    post, failure = Seen(), Seen()

    async def refuses(name: str, tool_input: dict[str, Any]) -> Deny:
        return Deny(message="no")

    await run_write(
        {"hooks": {"PostToolUse": [HookMatcher(hooks=[post])], "PostToolUseFailure": [HookMatcher(hooks=[failure])]}},
        can_use_tool=refuses,
    )
    assert post.inputs == [] and failure.inputs == []


async def test_a_block_sends_its_reason_to_the_model_after_the_result() -> None:
    hook = Seen({"decision": "block", "reason": "lint the file first"})
    ran = await run_write({"hooks": {"PostToolUse": [HookMatcher(matcher="write", hooks=[hook])]}})
    assert ran.tool_results()["t1"]["content"] == "wrote"  # it ran all the same
    assert [a["content"] for a in attachments(ran, "hook_blocking_error")] == [
        "PostToolUse:write hook blocking error: lint the file first"
    ]
    assert "lint the file first" in str(ran.model.requests[1].messages)
    assert ran.reason == "completed"


async def test_updated_tool_output_replaces_what_the_model_gets() -> None:
    hook = Seen({"hookSpecificOutput": {"hookEventName": "PostToolUse", "updatedToolOutput": "redacted"}})
    ran = await run_write({"hooks": {"PostToolUse": [HookMatcher(hooks=[hook])]}})
    assert ran.tool_results()["t1"]["content"] == "redacted"
    assert "wrote" not in str(ran.model.requests[1].messages)


async def test_updated_mcp_tool_output_counts_only_for_an_mcp_tool() -> None:
    hook = Seen({"hookSpecificOutput": {"hookEventName": "PostToolUse", "updatedMCPToolOutput": "redacted"}})
    ran = await run_write({"hooks": {"PostToolUse": [HookMatcher(hooks=[hook])]}})
    assert ran.tool_results()["t1"]["content"] == "wrote"  # `write` is not an MCP tool


async def test_an_updated_output_of_the_wrong_shape_is_a_hook_error_and_the_output_is_kept() -> None:
    hook = Seen({"hookSpecificOutput": {"hookEventName": "PostToolUse", "updatedToolOutput": 42}})
    ran = await run_write({"hooks": {"PostToolUse": [HookMatcher(hooks=[hook])]}})
    assert ran.tool_results()["t1"]["content"] == "wrote"
    (error,) = hook_errors(ran)
    assert error.data["hook_event"] == "PostToolUse" and "updatedToolOutput" in str(error.content)


@pytest.mark.parametrize("event", ["PostToolUse", "PostToolUseFailure"])
async def test_continue_false_ends_the_query_once_the_batch_is_answered(event: str) -> None:
    hook = Seen({"continue_": False, "stopReason": "enough"})
    matchers = {event: [HookMatcher(hooks=[hook])]}
    ran = await (run_write({"hooks": matchers}) if event == "PostToolUse" else run_failing_write(matchers))
    assert [a["message"] for a in attachments(ran, "hook_stopped_continuation")] == ["enough"]
    assert ran.reason == "hook_stopped" and len(ran.model.requests) == 1


async def test_failure_hooks_additional_context_reaches_the_model() -> None:
    hook = Seen(
        {"hookSpecificOutput": {"hookEventName": "PostToolUseFailure", "additionalContext": "retry with b.txt"}}
    )
    ran = await run_failing_write({"PostToolUseFailure": [HookMatcher(hooks=[hook])]})
    assert "PostToolUseFailure:write hook additional context: retry with b.txt" in str(ran.model.requests[1].messages)


async def test_a_hook_that_raises_is_a_non_blocking_error_named_after_its_event() -> None:
    async def broken(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        raise ValueError("boom")

    ran = await run_failing_write({"PostToolUseFailure": [HookMatcher(hooks=[broken])]})
    (error,) = hook_errors(ran)
    assert error.data["hook_event"] == "PostToolUseFailure" and error.data["tool_use_id"] == "t1"
    assert ran.reason == "completed" and ran.handle.result is not None
    assert any("boom" in text for text in ran.handle.result.errors)


async def test_the_older_post_tool_use_hooks_block_and_prevent_as_post_tool_use_hooks() -> None:
    given: list[PostToolUseInput] = []

    async def older(hook_input: PostToolUseInput) -> HookDecision:
        given.append(hook_input)
        return HookDecision(blocking_error="tests failed", prevent="stop here")

    ran = await run_write({}, post_tool_use_hooks=[older])
    ((seen,),) = [given]
    assert seen.tool_name == "write" and seen.result == "wrote" and seen.is_error is False
    assert [a["content"] for a in attachments(ran, "hook_blocking_error")] == [
        "PostToolUse:write hook blocking error: tests failed"
    ]
    assert [a["message"] for a in attachments(ran, "hook_stopped_continuation")] == ["stop here"]
    assert ran.reason == "hook_stopped"


async def test_the_older_post_tool_use_hooks_no_longer_run_after_a_failed_call() -> None:
    given: list[PostToolUseInput] = []

    async def older(hook_input: PostToolUseInput) -> None:
        given.append(hook_input)

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "write", {"path": "a.txt"})), text_reply("Answered.")],
            tools=[scripted_tool("write", raises="no")],
            post_tool_use_hooks=[older],
        )
        await assert_settled(ran)
    assert given == []
