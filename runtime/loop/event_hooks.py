"""Running a query's hooks for one event, as Claude Code runs them, with callbacks in the Agent SDK's shape
(`runtime.loop.sdk_hooks`); what each event's answers mean is its own module's (`pre_tool_use`,
`post_tool_use`).

* Which run: every callback of every matcher of the event that selects the matched value (a tool's name for
  tool events, `matcher_matches`), all at once (a trio nursery), each under its matcher's timeout (60 s by
  default). Each gets its own deep copy of `input_data`, so one that edits it in place changes neither the
  others' nor the conversation's.
* What comes back (`HookAnswers`): the answers that are hooks' JSON output (dicts), in configuration order,
  and the callbacks that failed with why. A callback that raises, runs past its timeout, or answers with
  something that is not a dict (None included) is a non-blocking hook error: it decides nothing, and the
  caller reports it as every hook error is reported (a `hook_error` event, its text in the result's
  `errors`). `{"async_": True}` decides nothing either: Claude Code does not wait for an async hook.
* The fields every event reads the same way (`common_output`): `continue` (`False` stops the query,
  `stopReason` saying why), `systemMessage` (a warning for the user), `suppressOutput` (accepted, no effect,
  as in Claude Code) and `hookSpecificOutput.additionalContext` (text for the model). The SDK's Python
  spelling `continue_` is read as `continue`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

import trio

from queryloop.runtime import telemetry
from queryloop.runtime.loop.events import AttachmentMessage
from queryloop.runtime.loop.hook_matching import matcher_matches
from queryloop.runtime.loop.host_code import HostCodeError, checked_field, checked_hook_output

if TYPE_CHECKING:
    from queryloop.runtime.loop.sdk_hooks import HookCallback, HookContext, HookMatcher

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class QueryHooks:
    """A query's hook matchers by event, and what the loop knows of where it runs (for `input_data`)."""

    matchers: Mapping[Any, tuple[HookMatcher, ...]]
    """By event name (`HookEvent`)."""
    session_id: str
    transcript_path: str
    """The session's transcript file, or `""` when it keeps none."""
    agent: tuple[str, str] | None = None
    """A subagent's id and type: its hooks' `input_data` carry them (`agent_id`, `agent_type`)."""
    permission_mode: str = "default"
    cwd: str | None = None
    """The query's working folder; None: the process's, read when the hook fires."""

    def has(self, event: str) -> bool:
        """Whether any matcher is registered for `event` (nothing runs, and nothing is built, without one)."""
        return bool(self.matchers.get(event))

    def input_for(self, event: str, fields: dict[str, Any]) -> dict[str, Any]:
        """`input_data` for `event`: the fields every event carries, then the event's own (`fields`)."""
        data: dict[str, Any] = {
            "session_id": self.session_id,
            "transcript_path": self.transcript_path,
            "cwd": self.cwd if self.cwd is not None else os.getcwd(),
            "permission_mode": self.permission_mode,
            "hook_event_name": event,
        }
        data.update(fields)
        if self.agent is not None:
            data["agent_id"], data["agent_type"] = self.agent
        return data


@dataclass(frozen=True, slots=True)
class HookAnswers:
    """What an event's callbacks answered (each one with its JSON output, configuration order) and which failed,
    with why."""

    outputs: tuple[tuple[HookCallback, dict[str, Any]], ...] = ()
    failures: tuple[tuple[HookCallback, Exception], ...] = ()


NO_ANSWERS = HookAnswers()


def selected(matchers: tuple[HookMatcher, ...], match_value: str | None) -> list[tuple[HookCallback, float]]:
    """Each callback that runs for `match_value` (None: the event takes no matcher, every one runs), with its
    timeout, in configuration order."""
    return [
        (callback, matcher.timeout_s)
        for matcher in matchers
        if match_value is None or matcher_matches(matcher.matcher, match_value)
        for callback in matcher.hooks
    ]


async def run_hooks(
    hooks: QueryHooks, event: str, match_value: str | None, fields: dict[str, Any], tool_use_id: str | None = None
) -> HookAnswers:
    """Run the callbacks of `event` that select `match_value`, all at once (module docstring)."""
    callbacks = selected(hooks.matchers.get(event, ()), match_value)
    if not callbacks:
        return NO_ANSWERS
    input_data = hooks.input_for(event, fields)
    answers: list[dict[str, Any] | Exception | None] = [None] * len(callbacks)

    async def call(index: int, callback: HookCallback, timeout_s: float) -> None:
        context: HookContext = {"signal": None}
        try:
            with trio.move_on_after(timeout_s) as deadline:
                value: object = await callback(copy.deepcopy(input_data), tool_use_id, context)  # type: ignore[arg-type]
            if deadline.cancelled_caught:
                answers[index] = TimeoutError(f"timed out after {timeout_s:g} s")
            else:
                output = checked_hook_output(value)
                if output.get("async_") is not True and output.get("async") is not True:
                    answers[index] = output
        except Exception as error:  # noqa: BLE001 - a failing hook is a non-blocking error, as in Claude Code
            answers[index] = error

    with telemetry.hook_span(event, len(callbacks)):  # the run's span while telemetry is on (the callbacks' parent)
        if len(callbacks) == 1:  # most runs: awaited here, no nursery and no task to spawn (bench hooks)
            await call(0, *callbacks[0])
        else:
            async with trio.open_nursery() as nursery:
                for index, (callback, timeout_s) in enumerate(callbacks):
                    nursery.start_soon(call, index, callback, timeout_s)
    return HookAnswers(
        tuple(
            (callback, answer)
            for (callback, _), answer in zip(callbacks, answers, strict=True)
            if isinstance(answer, dict)
        ),
        tuple(
            (callback, answer)
            for (callback, _), answer in zip(callbacks, answers, strict=True)
            if isinstance(answer, Exception)
        ),
    )


