"""One tool call's steps around its tool, as Claude Code takes them (the executor runs them in the call's work):

* before (`admitted`): the input checked by the tool's model, the PreToolUse hooks
  (`runtime.loop.pre_tool_use`), the permission rules and mode (`Permissions.decide`), then, for what is
  left undecided, the PermissionRequest hooks and `can_use_tool` (`ask`, with the SDK's context);
* after (`after_call`): the PostToolUse hooks, or PostToolUseFailure's for a call that failed
  (`runtime.loop.post_tool_use`), and the output the model gets.

What the hooks produce travels in the call's own `ToolResult` (`hook_messages`), after its result and in
the order it was produced: `hook_error` system messages for hooks that failed (the others count as if it
had passed), `hook_blocking_error` and `hook_additional_context` attachments for the model,
`hook_system_message` ones for the user, and a `hook_stopped_continuation` attachment for a hook that
stopped the query. A call its PreToolUse hooks deferred (`honours_defer`) gets no result: its `ToolResult`
carries the `hook_deferred_tool` attachment after its hooks' messages (`messages.deferred`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import ValidationError

from queryloop.actors.tool_executor.messages import (
    BeginTurn,
    CallEntry,
    ResponseGate,
    ToolResult,
    deferred,
    denied,
    failed,
)
from queryloop.runtime.loop.control import ToolPermissionContext
from queryloop.runtime.loop.event_hooks import QueryHooks, effect_messages, read_answers, run_hooks, specific_output
from queryloop.runtime.loop.events import AttachmentMessage, SystemMessage
from queryloop.runtime.loop.hooks import HookErrorSource, failure_text, hook_error_message
from queryloop.runtime.loop.host_code import checked_permission, input_error_text
from queryloop.runtime.loop.post_tool_use import PostToolUseVerdict, run_post_tool_use, run_post_tool_use_failure
from queryloop.runtime.loop.pre_tool_use import defer_ignored, deny_text, run_pre_tool_use
from queryloop.runtime.loop.tools import Deny, Tool, ToolOutput, plain_output
from queryloop.runtime.loop.transcript import tool_error
from queryloop.runtime.loop.turn_hooks import run_permission_request

if TYPE_CHECKING:
    from loguru import Logger

    from queryloop.runtime.loop.hook_matching import PermissionDecision
    from queryloop.runtime.loop.permissions import PermissionVerdict


class LogOwner(Protocol):
    """Whose log a call's warnings go to (the executor's): read only when there is something to say, so that a call
    with nothing to report never binds a logger."""

    @property
    def log(self) -> Logger: ...


Admitted = tuple[dict[str, Any], Any]
"""A call's input as the tool runs it: raw (the model's, or a hook's or `can_use_tool`'s in its stead) and parsed."""


async def admitted(owner: LogOwner, entry: CallEntry, tool: Tool, turn: BeginTurn) -> Admitted | ToolResult:
    """The input the tool runs with, or the error result for input refused by the tool's model or a permission
    denied (by a hook, a rule, the mode, `can_use_tool`, or because its check failed).

    As in Claude Code: the PreToolUse hooks run once the input passed the tool's model; then the
    permission rules and the mode decide (`Permissions.decide`: a hook's deny denies, its allow does not
    pass deny or ask rules); what is left undecided is asked (`asked`)."""
    raw_input: dict[str, Any] = entry.block.get("input") or {}
    parsed = parse(owner, entry, tool, raw_input)
    if isinstance(parsed, ToolResult):
        return parsed
    call: Admitted = (raw_input, parsed)
    hook_decision: PermissionDecision | None = None
    hook_reason = None
    if turn.hooks is not None and turn.hooks.has("PreToolUse"):
        hooked = await _pre_tool_use(owner, entry, tool, turn, turn.hooks, call=call)
        if isinstance(hooked, ToolResult):
            return hooked
        call, hook_decision, hook_reason = hooked
    permissions = turn.permissions
    if permissions is None:  # no rules, no mode, no `can_use_tool`: only a hook could have said no
        return call
    decided = permissions.decide(tool.name, call[0], hook_decision, hook_reason)
    if decided.behavior == "allow":
        return call
    if decided.behavior == "deny":
        return denied(entry, decided.reason, call[0])
    return await asked(owner, entry, tool, turn, call=call, decided=decided)


async def _pre_tool_use(
    owner: LogOwner, entry: CallEntry, tool: Tool, turn: BeginTurn, hooks: QueryHooks, *, call: Admitted
) -> tuple[Admitted, PermissionDecision | None, str | None] | ToolResult:
    """The call's PreToolUse hooks: the error result of a deny or a `continue: false`, the deferred answer of a
    defer the turn honours (`honours_defer`), else the input (an allow's `updatedInput` in the model's stead) and
    their decision and reason, for the permission rules."""
    name, raw_input = tool.name, call[0]
    verdict = await run_pre_tool_use(hooks, name, entry.id, raw_input)
    note_failures(owner, entry, "PreToolUse", verdict.failures)
    added, entry.stop = effect_messages("PreToolUse", verdict.read, tool_name=name, tool_use_id=entry.id)
    if added:
        entry.hook_messages = [*(entry.hook_messages or ()), *added]
    if entry.stop is not None:  # `continue: false` outranks any decision: the call does not run
        return failed(entry, entry.stop)
    if verdict.decision == "deny":
        return denied(entry, deny_text(verdict, name), raw_input)
    if verdict.decision == "defer":
        if await honours_defer(owner, entry, turn):
            return deferred(entry)
        return call, None, None  # the permission flow decides, as if the hooks had not
    if verdict.decision == "allow" and verdict.updated_input is not None:
        updated = replaced(owner, entry, tool, verdict.updated_input)
        if isinstance(updated, ToolResult):
            return updated
        call = updated
    return call, verdict.decision, verdict.reason


async def honours_defer(owner: LogOwner, entry: CallEntry, turn: BeginTurn) -> bool:
    """Whether a PreToolUse `defer` of this call holds, as in Claude Code: only for a turn with a single tool call
    (waited for: the response may still be streaming its other blocks) and, here, only in the session's own loop
    (a subagent's conversation is not the host's to resume). Otherwise it is ignored with a warning."""
    tool_calls = 0
    if turn.agent_id is None:
        gate = ResponseGate()
        turn.sink.push(gate)  # the loop opens it once the response is whole
        await gate.closed.wait()
        tool_calls = gate.tool_calls
    why = defer_ignored(tool_calls, in_subagent=turn.agent_id is not None)
    if why is None:
        return True
    owner.log.warning("PreToolUse defer of {} ({}) ignored: {}", entry.block.get("name", ""), entry.id, why)
    return False


async def asked(
    owner: LogOwner, entry: CallEntry, tool: Tool, turn: BeginTurn, *, call: Admitted, decided: PermissionVerdict
) -> Admitted | ToolResult:
    """A call the rules leave to the host: the Notification and PermissionRequest hooks, then `can_use_tool`;
    with nothing to ask, what nothing decided runs and what something asks is refused."""
    hooks = turn.hooks
    if hooks is not None and (hooks.has("PermissionRequest") or hooks.has("Notification")):
        answered = await ask_hooks(owner, entry, tool, hooks, call=call)
        if answered is not None:
            return answered
    if turn.can_use_tool is None:
        if decided.undecided:
            return call
        return denied(entry, f"{decided.reason} There is no can_use_tool to ask.", call[0])
    return await ask(owner, entry, tool, turn, call=call, reason=decided.reason)


async def ask_hooks(
    owner: LogOwner, entry: CallEntry, tool: Tool, hooks: QueryHooks, *, call: tuple[dict[str, Any], Any]
) -> tuple[dict[str, Any], Any] | ToolResult | None:
    """The hooks of a permission about to be asked, as Claude Code runs them when it would show its prompt: the
    Notification hooks (`notification_type` `permission_prompt`), then the PermissionRequest hooks, whose
    answer, if one gives it, is the host's (None: none did, `can_use_tool` is asked)."""
    name, (raw_input, _) = tool.name, call
    if hooks.has("Notification"):
        fields = {"message": f"Claude needs your permission to use {name}", "notification_type": "permission_prompt"}
        answers = await run_hooks(hooks, "Notification", "permission_prompt", fields)
        note_failures(owner, entry, "Notification", read_answers(answers, "Notification", _notification).failures)
    if not hooks.has("PermissionRequest"):
        return None
    answer, read = await run_permission_request(hooks, name, raw_input)
    note_failures(owner, entry, "PermissionRequest", read.failures)
    if answer is None:
        return None
    if not answer.allow:
        message = answer.message or f"Permission to use {name} has been denied."
        return denied(entry, message, raw_input, interrupt=answer.interrupt)
    return call if answer.updated_input is None else replaced(owner, entry, tool, answer.updated_input)


