"""StreamingToolExecutor: runs the current turn's tools as their blocks complete.

Scheduling follows Claude Code's: tools are queued in block order; a tool
starts when nothing runs, or when it and everything running are
concurrency-safe; a queued unsafe tool blocks the queue behind it, so unsafe
tools run alone and in order. Each tool is abortable work of this actor, under
its own cancel scope (for `Discard`) and its own timeout.

Results (and progress) go to the turn channel as they complete: a result at
once, past the channel's bound (one per tool: it never waits, so a finished
tool's result is always in the channel), progress with backpressure. Every path
answers a `tool_use` exactly once: an unknown tool, input that fails
validation or was cut off, a denied permission, an exception, a timeout, and an
output that is neither a string nor a JSON-serializable list of blocks (named with
the tool: the request carrying it could not be sent) each give an `is_error` result
wrapped in `<tool_use_error>`. An abort cancels every
unfinished tool; the loop answers those with synthetic errors itself.

A sync tool (a plain `def`) runs in a worker thread (`Tool.run`): the same
cancellation answers it at once and abandons its thread, whose late result is
dropped with this work's scope and whose progress is dropped by its context.

PreToolUse hooks (`runtime.loop.pre_tool_use`) run before the permission check, in this work: a deny
answers the call with its reason, an allow skips `can_use_tool`, `continue: false` answers it unrun and
stops the query after the turn. PostToolUse hooks (or PostToolUseFailure hooks, for a call that failed:
`runtime.loop.post_tool_use`) run after the tool, in this work. What the hooks of both produce travels in
the call's own `ToolResult` (`hook_messages`), after its result and in the order it was produced:
`hook_error` system messages for hooks that failed (the others count as if it had passed),
`hook_blocking_error` and `hook_additional_context` attachments for the model, `hook_system_message` ones
for the user, and a `hook_stopped_continuation` attachment for a hook that stopped the query.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import trio
from pydantic import ValidationError
from pydantic_core import PydanticSerializationError, to_jsonable_python

from queryloop.runtime import telemetry
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import CarrierMessage, Message, keyword_maker, record
from queryloop.runtime.loop.control import PermissionAsker, Permissions, ToolPermissionContext
from queryloop.runtime.loop.event_hooks import QueryHooks, effect_messages
from queryloop.runtime.loop.events import AttachmentMessage, Block, ProgressEvent, SystemMessage, UserMessage
from queryloop.runtime.loop.hooks import HookErrorSource, failure_text, hook_error_message
from queryloop.runtime.loop.host_code import checked_permission, input_error_text
from queryloop.runtime.loop.post_tool_use import PostToolUseVerdict, run_post_tool_use, run_post_tool_use_failure
from queryloop.runtime.loop.pre_tool_use import deny_text, run_pre_tool_use
from queryloop.runtime.loop.tools import Deny, Tool, ToolContext, ToolError, ToolOutput
from queryloop.runtime.loop.transcript import tool_error, tool_result_message

if TYPE_CHECKING:
    from queryloop.runtime.loop.hook_matching import PermissionDecision


class QueryAbortFlag(Protocol):
    """What the executor reads of its query's control: whether an abort has reached the query."""

    @property
    def abort_reason(self) -> str | None: ...


@record
class BeginTurn(CarrierMessage):
    """One model call's tool setting: results go to `sink`. It travels with each `AddTool`: a call
    without tools never wakes the executor, and the first tool of a new call discards the old call's."""

    sink: EventChannel[Any]
    tools: dict[str, Tool]
    can_use_tool: PermissionAsker | None = None
    """`can_use_tool`, called with the SDK's context (`permission_asker`)."""
    permissions: Permissions | None = None
    """The session's permission rules and mode (None: no rule, no mode and no `can_use_tool` decides anything)."""
    agent_id: str | None = None
    """The subagent whose calls these are (its `can_use_tool` context says so); None for the session's own."""
    hooks: QueryHooks | None = None
    """The query's hooks (PreToolUse before `can_use_tool`, PostToolUse after a call; None: it has none)."""
    control: QueryAbortFlag | None = None
    """The query's control: once an abort has reached the query, none of its tools starts any more."""

    async def report(self, tool_use_id: str, data: Any) -> None:
        """A running tool's progress, to the turn channel (each tool's `ToolContext` reports here)."""
        await self.sink.send(ProgressEvent(tool_use_id=tool_use_id, data=data))


