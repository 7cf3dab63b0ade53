"""QueryLoop: owns the loop `State` and the session's conversation; runs queries.

A `RunQuery` starts the query as *non-abortable* work of this actor: an abort
must not kill the loop, the loop must end the query itself as seed 000 says:
what the tools finished, synthetic `Interrupted by user` results for the rest,
an interruption message unless the reason is `interrupt`, and the `result`
event. `on_abort` records the reason and cancels the current *phase* (the model
stream and tool wait, or the stop hooks). Where the loop is waiting on its turn
(nearly all of a query's life), the ending is written at once, in the abort's own
call, once its handlers have returned (`_end_now`); elsewhere the loop's task,
woken by the cancellation, writes it. Both run the same synchronous ending
(`_end_early`, `_send_outcome`). The ModelCaller's and the executor's work is
abortable and is cancelled by the same `Abort` broadcast.

One iteration: the context pipeline (compaction) at the top, then
`stream_request_start` → model call (fallback retries inside) → the decisions
of `queryloop.runtime.loop.decisions`, in the reference's check order → a continue site of
`queryloop.runtime.loop.state` or a `Terminal`. Events are emitted in production order to the
query's bounded channel (a call's stream events and assistant messages by the
ModelCaller itself, which then hands each message to the loop); transcript
messages join the conversation as they are emitted, so the conversation is always
what the consumer saw. The `result` is sent as soon as the ending is known; the
stream ends once every helper's cancelled work has unwound.

With a `TranscriptLog`, every message that joins the conversation (and every
tombstone) is logged in the conversation's own order, and the log is flushed to
disk at each continue site and when the query ends, before its `result`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import trio

from queryloop.actors.budget_guard import (
    BeginQuery,
    BudgetStatus,
    CheckTokenBudget,
    RecordUsage,
    SettleQuery,
)
from queryloop.actors.compactor import (
    Compact,
    Compacted,
    ContextConfig,
    DrainCollapses,
    Drained,
    Prepare,
    Prepared,
    StageCollapse,
)
from queryloop.actors.model_caller import (
    PROMPT_TOO_LONG_ERROR_MESSAGE,
    CallEnded,
    CallProgress,
    ConsumerGone,
    StartCall,
)
from queryloop.actors.summarizer import Summarize
from queryloop.actors.tool_executor import BeginTurn, Discard, ToolResult
from queryloop.runtime.errors import QueryloopError, WorkCancelled
from queryloop.runtime.kernel.actor import TrioActor, TrioActorRef
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import Abort, AbortReason, CarrierMessage, Message
from queryloop.runtime.loop.context import ContextLimits, collapse_may_stage, pipeline_needed
from queryloop.runtime.loop.decisions import (
    abort_terminal,
    max_output_tokens_action,
    max_turns_reached,
    result_is_error,
    result_subtype,
)
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    Event,
    ProgressEvent,
    ResultMessage,
    StreamRequestStart,
    SystemMessage,
    TombstoneEvent,
    ToolUseSummaryEvent,
    TranscriptMessage,
    Usage,
    UserMessage,
    api_error_message,
)
from queryloop.runtime.loop.hooks import STOP_HOOK_FEEDBACK, StopHookInput
from queryloop.runtime.loop.model import ModelError, ModelRequest
from queryloop.runtime.loop.options import DEFAULT_SYSTEM_PROMPT, QueryOptions
from queryloop.runtime.loop.pricing import context_window_for
from queryloop.runtime.loop.state import (
    MAX_OUTPUT_TOKENS_RECOVERY_TEXT,
    ContinueReason,
    State,
    Terminal,
    collapse_drain_retry,
    max_output_tokens_escalate,
    max_output_tokens_recovery,
    next_turn,
    reactive_compact_retry,
    stop_hook_blocking,
    token_budget_continuation,
)
from queryloop.runtime.loop.token_budget import TokenBudgetDecision
from queryloop.runtime.loop.transcript import (
    INTERRUPT_MESSAGE,
    INTERRUPT_MESSAGE_FOR_TOOL_USE,
    INTERRUPTED_BY_USER,
    build_system_prompt,
    messages_after_compact_boundary,
    missing_tool_results,
    normalize_messages_for_api,
    strip_signature_blocks,
    user_context_message,
)

if TYPE_CHECKING:
    from types import TracebackType

    from pykka import ActorRef, Future

    from queryloop.actors.budget_guard import BudgetGuard
    from queryloop.actors.compactor import Compactor
    from queryloop.actors.model_caller import ModelCaller
    from queryloop.actors.summarizer import HaikuSummarizer
    from queryloop.actors.tool_executor import StreamingToolExecutor
    from queryloop.runtime.kernel._future import TrioFuture
    from queryloop.runtime.loop.persistence import TranscriptLog

TURN_BUFFER = 256
"""Items a model call and its tools may queue before they wait for the loop (backpressure)."""

_TRANSCRIPT_TYPES = (UserMessage, AssistantMessage, SystemMessage, AttachmentMessage)


class QueryInProgress(QueryloopError):
    """A query is already running in this session."""


class QueryControl:
    """Shared by a query's handle and the loop, on the trio thread: the abort request.

    The session sets `abort_reason` before broadcasting `Abort`, so an abort that
    overtakes the `RunQuery` in the mailbox still reaches the query. Once the loop has
    decided how the query ends (`decided`), an abort changes nothing and is not recorded:
    the query ends as decided, like the reference's, whose last abort check has passed.
    """

    __slots__ = ("abort_reason", "decided", "ended")

    def __init__(self) -> None:
        self.abort_reason: AbortReason | None = None
        self.decided = False
        """Set when the loop has its terminal: what is left is stopping helpers and sending the result."""
        self.ended = trio.Event()
        """Set once the query's work is over (its result sent, or the session closed under it)."""

    @property
    def finished(self) -> bool:
        return self.ended.is_set()

    def request_abort(self, reason: AbortReason) -> bool:
        """Record the first abort reason while it can still change the ending; True if recorded now."""
        if self.abort_reason is not None or self.decided or self.finished:
            return False
        self.abort_reason = reason
        return True


