"""A deferred tool call in the conversation (a PreToolUse hook's `permissionDecision: "defer"`), as pure functions.

Claude Code keeps a deferred call in the transcript as it was left: the assistant's `tool_use` with no
`tool_result`, followed by a `hook_deferred_tool` attachment (never sent to the model) naming the call. So does
the runtime: the conversation's last message is that attachment while the call waits for the host's decision
(`pending_deferred`), which the session's next query, or a session resumed from the transcript, replays.
"""

from __future__ import annotations

from collections.abc import Sequence

from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    Block,
    DeferredToolUse,
    TranscriptMessage,
    UserMessage,
)

DEFERRED_TOOL = "hook_deferred_tool"
"""The attachment that follows a deferred call's `tool_use` in the conversation (Claude Code's type)."""


def deferred_attachment(call: DeferredToolUse) -> AttachmentMessage:
    """The `hook_deferred_tool` attachment of a call a PreToolUse hook deferred (keyed as the other hook
    attachments are: `toolUseID`, `hookEvent`)."""
    return AttachmentMessage(
        attachment={
            "type": DEFERRED_TOOL,
            "toolUseID": call.id,
            "toolName": call.name,
            "toolInput": call.input,
            "hookEvent": "PreToolUse",
        }
    )


def deferred_tool_use(block: Block) -> DeferredToolUse:
    """The result's `deferred_tool_use` for a `tool_use` block."""
    return DeferredToolUse(id=block["id"], name=block.get("name", ""), input=block.get("input") or {})


def pending_deferred(messages: Sequence[TranscriptMessage]) -> tuple[AssistantMessage, Block] | None:
    """The call waiting for the host's decision (its response's message and `tool_use` block): the one the
    conversation's last message (a `hook_deferred_tool` attachment) names, in the response before it, still
    without a result. None for any other conversation (looked at from its end: the last message alone, for almost
    every one)."""
    if not messages:
        return None
    last = messages[-1]
    if type(last) is not AttachmentMessage or last.attachment.get("type") != DEFERRED_TOOL:
        return None
    tool_use_id = last.attachment.get("toolUseID")
    for message in reversed(messages):
        if isinstance(message, AssistantMessage):
            for block in message.content:
                if block.get("type") == "tool_use" and block.get("id") == tool_use_id:
                    return message, block
        elif isinstance(message, UserMessage):
            return None  # the user side before the deferring response (or a result): the call is not pending
    return None