def _notification(value: dict[str, Any]) -> None:
    """A Notification answer has no fields of its own that decide anything here (checked all the same)."""
    specific_output(value, "Notification")


async def ask(
    owner: LogOwner, entry: CallEntry, tool: Tool, turn: BeginTurn, *, call: Admitted, reason: str | None
) -> Admitted | ToolResult:
    """`can_use_tool`'s answer for the call (with the SDK's context), or the error result of a deny."""
    name, (raw_input, parsed) = tool.name, call
    assert turn.can_use_tool is not None
    context = ToolPermissionContext(tool_use_id=entry.id, agent_id=turn.agent_id, decision_reason=reason)
    try:
        decision = checked_permission(await turn.can_use_tool(name, raw_input, context))
    except Exception as error:  # noqa: BLE001 - the host's callback: an error result, never a dead session
        # Never taken as an allow: the tool does not run, and the result's `errors` names why.
        owner.log.opt(exception=error).warning("can_use_tool failed for {} ({})", name, entry.id)
        text = f"can_use_tool failed for {name} ({entry.id}): {failure_text(error)}"
        return failed(entry, f"Error: permission check failed: {failure_text(error)}", host_error=text)
    if isinstance(decision, Deny):
        message = decision.message or f"Permission to use {name} has been denied."
        return denied(entry, message, raw_input, interrupt=decision.interrupt)
    if decision.updated_permissions and turn.permissions is not None:
        try:
            turn.permissions.apply(decision.updated_permissions)
        except (TypeError, ValueError) as error:  # the SDK's rule: the call is allowed, no update applies
            owner.log.warning("can_use_tool's updated_permissions for {} not applied: {}", entry.id, error)
            entry.host_error = f"can_use_tool's updated_permissions for {name} ({entry.id}) not applied: {error}"
    if decision.updated_input is None:
        return raw_input, parsed
    return replaced(owner, entry, tool, decision.updated_input)