@record
class AddTool(CarrierMessage):
    """A `tool_use` block completed in the stream (or was cut off: `input_error` says why)."""

    block: Block
    turn: BeginTurn
    input_error: str | None = None


@record
class Discard(Message):
    """Fallback: the response is retracted; cancel its tools and drop their results."""


@record
class ToolResult(Message):
    """A tool's answer, sent to the turn channel."""

    tool_use_id: str
    message: UserMessage
    hook_messages: list[AttachmentMessage | SystemMessage] = field(default_factory=list)
    """What its PreToolUse and PostToolUse hooks produced, in order (module docstring); emitted after `message`."""
    prevent_continuation: bool = False
    host_errors: tuple[str, ...] = ()
    """What host code failed while answering it (`can_use_tool`, an input validator): for the result's `errors`."""
    denial: dict[str, Any] | None = None
    """A denied permission (by a hook, a rule, the mode or `can_use_tool`): the result's `permission_denials` entry
    (`tool_name`, `tool_use_id`, `tool_input`)."""
    interrupt: bool = False
    """`can_use_tool` denied it with `interrupt`: the query ends as a user's interrupt ends it."""


begin_turn = keyword_maker(BeginTurn)
add_tool = keyword_maker(AddTool)
tool_result = keyword_maker(ToolResult)
"""`BeginTurn(...)`, `AddTool(...)` and `ToolResult(...)` for every call and tool (`keyword_maker`)."""


Status = Literal["queued", "executing", "delivered", "discarded"]


@dataclass(slots=True)
class _Entry:
    block: Block
    input_error: str | None
    safe: bool
    status: Status = "queued"
    scope: trio.CancelScope | None = None
    """The scope its work runs under, once started (`Discard` cancels it alone)."""
    hook_messages: list[AttachmentMessage | SystemMessage] | None = None
    """What its PreToolUse hooks produced (None: nothing, or none ran)."""
    stop: str | None = None
    """A hook's `continue: false`: the text the query stops with after this turn."""
    host_error: str | None = None
    """Host code that failed without deciding the call (an `updated_permissions` not applied)."""

    @property
    def id(self) -> str:
        tool_id: str = self.block["id"]
        return tool_id


