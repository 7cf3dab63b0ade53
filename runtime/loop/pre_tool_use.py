"""PreToolUse hooks (`QueryOptions.hooks["PreToolUse"]`): run before a tool call's permission check, as
Claude Code runs them (`runtime.loop.event_hooks` runs them: every matching callback at once, each under its
timeout, a failing one a non-blocking hook error).

* What each answer says (`read_output`, pure): `hookSpecificOutput.permissionDecision`, or the deprecated
  top-level `decision` (`"block"`: deny, `"approve"`: allow), the deny's text
  (`permissionDecisionReason`, else the top-level `reason`) and `updatedInput`; and the fields every event
  reads (`continue: false` stops the query after this turn, the call not run; `additionalContext` reaches
  the model after the call's result; `systemMessage` is a warning for the user). Unknown keys are ignored,
  as the SDK ignores them.
* What they add up to (`combine`, pure): deny beats defer beats ask beats allow (`strongest_decision`).
  A deny's text is its hooks' reasons (one a line), else Claude Code's `Hook PreToolUse:<tool> denied
  this tool`; an allow's `updatedInput` is the last one (in configuration order) of the hooks that allowed.
  A defer holds the call for the host when it is the turn's only one (`defer_ignored`; the executor counts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from queryloop.runtime.loop.event_hooks import (
    NO_READ,
    QueryHooks,
    ReadAnswers,
    read_answers,
    run_hooks,
    specific_output,
)
from queryloop.runtime.loop.hook_matching import PermissionDecision, strongest_decision
from queryloop.runtime.loop.host_code import HostCodeError, checked_field

if TYPE_CHECKING:
    from queryloop.runtime.loop.sdk_hooks import HookCallback


class HookOutput(NamedTuple):
    """What one callback's answer says for PreToolUse (all None: no opinion)."""

    decision: PermissionDecision | None = None
    reason: str | None = None
    updated_input: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class PreToolUseVerdict:
    """What a call's PreToolUse hooks decided, and the callbacks that failed (with why)."""

    decision: PermissionDecision | None = None
    reason: str | None = None
    """A deny's text for the model."""
    updated_input: dict[str, Any] | None = None
    """An allow's replacement input (to be validated by the tool's model)."""
    failures: tuple[tuple[HookCallback, Exception], ...] = ()
    read: ReadAnswers[HookOutput] = NO_READ
    """The answers read: their common fields (`continue`, `additionalContext`, `systemMessage`)."""


NO_VERDICT = PreToolUseVerdict()


def defer_ignored(tool_calls: int, *, in_subagent: bool) -> str | None:
    """Why a PreToolUse `defer` does not hold, or None where it does: Claude Code holds it only for the turn's
    single tool call; here, not for a subagent's call either (its conversation is not the host's to resume)."""
    if in_subagent:
        return "a subagent's call cannot be deferred to the host"
    if tool_calls != 1:
        return f"the turn has {tool_calls} tool calls, defer needs a single one"
    return None


def deny_text(verdict: PreToolUseVerdict, tool_name: str) -> str:
    """The error result's text of a denied call: the hooks' reason, else Claude Code's own wording."""
    return verdict.reason or f"Hook PreToolUse:{tool_name} denied this tool"


_DECISIONS = ("allow", "deny", "ask", "defer")
_LEGACY = {"block": "deny", "approve": "allow"}


def read_output(value: dict[str, Any]) -> HookOutput:
    """What one answer (a hook's JSON output) says of the call's permission, or `HostCodeError` for a decision
    that is not one of the values, a field of the wrong type, `hookSpecificOutput` of another event."""
    decision: Any = None
    legacy = value.get("decision")
    if legacy is not None:
        if legacy not in _LEGACY:
            msg = f"returned decision {legacy!r}, not 'block' or 'approve'"
            raise HostCodeError(msg)
        decision = _LEGACY[legacy]
    reason = checked_field(value, "reason", str, "a string")
    updated_input = None
    specific = specific_output(value, "PreToolUse")
    if specific is not None:
        permission = specific.get("permissionDecision")
        if permission is not None:
            if permission not in _DECISIONS:
                msg = f"returned permissionDecision {permission!r}, not one of {', '.join(_DECISIONS)}"
                raise HostCodeError(msg)
            decision = permission  # the hook-specific decision wins over the deprecated one, as in Claude Code
        reason = checked_field(specific, "permissionDecisionReason", str, "a string") or reason
        updated_input = checked_field(specific, "updatedInput", dict, "a dict")
    return HookOutput(decision, reason, updated_input)


def combine(outputs: Sequence[HookOutput]) -> tuple[PermissionDecision | None, str | None, dict[str, Any] | None]:
    """The decision, deny text and replacement input of the hooks that answered, in configuration order."""
    decision = strongest_decision(output.decision for output in outputs)
    if decision is None:
        return None, None, None
    reasons = [output.reason for output in outputs if output.decision == decision and output.reason]
    updated_input = None
    if decision == "allow":
        for output in outputs:
            if output.decision == "allow" and output.updated_input is not None:
                updated_input = output.updated_input
    return decision, "\n".join(reasons) or None, updated_input


async def run_pre_tool_use(
    hooks: QueryHooks, tool_name: str, tool_use_id: str, tool_input: dict[str, Any]
) -> PreToolUseVerdict:
    """Run the PreToolUse callbacks that select `tool_name`, all at once, and add up their answers."""
    fields = {"tool_name": tool_name, "tool_input": tool_input, "tool_use_id": tool_use_id}  # each hook gets a copy
    answers = await run_hooks(hooks, "PreToolUse", tool_name, fields, tool_use_id)
    if not answers.outputs and not answers.failures:
        return NO_VERDICT
    read = read_answers(answers, "PreToolUse", read_output)
    decision, reason, updated_input = combine(read.specific)
    return PreToolUseVerdict(decision, reason, updated_input, read.failures, read)