def replaced(
    owner: LogOwner, entry: CallEntry, tool: Tool, updated: dict[str, Any]
) -> tuple[dict[str, Any], Any] | ToolResult:
    """The input a hook's allow or `can_use_tool` gave in the model's stead, raw and parsed by the tool's
    model (or the error result for one the model refuses)."""
    parsed = parse(owner, entry, tool, updated)
    return parsed if isinstance(parsed, ToolResult) else (updated, parsed)


def parse(owner: LogOwner, entry: CallEntry, tool: Tool, raw_input: dict[str, Any]) -> Any:
    """The tool's parsed input, or the error result for input its model refused (or whose validator,
    host code, raised something else than a `ValidationError`: then named in the result's `errors`)."""
    try:
        return tool.parse_input(raw_input)
    except ValidationError as error:
        return failed(entry, input_error_text(error))
    except Exception as error:  # noqa: BLE001 - a host's validator: an error result, never a dead session
        owner.log.opt(exception=error).warning("input validator of {} raised", tool.name)
        text = f"input validator of {tool.name} ({entry.id}) failed: {failure_text(error)}"
        return failed(entry, input_error_text(error), host_error=text)


def as_json(owner: LogOwner, name: str, output: object) -> tuple[ToolOutput, bool]:
    """A tool's non-string output as plain JSON (`plain_output`), or an error result naming the tool.

    Checked here, where the result is made, because nothing later can answer for it: the request
    that carries it would fail to serialize (a model error ending the query) and so would the
    transcript file."""
    plain, problem = plain_output(output)
    if plain is not None:
        return plain, False
    owner.log.warning(f"tool {name} returned {problem}")
    return tool_error(f"Error: tool {name} returned {problem}"), True


def note_failures(
    owner: LogOwner, entry: CallEntry, event: HookErrorSource, failures: tuple[tuple[Any, Exception], ...]
) -> None:
    """Each hook that failed, logged and kept as a `hook_error` event of the call."""
    if not failures:
        return
    name = entry.block.get("name", "")
    messages = entry.hook_messages if entry.hook_messages is not None else []
    for hook, error in failures:
        owner.log.opt(exception=error).warning("{} hook failed for {} ({})", event, name, entry.id)
        messages.append(hook_error_message(event, hook, error, tool_name=name, tool_use_id=entry.id))
    entry.hook_messages = messages


async def after_call(
    owner: LogOwner,
    entry: CallEntry,
    tool: Tool,
    hooks: QueryHooks,
    *,
    tool_input: dict[str, Any],
    output: ToolOutput,
    is_error: bool,
    duration_ms: int,
) -> ToolOutput:
    """The call's PostToolUse hooks (PostToolUseFailure's for a failed one); the output the model gets."""
    name = tool.name
    observed = tool.observable_input(tool_input)  # the backfill of observable input, as Claude Code's
    tool_input = observed if observed is not None else tool_input
    verdict: PostToolUseVerdict
    if is_error:
        error = output if isinstance(output, str) else json.dumps(output)
        error = error.removeprefix("<tool_use_error>").removesuffix("</tool_use_error>")
        verdict = await run_post_tool_use_failure(
            hooks, name, entry.id, tool_input=tool_input, error=error, duration_ms=duration_ms
        )
        event: HookErrorSource = "PostToolUseFailure"
    else:
        verdict = await run_post_tool_use(
            hooks, name, entry.id, tool_input=tool_input, tool_response=output, duration_ms=duration_ms
        )
        event = "PostToolUse"
    note_failures(owner, entry, event, verdict.read.failures)
    added: list[AttachmentMessage | SystemMessage] = [
        AttachmentMessage(
            attachment={
                "type": "hook_blocking_error",
                "content": f"{event}:{name} hook blocking error: {reason}",
                "hookEvent": event,
                "toolUseID": entry.id,
            }
        )
        for reason in verdict.blocks
    ]
    effects, stop = effect_messages(event, verdict.read, tool_name=name, tool_use_id=entry.id)
    added.extend(effects)
    if added:
        entry.hook_messages = [*(entry.hook_messages or ()), *added]
    if stop is not None and entry.stop is None:
        entry.stop = stop
    if verdict.replaces_output:
        replaced: ToolOutput = verdict.output
        if replaced.__class__ is not str:
            replaced, failed = as_json(owner, name, replaced)
            if failed:
                return output
        return replaced
    return output
