"""The turn: one model call and its tools, and the emission of what they produce.

`QueryLoopTurns` holds the QueryLoop's state (its helpers, spawned on first need, the budget ledger,
the conversation, the transcript log) and runs the model phase: it hands the call to the ModelCaller's
task for the query (`CallFeed`), waits on the turn's channel, and dispatches each item (assistant
messages, tool results, progress, the call's end) as it arrives. That wait has no cancel scope: an
abort wakes it (`Run.abort`) and the loop stops dispatching; the ending takes what is left.
Every event a query emits goes through `_emit` (may wait for a slow consumer) or `_emit_now`
(for an ending, never waits); a transcript message joins the conversation as it is emitted, and its
record the session's log before the event is in the consumer's channel (the consumer's handle writes
the log's buffer before it takes an event: `runtime.loop.persistence`'s rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.budget_guard import BudgetGuard, BudgetLedger
from queryloop.actors.compactor import Compactor
from queryloop.actors.model_caller import CallEnded, ConsumerGone, start_call
from queryloop.actors.query_loop.accounting import QueryAccounts
from queryloop.actors.query_loop.messages import Forwarded, RunQuery
from queryloop.actors.query_loop.run import (
    TRANSCRIPT_TYPES,
    BudgetExceeded,
    PhaseScope,
    QueryPhase,
    Run,
    Turn,
    accept_result,
    note_assistant,
    task_budget_of,
    turn_done,
    wait_for_room,
)
from queryloop.actors.summarizer import ToolUseSummarizer
from queryloop.actors.tool_executor import Discard, ToolResult, begin_turn
from queryloop.runtime.errors import WorkCancelled
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop.events import (
    AssistantMessage,
    Event,
    ProgressEvent,
    StreamRequestStart,
    SystemMessage,
    TombstoneEvent,
    TranscriptMessage,
    Usage,
)
from queryloop.runtime.loop.model import ModelError, ModelProvider, ModelRequest, model_request
from queryloop.runtime.loop.state import State
from queryloop.runtime.loop.transcript import response_text, strip_signature_blocks

if TYPE_CHECKING:
    from collections import deque
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from pykka import ActorRef

    from queryloop.actors.model_caller import ModelCaller
    from queryloop.actors.tool_executor import StreamingToolExecutor
    from queryloop.runtime.loop.persistence import TranscriptLog
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.loop.tools import Tool

TURN_BUFFER = 256
"""Items a model call and its tools may queue before they wait for the loop (backpressure)."""


class QueryLoopTurns(TrioActor):
    """The QueryLoop's state and its turn: see the module docstring."""

    model_caller: ActorRef[ModelCaller]
    executor: ActorRef[StreamingToolExecutor]
    ledger: BudgetLedger | None
    """The session's budget ledger, kept here where no host budget is set; else None (the BudgetGuard's)."""
    accounts: QueryAccounts
    """What the loop asks of the books, inline or of the BudgetGuard (`accounting`)."""
    _budget_guard: ActorRef[BudgetGuard] | None
    _compactor: ActorRef[Compactor] | None
    _summarizer: ActorRef[ToolUseSummarizer] | None
    _compact_provider: ModelProvider
    _summary_provider: ModelProvider
    _session_dir: Path | None
    conversation: list[TranscriptMessage]
    transcript: TranscriptLog | None
    sidechains: dict[str, Sidechain]
    """The subagents' conversations, by agent id: restored on resume, and each one's as it ends."""
    mcp_tools: Callable[[list[str]], list[Tool]] | None
    """The current tools of the runtime's MCP servers of these names (`QueryOptions.mcp_servers`)."""
    agent: tuple[str, str] | None
    """A subagent's loop: its agent id and type (for its stop hooks); None for a session's own."""
    detach: Callable[[Callable[[], Awaitable[None]]], None] | None
    """Runs a coroutine function in the runtime, detached from the query (the StopFailure hooks)."""
    _run: Run | None
    _queued: deque[RunQuery]

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

    async def _model_phase(
        self, run: Run, state: State, messages_for_query: list[TranscriptMessage]
    ) -> tuple[Turn, list[TranscriptMessage]]:
        """One model call; a fallback retries it here with the same State (a bare continue, as in Claude Code's loop).

        A `refusal` switches to the fallback model too, when one is set (the API's advice: a refused
        conversation sent again as is is refused again); without one, the query ends as a refusal.
        """
        while True:
            turn = await self._call_once(run, state, messages_for_query)
            ended = turn.ended
            if ended is None or run.setup.control.abort_reason is not None:
                return turn, messages_for_query
            refused = ended.stop_reason == "refusal"
            if not (ended.fallback or refused):
                return turn, messages_for_query
            fallback = run.setup.options.fallback_model
            if fallback is None or fallback == run.model:
                if not refused:
                    turn.ended = CallEnded(error=ModelError("api_error", "fallback requested but no fallback model"))
                return turn, messages_for_query
            if self.transcript is not None:  # logged as held already: retracted there too
                for message in turn.held_results or ():
                    self.transcript.append(TombstoneEvent(message_uuid=message.uuid))
            turn.held_results = None  # results of the abandoned response go with it
            for message in [*turn.assistant_messages, *turn.tool_results]:
                await self._emit(run, TombstoneEvent(message_uuid=message.uuid))
            self.executor.tell(Discard())
            previous, run.model = run.model, fallback
            messages_for_query = strip_signature_blocks(messages_for_query)
            why = "refused the request" if refused else "is unavailable"
            await self._emit(
                run,
                SystemMessage(
                    subtype="model_fallback",
                    content=f"Switched to {fallback} because {previous} {why}",
                    data={"from": previous, "to": fallback, "reason": "refusal" if refused else "overloaded"},
                ),
            )

    async def _call_once(self, run: Run, state: State, messages_for_query: list[TranscriptMessage]) -> Turn:
        channel: EventChannel[Any] = EventChannel(TURN_BUFFER)
        turn = Turn(channel)
        run.turn, run.turn_count = turn, state.turn_count
        setup = run.setup
        control = setup.control
        if control.abort_reason is not None:
            return turn  # aborted before the request: nothing is started
        await self._emit(run, StreamRequestStart())
        options = setup.options
        turn_setting = begin_turn(
            sink=channel,
            tools=setup.tools,
            can_use_tool=options.can_use_tool,
            hooks=setup.hooks,
            control=control,
        )
        call = start_call(
            request=self._request(run, state, messages_for_query),
            sink=channel,
            events=setup.sink,
            progress=turn.progress,
            turn=turn_setting,
            max_retries=options.max_retries,
            fallback_available=options.fallback_model is not None and options.fallback_model != run.model,
            feed=run.calls,
            transcript=self.transcript,
        )
        if self.transcript is not None:
            try:
                self.transcript.write()  # what the request carries is in the file before it goes out
            except OSError as error:  # a full disk: wait for room (past the bound, the query ends: it raises)
                await wait_for_room(run, self.transcript, error)
                if run.disk_error is not None:
                    return turn  # an abort cut the wait: no request goes out, the ending is the abort's
        if run.calls.accepting:
            run.calls.feed(call)  # to the ModelCaller's task for this query: no message, no new task
        else:
            self.model_caller.tell(call)  # the query's first call (or the first since an abort cut its task)
        # No cancel scope: an abort wakes the wait below (`Run.abort`), and the loop stops dispatching at
        # once; what the turn still holds is taken by the ending (`_drain_in_ending`). The only other waits
        # here are shielded (a slow consumer, a transcript flush) or a host budget's answer, which the
        # abort cancels too.
        items = channel.items
        while run.terminal is None and control.abort_reason is None:
            if not items:
                run.phase = QueryPhase.AWAITING_TURN
                try:
                    await channel.wait()  # one wakeup takes the whole burst that arrived meanwhile
                finally:
                    if run.phase is QueryPhase.AWAITING_TURN:  # else an abort has ended the query meanwhile
                        run.phase = QueryPhase.RUNNING
                continue
            item = items.popleft()  # `channel.take()` written out (`EventChannel`'s note)
            if channel.waiting_senders:
                channel.admit_waiting_sender()
            if type(item) is AssistantMessage:  # most items: the consumer has it; recorded here, nothing awaited
                self._take_block(run, turn, item)
            else:
                await self._dispatch(run, turn, item)
            if turn_done(turn):  # only an item changes it: a fresh turn is not done, and a wait changes nothing
                break
        return turn

    def _request(self, run: Run, state: State, messages_for_query: list[TranscriptMessage]) -> ModelRequest:
        setup = run.setup
        options = setup.options
        context = setup.context_message
        messages = messages_for_query if context is None else [context, *messages_for_query]
        return model_request(  # a record: built from parts already valid, nothing copied
            model=run.model,
            system=setup.system,
            messages=run.caches.normalizer.normalize(messages),  # only what is new since the last call (its docstring)
            tools=setup.tool_schemas,
            max_tokens=state.max_output_tokens_override or options.max_output_tokens,
            thinking=options.thinking,
            task_budget=task_budget_of(run),
            effort=options.effort,
            purpose="main",
            stream_idle_timeout_s=options.stream_idle_timeout_s,
        )

    async def _dispatch(self, run: Run, turn: Turn, item: Any) -> None:
        """An item of the turn channel other than a block's message (`_call_once` takes those: `_take_block`)."""
        kind = type(item)
        if kind is ProgressEvent or kind is SystemMessage:
            await self._emit(run, item)
        elif kind is ConsumerGone:
            run.consumer_open = False  # the consumer went away: that is an abort by the user
            run.abort("user")
        elif kind is ToolResult:
            for message in accept_result(run, turn, item):
                await self._emit(run, message, of_turn=turn)
        elif kind is CallEnded:
            await self._charge_call(run, turn, item)
        elif kind is Forwarded:  # a subagent's event, tagged: to the consumer only (its own log has it)
            await self._emit(run, item.event, record=False)

    async def _charge_call(self, run: Run, turn: Turn, ended: CallEnded) -> None:
        """The call has ended: its usage to the query's accounts (kept for the end where no cap needs it now);
        a cap reached ends the query (`BudgetExceeded`)."""
        usage = self._end_call(run, turn, ended)
        if usage is None:
            return
        accounts = self.accounts
        if accounts.defers(run.setup.options):
            run.unsettled.append((run.model, usage))  # no cap to check: accounted once, when the query ends
            return
        try:
            status = await accounts.charge(run.model, usage)
        except WorkCancelled:  # a BudgetGuard's answer, cut by the abort
            if run.setup.control.abort_reason is None:
                raise
            return  # the call is recorded, the query ends aborted
        run.cost_usd = status.query_cost_usd
        if status.exceeded:
            run.budget_exceeded = True
            if run.phase < QueryPhase.ENDING:
                raise BudgetExceeded

    def _take_block(self, run: Run, turn: Turn, message: AssistantMessage) -> None:
        """A block's message, which the ModelCaller has given to the consumer already: the turn and the
        conversation take it (`_emit` with `sent`, without its coroutine)."""
        note_assistant(turn, message)
        self._keep(run, message, None, True)
        if run.budget_exceeded and run.phase < QueryPhase.ENDING:  # a subagent's spend reached the cap meanwhile
            raise BudgetExceeded

    def _drain_in_ending(self, run: Run, turn: Turn) -> None:
        """`_dispatch` for what a turn cut short has queued: nothing waits (the ending's events are
        few, they go past the consumer's bound), and the call's usage is settled with the query."""
        channel = turn.channel
        while channel.items:
            item = channel.take()
            kind = type(item)
            if kind is AssistantMessage:
                note_assistant(turn, item)
                self._emit_now(run, item, sent=True)
            elif kind is ToolResult:
                for message in accept_result(run, turn, item):
                    self._emit_now(run, message, of_turn=turn)
            elif kind is CallEnded:
                usage = self._end_call(run, turn, item)
                if usage is not None:
                    run.unsettled.append((run.model, usage))
            elif kind is ConsumerGone:
                run.consumer_open = False
            elif kind is Forwarded:
                if run.consumer_open:
                    try:
                        run.setup.sink.push(item.event)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        run.consumer_open = False
            else:  # progress and system messages produced before the cut
                self._emit_now(run, item)

    def _end_call(self, run: Run, turn: Turn, ended: CallEnded) -> Usage | None:
        """The call's last item: its response is whole; the usage to record, if it reached its end."""
        turn.ended = ended
        self._close_response(turn)
        if ended.stop_reason is None:
            return None
        run.last_stop_reason = ended.stop_reason
        turn.usage_recorded = True
        run.usage = run.usage + ended.usage
        return ended.usage

    def _close_response(self, turn: Turn) -> None:
        """The response has no more blocks: the results held back join the conversation after it."""
        turn.response_closed = True
        held = turn.held_results
        if held is None:
            return
        self.conversation.extend(held)  # their records are in the log already, held: released there too
        if self.transcript is not None:
            self.transcript.release()
        turn.held_results = None

    async def _emit(
        self, run: Run, event: Event, *, of_turn: Turn | None = None, sent: bool = False, record: bool = True
    ) -> None:
        """Send `event` to the consumer now (unless the ModelCaller has: `sent`); record a transcript message
        in the conversation (unless `record` is False: a subagent's event, which joins neither the
        conversation nor this log).

        A tool's result (`of_turn`) can be emitted while its own response is still streaming;
        the conversation takes it only after the response's last block (`_close_response`), so
        that the stored history keeps each response whole, followed by its results.
        """
        if record:
            self._keep(run, event, of_turn, sent)
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

    def _emit_now(self, run: Run, event: Event, *, of_turn: Turn | None = None, sent: bool = False) -> None:
        """`_emit` for a query's ending: never waits for the consumer (`EventChannel.push`)."""
        self._keep(run, event, of_turn, sent)
        if run.consumer_open and not sent:
            try:
                run.setup.sink.push(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.consumer_open = False

    def _keep(self, run: Run, event: Event, of_turn: Turn | None, logged: bool) -> None:
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
                self._record(event)
            if type(event) is AssistantMessage:
                run.last_message_id, run.last_text = response_text(run.last_message_id, run.last_text, event)
        elif type(event) is TombstoneEvent:
            self.conversation = [m for m in self.conversation if m.uuid != event.message_uuid]
            if self.transcript is not None:
                self.transcript.append(event)

    def _record(self, message: TranscriptMessage) -> None:
        """`message` joins the conversation, and the log in the same order."""
        self.conversation.append(message)
        if self.transcript is not None:
            self.transcript.append(message)

    async def _surface(self, run: Run, message: AssistantMessage) -> None:
        run.api_error_surfaced = True
        await self._emit(run, message)

    @staticmethod
    def _phase(run: Run) -> PhaseScope:
        """A cancel scope that an abort cancels; entered already cancelled if the abort came first."""
        return PhaseScope(run)