class CommonOutput(NamedTuple):
    """What an answer says in the fields every event reads alike."""

    stop: bool = False
    """`continue: false`: the query stops (after what this event was deciding)."""
    stop_reason: str | None = None
    system_message: str | None = None
    additional_context: str | None = None


NO_COMMON = CommonOutput()


def common_output(output: dict[str, Any], event: str) -> CommonOutput:
    """`continue`/`stopReason`/`systemMessage`/`additionalContext` of one answer, or `HostCodeError` for a
    field of the wrong type or a `hookSpecificOutput` of another event."""
    go_on = output.get("continue", output.get("continue_", True))
    if not isinstance(go_on, bool):
        msg = f"returned continue {type(go_on).__name__}, not a bool"
        raise HostCodeError(msg)
    stop_reason = checked_field(output, "stopReason", str, "a string")
    system_message = checked_field(output, "systemMessage", str, "a string")
    specific = specific_output(output, event)
    context = None if specific is None else checked_field(specific, "additionalContext", str, "a string")
    if go_on and stop_reason is None and system_message is None and context is None:
        return NO_COMMON
    return CommonOutput(not go_on, stop_reason, system_message, context)


def block_reason(output: dict[str, Any], default: str) -> str | None:
    """`decision: "block"`'s reason (`default` when it gives none), None without a decision; `HostCodeError` for
    another decision or a reason that is not a string (the events whose only decision is a block)."""
    decision = output.get("decision")
    if decision is not None and decision != "block":
        msg = f"returned decision {decision!r}, not 'block'"
        raise HostCodeError(msg)
    reason = checked_field(output, "reason", str, "a string")
    return None if decision is None else reason or default


def specific_output(output: dict[str, Any], event: str) -> dict[str, Any] | None:
    """`hookSpecificOutput`, checked to be a dict for `event` (its `hookEventName`, when given, names it)."""
    specific: dict[str, Any] | None = checked_field(output, "hookSpecificOutput", dict, "a dict")
    if specific is not None:
        named = specific.get("hookEventName")
        if named is not None and named != event:
            msg = f"returned hookSpecificOutput for {named!r}, not {event}"
            raise HostCodeError(msg)
    return specific


@dataclass(frozen=True, slots=True)
class ReadAnswers(Generic[T]):
    """An event's answers read: each one's own fields (`specific`) and common fields, in configuration order,
    and the callbacks that failed (those that raised, and those whose answer could not be read)."""

    specific: tuple[T, ...] = ()
    common: tuple[CommonOutput, ...] = ()
    failures: tuple[tuple[HookCallback, Exception], ...] = ()

    @property
    def stop(self) -> CommonOutput | None:
        """The first answer that stops the query, if any (its `stopReason` is the one said)."""
        return next((c for c in self.common if c.stop), None)

    def contexts(self) -> list[str]:
        """The `additionalContext` texts, in configuration order."""
        return [c.additional_context for c in self.common if c.additional_context]

    def system_messages(self) -> list[str]:
        """The `systemMessage` warnings, in configuration order."""
        return [c.system_message for c in self.common if c.system_message]


NO_READ: ReadAnswers[Any] = ReadAnswers()


def read_answers(answers: HookAnswers, event: str, read: Callable[[dict[str, Any]], T]) -> ReadAnswers[T]:
    """Each answer read by `read` (the event's own fields) and `common_output`; an answer either refuses
    (`HostCodeError`) joins the failures: it decides nothing."""
    specific: list[T] = []
    common: list[CommonOutput] = []
    failures = list(answers.failures)
    for callback, output in answers.outputs:
        try:
            own, shared = read(output), common_output(output, event)
        except HostCodeError as error:
            failures.append((callback, error))
            continue
        specific.append(own)
        common.append(shared)
    return ReadAnswers(tuple(specific), tuple(common), tuple(failures))


def effect_messages(
    event: str, read: ReadAnswers[Any], *, tool_name: str | None = None, tool_use_id: str | None = None
) -> tuple[list[AttachmentMessage], str | None]:
    """What an event's answers add to the conversation, in the order Claude Code adds it: each hook's
    `additionalContext` (for the model, a `hook_additional_context` attachment), each `systemMessage` (for the
    user only, `hook_system_message`); and the text the query stops with when one said `continue: false`
    (its `stopReason`, else Claude Code's `Execution stopped by <event> hook`), or None."""
    where = f"{event}:{tool_name}" if tool_name else event
    ids: dict[str, Any] = {"hookEvent": event}
    if tool_use_id is not None:
        ids["toolUseID"] = tool_use_id
    messages = [
        AttachmentMessage(
            attachment={"type": "hook_additional_context", "content": f"{where} hook additional context: {text}", **ids}
        )
        for text in read.contexts()
    ]
    messages.extend(
        AttachmentMessage(attachment={"type": "hook_system_message", "content": text, **ids})
        for text in read.system_messages()
    )
    stop = read.stop
    if stop is None:
        return messages, None
    return messages, stop.stop_reason or f"Execution stopped by {event} hook"
