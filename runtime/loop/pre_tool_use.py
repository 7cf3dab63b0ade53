"""PreToolUse hooks (`QueryOptions.hooks["PreToolUse"]`): run before a tool call's permission check, as
Claude Code runs them, with callbacks in the Agent SDK's shape (`runtime.loop.sdk_hooks`).

* Which run: every callback of every matcher that selects the tool's name (`matcher_matches`), all at once
  (a trio nursery), each under its matcher's timeout (60 s by default). Each gets its own copy of the
  call's input, so one that edits it in place changes neither the others' nor the conversation's.
* What each answer says (`read_output`, pure): `hookSpecificOutput.permissionDecision`, or the deprecated
  top-level `decision` (`"block"`: deny, `"approve"`: allow), the deny's text
  (`permissionDecisionReason`, else the top-level `reason`) and `updatedInput`. Unknown keys are ignored,
  as the SDK ignores them; the fields not used yet (`continue_`, `stopReason`, `systemMessage`,
  `suppressOutput`, `additionalContext`, `{"async_": True}`) are accepted and change nothing.
* What they add up to (`combine`, pure): deny beats defer beats ask beats allow (`strongest_decision`).
  A deny's text is its hooks' reasons (one a line), else Claude Code's `Hook PreToolUse:<tool> denied
  this tool`; an allow's `updatedInput` is the last one (in configuration order) of the hooks that allowed.
* A callback that raises, runs past its timeout, or answers with something that is not such a dict (None
  included) is a non-blocking hook error: it decides nothing, and the executor reports it as every hook
  error is reported (a `hook_error` event, its text in the result's `errors`).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import trio

from queryloop.runtime.loop.hook_matching import PermissionDecision, matcher_matches, strongest_decision
from queryloop.runtime.loop.host_code import HostCodeError, checked_field, checked_hook_output

if TYPE_CHECKING:
    from queryloop.runtime.loop.sdk_hooks import HookCallback, HookContext, HookMatcher, PreToolUseHookInput


@dataclass(frozen=True, slots=True)
class PreToolUseHooks:
    """A turn's PreToolUse matchers and what the loop knows of where the calls run (for `input_data`)."""

    matchers: tuple[HookMatcher, ...]
    session_id: str
    transcript_path: str
    """The session's transcript file, or `""` when it keeps none."""
    agent: tuple[str, str] | None = None
    """A subagent's id and type: its calls' `input_data` carry them (`agent_id`, `agent_type`)."""


class HookOutput(NamedTuple):
    """What one callback's answer says for PreToolUse (all None: no opinion)."""

    decision: PermissionDecision | None = None
    reason: str | None = None
    updated_input: dict[str, Any] | None = None


NO_OPINION = HookOutput()


@dataclass(frozen=True, slots=True)
class PreToolUseVerdict:
    """What a call's PreToolUse hooks decided, and the callbacks that failed (with why)."""

    decision: PermissionDecision | None = None
    reason: str | None = None
    """A deny's text for the model."""
    updated_input: dict[str, Any] | None = None
    """An allow's replacement input (to be validated by the tool's model)."""
    failures: tuple[tuple[HookCallback, Exception], ...] = ()


NO_VERDICT = PreToolUseVerdict()


def deny_text(verdict: PreToolUseVerdict, tool_name: str) -> str:
    """The error result's text of a denied call: the hooks' reason, else Claude Code's own wording."""
    return verdict.reason or f"Hook PreToolUse:{tool_name} denied this tool"


_DECISIONS = ("allow", "deny", "ask", "defer")
_LEGACY = {"block": "deny", "approve": "allow"}


def read_output(value: object) -> HookOutput:
    """What a callback's answer says, or `HostCodeError` for one that is not a hook's JSON output: not a
    dict, a decision that is not one of the values, a field of the wrong type, `hookSpecificOutput` of another
    event."""
    value = checked_hook_output(value)
    if value.get("async_") is True or value.get("async") is True:
        return NO_OPINION  # an async hook decides nothing: Claude Code does not wait for it
    decision: Any = None
    legacy = value.get("decision")
    if legacy is not None:
        if legacy not in _LEGACY:
            msg = f"returned decision {legacy!r}, not 'block' or 'approve'"
            raise HostCodeError(msg)
        decision = _LEGACY[legacy]
    reason = checked_field(value, "reason", str, "a string")
    updated_input = None
    specific = checked_field(value, "hookSpecificOutput", dict, "a dict")
    if specific is not None:
        event = specific.get("hookEventName")
        if event is not None and event != "PreToolUse":
            msg = f"returned hookSpecificOutput for {event!r}, not PreToolUse"
            raise HostCodeError(msg)
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


def selected(matchers: Sequence[HookMatcher], tool_name: str) -> list[tuple[HookCallback, float]]:
    """Each callback that runs for `tool_name`, with its timeout, in configuration order."""
    return [
        (callback, matcher.timeout_s)
        for matcher in matchers
        if matcher_matches(matcher.matcher, tool_name)
        for callback in matcher.hooks
    ]


def hook_input(
    hooks: PreToolUseHooks, tool_name: str, tool_use_id: str, tool_input: dict[str, Any]
) -> PreToolUseHookInput:
    """A callback's `input_data`, as the SDK builds it for PreToolUse (a fresh copy of `tool_input`)."""
    data: PreToolUseHookInput = {
        "session_id": hooks.session_id,
        "transcript_path": hooks.transcript_path,
        "cwd": os.getcwd(),
        "permission_mode": "default",
        "hook_event_name": "PreToolUse",
        "tool_name": tool_name,
        "tool_input": copy.deepcopy(tool_input),
        "tool_use_id": tool_use_id,
    }
    if hooks.agent is not None:
        data["agent_id"], data["agent_type"] = hooks.agent
    return data


async def run_pre_tool_use(
    hooks: PreToolUseHooks, tool_name: str, tool_use_id: str, tool_input: dict[str, Any]
) -> PreToolUseVerdict:
    """Run the callbacks that select `tool_name`, all at once, and add up their answers (module docstring)."""
    callbacks = selected(hooks.matchers, tool_name)
    if not callbacks:
        return NO_VERDICT
    answers: list[HookOutput | Exception] = [NO_OPINION] * len(callbacks)

    async def call(index: int, callback: HookCallback, timeout_s: float) -> None:
        context: HookContext = {"signal": None}
        try:
            with trio.move_on_after(timeout_s) as deadline:
                value: object = await callback(
                    hook_input(hooks, tool_name, tool_use_id, tool_input), tool_use_id, context
                )
            if deadline.cancelled_caught:
                answers[index] = TimeoutError(f"timed out after {timeout_s:g} s")
            else:
                answers[index] = read_output(value)
        except Exception as error:  # noqa: BLE001 - a failing hook is a non-blocking error, as in Claude Code
            answers[index] = error

    async with trio.open_nursery() as nursery:
        for index, (callback, timeout_s) in enumerate(callbacks):
            nursery.start_soon(call, index, callback, timeout_s)
    outputs = [answer for answer in answers if isinstance(answer, HookOutput)]
    failures = tuple(
        (callback, answer)
        for (callback, _), answer in zip(callbacks, answers, strict=True)
        if isinstance(answer, Exception)
    )
    decision, reason, updated_input = combine(outputs)
    return PreToolUseVerdict(decision, reason, updated_input, failures)