class RunQuery(CarrierMessage):
    prompt: UserMessage
    options: QueryOptions
    sink: EventChannel[Any]
    control: QueryControl


class GetConversation(Message):
    """Answered with a copy of the session's conversation."""


class Refused(Message):
    """Sent instead of any event when a query cannot start (another one is running)."""

    reason: str


class Settled(Message):
    """Sent to the query's channel just before `result`: how the query ended (the handle keeps it)."""

    terminal: Terminal
    transitions: list[ContinueReason]


class _BudgetExceeded(Exception):
    pass


@dataclass(slots=True)
class _Turn:
    """One model call and its tools."""

    channel: EventChannel[Any]
    """The call's events and its tools' results, in production order."""
    assistant_messages: list[AssistantMessage] = field(default_factory=list)
    tool_results: list[TranscriptMessage] = field(default_factory=list)
    tool_ids: list[str] = field(default_factory=list)
    pending: set[str] = field(default_factory=set)
    ended: CallEnded | None = None
    prevent_continuation: bool = False
    response_closed: bool = False
    held_results: list[TranscriptMessage] = field(default_factory=list)
    """Tool results emitted while their response was still streaming, waiting for its last block."""
    progress: CallProgress = field(default_factory=CallProgress)
    """What the call's stream reported so far, kept by the ModelCaller (billed even if the call never ends)."""
    usage_recorded: bool = False


@dataclass(slots=True)
class _Run:
    """One query's mutable context (the reference's toolUseContext): model, abort, accounting."""

    options: QueryOptions
    sink: EventChannel[Any]
    control: QueryControl
    model: str
    system: list[dict[str, Any]]
    tool_schemas: list[dict[str, Any]]
    tools: dict[str, Any]
    started: float
    context: ContextConfig
    transitions: list[ContinueReason] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    unsettled: list[RecordUsage] = field(default_factory=list)
    """Calls of an uncapped query, reported to the BudgetGuard in one message at the end."""
    cost_usd: float = 0.0
    last_stop_reason: str | None = None
    last_text: str = ""
    last_message_id: str = ""
    api_error_surfaced: bool = False
    phase: trio.CancelScope | None = None
    waiting: bool = False
    """The loop's task is suspended at its turn's wait (an abort then ends the query in its own call)."""
    turn_count: int = 1
    terminal: Terminal | None = None
    """Set when an abort ended the query's turn in the abort's own call (`QueryLoop._end_now`)."""
    settling: TrioFuture[BudgetStatus] | None = None
    outcome_sent: bool = False
    helpers_aborted: bool = False
    """An `Abort` broadcast reached this query: the helpers' work is being cancelled already."""
    consumer_open: bool = True
    budget_exceeded: bool = False
    ending: bool = False
    """Set once the query is ending early: emission no longer checks the budget."""
    task_budget_remaining: int | None = None
    turn: _Turn | None = None
    memory: str | None = None
    memory_used: bool = False

    def abort(self, reason: AbortReason) -> None:
        self.control.request_abort(reason)
        if self.phase is not None:
            self.phase.cancel()


