"""The hooks that decide a query's turns, in the Agent SDK's shape (`runtime.loop.event_hooks` runs them):

* UserPromptSubmit, before a prompt joins the conversation: `decision: "block"` blocks and erases it (the
  query ends without a model call, the `reason` in its result's `errors`); `additionalContext` (a command
  hook's plain stdout too) reaches the model after the prompt; `continue: false` ends the query at once.
* Stop (SubagentStop in a subagent), when the model would end its turn: `decision: "block"` sends `reason`
  back to the model, which answers again; `additionalContext` does the same as feedback rather than an
  error; both count under the Stop-hook block cap, as Claude Code counts them. `continue: false` ends the
  query (`stop_hook_prevented`, with `stopReason`).
* PermissionRequest, when a call's permission would be asked of the host: `hookSpecificOutput.decision`
  (`{"behavior": "allow", "updatedInput": ...}` or `{"behavior": "deny", "message": ..., "interrupt": ...}`)
  answers in the host's stead; the first hook (in configuration order) that answers decides. A command
  hook's exit 2 is ignored here, as Claude Code ignores it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from queryloop.runtime.loop.event_hooks import (
    QueryHooks,
    ReadAnswers,
    block_reason,
    read_answers,
    run_hooks,
    specific_output,
)
from queryloop.runtime.loop.host_code import HostCodeError, checked_field


def _block_reason(value: dict[str, Any], event: str) -> str | None:
    """An answer's block reason (`block_reason`), its `hookSpecificOutput` checked to be `event`'s."""
    specific_output(value, event)
    return block_reason(value, f"Blocked by {event} hook")


@dataclass(frozen=True, slots=True)
class BlockingVerdict:
    """What an event's hooks said: the block reasons (configuration order) and the answers read."""

    blocks: tuple[str, ...]
    read: ReadAnswers[str | None]


async def run_user_prompt_submit(hooks: QueryHooks, prompt: str) -> BlockingVerdict:
    """Run the UserPromptSubmit hooks for `prompt` (its text) and read their answers."""
    answers = await run_hooks(hooks, "UserPromptSubmit", None, {"prompt": prompt})
    read = read_answers(answers, "UserPromptSubmit", lambda value: _block_reason(value, "UserPromptSubmit"))
    return BlockingVerdict(tuple(reason for reason in read.specific if reason is not None), read)


async def run_stop(
    hooks: QueryHooks, *, subagent: bool, stop_hook_active: bool, last_assistant_message: str
) -> BlockingVerdict:
    """Run the Stop hooks (SubagentStop's in a subagent) and read their answers."""
    event = "SubagentStop" if subagent else "Stop"
    fields: dict[str, Any] = {"stop_hook_active": stop_hook_active, "last_assistant_message": last_assistant_message}
    if subagent:
        fields["agent_transcript_path"] = hooks.transcript_path
    answers = await run_hooks(hooks, event, None, fields)
    read = read_answers(answers, event, lambda value: _block_reason(value, event))
    return BlockingVerdict(tuple(reason for reason in read.specific if reason is not None), read)


@dataclass(frozen=True, slots=True)
class PermissionAnswer:
    """A PermissionRequest hook's answer in the host's stead."""

    allow: bool
    updated_input: dict[str, Any] | None = None
    message: str = ""
    interrupt: bool = False


def _permission_answer(value: dict[str, Any]) -> PermissionAnswer | None:
    specific = specific_output(value, "PermissionRequest")
    decision = None if specific is None else checked_field(specific, "decision", dict, "a dict")
    if decision is None:
        return None
    behavior = decision.get("behavior")
    if behavior == "allow":
        return PermissionAnswer(True, checked_field(decision, "updatedInput", dict, "a dict"))
    if behavior == "deny":
        message = checked_field(decision, "message", str, "a string") or ""
        interrupt = checked_field(decision, "interrupt", bool, "a bool") or False
        return PermissionAnswer(False, None, message, interrupt)
    msg = f"returned decision.behavior {behavior!r}, not 'allow' or 'deny'"
    raise HostCodeError(msg)


async def run_permission_request(
    hooks: QueryHooks, tool_name: str, tool_input: dict[str, Any]
) -> tuple[PermissionAnswer | None, ReadAnswers[PermissionAnswer | None]]:
    """Run the PermissionRequest hooks that select `tool_name`: the first answer that decides, and all read."""
    fields = {"tool_name": tool_name, "tool_input": tool_input, "permission_suggestions": []}
    answers = await run_hooks(hooks, "PermissionRequest", tool_name, fields)
    read = read_answers(answers, "PermissionRequest", _permission_answer)
    return next((answer for answer in read.specific if answer is not None), None), read
