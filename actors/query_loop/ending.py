"""The ending: how a query stops early (abort, budget, a transcript given up, a model error, a refusal) and
how its outcome is sent, as steps of the query (functions of the `QueryLoop`).

Every tool_use gets exactly one result (delivered, finished, or synthetic), the helpers' work is
cancelled, the interruption message follows Claude Code's rule, and `Settled` then the `result` are the
query's last events (`send_outcome`). One function ends a query early, `end_early`, whoever calls it: the
loop's task (an abort it woke to, a budget spent, a transcript given up), or the abort's own call when it
finds the loop waiting on its turn (`end_now`, which then sends the outcome too if nothing must be awaited
first; docs/design.md has the measurement that keeps this shortcut).
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.budget_guard import BudgetStatus
from queryloop.actors.query_loop import sdk_fields
from queryloop.actors.query_loop.messages import Settled
from queryloop.actors.query_loop.run import QueryPhase, Run, Turn, add_tool_results
from queryloop.actors.query_loop.turn import close_response, drain_in_ending
from queryloop.runtime import telemetry
from queryloop.runtime.loop.decisions import (
    abort_terminal,
    api_failure_terminal,
    claude_code_terminal_reason,
    result_is_error,
    result_subtype,
)
from queryloop.runtime.loop.disk import disk_error_text
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    ResultMessage,
    TombstoneEvent,
    UserMessage,
    api_error_message,
)
from queryloop.runtime.loop.hooks import StopFailureError, StopFailureInput, run_stop_failure_hook, stop_failure_error
from queryloop.runtime.loop.lifecycle_hooks import run_detached
from queryloop.runtime.loop.model import ModelError
from queryloop.runtime.loop.state import State, Terminal, TerminalReason
from queryloop.runtime.loop.transcript import (
    INTERRUPT_MESSAGE,
    INTERRUPT_MESSAGE_FOR_TOOL_USE,
    INTERRUPTED_BY_USER,
    missing_tool_results,
)

if TYPE_CHECKING:
    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.runtime.kernel._future import TrioFuture


def refusal_text(details: dict[str, Any] | None) -> str:
    """What a refusal's result says: Claude Code's wording, with the API's category and explanation."""
    text = (
        "API Error: Claude is unable to respond to this request, which appears to violate the Usage Policy "
        "(https://www.anthropic.com/legal/aup) (stop_reason: refusal"
    )
    for key in ("category", "explanation"):
        value = (details or {}).get(key)
        if value:
            text += f"; {key}: {value}"
    return text + ")"


def end_now(loop: QueryLoop, run: Run) -> None:
    """An abort found the loop waiting on its turn: end the query inside the abort's own call.

    Run once the abort's handlers have returned (`after_handlers`), before any task runs:
    the turn is ended exactly as the loop's task would end it (`end_early`), and where
    nothing has to be awaited first (no transcript, or one whose fsync runs inline, and the
    BudgetGuard answering at once) the `result` follows. The consumer then has it one
    scheduler pass sooner than if the loop's task had to wake up to write it (more, with a
    transcript fsynced off the trio thread); that task, when it runs, finds the query ended
    and only stops the helpers and ends the stream (or sends the result, if it is left).
    """
    turn = run.turn
    if loop.running is not run or run.phase is not QueryPhase.AWAITING_TURN or turn is None:
        return
    # What reached the turn before the abort counts, as it would for the task (woken by it, it takes
    # it all before its next wait, where the cancellation lands): it decides how the turn ends.
    drain_in_ending(loop, run, turn)
    run.terminal = end_early(loop, run, turn, abort_terminal(turn.ended is not None, bool(turn.tool_ids)))
    run.setup.control.decided = True
    log = loop.transcript
    if log is not None:
        try:
            synced = log.sync_now()
        except OSError as error:
            # A full disk, and nothing may wait here: what was not written stays in the log's buffer (its
            # next write takes it), the query gives up on it and ends as the abort decided, saying so.
            run.disk_error, synced = disk_error_text(log.path, error), True
        if not synced:
            return  # its fsync goes to a worker thread: the loop's task awaits it, then sends the result
    totals = settle(loop, run)
    if totals.done():  # else the loop's task awaits the guard's answer, then sends the result
        send_outcome(loop, run, run.terminal, run.turn_count, totals.get_nowait())


def end_early(
    loop: QueryLoop, run: Run, turn: Turn | None, reason: TerminalReason, *, error: str | None = None
) -> Terminal:
    """The one way a query ends early: aborted, its budget spent, or its transcript given up (`error`, the
    disk's: `run.wait_for_room`). Stops the call and the tools, answers every tool_use, says why (an
    interruption message for an abort that is not an `interrupt`; none for the disk: no one interrupted,
    and it could not be written). Never waits, so that an abort's own call may run it (`end_now`)."""
    run.begin_ending()
    if error is not None:
        interrupted, text = False, f"Error: {error}"
    else:
        interrupted = reason in ("aborted_streaming", "aborted_tools")
        text = INTERRUPTED_BY_USER if interrupted else "Stopped: the query's budget is spent"
    # Stop every helper now: a tool's result is in the turn channel as soon as it has finished, so
    # what is not there has none to wait for. Their unwinding is awaited before the stream ends
    # (`QueryLoop._query`), not before the result: nothing they do while unwinding reaches the consumer.
    if not run.helpers_aborted:
        loop.stop_workers_soon()
    if turn is not None:
        turn.progress.cut = True  # whatever step the call's task still takes, it reaches no one
        collect_remaining(loop, run, turn, text)
    if interrupted and run.setup.control.abort_reason != "interrupt":
        note = INTERRUPT_MESSAGE_FOR_TOOL_USE if reason == "aborted_tools" else INTERRUPT_MESSAGE
        loop.emit_now(run, UserMessage(content=[{"type": "text", "text": note}]))
    return Terminal(reason=reason) if error is None else Terminal(reason=reason, error=error)