class QueryLoop(TrioActor):
    actor_name = "QueryLoop"

    def __init__(
        self,
        *,
        model_caller: ActorRef[ModelCaller],
        executor: ActorRef[StreamingToolExecutor],
        budget_guard: ActorRef[BudgetGuard],
        compactor: ActorRef[Compactor],
        summarizer: ActorRef[HaikuSummarizer],
        host_capped: bool = False,
        conversation: list[TranscriptMessage] | None = None,
        transcript: TranscriptLog | None = None,
    ) -> None:
        super().__init__()
        self.model_caller = model_caller
        self.executor = executor
        self.budget_guard = budget_guard
        self.compactor = compactor
        self.summarizer = summarizer
        self.host_capped = host_capped
        """A host-wide budget sits above this session: every call's cost must be checked."""
        self.conversation: list[TranscriptMessage] = list(conversation or [])
        """Restored (resume) messages are in the log already: only what joins from now on is logged."""
        self.transcript = transcript
        self._run: _Run | None = None
        self._queued: RunQuery | None = None

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, RunQuery):
            self._submit(message)
            return None
        if isinstance(message, GetConversation):
            return list(self.conversation)
        return super().on_receive(message)

    def _submit(self, message: RunQuery) -> None:
        if self._run is None:
            self._run = self._new_run(message)
            self.start_work(self._query, message, abortable=False)
        elif (self._run.control.abort_reason is not None or self._run.control.decided) and self._queued is None:
            self._queued = message  # it starts as soon as the ending query has ended
        else:
            message.sink.send_nowait(Refused(reason="a query is already running in this session"))
            message.sink.close()

    def on_abort(self, reason: AbortReason) -> None:
        run = self._run
        if run is not None:
            # A broadcast aborts every helper in the same call (before any task runs): `_end_early` need not again.
            run.helpers_aborted = True
            run.abort(reason)
            if run.waiting and run.control.abort_reason is not None and not run.control.decided:
                self.after_handlers(lambda: self._end_now(run))

    def on_stop(self) -> None:
        # After the work has ended: no flush is running. What a cancelled query left buffered
        # is written unsynced, as a crash would have it: the next load repairs it.
        if self.transcript is not None:
            self.transcript.close()

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.on_stop()

    def _new_run(self, message: RunQuery) -> _Run:
        # The config snapshot: taken once, used by every iteration of this query (seed 001).
        options = message.options
        return _Run(
            options=options,
            sink=message.sink,
            control=message.control,
            model=options.model,
            system=build_system_prompt(
                DEFAULT_SYSTEM_PROMPT,
                custom=options.system_prompt,
                append=options.append_system_prompt,
                system_context=options.system_context,
            ),
            tool_schemas=[t.api_schema() for t in options.tools],
            tools={t.name: t for t in options.tools},
            started=time.monotonic(),
            context=ContextConfig(
                model=options.model,
                limits=ContextLimits(
                    context_window=options.context_window or context_window_for(options.model),
                    max_output_tokens=options.max_output_tokens,
                    summary_output_reserve=options.summary_output_reserve,
                    autocompact_buffer=options.autocompact_buffer_tokens,
                    warning_buffer=options.warning_buffer_tokens,
                    blocking_buffer=options.blocking_buffer_tokens,
                ),
                auto_compact=options.auto_compact,
                reactive_compact=options.reactive_compact,
                context_collapse=options.context_collapse,
                max_tool_result_chars=options.max_tool_result_chars,
                tool_result_preview_chars=options.tool_result_preview_chars,
                microcompact_keep_recent=options.microcompact_keep_recent,
                collapse_keep_recent_rounds=options.collapse_keep_recent_rounds,
                snip_max_rounds=options.snip_max_rounds,
            ),
        )

    # -- one query ----------------------------------------------------------------------

    async def _query(self, message: RunQuery) -> None:
        run = self._run
        assert run is not None
        try:
            self.budget_guard.tell(
                BeginQuery(
                    max_budget_usd=run.options.max_budget_usd,
                    token_budget=run.options.token_budget,
                    model=run.options.model,
                    pricing=run.options.pricing,
                )
            )
            self._record(message.prompt)
            state = State(messages=list(self.conversation))
            if run.options.memory_prefetch is None:
                terminal, state = await self._run_loop(run, state)
            else:
                async with trio.open_nursery() as prefetch:
                    prefetch.start_soon(self._prefetch_memory, run, list(state.messages))
                    terminal, state = await self._run_loop(run, state)
                    # Disposed on every exit path, as the reference's `using` does.
                    prefetch.cancel_scope.cancel()
            run.control.decided = True
            if not run.outcome_sent:  # else an abort has sent it, in its own call (`_end_now`)
                await self._flush_transcript()  # before the result: a consumer that saw it can rely on the file
                totals = await self._settle(run)
                self._send_outcome(run, terminal, terminal.turn_count or state.turn_count, totals)
            await self._stop_workers()  # before the stream ends: then no task of the session runs
        finally:
            self._run = None
            run.control.ended.set()
            queued, self._queued = self._queued, None
            if queued is not None:
                self._submit(queued)
            run.sink.close()  # the last statement: when the consumer sees the end, this work is done

    async def _run_loop(self, run: _Run, state: State) -> tuple[Terminal, State]:
        try:
            return await self._loop(run, state)
        except _BudgetExceeded:
            return self._end_early(run, run.turn, "max_budget_usd"), state

    async def _loop(self, run: _Run, state: State) -> tuple[Terminal, State]:
        options = run.options
        while True:
            await self._begin_iteration(run, state)
            prepared = await self._prepare(run, messages_after_compact_boundary(state.messages))
            if prepared is None:  # aborted while summarizing or compacting
                return self._end_early(run, None, "aborted_streaming"), state
            messages_for_query = prepared.messages
            if prepared.compacted is not None:
                messages_for_query = await self._install_compaction(
                    run, prepared.compacted, prepared.pre_compact_tokens
                )
            if prepared.blocking:
                await self._surface(run, api_error_message(run.model, PROMPT_TOO_LONG_ERROR_MESSAGE))
                return Terminal(reason="blocking_limit"), state
            turn, messages_for_query = await self._model_phase(run, state, messages_for_query)
            ended = turn.ended
            if run.control.abort_reason is not None or ended is None:
                if run.terminal is not None:  # the abort has ended the turn already, in its own call
                    return run.terminal, state
                return self._end_early(run, turn, abort_terminal(ended is not None, bool(turn.tool_ids))), state
            # The previous batch's summary was made while this call streamed: collect it now.
            await self._consume_summary(run, state)
            if ended.error is not None and ended.withheld is None:
                return await self._model_error(run, turn, ended.error), state
            if ended.error is not None and ended.withheld is not None:
                recovered = await self._recover_prompt_too_long(run, state, messages_for_query)
                if run.control.abort_reason is not None:  # aborted while compacting: the abort comes first
                    return self._end_early(run, turn, abort_terminal(True, bool(turn.tool_ids))), state
                if recovered is None:
                    await self._surface(run, ended.withheld)
                    return Terminal(reason="prompt_too_long"), state
                state = recovered
                continue

            if not turn.tool_ids:
                if ended.withheld is not None:  # max_tokens truncation
                    retried = await self._recover_max_output_tokens(run, state, messages_for_query, turn)
                    if retried is not None:
                        state = retried
                        continue
                    await self._surface(run, ended.withheld)
                    return Terminal(reason="completed"), state  # an API error never reaches stop hooks
                prevent, blocking = await self._stop_hooks(run, state, messages_for_query, turn)
                if run.control.abort_reason is not None:
                    return self._end_early(run, turn, abort_terminal(True, False)), state
                if prevent is not None:
                    return Terminal(reason="stop_hook_prevented", error=prevent), state
                if blocking:
                    state = stop_hook_blocking(state, messages_for_query, turn.assistant_messages, blocking)
                    run.transitions.append("stop_hook_blocking")
                    continue
                nudge = await self._token_budget_nudge(run)
                if nudge is not None:
                    state = token_budget_continuation(state, messages_for_query, turn.assistant_messages, nudge)
                    run.transitions.append("token_budget_continuation")
                    continue
                return Terminal(reason="completed"), state

            if turn.prevent_continuation:
                return Terminal(reason="hook_stopped"), state
            attachments = await self._attachments(run)
            if max_turns_reached(state.turn_count, options.max_turns):
                await self._emit(
                    run,
                    AttachmentMessage(
                        attachment={
                            "type": "max_turns_reached",
                            "maxTurns": options.max_turns,
                            "turnCount": state.turn_count + 1,
                        }
                    ),
                )
                return Terminal(reason="max_turns", turn_count=state.turn_count + 1), state
            state = next_turn(
                state,
                [*messages_for_query, *turn.assistant_messages, *turn.tool_results, *attachments],
                self._start_summary(run, turn),
            )
            run.transitions.append("next_turn")
            if run.options.context_collapse and collapse_may_stage(state.messages, run.context.limits):
                self.compactor.tell(StageCollapse(messages=state.messages, config=run.context))

    async def _begin_iteration(self, run: _Run, state: State) -> None:
        if state.transition is not None:
            await self._flush_transcript()  # a continue site: the turn that ended is made durable

    async def _recover_max_output_tokens(
        self, run: _Run, state: State, messages_for_query: list[TranscriptMessage], turn: _Turn
    ) -> State | None:
        """Escalate once, silently; then up to three recovery messages; None: surface the error."""
        options = run.options
        action = max_output_tokens_action(
            state, max_output_tokens=options.max_output_tokens, escalated=options.escalated_max_output_tokens
        )
        if action == "escalate":
            run.transitions.append("max_output_tokens_escalate")
            return max_output_tokens_escalate(state, messages_for_query, options.escalated_max_output_tokens)
        if action == "recover":
            recovery = UserMessage(content=MAX_OUTPUT_TOKENS_RECOVERY_TEXT, is_meta=True)
            await self._emit(run, recovery)
            run.transitions.append("max_output_tokens_recovery")
            return max_output_tokens_recovery(state, messages_for_query, turn.assistant_messages, recovery)
        return None

    # -- context: summaries, the pipeline, the 413 cascade, the token budget ----------------

    async def _consume_summary(self, run: _Run, state: State) -> None:
        """The previous batch's summary, made while this iteration's model call ran; its failure costs only it.

        Seed 001 says "awaited at the top of the next iteration"; it is awaited once that
        iteration's stream has ended, so that it overlaps the model call as the seed's
        rationale (and the reference's "resolved during model streaming") intends.
        """
        pending: _PendingSummary | None = state.pending_tool_use_summary
        if pending is None:
            return
        summary: str | None = None
        with self._phase(run):
            try:
                summary = await pending.future
            except Exception:  # noqa: BLE001 - cancelled or failed: the summary is lost, the loop goes on
                summary = None
        if summary:
            await self._emit(run, ToolUseSummaryEvent(summary=summary, preceding_tool_use_ids=pending.tool_use_ids))

    def _start_summary(self, run: _Run, turn: _Turn) -> _PendingSummary | None:
        if not run.options.tool_use_summaries or not turn.tool_ids:
            return None
        uses = [b for m in turn.assistant_messages for b in m.content if b.get("type") == "tool_use"]
        results = [
            b
            for m in turn.tool_results
            if isinstance(m, UserMessage) and isinstance(m.content, list)
            for b in m.content
            if b.get("type") == "tool_result"
        ]
        future = self.summarizer.ask(
            Summarize(model=run.options.small_model, tool_uses=uses, results=results), block=False
        )
        return _PendingSummary(future=future, tool_use_ids=list(turn.tool_ids))

    async def _prepare(self, run: _Run, messages: list[TranscriptMessage]) -> Prepared | None:
        context = run.context
        if not pipeline_needed(
            messages,
            context.limits,
            max_tool_result_chars=context.max_tool_result_chars,
            snip_max_rounds=context.snip_max_rounds,
        ):
            return Prepared.model_construct(
                messages=messages, tokens=0, compacted=None, pre_compact_tokens=0, snip_tokens_freed=0, blocking=False
            )
        prepared: Prepared | None = None
        with self._phase(run):
            try:
                prepared = await self.compactor.ask(Prepare(messages=messages, config=run.context), block=False)
            except WorkCancelled:
                prepared = None
        return None if run.control.abort_reason is not None else prepared

    async def _install_compaction(
        self, run: _Run, compacted: list[TranscriptMessage], pre_tokens: int
    ) -> list[TranscriptMessage]:
        for message in compacted:
            await self._emit(run, message)
        if run.options.task_budget is not None:  # loop-local, updated on compaction only (seed 001)
            remaining = run.task_budget_remaining if run.task_budget_remaining is not None else run.options.task_budget
            run.task_budget_remaining = max(0, remaining - pre_tokens)
        return messages_after_compact_boundary(compacted)

    async def _recover_prompt_too_long(
        self, run: _Run, state: State, messages_for_query: list[TranscriptMessage]
    ) -> State | None:
        """Seed 000's cascade: collapse drain (never twice in a row), then one reactive compact."""
        options = run.options
        transition = state.transition
        if options.context_collapse and (transition is None or transition.reason != "collapse_drain_retry"):
            drained: Drained = await self.compactor.ask(DrainCollapses(messages=messages_for_query), block=False)
            if drained.committed > 0:
                run.transitions.append("collapse_drain_retry")
                return collapse_drain_retry(state, drained.messages, drained.committed)
        if options.reactive_compact and not state.has_attempted_reactive_compact:
            compacted: Compacted | None = None
            with self._phase(run):
                try:
                    compacted = await self.compactor.ask(
                        Compact(messages=messages_for_query, config=run.context, trigger="reactive"), block=False
                    )
                except WorkCancelled:
                    compacted = None
            if compacted is not None and run.control.abort_reason is None:
                await self._install_compaction(run, compacted.messages, compacted.pre_tokens)
                run.transitions.append("reactive_compact_retry")
                return reactive_compact_retry(state, compacted.messages)
        return None

    async def _token_budget_nudge(self, run: _Run) -> UserMessage | None:
        """Seed 003's gate: a meta nudge to go on, or None to stop (with its completion event)."""
        if run.options.token_budget is None:
            return None
        decision: TokenBudgetDecision = await self.budget_guard.ask(
            CheckTokenBudget(global_turn_tokens=run.usage.output_tokens), block=False
        )
        if decision.action == "continue" and decision.nudge_message is not None:
            nudge = UserMessage(content=decision.nudge_message, is_meta=True)
            await self._emit(run, nudge)
            return nudge
        if decision.completion_event is not None:
            await self._emit(run, SystemMessage(subtype="token_budget", data=decision.completion_event.model_dump()))
        return None

    # -- the model call -----------------------------------------------------------------

    async def _model_phase(
        self, run: _Run, state: State, messages_for_query: list[TranscriptMessage]
    ) -> tuple[_Turn, list[TranscriptMessage]]:
        """One model call; a fallback retries it here with the same State (a bare continue, seed 001)."""
        while True:
            turn = await self._call_once(run, state, messages_for_query)
            ended = turn.ended
            if ended is None or not ended.fallback or run.control.abort_reason is not None:
                return turn, messages_for_query
            fallback = run.options.fallback_model
            if fallback is None or fallback == run.model:
                turn.ended = CallEnded(error=ModelError("api_error", "fallback requested but no fallback model"))
                return turn, messages_for_query
            turn.held_results.clear()  # results of the abandoned response go with it
            for message in turn.assistant_messages:
                await self._emit(run, TombstoneEvent(message_uuid=message.uuid))
            self.executor.tell(Discard())
            previous, run.model = run.model, fallback
            messages_for_query = strip_signature_blocks(messages_for_query)
            await self._emit(
                run,
                SystemMessage(
                    subtype="model_fallback",
                    content=f"Switched to {fallback} because {previous} is unavailable",
                    data={"from": previous, "to": fallback},
                ),
            )

    async def _call_once(self, run: _Run, state: State, messages_for_query: list[TranscriptMessage]) -> _Turn:
        channel = EventChannel[Any](TURN_BUFFER)
        turn = _Turn(channel)
        run.turn, run.turn_count = turn, state.turn_count
        if run.control.abort_reason is not None:
            return turn  # aborted before the request: nothing is started
        await self._emit(run, StreamRequestStart())
        options = run.options
        turn_setting = BeginTurn(
            sink=channel,
            tools=run.tools,
            can_use_tool=options.can_use_tool,
            post_tool_use_hooks=options.post_tool_use_hooks,
        )
        self.model_caller.tell(
            StartCall(
                request=self._request(run, state, messages_for_query),
                sink=channel,
                events=run.sink,
                progress=turn.progress,
                turn=turn_setting,
                max_retries=options.max_retries,
                fallback_available=options.fallback_model is not None and options.fallback_model != run.model,
            )
        )
        items = channel.items
        with self._phase(run):
            while not _turn_done(turn) and run.terminal is None:
                if not items:
                    run.waiting = True
                    try:
                        await channel.wait()  # one wakeup takes the whole burst that arrived meanwhile
                    finally:
                        run.waiting = False
                    continue
                await self._dispatch(run, turn, channel.take())
        return turn

    def _request(self, run: _Run, state: State, messages_for_query: list[TranscriptMessage]) -> ModelRequest:
        messages = messages_for_query
        context = user_context_message(run.options.user_context)
        if context is not None:
            messages = [context, *messages]
        # Built from parts that are already valid: validating would copy every message dict again.
        # (For small models validation is the cheaper path: pydantic-core's __init__ costs about half
        # of the pure-Python model_construct. Only lists of dicts or messages are worth skipping.)
        return ModelRequest.model_construct(
            model=run.model,
            system=run.system,
            messages=normalize_messages_for_api(messages),
            tools=run.tool_schemas,
            max_tokens=state.max_output_tokens_override or run.options.max_output_tokens,
            thinking=run.options.thinking,
            task_budget=_task_budget(run),
            purpose="main",
        )

    async def _dispatch(self, run: _Run, turn: _Turn, item: Any) -> None:
        kind = type(item)
        if kind is ProgressEvent or kind is SystemMessage:
            await self._emit(run, item)
        elif kind is AssistantMessage:  # the ModelCaller has given it to the consumer already
            _note_assistant(turn, item)
            await self._emit(run, item, sent=True)
        elif kind is ConsumerGone:
            run.consumer_open = False  # the consumer went away: that is an abort by the user
            run.abort("user")
        elif kind is ToolResult:
            for message in _accept_result(turn, item):
                await self._emit(run, message, of_turn=turn)
        elif kind is CallEnded:
            record = self._end_call(run, turn, item)
            # The response is whole: make it durable before its tools (which may run long) finish.
            await self._flush_transcript()
            if record is None:
                return
            if run.options.max_budget_usd is None and not self.host_capped:
                run.unsettled.append(record)  # no cap to check: settled once, when the query ends
                return
            status: BudgetStatus = await self.budget_guard.ask(record, block=False)
            run.cost_usd = status.query_cost_usd
            if status.exceeded:
                run.budget_exceeded = True
                if not run.ending:
                    raise _BudgetExceeded

    def _drain_in_ending(self, run: _Run, turn: _Turn) -> None:
        """`_dispatch` for what a turn cut short has queued: nothing waits (the ending's events are
        few, they go past the consumer's bound), and the call's usage is settled with the query."""
        channel = turn.channel
        while channel.items:
            item = channel.take()
            kind = type(item)
            if kind is AssistantMessage:
                _note_assistant(turn, item)
                self._emit_now(run, item, sent=True)
            elif kind is ToolResult:
                for message in _accept_result(turn, item):
                    self._emit_now(run, message, of_turn=turn)
            elif kind is CallEnded:
                record = self._end_call(run, turn, item)
                if record is not None:
                    run.unsettled.append(record)
            elif kind is ConsumerGone:
                run.consumer_open = False
            else:  # progress and system messages produced before the cut
                self._emit_now(run, item)

    def _end_call(self, run: _Run, turn: _Turn, ended: CallEnded) -> RecordUsage | None:
        """The call's last item: its response is whole; the usage to record, if it reached its end."""
        turn.ended = ended
        self._close_response(turn)
        if ended.stop_reason is None:
            return None
        run.last_stop_reason = ended.stop_reason
        turn.usage_recorded = True
        run.usage = run.usage + ended.usage
        return RecordUsage(model=run.model, usage=ended.usage, query_usage=True)

    def _close_response(self, turn: _Turn) -> None:
        """The response has no more blocks: the results held back join the conversation after it."""
        turn.response_closed = True
        for message in turn.held_results:
            self._record(message)
        turn.held_results.clear()

    # -- emission -----------------------------------------------------------------------

    async def _emit(self, run: _Run, event: Event, *, of_turn: _Turn | None = None, sent: bool = False) -> None:
        """Send `event` to the consumer now (unless the ModelCaller has: `sent`); record a transcript message
        in the conversation.

        A tool's result (`of_turn`) can be emitted while its own response is still streaming;
        the conversation takes it only after the response's last block (`_close_response`), so
        that the stored history keeps each response whole, followed by its results.
        """
        self._keep(run, event, of_turn)
        if run.consumer_open and not sent:
            try:
                run.sink.send_nowait(event)
            except trio.WouldBlock:
                # A slow consumer: wait for it, shielded, so that an abort never drops an event.
                with trio.CancelScope(shield=True):
                    await run.sink.send(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.consumer_open = False  # the consumer went away: that is an abort by the user
                run.abort("user")
        if run.budget_exceeded and not run.ending:
            raise _BudgetExceeded

    def _emit_now(self, run: _Run, event: Event, *, of_turn: _Turn | None = None, sent: bool = False) -> None:
        """`_emit` for a query's ending: never waits for the consumer (`EventChannel.push`)."""
        self._keep(run, event, of_turn)
        if run.consumer_open and not sent:
            try:
                run.sink.push(event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.consumer_open = False

    def _keep(self, run: _Run, event: Event, of_turn: _Turn | None) -> None:
        """What emitting `event` does to the conversation (and the log)."""
        if isinstance(event, _TRANSCRIPT_TYPES):
            if of_turn is not None and not of_turn.response_closed:
                of_turn.held_results.append(event)
            else:
                self._record(event)
            if type(event) is AssistantMessage:
                self._note_text(run, event)
        elif type(event) is TombstoneEvent:
            self.conversation = [m for m in self.conversation if m.uuid != event.message_uuid]
            if self.transcript is not None:
                self.transcript.append(event)

    def _record(self, message: TranscriptMessage) -> None:
        """`message` joins the conversation, and the log in the same order."""
        self.conversation.append(message)
        if self.transcript is not None:
            self.transcript.append(message)

    async def _flush_transcript(self) -> None:
        if self.transcript is not None:
            await self.transcript.flush()

    @staticmethod
    def _note_text(run: _Run, message: AssistantMessage) -> None:
        text = "".join(b.get("text", "") for b in message.content if b.get("type") == "text")
        if message.message_id != run.last_message_id:
            run.last_message_id, run.last_text = message.message_id, ""
        run.last_text += text

    async def _surface(self, run: _Run, message: AssistantMessage) -> None:
        run.api_error_surfaced = True
        await self._emit(run, message)

    # -- endings ------------------------------------------------------------------------

    def _end_now(self, run: _Run) -> None:
        """An abort found the loop waiting on its turn: end the query inside the abort's own call.

        Run once the abort's handlers have returned (`after_handlers`), before any task runs:
        the turn is ended exactly as the loop's task would end it (`_end_early`), and where
        nothing has to be awaited first (no transcript to flush, the BudgetGuard answering at
        once) the `result` follows. The consumer then has it one scheduler pass sooner than if the
        loop's task had to wake up to write it; that task, when it runs, finds the query ended
        and only stops the helpers and ends the stream (or sends the result, if it is left).
        """
        turn = run.turn
        if self._run is not run or not run.waiting or run.ending or turn is None:
            return
        # What reached the turn before the abort counts, as it would for the task (woken by it, it takes
        # it all before its next wait, where the cancellation lands): it decides how the turn ends.
        self._drain_in_ending(run, turn)
        run.terminal = self._end_early(run, turn, abort_terminal(turn.ended is not None, bool(turn.tool_ids)))
        run.control.decided = True
        if self.transcript is not None:
            return
        totals = self._settle(run)
        if totals.done():
            self._send_outcome(run, run.terminal, run.turn_count, totals.get_nowait())

    def _end_early(self, run: _Run, turn: _Turn | None, reason: Any) -> Terminal:
        """Abort or budget: stop the call and the tools, answer every tool_use, say why. Never waits."""
        run.ending = True
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
        if interrupted and run.control.abort_reason != "interrupt":
            note = INTERRUPT_MESSAGE_FOR_TOOL_USE if reason == "aborted_tools" else INTERRUPT_MESSAGE
            self._emit_now(run, UserMessage(content=[{"type": "text", "text": note}]))
        return Terminal(reason=reason)

    async def _model_error(self, run: _Run, turn: _Turn, error: ModelError) -> Terminal:
        run.ending = True
        if turn.pending:
            self._stop_workers_soon()  # the tools the failed response started stop now
        self._collect_remaining(run, turn, f"Error: {error.message}")
        text = error.message if error.kind == "image_size" else f"API Error: {error.message}"
        await self._surface(run, api_error_message(run.model, text))
        if error.kind == "image_size":
            return Terminal(reason="image_error", error=text)
        return Terminal(reason="model_error", error=text)

    def _collect_remaining(self, run: _Run, turn: _Turn, text: str) -> None:
        """Every tool_use of the turn gets exactly one result: delivered, finished, or synthetic (`text`)."""
        self._drain_in_ending(run, turn)
        self._close_response(turn)  # cut short: no more blocks will come
        streamed = turn.progress.usage()
        if not turn.usage_recorded and streamed is not None:
            # A call cut short was billed for what its stream reported: that spend is kept.
            turn.usage_recorded = True
            run.usage = run.usage + streamed
            run.unsettled.append(RecordUsage(model=run.model, usage=streamed, query_usage=True))
        for message in missing_tool_results(turn.assistant_messages, turn.tool_results, text):
            turn.tool_results.append(message)
            self._emit_now(run, message)
        turn.pending.clear()

    async def _stop_workers(self) -> None:
        """Cancel whatever the query's helpers still run (model call, tools, summary, compaction); wait for it."""
        for future in self._stop_workers_soon():
            await future

    def _stop_workers_soon(self) -> list[Future[Any]]:
        """Send `Abort` to every busy helper at once; the futures answer once each one's work has unwound."""
        stop = Abort(reason="user")
        return [
            worker.ask(stop, block=False)
            for worker in (self.model_caller, self.executor, self.summarizer, self.compactor)
            if cast("TrioActorRef[Any]", worker).busy()
        ]

    def _settle(self, run: _Run) -> TrioFuture[BudgetStatus]:
        """Ask the BudgetGuard for the query's totals, once (it records the `unsettled` calls then).

        The BudgetGuard holds the totals (summaries and compactions report their cost to it). Asked
        where no handler runs (the loop's task, `_end_now`), it answers before `ask` returns."""
        if run.settling is None:
            run.settling = self.budget_guard.ask(SettleQuery(calls=run.unsettled), block=False)  # type: ignore[assignment]
        assert run.settling is not None
        return run.settling

    def _send_outcome(self, run: _Run, terminal: Terminal, turn_count: int, totals: BudgetStatus) -> None:
        """`Settled`, then the `result`: the query's last events."""
        reason = terminal.reason
        errors: list[str] = []
        if reason == "max_turns":
            errors.append(f"Reached maximum number of turns ({run.options.max_turns})")
        elif reason == "max_budget_usd":
            errors.append(f"Reached maximum budget (${run.options.max_budget_usd})")
        elif terminal.error:
            errors.append(terminal.error)
        run.usage, run.cost_usd = totals.query_usage, totals.query_cost_usd
        result = ResultMessage(
            subtype=result_subtype(reason),
            is_error=result_is_error(reason, run.api_error_surfaced),
            duration_ms=int((time.monotonic() - run.started) * 1000),
            result=run.last_text,
            stop_reason=run.last_stop_reason,
            total_cost_usd=run.cost_usd,
            usage=run.usage,
            num_turns=turn_count,
            errors=errors,
        )
        run.ending = True
        if run.consumer_open:
            try:
                run.sink.push(Settled(terminal=terminal, transitions=list(run.transitions)))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                run.consumer_open = False
        self._emit_now(run, result)
        run.outcome_sent = True

    # -- hooks and attachments -----------------------------------------------------------

    async def _stop_hooks(
        self, run: _Run, state: State, messages_for_query: list[TranscriptMessage], turn: _Turn
    ) -> tuple[str | None, list[UserMessage]]:
        hooks = run.options.stop_hooks
        if not hooks:
            return None, []
        hook_input = StopHookInput(
            messages=[*messages_for_query, *turn.assistant_messages], stop_hook_active=state.stop_hook_active
        )
        prevent: str | None = None
        errors: list[str] = []
        with self._phase(run):
            for hook in hooks:
                try:
                    decision = await hook(hook_input)
                except Exception:
                    self.log.exception("stop hook failed")
                    continue
                if decision is None:
                    continue
                if decision.prevent is not None and prevent is None:
                    prevent = decision.prevent
                if decision.blocking_error is not None:
                    errors.append(decision.blocking_error)
        blocking = [UserMessage(content=STOP_HOOK_FEEDBACK.format(error=e), is_meta=True) for e in errors]
        if prevent is None:
            for message in blocking:
                await self._emit(run, message)
        return prevent, blocking

    async def _attachments(self, run: _Run) -> list[AttachmentMessage]:
        """Context that arose while the tools ran, injected before the next model call."""
        found: list[dict[str, Any]] = []
        for source in run.options.attachment_sources:
            found.extend(await source.collect())
        if run.memory is not None and not run.memory_used:
            run.memory_used = True
            found.append({"type": "memory", "content": run.memory})
        messages = [AttachmentMessage(attachment=a) for a in found]
        for message in messages:
            await self._emit(run, message)
        return messages

    async def _prefetch_memory(self, run: _Run, messages: list[TranscriptMessage]) -> None:
        assert run.options.memory_prefetch is not None
        try:
            run.memory = await run.options.memory_prefetch(messages)
        except Exception:
            self.log.exception("memory prefetch failed")

    @staticmethod
    def _phase(run: _Run) -> _Phase:
        """A cancel scope that an abort cancels; entered already cancelled if the abort came first."""
        return _Phase(run)


class _Phase:
    """`QueryLoop._phase`: the scope of the phase in flight, where `_Run.abort` finds it."""

    __slots__ = ("_run", "_scope")

    def __init__(self, run: _Run) -> None:
        self._run = run
        self._scope = trio.CancelScope()

    def __enter__(self) -> trio.CancelScope:
        scope = self._scope
        if self._run.control.abort_reason is not None:
            scope.cancel()
        self._run.phase = scope
        return scope.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            return self._scope.__exit__(exc_type, exc, tb)
        finally:
            self._run.phase = None


@dataclass(frozen=True, slots=True)
class _PendingSummary:
    future: Any
    tool_use_ids: list[str]


def _task_budget(run: _Run) -> dict[str, int] | None:
    total = run.options.task_budget
    if total is None:
        return None
    if run.task_budget_remaining is None:
        return {"total": total}
    return {"total": total, "remaining": run.task_budget_remaining}


def _turn_done(turn: _Turn) -> bool:
    ended = turn.ended
    if ended is None:
        return False
    return not turn.pending or ended.error is not None or ended.fallback


def _note_assistant(turn: _Turn, message: AssistantMessage) -> None:
    """A block of the turn's response has arrived: its tool_use (if any) now awaits a result."""
    turn.assistant_messages.append(message)
    for block in message.content:
        if block.get("type") == "tool_use":
            turn.tool_ids.append(block["id"])
            turn.pending.add(block["id"])


def _accept_result(turn: _Turn, result: ToolResult) -> list[TranscriptMessage]:
    """A tool's answer joins the turn, once: what to emit (its result, then its attachments)."""
    if result.tool_use_id not in turn.pending:
        return []  # answered already, or not of this turn
    turn.pending.discard(result.tool_use_id)
    turn.prevent_continuation |= result.prevent_continuation
    messages: list[TranscriptMessage] = [result.message, *result.attachments]
    turn.tool_results.extend(messages)
    return messages
