"""A deferred tool call's place in the conversation, as pure functions: Claude Code's pending call (the `tool_use`
without a result, then its `hook_deferred_tool` attachment) is found from the conversation's end, is a valid
conversation, is never sent to the model as such and is not repaired as a crash's open call; its endings' results.
"""

from __future__ import annotations

from typing import Any

from queryloop.runtime.loop.decisions import claude_code_terminal_reason, result_is_error, result_subtype
from queryloop.runtime.loop.deferred import deferred_attachment, deferred_tool_use, pending_deferred
from queryloop.runtime.loop.events import AssistantMessage, AttachmentMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.pre_tool_use import defer_ignored
from queryloop.runtime.loop.restore import answer_open_tool_uses
from queryloop.runtime.loop.transcript import normalize_messages_for_api, tool_result_message, transcript_problems

CALL: dict[str, Any] = {"type": "tool_use", "id": "t1", "name": "write", "input": {"path": "a.txt"}}


def response(*blocks: dict[str, Any]) -> list[AssistantMessage]:
    return [AssistantMessage(message_id="m1", model="claude", content=[dict(block)]) for block in blocks]


def deferred_conversation() -> list[TranscriptMessage]:
    return [UserMessage(content="Write a.txt"), *response(CALL), deferred_attachment(deferred_tool_use(CALL))]


def test_the_pending_call_is_the_one_the_last_attachment_names_in_the_response_before_it() -> None:
    messages = deferred_conversation()
    found = pending_deferred(messages)
    assert found is not None and found[1] == CALL and found[0] is messages[1]
    text: dict[str, Any] = {"type": "text", "text": "I'll write it."}
    split: list[TranscriptMessage] = [
        UserMessage(content="go"),
        *response(text, CALL),
        deferred_attachment(deferred_tool_use(CALL)),
    ]
    assert pending_deferred(split) is not None  # a response spans several messages, one per block


def test_no_call_is_pending_once_answered_or_without_the_attachment_last() -> None:
    answered = [*deferred_conversation(), tool_result_message("t1", "wrote", is_error=False)]
    assert pending_deferred(answered) is None
    assert pending_deferred(deferred_conversation()[:-1]) is None  # a crash's open call, not a deferred one
    assert pending_deferred([]) is None
    stray: list[TranscriptMessage] = [UserMessage(content="hi"), deferred_attachment(deferred_tool_use(CALL))]
    assert pending_deferred(stray) is None  # names no call of the response before it


def test_a_pending_call_is_a_valid_conversation_and_a_crashs_open_call_is_not() -> None:
    assert transcript_problems(deferred_conversation()) == []
    assert transcript_problems(deferred_conversation()[:-1]) == ["message 1: tool_use t1 has no tool_result"]


def test_a_resume_leaves_a_deferred_call_open_and_answers_a_crashs() -> None:
    assert answer_open_tool_uses(deferred_conversation()) == []
    (repair,) = answer_open_tool_uses(deferred_conversation()[:-1])
    assert repair.content[0]["tool_use_id"] == "t1"  # type: ignore[index]


def test_the_attachment_is_never_sent_to_the_model_and_the_replayed_result_follows_the_call() -> None:
    replayed = [*deferred_conversation(), tool_result_message("t1", "wrote", is_error=False)]
    sent = normalize_messages_for_api(replayed)
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[2]["content"] == [{"type": "tool_result", "tool_use_id": "t1", "content": "wrote", "is_error": False}]


def test_the_attachment_names_the_call_as_claude_codes_does() -> None:
    attachment = deferred_attachment(deferred_tool_use(CALL))
    assert isinstance(attachment, AttachmentMessage)
    assert attachment.attachment == {
        "type": "hook_deferred_tool",
        "toolUseID": "t1",
        "toolName": "write",
        "toolInput": {"path": "a.txt"},
        "hookEvent": "PreToolUse",
    }


def test_tool_deferred_is_a_success_and_tool_deferred_unavailable_an_error() -> None:
    assert result_subtype("tool_deferred") == result_subtype("tool_deferred_unavailable") == "success"
    assert result_is_error("tool_deferred", api_error_surfaced=False) is False
    assert result_is_error("tool_deferred_unavailable", api_error_surfaced=False) is True
    assert claude_code_terminal_reason("tool_deferred") == "tool_deferred"
    assert claude_code_terminal_reason("tool_deferred_unavailable") == "tool_deferred_unavailable"


def test_a_defer_holds_only_for_the_turns_single_tool_call_and_not_in_a_subagent() -> None:
    assert defer_ignored(1, in_subagent=False) is None
    assert defer_ignored(2, in_subagent=False) == "the turn has 2 tool calls, defer needs a single one"
    assert defer_ignored(1, in_subagent=True) == "a subagent's call cannot be deferred to the host"