async def model_error(loop: QueryLoop, run: Run, turn: Turn, error: ModelError) -> Terminal:
    """A model call failed for good: its tool uses answered, the error surfaced. The query ends `api_error`, or
    `model_error` for a model that cannot be used (`api_failure_terminal`), or `image_error`."""
    run.begin_ending()
    run.api_error_status = error.status
    if turn.pending:
        loop.stop_workers_soon()  # the tools the failed response started stop now
    collect_remaining(loop, run, turn, f"Error: {error.message}")
    if error.kind == "image_size":  # Claude Code's image error path: no StopFailure hooks
        await loop.surface(run, api_error_message(run.model, error.message))
        return Terminal(reason="image_error", error=error.message)
    text = f"API Error: {error.message}"
    if error.request_id is not None:  # what Anthropic's support asks for, kept with the error
        text = f"{text} (request_id {error.request_id})"
    failure = stop_failure_error(error.kind, error.message)
    await surface_failure(loop, run, api_error_message(run.model, text), failure, error.message)
    return Terminal(reason=api_failure_terminal(error.kind), error=text)


async def max_turns(loop: QueryLoop, run: Run, state: State) -> Terminal:
    """At the `next_turn` site, the next turn would pass `max_turns` (`max_turns_reached`): the query
    ends, saying so."""
    max_turns = run.setup.options.max_turns
    attachment = {"type": "max_turns_reached", "maxTurns": max_turns, "turnCount": state.turn_count + 1}
    await loop.emit(run, AttachmentMessage(attachment=attachment))
    return Terminal(reason="max_turns", turn_count=state.turn_count + 1)


async def refusal(loop: QueryLoop, run: Run, turn: Turn, details: dict[str, Any] | None) -> Terminal:
    """The model refused (no fallback model to ask instead): the query ends saying so, no stop hooks.

    The refused response is retracted (tombstones, as a fallback retracts an abandoned one): the
    API's advice is to reset the context, a conversation that carries the refused turn is refused
    again. The consumer has seen its partial output; the session's history keeps none of it.
    """
    run.begin_ending()
    if turn.pending:
        loop.stop_workers_soon()
    collect_remaining(loop, run, turn, "Error: the response was refused")
    for message in [*turn.assistant_messages, *turn.tool_results]:
        loop.emit_now(run, TombstoneEvent(message_uuid=message.uuid))
    text = refusal_text(details)
    await surface_failure(loop, run, api_error_message(run.model, text), "invalid_request")
    return Terminal(reason="completed", error=text, stop_details=details)


async def surface_failure(
    loop: QueryLoop, run: Run, message: AssistantMessage, error: StopFailureError, details: str | None = None
) -> None:
    """Surface the API error the query ends on, and start its StopFailure hooks without waiting for them
    (fire and forget, as Claude Code's `void executeStopFailureHooks(lastMessage)`): they run in the
    runtime, not the session. Both forms: `stop_failure_hooks`, and the StopFailure matchers of its hooks."""
    await loop.surface(run, message)
    hooks, detach, sdk_hooks = run.setup.options.stop_failure_hooks, loop.detach, run.setup.hooks
    if (not hooks and sdk_hooks is None) or detach is None:
        return
    text = "".join(block.get("text", "") for block in message.content if block.get("type") == "text")
    details = details if details is not None else text
    if sdk_hooks is not None and sdk_hooks.has("StopFailure"):  # the SDK's shape, matched against the error
        fields = {"error": error, "error_details": details, "last_assistant_message": text}
        detach(functools.partial(run_detached, sdk_hooks, "StopFailure", error, fields))
    if not hooks:
        return
    agent_id, agent_type = loop.agent or (None, None)
    hook_input = StopFailureInput(
        session_id=loop.supervisor.session_id,
        error=error,
        error_details=details,
        last_assistant_message=text,
        agent_id=agent_id,
        agent_type=agent_type,
    )
    for hook in hooks:
        detach(functools.partial(run_stop_failure_hook, hook, hook_input))


