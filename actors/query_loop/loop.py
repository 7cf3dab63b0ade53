"""QueryLoop: the actor that owns the session's conversation and runs its queries, one at a time.

The class is the actor alone: its messages, the session's state (helpers spawned on first need, the
conversation, transcript, accounts, sidechains) and the emission every step goes through (`emit`,
`emit_now`, `keep`, `record`, `surface`). A query's run reads in order below (`_query` → `_run_loop` →
`_loop` → `_after_model` → `_after_final` / `_after_tool_use`), calling steps that are plain functions of
`intake`, `deferred`, `context`, `recoveries`, `turn` and `ending` taking the loop and the query's `Run`.

A query is non-abortable work of this actor: the loop ends the query itself, as Claude Code's does.
`on_abort` records the reason and stops what the loop waits on (`Run.abort`). One function writes an early
ending, `ending.end_early`: in the abort's own call where the loop waits on its turn (`ending.end_now`),
else in the loop's task. Transcript messages join the conversation (and the transcript, before the consumer
can take them: `runtime.loop.persistence`'s rule) as emitted; a full disk is waited out (`wait_for_room`).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.budget_guard import BudgetGuard, BudgetLedger
from queryloop.actors.compactor import Compactor
from queryloop.actors.query_loop.accounting import GuardAccounts, LedgerAccounts, QueryAccounts
from queryloop.actors.query_loop.context import (
    attachments_due,
    collect_attachments,
    consume_summary,
    continue_paused,
    pipeline_due,
    prefetch_memory,
    recover_cut_off,
    retry_too_long,
    settle_answer,
    stage_collapse,
    start_summary,
    through_pipeline,
)
from queryloop.actors.query_loop.controls import SESSION_ASKS, answer
from queryloop.actors.query_loop.deferred import joins_plainly
from queryloop.actors.query_loop.ending import (
    UNWRITABLE,
    end_early,
    end_now,
    max_turns,
    refusal,
    send_outcome,
    settle,
    surface_failure,
    unwritable_terminal,
)
from queryloop.actors.query_loop.intake import admit_prompt, answer_absorbed, new_run, query_span, take_in_queued
from queryloop.actors.query_loop.lifecycle import session_end
from queryloop.actors.query_loop.messages import RunQuery
from queryloop.actors.query_loop.recoveries import after_error, after_final
from queryloop.actors.query_loop.run import (
    TRANSCRIPT_TYPES,
    BudgetExceeded,
    QueryPhase,
    Run,
    SessionCaches,
    TranscriptUnwritable,
    Turn,
    flush_for_room,
    wait_for_room,
)
from queryloop.actors.query_loop.subagent import Subagents
from queryloop.actors.query_loop.turn import model_phase
from queryloop.actors.summarizer import ToolUseSummarizer
from queryloop.runtime import telemetry
from queryloop.runtime._frozen import EMPTY_DICT
from queryloop.runtime.errors import SessionClosed
from queryloop.runtime.kernel.actor import TrioActor, TrioActorRef
from queryloop.runtime.kernel.messages import Abort, AbortReason
from queryloop.runtime.loop.decisions import abort_terminal, max_turns_reached, tools_stopped_terminal
from queryloop.runtime.loop.events import AssistantMessage, Event, TombstoneEvent, TranscriptMessage, UserMessage
from queryloop.runtime.loop.state import COMPLETED, State, Terminal, initial_state, next_turn
from queryloop.runtime.loop.transcript import response_text

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from pykka import ActorRef, Future

    from queryloop.actors.model_caller import CallEnded, ModelCaller
    from queryloop.actors.query_loop.subagent import AgentsHost
    from queryloop.actors.tool_executor import StreamingToolExecutor
    from queryloop.runtime.loop.hooks import StopFailureError
    from queryloop.runtime.loop.model import ModelProvider
    from queryloop.runtime.loop.persistence import TranscriptLog
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.loop.tools import Tool

_STOP_HELPERS = Abort(reason="user")
"""What stops the helpers' work at a query's end: frozen, so made once (validated, as supervisor mail is)."""


class QueryLoop(TrioActor):
    """Owns the loop `State` and the session's conversation; runs one query at a time (module docstring)."""

    actor_name = "QueryLoop"

    def __init__(
        self,
        *,
        model_caller: ActorRef[ModelCaller],
        executor: ActorRef[StreamingToolExecutor],
        compact_provider: ModelProvider,
        summary_provider: ModelProvider,
        session_dir: Path | None = None,
        budget_guard: ActorRef[BudgetGuard] | None = None,
        conversation: list[TranscriptMessage] | None = None,
        transcript: TranscriptLog | None = None,
        ledger: BudgetLedger | None = None,
        agents_host: AgentsHost | None = None,
        depth: int = 0,
        sidechains: dict[str, Sidechain] | None = None,
        mcp_tools: Callable[[list[str]], list[Tool]] | None = None,
        agent: tuple[str, str] | None = None,
        detach: Callable[[Callable[[], Awaitable[None]]], None] | None = None,
    ) -> None:
        super().__init__()
        self.model_caller = model_caller
        self.executor = executor
        # A `budget_guard` (a host budget sits above the session: every call's cost must be reported) is
        # asked by message; without one the loop accounts inline and the guard is spawned on first need.
        self._budget_guard = budget_guard
        self.ledger: BudgetLedger | None = None
        """The session's budget ledger, kept here where no host budget is set; else None (the BudgetGuard's)."""
        self.accounts: QueryAccounts
        """What the loop asks of the books, inline or of the BudgetGuard (`accounting`)."""
        if budget_guard is None:
            self.ledger = ledger or BudgetLedger()
            self.accounts = LedgerAccounts(self.ledger)
        else:
            self.accounts = GuardAccounts(budget_guard)
        self._compactor: ActorRef[Compactor] | None = None
        self._summarizer: ActorRef[ToolUseSummarizer] | None = None
        self._compact_provider = compact_provider
        self._summary_provider = summary_provider
        self._session_dir = session_dir
        self.conversation: list[TranscriptMessage] = list(conversation or [])
        """Restored (resume) messages are in the log already: only what joins from now on is logged."""
        self.transcript = transcript
        self.sidechains: dict[str, Sidechain] = dict(sidechains) if sidechains else EMPTY_DICT
        """The subagents' conversations by agent id, restored or kept as each ends; the shared empty dict till one."""
        self.agents_host = agents_host
        self.depth = depth
        self.mcp_tools = mcp_tools
        """The current tools of the runtime's MCP servers of these names (`QueryOptions.mcp_servers`)."""
        self.agent = agent
        """A subagent's loop: its agent id and type (for its stop hooks); None for a session's own."""
        self.detach = detach
        """Runs a coroutine function in the runtime, detached from the query (the StopFailure hooks)."""
        self.subagents: Subagents | None = None
        """Made for the first query that has `agents` (a session without them never has one)."""
        self.running: Run | None = None
        self.queued: deque[RunQuery] = deque()
        """Messages sent while a query runs, in order: taken in at its next turn boundary, or run after it."""
        self.caches = SessionCaches(len(self.conversation))
        """Shared by the session's queries: each one's requests build on the previous one's (its docstring)."""

    # -- the helpers, spawned on first need ------------------------------------------------
    @property
    def budget_guard(self) -> ActorRef[BudgetGuard]:
        """The session's BudgetGuard; where no host budget is set, spawned on first need around `ledger`."""
        guard = self._budget_guard
        if guard is None:
            guard = self._budget_guard = self.supervisor.spawn(BudgetGuard, ledger=self.ledger)
        return guard

    @property
    def compactor(self) -> ActorRef[Compactor]:
        """The session's Compactor, spawned on first need (a session whose context never needs it has none)."""
        compactor = self._compactor
        if compactor is None:
            compactor = self._compactor = self.supervisor.spawn(
                Compactor, self._compact_provider, budget_guard=self.budget_guard, session_dir=self._session_dir
            )
        return compactor

    @property
    def summarizer(self) -> ActorRef[ToolUseSummarizer]:
        """The session's ToolUseSummarizer, spawned on first need (tool-use summaries only)."""
        summarizer = self._summarizer
        if summarizer is None:
            summarizer = self._summarizer = self.supervisor.spawn(
                ToolUseSummarizer, self._summary_provider, budget_guard=self.budget_guard
            )
        return summarizer

    # -- its messages -----------------------------------------------------------------------
    def on_receive(self, message: Any) -> Any:
        if isinstance(message, RunQuery):
            self._submit(message)
            return None
        if isinstance(message, SESSION_ASKS):  # the conversation, its usage, `/compact` (`controls`)
            return answer(self, message)
        return super().on_receive(message)

    def _submit(self, message: RunQuery) -> None:
        if self.running is None:
            self.running = new_run(self, message)
            # The prompt alone: the rest is the run's now, and work holds its arguments for the whole query.
            self.start_work(self._query, message.prompt, abortable=False)
        elif message.interrupt:
            self.queued.appendleft(message)  # the session has aborted the running query: this one is next
        else:
            self.queued.append(message)  # it waits its turn (Claude Code's queued messages)

    def on_abort(self, reason: AbortReason) -> None:
        run = self.running
        if run is not None:
            # A broadcast aborts every helper in the same call (before any task runs): `end_early` need not again.
            run.helpers_aborted = True
            run.abort(reason)
            if (
                run.phase is QueryPhase.AWAITING_TURN
                and run.setup.control.abort_reason is not None
                and not run.setup.control.decided
            ):
                self.after_handlers(lambda: end_now(self, run))

    def on_stop(self) -> None:
        # A message still waiting is never started now: its stream ends, without a result.
        while self.queued:
            left = self.queued.popleft()
            left.sink.close()
            left.control.end()
        # After the work has ended: no flush is running. What a cancelled query left buffered
        # is written unsynced, as a crash would have it: the next load repairs it.
        if self.transcript is not None:
            try:
                self.transcript.close()
            except OSError as error:
                # Closed all the same. A session's log then raises EIO at every later write, so its handle tells
                # a consumer what the file lacks; a subagent's (a sidechain) leaves the records to its parent's log.
                self.log.warning("transcript {} closed with records unwritten: {}", self.transcript.path, error)
        session_end(self)  # the SessionEnd hooks, detached

    def on_failure(self, *exc_info: object) -> None:
        self.on_stop()

    # -- emission: the conversation and transcript writer, every step's one way to the consumer --
    async def emit(
        self, run: Run, event: Event, *, of_turn: Turn | None = None, sent: bool = False, record: bool = True
    ) -> None:
        """Send `event` to the consumer now (unless the ModelCaller has: `sent`); record a transcript message
        in the conversation (unless `record` is False: a subagent's event, which joins neither the
        conversation nor this log).

        A tool's result (`of_turn`) can be emitted while its own response is still streaming;
        the conversation takes it only after the response's last block (`turn.close_response`), so
        that the stored history keeps each response whole, followed by its results.
        """
        if record:
            self.keep(run, event, of_turn, sent)
        if run.consumer_open and not sent:
            try:
                run.setup.sink.send_nowait(event)
            except trio.WouldBlock:
                # A slow consumer: wait for it, shielded, so that an abort never drops an event.
                with trio.CancelScope(shield=True):
                    await run.setup.sink.send(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.consumer_open = False  # the consumer went away: that is an abort by the user
                run.abort("user")
        if run.budget_exceeded and run.phase < QueryPhase.ENDING:
            raise BudgetExceeded

    def emit_now(self, run: Run, event: Event, *, of_turn: Turn | None = None, sent: bool = False) -> None:
        """`emit` for a query's ending: never waits for the consumer (`EventChannel.push`)."""
        self.keep(run, event, of_turn, sent)
        if run.consumer_open and not sent:
            try:
                run.setup.sink.push(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.consumer_open = False

    def keep(self, run: Run, event: Event, of_turn: Turn | None, logged: bool) -> None:
        """What emitting `event` does to the conversation and the log (`logged`: by the ModelCaller already).

        Before the event is sent: its record is buffered in the log, which the consumer's handle
        writes before it takes an event. A held result is logged as held, at once."""
        if isinstance(event, TRANSCRIPT_TYPES):
            if of_turn is not None and not of_turn.response_closed:
                if of_turn.held_results is None:
                    of_turn.held_results = []
                of_turn.held_results.append(event)
                if self.transcript is not None:
                    self.transcript.append(event, held=True)
            elif logged:
                self.conversation.append(event)
            else:
                self.record(event)
            if type(event) is AssistantMessage:
                run.last_message_id, run.last_text = response_text(run.last_message_id, run.last_text, event)
        elif type(event) is TombstoneEvent:
            self.conversation = [m for m in self.conversation if m.uuid != event.message_uuid]
            if self.transcript is not None:
                self.transcript.append(event)

    def record(self, message: TranscriptMessage) -> None:
        """`message` joins the conversation, and the log in the same order."""
        self.conversation.append(message)
        if self.transcript is not None:
            self.transcript.append(message)

    async def surface(self, run: Run, message: AssistantMessage) -> None:
        """`emit` for the API error the query ends on (its `result` is then an error)."""
        run.api_error_surfaced = True
        await self.emit(run, message)

    def stop_workers_soon(self) -> list[Future[Any]]:
        """Send `Abort` to every busy helper at once (model call, tools, summary, compaction); the futures answer
        once each one's work has unwound. The ModelCaller's task for the query is told there are no more calls
        (it ends on its own when it runs next: the stream's end waits for it, `_query`), and is aborted only if
        it is still in a call."""
        run = self.running
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

    # -- the query, read in order: each step a function of its module -----------------------
    async def _query(self, prompt: UserMessage) -> None:
        run = self.running
        assert run is not None
        try:
            if telemetry.active is not None:  # the query's `invoke_agent` span, current in this task (its hooks nest)
                run.span = query_span(self, run)
            self.accounts.begin_query(run.setup.options)
            self.caches.hooks = run.setup.hooks  # the last query's: the session's SessionEnd hooks
            refused = None  # the prompt joins the conversation (written first thing in `_run_loop`), unless:
            if joins_plainly(self, run):  # (most queries: nothing to ask first, no deferred call to replay)
                self.record(prompt)
            else:
                refused = await admit_prompt(self, run, prompt)
            if refused is not None:
                terminal, turns = refused, 0
            elif run.setup.options.memory_prefetch is None:
                terminal, turns = await self._run_loop(run)
            else:
                async with trio.open_nursery() as prefetch:
                    prefetch.start_soon(prefetch_memory, self, run, list(self.conversation))
                    terminal, turns = await self._run_loop(run)
                    # Disposed on every exit path, as Claude Code's `using` does.
                    prefetch.cancel_scope.cancel()
            run.calls.close()  # no more model calls: the ModelCaller's task for this query ends when it runs
            run.setup.control.decided = True
            if run.phase is not QueryPhase.RESULT_SENT:  # else an abort has sent it, in its own call (`end_now`)
                if self.transcript is not None:
                    # Before the result: a consumer that saw it can rely on the file. Past the bound for a full
                    # disk the result is the disk's error (a success must not read as "all of it is in the file");
                    # an abort that cuts the wait keeps the ending decided, its `errors` naming the disk.
                    try:
                        await flush_for_room(run, self.transcript)
                    except TranscriptUnwritable as unwritable:
                        terminal = unwritable_terminal(str(unwritable))
                totals = await settle(self, run)
                send_outcome(self, run, terminal, terminal.turn_count or turns, totals)
            for future in self.stop_workers_soon():  # awaited before the stream ends: then no task of the session runs
                await future
        except SessionClosed:
            # A helper could not be spawned: the session is closing, and its stop is cancelling this work.
            pass
        finally:
            self.running = None
            run.setup.control.end()
            if run.absorbed is not None:
                answer_absorbed(run)
            if self.queued:
                self._submit(self.queued.popleft())
            # The last statement: when the consumer sees the end, this work is done, and so is the
            # ModelCaller's task for the query (the stream ends when it has, if it has not yet).
            run.calls.close(then=run.setup.sink.close)

    async def _run_loop(self, run: Run) -> tuple[Terminal, int]:
        """The query's loop over the conversation as it is now: its end, and the turn it reached (a budget stop's
        too: the turn of the call that reached the cap)."""
        try:
            if self.transcript is not None:
                try:  # the prompt: a kill from here on keeps it (a compaction may call a model first)
                    self.transcript.write()
                except OSError as error:  # a full disk: wait for room (an abort's cut ends the query below as usual)
                    await wait_for_room(run, self.transcript, error)
            # The first State made in the call, not kept in a local: no caller's frame holds it (its dict and
            # its list of messages would stay in flight for the whole query); each iteration's is the only one.
            terminal, state = await self._loop(run, initial_state(list(self.conversation)))
        except BudgetExceeded:
            return end_early(self, run, run.turn, "max_budget_usd"), run.turn_count
        except TranscriptUnwritable as unwritable:  # the prompt's write, one before a request, or a continue site's
            return end_early(self, run, run.turn, UNWRITABLE, error=str(unwritable)), run.turn_count
        return terminal, state.turn_count

    async def _loop(self, run: Run, state: State) -> tuple[Terminal, State]:
        """The query's iterations, each read top to bottom: make the last turn durable, the context pipeline, the
        model phase, then `_after_model`'s decisions, which end the query (a `Terminal`) or give the next State."""
        # Each step below that has nothing to do on most iterations is awaited only when it has: an
        # `async def` that returns at once still costs a coroutine (a thousand loops, a dozen a loop).
        while True:
            if state.transition is not None and self.transcript is not None:
                await flush_for_room(run, self.transcript)  # a continue site: the turn that ended is made durable
            messages_for_query = self.caches.boundary.after(state.messages)
            if pipeline_due(run, messages_for_query):  # sent as they are on most iterations
                through = await through_pipeline(self, run, messages_for_query)
                if isinstance(through, Terminal):  # aborted while compacting, or at the blocking limit
                    return through, state
                messages_for_query = through
            turn, messages_for_query = await model_phase(self, run, state, messages_for_query)
            step = await self._after_model(run, state, messages_for_query, turn)
            if isinstance(step, Terminal):
                return step, state
            # The turn's messages are in the state now: its own objects (lists, channel, the call's end) die
            # here, not when the next call returns, so a thousand loops in flight hold a turn each, not two.
            state = step
            del turn, messages_for_query

    async def _after_model(
        self, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
    ) -> Terminal | State:
        """The decisions after a model call, in Claude Code's check order: an abort, a model error (the
        prompt-too-long cascade), a refusal, a paused turn, then a response without tool use (its recoveries,
        stop hooks) or with it (the next turn)."""
        ended = turn.ended
        if run.setup.control.abort_reason is not None or ended is None:
            if run.terminal is not None:  # the abort has ended the turn already, in its own call
                return run.terminal
            return end_early(self, run, turn, abort_terminal(ended is not None, bool(turn.tool_ids)))
        # The previous batch's summary was made while this call streamed: collect it now.
        if state.pending_tool_use_summary is not None:
            await consume_summary(self, run, state.pending_tool_use_summary)
        if ended.error is not None:
            if ended.withheld is None:  # failed for good: a cut after visible output is resumed (`recoveries`)
                return await after_error(self, run, state, messages_for_query, turn, error=ended.error)
            # the prompt-too-long cascade
            return await retry_too_long(self, run, state, messages_for_query, turn, withheld=ended.withheld)
        if ended.stop_reason == "refusal":  # no fallback model took it (`model_phase`)
            return await refusal(self, run, turn, ended.stop_details)
        if ended.stop_reason == "pause_turn" and not turn.tool_ids:
            # Not an end: the server paused a long server-tool turn. No stop hooks; the response goes back.
            return await continue_paused(self, run, state, messages_for_query, turn)
        if not turn.tool_ids:
            return await self._after_final(run, state, messages_for_query, turn, ended)
        return await self._after_tool_use(run, state, messages_for_query, turn)

    async def _after_final(
        self, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn, ended: CallEnded
    ) -> Terminal | State:
        """A response without tool use: a cut-off one's recoveries, else (`recoveries.after_final`) a malformed
        tool call's or an empty answer's retry, or the stop hooks' verdict."""
        if ended.withheld is None:
            return await after_final(self, run, state, messages_for_query, turn, ended=ended)
        # max_tokens or model_context_window_exceeded truncation
        retried = await recover_cut_off(self, run, state, messages_for_query, turn, ended=ended)
        if retried is not None:
            return retried
        cut: StopFailureError = "max_output_tokens" if ended.stop_reason == "max_tokens" else "invalid_request"
        await surface_failure(self, run, ended.withheld, cut)
        return COMPLETED  # an API error never reaches stop hooks

    async def _after_tool_use(
        self, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
    ) -> Terminal | State:
        """A response with tool use, its tools done: a hook's stop, a structured answer, the turn cap, or the
        next turn with the results (and the attachments due)."""
        if turn.prevent_continuation:  # a hook's `continue: false`, or the call a PreToolUse hook deferred
            return Terminal(reason=tools_stopped_terminal(run.deferred_tool_use is not None))
        if run.structured is not None:
            answered = settle_answer(run, turn)
            if answered is not None:
                return answered
        attachments: list[TranscriptMessage] = []
        if attachments_due(run):
            attachments.extend(await collect_attachments(self, run))
        if self.queued:  # messages sent while the tools ran join this turn
            attachments.extend(await take_in_queued(self, run))
        if max_turns_reached(state.turn_count, run.setup.options.max_turns):
            return await max_turns(self, run, state)
        state = next_turn(
            state,
            [*messages_for_query, *turn.assistant_messages, *turn.tool_results, *attachments],
            start_summary(self, run, turn),
        )
        run.transitions.append("next_turn")
        if run.setup.options.context_collapse:
            stage_collapse(self, run, state)
        return state
