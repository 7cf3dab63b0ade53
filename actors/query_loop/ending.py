"""The ending: how a query stops early (abort, budget, model error) and how its outcome is sent.

Every tool_use gets exactly one result (delivered, finished, or synthetic), the helpers' work is
cancelled, the interruption message follows Claude Code's rule, and `Settled` then the `result` are the
query's last events. `_end_now` does all of it inside an abort's own call when the loop was waiting
on its turn.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.budget_guard import BudgetStatus
from queryloop.actors.query_loop.messages import Settled
from queryloop.actors.query_loop.run import QueryPhase, Run, Turn, add_tool_results
from queryloop.actors.query_loop.turn import QueryLoopTurns
from queryloop.runtime.kernel.actor import TrioActorRef
from queryloop.runtime.kernel.messages import Abort
from queryloop.runtime.loop.decisions import abort_terminal, result_is_error, result_subtype
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
from queryloop.runtime.loop.model import ModelError
from queryloop.runtime.loop.state import State, Terminal
from queryloop.runtime.loop.transcript import (
    INTERRUPT_MESSAGE,
    INTERRUPT_MESSAGE_FOR_TOOL_USE,
    INTERRUPTED_BY_USER,
    missing_tool_results,
)

if TYPE_CHECKING:
    from pykka import ActorRef, Future

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


_STOP_HELPERS = Abort(reason="user")
"""What stops the helpers' work at a query's end: frozen, so made once (validated, as supervisor mail is)."""


class QueryLoopEnding(QueryLoopTurns):
    """Endings of a query: see the module docstring."""

    def _end_now(self, run: Run) -> None:
        """An abort found the loop waiting on its turn: end the query inside the abort's own call.

        Run once the abort's handlers have returned (`after_handlers`), before any task runs:
        the turn is ended exactly as the loop's task would end it (`_end_early`), and where
        nothing has to be awaited first (no transcript, or one whose fsync runs inline, and the
        BudgetGuard answering at once) the `result` follows. The consumer then has it one
        scheduler pass sooner than if the loop's task had to wake up to write it (more, with a
        transcript fsynced off the trio thread); that task, when it runs, finds the query ended
        and only stops the helpers and ends the stream (or sends the result, if it is left).
        """
        turn = run.turn
        if self._run is not run or run.phase is not QueryPhase.AWAITING_TURN or turn is None:
            return
        # What reached the turn before the abort counts, as it would for the task (woken by it, it takes
        # it all before its next wait, where the cancellation lands): it decides how the turn ends.
        self._drain_in_ending(run, turn)
        run.terminal = self._end_early(run, turn, abort_terminal(turn.ended is not None, bool(turn.tool_ids)))
        run.setup.control.decided = True
        log = self.transcript
        if log is not None:
            try:
                synced = log.sync_now()
            except OSError as error:
                # A full disk, and nothing may wait here: what was not written stays in the log's buffer (its
                # next write takes it), the query gives up on it and ends as the abort decided, saying so.
                run.disk_error, synced = disk_error_text(log.path, error), True
            if not synced:
                return  # its fsync goes to a worker thread: the loop's task awaits it, then sends the result
        totals = self._settle(run)
        if totals.done():  # else the loop's task awaits the guard's answer, then sends the result
            self._send_outcome(run, run.terminal, run.turn_count, totals.get_nowait())

    def _end_early(self, run: Run, turn: Turn | None, reason: Any) -> Terminal:
        """Abort or budget: stop the call and the tools, answer every tool_use, say why. Never waits."""
        run.begin_ending()
        interrupted = reason in ("aborted_streaming", "aborted_tools")
        text = INTERRUPTED_BY_USER if interrupted else "Stopped: the query's budget is spent"
        # Stop every helper now: a tool's result is in the turn channel as soon as it has finished, so
        # what is not there has none to wait for. Their unwinding is awaited before the stream ends
        # (`_query`), not before the result: nothing they do while unwinding reaches the consumer.
        if not run.helpers_aborted:
            self._stop_workers_soon()
        if turn is not None:
            turn.progress.cut = True  # whatever step the call's task still takes, it reaches no one
            self._collect_remaining(run, turn, text)
        if interrupted and run.setup.control.abort_reason != "interrupt":
            note = INTERRUPT_MESSAGE_FOR_TOOL_USE if reason == "aborted_tools" else INTERRUPT_MESSAGE
            self._emit_now(run, UserMessage(content=[{"type": "text", "text": note}]))
        return Terminal(reason=reason)

    def _end_unwritable(self, run: Run, text: str) -> Terminal:
        """The query gave up on its transcript (`run.wait_for_room`): stop what runs, answer every tool_use,
        end with the disk's error. No interruption message: no one interrupted, and it could not be written."""
        run.begin_ending()
        if not run.helpers_aborted:
            self._stop_workers_soon()
        turn = run.turn
        if turn is not None:
            turn.progress.cut = True
            self._collect_remaining(run, turn, f"Error: {text}")
        return unwritable_terminal(text)

    async def _model_error(self, run: Run, turn: Turn, error: ModelError) -> Terminal:
        run.begin_ending()
        if turn.pending:
            self._stop_workers_soon()  # the tools the failed response started stop now
        self._collect_remaining(run, turn, f"Error: {error.message}")
        if error.kind == "image_size":  # Claude Code's image error path: no StopFailure hooks
            await self._surface(run, api_error_message(run.model, error.message))
            return Terminal(reason="image_error", error=error.message)
        text = f"API Error: {error.message}"
        if error.request_id is not None:  # what Anthropic's support asks for, kept with the error
            text = f"{text} (request_id {error.request_id})"
        failure = stop_failure_error(error.kind, error.message)
        await self._surface_failure(run, api_error_message(run.model, text), failure, error.message)
        return Terminal(reason="model_error", error=text)

    async def _max_turns(self, run: Run, state: State) -> Terminal:
        """At the `next_turn` site, the next turn would pass `max_turns` (`max_turns_reached`): the query
        ends, saying so."""
        max_turns = run.setup.options.max_turns
        attachment = {"type": "max_turns_reached", "maxTurns": max_turns, "turnCount": state.turn_count + 1}
        await self._emit(run, AttachmentMessage(attachment=attachment))
        return Terminal(reason="max_turns", turn_count=state.turn_count + 1)

    async def _refusal(self, run: Run, turn: Turn, details: dict[str, Any] | None) -> Terminal:
        """The model refused (no fallback model to ask instead): the query ends saying so, no stop hooks.

        The refused response is retracted (tombstones, as a fallback retracts an abandoned one): the
        API's advice is to reset the context, a conversation that carries the refused turn is refused
        again. The consumer has seen its partial output; the session's history keeps none of it.
        """
        run.begin_ending()
        if turn.pending:
            self._stop_workers_soon()
        self._collect_remaining(run, turn, "Error: the response was refused")
        for message in [*turn.assistant_messages, *turn.tool_results]:
            self._emit_now(run, TombstoneEvent(message_uuid=message.uuid))
        text = refusal_text(details)
        await self._surface_failure(run, api_error_message(run.model, text), "invalid_request")
        return Terminal(reason="completed", error=text, stop_details=details)

    async def _surface_failure(
        self, run: Run, message: AssistantMessage, error: StopFailureError, details: str | None = None
    ) -> None:
        """Surface the API error the query ends on, and start its StopFailure hooks without waiting for them
        (fire and forget, as Claude Code's `void executeStopFailureHooks(lastMessage)`): they run in the
        runtime, not the session."""
        await self._surface(run, message)
        hooks, detach = run.setup.options.stop_failure_hooks, self.detach
        if not hooks or detach is None:
            return
        agent_id, agent_type = self.agent or (None, None)
        text = "".join(block.get("text", "") for block in message.content if block.get("type") == "text")
        hook_input = StopFailureInput(
            session_id=self.supervisor.session_id,
            error=error,
            error_details=details if details is not None else text,
            last_assistant_message=text,
            agent_id=agent_id,
            agent_type=agent_type,
        )
        for hook in hooks:
            detach(functools.partial(run_stop_failure_hook, hook, hook_input))

    def _collect_remaining(self, run: Run, turn: Turn, text: str) -> None:
        """Every tool_use of the turn gets exactly one result: delivered, finished, or synthetic (`text`)."""
        self._drain_in_ending(run, turn)
        self._close_response(turn)  # cut short: no more blocks will come
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
            self._emit_now(run, message)
        if turn.pending:
            turn.pending.clear()

    async def _stop_workers(self) -> None:
        """Cancel whatever the query's helpers still run (model call, tools, summary, compaction); wait for it.

        The ModelCaller's task for the query is told there are no more calls (it ends on its own
        when it runs next: the stream's end waits for it, `_query`), and is aborted only if it is
        still in a call."""
        for future in self._stop_workers_soon():
            await future

    def _stop_workers_soon(self) -> list[Future[Any]]:
        """Send `Abort` to every busy helper at once; the futures answer once each one's work has unwound."""
        run = self._run
        workers: list[ActorRef[Any]] = [self.executor]
        if self._summarizer is not None:
            workers.append(self._summarizer)
        if self._compactor is not None:
            workers.append(self._compactor)
        if run is None or run.calls.calling or run.calls.serving is None:
            workers.append(self.model_caller)  # a call in flight (or work not of this query's feed)
        if run is not None:
            run.calls.close()  # no more calls in this query: the ModelCaller's task for it ends
        helpers: list[TrioActorRef[Any]] = workers  # type: ignore[assignment]  # every helper is a TrioActor
        return [helper.ask(_STOP_HELPERS, block=False) for helper in helpers if helper.busy()]

    def _settle(self, run: Run) -> TrioFuture[BudgetStatus]:
        """The query's totals, the `unsettled` calls accounted first (summaries and compactions have
        reported their cost already), asked once of the accounts (asked where no handler runs, the loop's
        task or `_end_now`, a BudgetGuard answers before `ask` returns; the ledger always has)."""
        if run.settling is None:
            run.settling = self.accounts.settle(run.unsettled)
            run.unsettled.clear()  # accounted by now (the guard's records were made in the call)
        return run.settling

    def _send_outcome(self, run: Run, terminal: Terminal, turn_count: int, totals: BudgetStatus) -> None:
        """`Settled`, then the `result`: the query's last events."""
        reason = terminal.reason
        errors: list[str] = []
        if reason == "max_turns":
            errors.append(f"Reached maximum number of turns ({run.setup.options.max_turns})")
        elif reason == "max_budget_usd":
            errors.append(budget_error(run.setup.options.max_budget_usd, totals.query_cost_usd))
        elif terminal.error:
            errors.append(terminal.error)
        if run.disk_error is not None and run.disk_error != terminal.error:  # an abort cut the wait for room
            errors.append(run.disk_error)
        errors.extend(run.hook_errors)  # non-blocking: they change neither the subtype nor is_error
        run.usage, run.cost_usd = totals.query_usage, totals.query_cost_usd
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
        )
        run.begin_ending()
        settled = Settled(terminal=terminal, transitions=list(run.transitions))
        if run.consumer_open:
            try:
                run.setup.sink.push(settled)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.consumer_open = False
        self._emit_now(run, result)
        run.outcome = (settled, result)
        run.phase = QueryPhase.RESULT_SENT


def unwritable_terminal(text: str) -> Terminal:
    """How a query that gave up on its transcript ends: cut short during execution (the result's subtype is
    `error_during_execution`, as for an abort, with no abort reason), `text` naming the file and the OS error."""
    return Terminal(reason="aborted_streaming", error=text)


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