def collect_remaining(loop: QueryLoop, run: Run, turn: Turn, text: str) -> None:
    """Every tool_use of the turn gets exactly one result: delivered, finished, or synthetic (`text`)."""
    drain_in_ending(loop, run, turn)
    close_response(loop, turn)  # cut short: no more blocks will come
    progress = turn.progress
    early, progress.held = progress.held, None
    if early and run.consumer_open:  # the call's start, held back for an event that never came: shown now,
        for event in early:  # as its usage is billed below
            run.setup.sink.push(event)
    streamed = progress.usage()
    if not turn.usage_recorded and streamed is not None:
        # A call cut short was billed for what its stream reported: that spend is kept.
        turn.usage_recorded = True
        run.usage = run.usage + streamed
        run.unsettled.append((run.model, streamed))
    for message in missing_tool_results(turn.assistant_messages, turn.tool_results, text):
        add_tool_results(turn, (message,))
        loop.emit_now(run, message)
    if turn.pending:
        turn.pending.clear()


def settle(loop: QueryLoop, run: Run) -> TrioFuture[BudgetStatus]:
    """The query's totals, the `unsettled` calls accounted first (summaries and compactions have
    reported their cost already), asked once of the accounts (asked where no handler runs, the loop's
    task or `end_now`, a BudgetGuard answers before `ask` returns; the ledger always has)."""
    if run.settling is None:
        run.settling = loop.accounts.settle(run.unsettled)
        run.unsettled.clear()  # accounted by now (the guard's records were made in the call)
    return run.settling


def send_outcome(loop: QueryLoop, run: Run, terminal: Terminal, turn_count: int, totals: BudgetStatus) -> None:
    """`Settled`, then the `result`: the query's last events."""
    reason, options = terminal.reason, run.setup.options
    errors: list[str] = []
    if reason == "max_turns":
        errors.append(f"Reached maximum number of turns ({options.max_turns})")
    elif reason == "max_budget_usd":
        errors.append(budget_error(options.max_budget_usd, totals.query_cost_usd))
    elif terminal.error:
        errors.append(terminal.error)
    if run.disk_error is not None and run.disk_error != terminal.error:  # an abort cut the wait for room
        errors.append(run.disk_error)
    errors.extend(run.hook_errors)  # non-blocking: they change neither the subtype nor is_error
    run.usage, run.cost_usd = totals.query_usage, totals.query_cost_usd
    claude_code_reason = claude_code_terminal_reason(terminal.reason)
    result = ResultMessage(
        subtype=result_subtype(reason),
        is_error=result_is_error(reason, run.api_error_surfaced),
        duration_ms=int((time.monotonic() - run.setup.started) * 1000),
        result=run.last_text,
        stop_reason=run.last_stop_reason,
        total_cost_usd=run.cost_usd,
        usage=run.usage,
        num_turns=turn_count,
        errors=errors,
        stop_details=terminal.stop_details,
        usage_by_agent=run.agent_usage if run.agent_usage is not None else {},
        structured_output=run.structured_output,
        user_message_uuid=run.setup.prompt_uuid,
        user_message_uuids=[run.setup.prompt_uuid, *(m.prompt.uuid for m in run.absorbed or ())],
        permission_denials=list(run.permission_denials),  # the host's own list, never the shared empty one
        terminal_reason=claude_code_reason,
        model_usage=sdk_fields.model_usage(options, totals.models),
        duration_api_ms=sdk_fields.duration_api_ms(run),
        api_error_status=sdk_fields.api_error_status(claude_code_reason, run),
        session_id=sdk_fields.session_id(loop),
        deferred_tool_use=run.deferred_tool_use,
    )
    run.begin_ending()
    settled = Settled(terminal=terminal, transitions=list(run.transitions))
    if run.consumer_open:
        try:
            run.setup.sink.push(settled)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            run.consumer_open = False
    loop.emit_now(run, result)
    run.outcome = (settled, result)
    if run.span is not None:  # telemetry is on: the query's span ends with its result
        telemetry.query_span_end(
            run.span, reason, cost_usd=run.cost_usd, is_error=result.is_error, error=terminal.error
        )
    run.phase = QueryPhase.RESULT_SENT


UNWRITABLE: TerminalReason = "aborted_streaming"
"""How a query that gave up on its transcript ends: cut short during execution (the result's subtype is
`error_during_execution`, as for an abort, with no abort reason), its error naming the file and the OS error."""


def unwritable_terminal(text: str) -> Terminal:
    """The ending of a query whose transcript could not be made durable once its ending was decided."""
    return Terminal(reason=UNWRITABLE, error=text)


def budget_error(own_cap: float | None, query_cost_usd: float) -> str:
    """Claude Code's ``Reached maximum budget ($${maxBudgetUsd})``, the cap printed as JavaScript prints a number
    (`$1`, not `$1.0`). A stop on a cap the query shares (the host's, or its parent query's for a subagent),
    not its own, says so instead of naming its own cap, which it did not reach."""
    if own_cap is not None and query_cost_usd >= own_cap:
        return f"Reached maximum budget (${js_number(own_cap)})"
    return "Reached maximum budget (a shared cap: the host's or a parent query's)"


def js_number(value: float) -> str:
    """`value` as JavaScript's `String(number)` prints it in a budget: integral values without a fraction."""
    value = float(value)  # an int cap (pydantic keeps one given as such) prints as the same number
    return str(int(value)) if value.is_integer() and abs(value) < 1e21 else repr(value)