class StreamingToolExecutor(TrioActor):
    actor_name = "StreamingToolExecutor"

    def __init__(self) -> None:
        super().__init__()
        self._turn: BeginTurn | None = None
        self._entries: list[_Entry] = []
        self._executing = 0
        """How many of `_entries` are executing."""
        self._executing_unsafe = 0
        """How many of those are not concurrency-safe (at most one, running alone)."""

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, AddTool):
            return self._add(message)
        if isinstance(message, Discard):
            return self._discard()
        return super().on_receive(message)

    # -- scheduling ---------------------------------------------------------------------

    def _add(self, message: AddTool) -> None:
        turn = message.turn
        if turn is not self._turn:
            self._discard()
            self._turn = turn
        tool = turn.tools.get(message.block.get("name", ""))
        safe = tool is not None and tool.concurrency_safe
        self._entries.append(_Entry(message.block, message.input_error, safe))
        self._process_queue()

    def _can_execute(self, safe: bool) -> bool:
        return not self._executing or (safe and not self._executing_unsafe)

    def _count_executing(self, entry: _Entry, change: int) -> None:
        """`change` (+1, -1) the executing tools' counts by `entry`, which starts or has delivered."""
        self._executing += change
        if not entry.safe:
            self._executing_unsafe += change

    def _process_queue(self) -> None:
        control = self._turn.control if self._turn is not None else None
        if control is not None and control.abort_reason is not None:
            # The query is being aborted. A block that completed while the abort unwound this actor's work
            # (its `AddTool` waited behind the abort) must not start a tool once the abort is acked: the
            # query's end answers it with a synthetic result, and nothing of the query may run after it.
            return
        for entry in self._entries:
            if entry.status != "queued":
                continue
            if self._can_execute(entry.safe):
                entry.status = "executing"
                self._count_executing(entry, 1)
                entry.scope = self.start_work(self._execute, entry, self._turn)
            elif not entry.safe:
                break  # an unsafe tool keeps its place: nothing behind it starts first

    def _discard(self) -> None:
        for entry in self._entries:
            if entry.status in ("queued", "executing"):
                entry.status = "discarded"
                if entry.scope is not None:
                    entry.scope.cancel()
        self._entries = []
        self._executing = self._executing_unsafe = 0  # a discarded tool no longer holds the queue back

    # -- running one tool -------------------------------------------------------------------

    async def _execute(self, entry: _Entry, turn: BeginTurn) -> None:
        run = self._run(entry, turn)  # in its query's context while telemetry is on (its hooks' spans nest there)
        result = await (run if telemetry.active is None else telemetry.active.in_query(turn.control, run))
        if entry.status != "executing":
            return  # discarded meanwhile
        entry.status = "delivered"
        self._count_executing(entry, -1)
        turn.sink.push(result)
        self._process_queue()

    async def _run(self, entry: _Entry, turn: BeginTurn) -> ToolResult:
        name = entry.block.get("name", "")
        tool = turn.tools.get(name)
        if entry.input_error is not None:
            return _failed(entry, entry.input_error)
        if tool is None:
            return _failed(entry, f"Error: No such tool available: {name}")
        admitted = await self._admitted(entry, tool, turn)
        if isinstance(admitted, ToolResult):
            return admitted
        raw_input, args = admitted
        started = time.monotonic()
        call = self._call(entry, tool, args, turn)  # in its `execute_tool` span while telemetry is on
        output, is_error = await (call if telemetry.active is None else telemetry.active.tool(tool, entry.id, call))
        tool_use_id = entry.id
        hooks = turn.hooks
        if hooks is not None and hooks.has("PostToolUseFailure" if is_error else "PostToolUse"):
            duration_ms = int((time.monotonic() - started) * 1000)
            output = await self._post_tool_use(
                entry, tool, hooks, tool_input=raw_input, output=output, is_error=is_error, duration_ms=duration_ms
            )
        if entry.hook_messages is None and entry.stop is None and entry.host_error is None:
            message = tool_result_message(tool_use_id, output, is_error=is_error)
            return tool_result(tool_use_id=tool_use_id, message=message)
        return ToolResult(
            tool_use_id=tool_use_id,
            message=tool_result_message(tool_use_id, output, is_error=is_error),
            hook_messages=_with_stop(entry),
            prevent_continuation=entry.stop is not None,
            host_errors=(entry.host_error,) if entry.host_error else (),
        )

    async def _admitted(self, entry: _Entry, tool: Tool, turn: BeginTurn) -> tuple[dict[str, Any], Any] | ToolResult:
        """The input the tool runs with, raw and parsed (the one a PreToolUse hook's allow or `can_use_tool` gave
        in its stead, if one did), or the error result for input refused by the tool's model or a permission
        denied (by a hook, a rule, the mode, `can_use_tool`, or because its check failed).

        As in Claude Code: the PreToolUse hooks run once the input passed the tool's model; then the
        permission rules and the mode decide (`Permissions.decide`: a hook's deny denies, its allow does not
        pass deny or ask rules); `can_use_tool` is asked only what is left undecided."""
        name = entry.block.get("name", "")
        raw_input: dict[str, Any] = entry.block.get("input") or {}
        parsed = self._parse(entry, tool, raw_input)
        if isinstance(parsed, ToolResult):
            return parsed
        hook_decision: PermissionDecision | None = None
        hook_reason = None
        if turn.hooks is not None and turn.hooks.has("PreToolUse"):
            verdict = await run_pre_tool_use(turn.hooks, name, entry.id, raw_input)
            self._note_failures(entry, "PreToolUse", verdict.failures)
            added, entry.stop = effect_messages("PreToolUse", verdict.read, tool_name=name, tool_use_id=entry.id)
            if added:
                entry.hook_messages = [*(entry.hook_messages or ()), *added]
            if entry.stop is not None:  # `continue: false` outranks any decision: the call does not run
                return _failed(entry, entry.stop)
            if verdict.decision == "deny":
                return _denied(entry, deny_text(verdict, name), raw_input)
            hook_decision, hook_reason = verdict.decision, verdict.reason
            if verdict.decision == "allow" and verdict.updated_input is not None:
                replaced = self._replaced(entry, tool, verdict.updated_input)
                if isinstance(replaced, ToolResult):
                    return replaced
                raw_input, parsed = replaced
        permissions = turn.permissions
        if permissions is None:  # no rules, no mode, no `can_use_tool`: only a hook could have said no
            return raw_input, parsed
        decided = permissions.decide(name, raw_input, hook_decision, hook_reason)
        if decided.behavior == "allow":
            return raw_input, parsed
        if decided.behavior == "deny":
            return _denied(entry, decided.reason, raw_input)
        if turn.can_use_tool is None:  # nothing to ask: what nothing decided runs, what something asks is refused
            if decided.undecided:
                return raw_input, parsed
            return _denied(entry, f"{decided.reason} There is no can_use_tool to ask.", raw_input)
        return await self._ask(entry, tool, turn, (raw_input, parsed), decided.reason)

    async def _ask(
        self, entry: _Entry, tool: Tool, turn: BeginTurn, admitted: tuple[dict[str, Any], Any], reason: str | None
    ) -> tuple[dict[str, Any], Any] | ToolResult:
        """`can_use_tool`'s answer for the call (with the SDK's context), or the error result of a deny."""
        name, (raw_input, parsed) = tool.name, admitted
        assert turn.can_use_tool is not None
        context = ToolPermissionContext(tool_use_id=entry.id, agent_id=turn.agent_id, decision_reason=reason)
        try:
            decision = checked_permission(await turn.can_use_tool(name, raw_input, context))
        except Exception as error:  # noqa: BLE001 - the host's callback: an error result, never a dead session
            # Never taken as an allow: the tool does not run, and the result's `errors` names why.
            self.log.opt(exception=error).warning("can_use_tool failed for {} ({})", name, entry.id)
            text = f"can_use_tool failed for {name} ({entry.id}): {failure_text(error)}"
            return _failed(entry, f"Error: permission check failed: {failure_text(error)}", host_error=text)
        if isinstance(decision, Deny):
            message = decision.message or f"Permission to use {name} has been denied."
            return _denied(entry, message, raw_input, interrupt=decision.interrupt)
        if decision.updated_permissions and turn.permissions is not None:
            try:
                turn.permissions.apply(decision.updated_permissions)
            except (TypeError, ValueError) as error:  # the SDK's rule: the call is allowed, no update applies
                self.log.warning("can_use_tool's updated_permissions for {} not applied: {}", entry.id, error)
                entry.host_error = f"can_use_tool's updated_permissions for {name} ({entry.id}) not applied: {error}"
        if decision.updated_input is None:
            return raw_input, parsed
        return self._replaced(entry, tool, decision.updated_input)

    def _replaced(self, entry: _Entry, tool: Tool, updated: dict[str, Any]) -> tuple[dict[str, Any], Any] | ToolResult:
        """The input a hook's allow or `can_use_tool` gave in the model's stead, raw and parsed by the tool's
        model (or the error result for one the model refuses)."""
        parsed = self._parse(entry, tool, updated)
        return parsed if isinstance(parsed, ToolResult) else (updated, parsed)

    async def _call(self, entry: _Entry, tool: Tool, args: Any, turn: BeginTurn) -> tuple[ToolOutput, bool]:
        """The tool's output for `args` and whether it is an error: a timeout, an exception, or an output that
        is neither a string nor plain JSON."""
        name = entry.block.get("name", "")
        output: ToolOutput
        is_error = False
        context = ToolContext(entry.id, turn.report)
        try:
            if tool.timeout_s is None:  # no deadline, no cancel scope to pay for
                output = await tool.run(args, context)
            else:
                with trio.move_on_after(tool.timeout_s) as deadline:
                    output = await tool.run(args, context)
                if deadline.cancelled_caught:
                    output, is_error = tool_error(f"Error: {name} timed out after {tool.timeout_s:g}s"), True
        except Exception as error:  # noqa: BLE001 - a failing tool is an error result, never a dead session
            # A `ToolError` is the tool's own report (its message says it all); anything else is a bug: its traceback.
            trace = None if isinstance(error, ToolError) else error
            self.log.opt(exception=trace).warning("tool {} ({}) raised {}", name, entry.id, failure_text(error))
            output, is_error = tool_error(f"Error: {error}"), True
        if output.__class__ is not str and not is_error:
            output, is_error = self._as_json(name, output)
        return output, is_error

    def _parse(self, entry: _Entry, tool: Tool, raw_input: dict[str, Any]) -> Any:
        """The tool's parsed input, or the error result for input its model refused (or whose validator,
        host code, raised something else than a `ValidationError`: then named in the result's `errors`)."""
        try:
            return tool.parse_input(raw_input)
        except ValidationError as error:
            return _failed(entry, input_error_text(error))
        except Exception as error:  # noqa: BLE001 - a host's validator: an error result, never a dead session
            self.log.opt(exception=error).warning("input validator of {} raised", tool.name)
            text = f"input validator of {tool.name} ({entry.id}) failed: {failure_text(error)}"
            return _failed(entry, input_error_text(error), host_error=text)

    def _as_json(self, name: str, output: object) -> tuple[ToolOutput, bool]:
        """A tool's non-string output as plain JSON, or an error result naming the tool when it has none.

        Checked here, where the result is made, because nothing later can answer for it: the request
        that carries it would fail to serialize (a model error ending the query) and so would the
        transcript file. Values pydantic's JSON mode knows (datetimes, sets, models…) are converted,
        as the SDK and the transcript would convert them.
        """
        problem: str
        if isinstance(output, list):
            try:
                plain: list[dict[str, Any]] = to_jsonable_python(output)
                json.dumps(plain, allow_nan=False)  # NaN and infinities are not JSON: the SDK refuses them
            except (PydanticSerializationError, TypeError, ValueError) as error:
                problem = f"a result that is not JSON-serializable ({error})"
            else:
                return plain, False
        else:
            problem = f"a {type(output).__name__}, not a string or a list of content blocks"
        self.log.warning(f"tool {name} returned {problem}")
        return tool_error(f"Error: tool {name} returned {problem}"), True

    def _note_failures(
        self, entry: _Entry, event: HookErrorSource, failures: tuple[tuple[Any, Exception], ...]
    ) -> None:
        """Each hook that failed, logged and kept as a `hook_error` event of the call."""
        if not failures:
            return
        name = entry.block.get("name", "")
        messages = entry.hook_messages if entry.hook_messages is not None else []
        for hook, error in failures:
            self.log.opt(exception=error).warning("{} hook failed for {} ({})", event, name, entry.id)
            messages.append(hook_error_message(event, hook, error, tool_name=name, tool_use_id=entry.id))
        entry.hook_messages = messages

    async def _post_tool_use(
        self,
        entry: _Entry,
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
        self._note_failures(entry, event, verdict.read.failures)
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
                replaced, failed = self._as_json(name, replaced)
                if failed:
                    return output
            return replaced
        return output


def _with_stop(entry: _Entry) -> list[AttachmentMessage | SystemMessage]:
    """The call's hook messages, then the `hook_stopped_continuation` attachment of a hook that stopped the query."""
    messages = list(entry.hook_messages or ())
    if entry.stop is not None:
        name = entry.block.get("name", "")
        messages.append(
            AttachmentMessage(
                attachment={
                    "type": "hook_stopped_continuation",
                    "message": entry.stop,
                    "tool_use_id": entry.id,
                    "tool_name": name,
                }
            )
        )
    return messages


def _failed(
    entry: _Entry,
    message: str,
    *,
    host_error: str | None = None,
    denial: dict[str, Any] | None = None,
    interrupt: bool = False,
) -> ToolResult:
    result = tool_result_message(entry.id, tool_error(message), is_error=True)
    return ToolResult(
        tool_use_id=entry.id,
        message=result,
        hook_messages=_with_stop(entry),
        prevent_continuation=entry.stop is not None,
        host_errors=(host_error,) if host_error else (),
        denial=denial,
        interrupt=interrupt,
    )


def _denied(entry: _Entry, message: str, tool_input: dict[str, Any], *, interrupt: bool = False) -> ToolResult:
    """The error result of a call whose permission was denied, with its `permission_denials` entry."""
    denial = {"tool_name": entry.block.get("name", ""), "tool_use_id": entry.id, "tool_input": tool_input}
    return _failed(entry, message, denial=denial, interrupt=interrupt)
