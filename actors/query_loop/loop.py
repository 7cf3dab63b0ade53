"""QueryLoop: owns the loop `State` and the session's conversation; runs queries.

A `RunQuery` starts the query as *non-abortable* work of this actor: an abort
must not kill the loop, the loop must end the query itself, as Claude Code's does:
what the tools finished, synthetic `Interrupted by user` results for the rest,
an interruption message unless the reason is `interrupt`, and the `result`
event. `on_abort` records the reason and stops what the loop waits on: the
turn (the model stream and the tools: the loop's wait on its turn channel is
woken, no cancel scope is needed there, `Run.abort`) or the current *phase*'s
cancel scope (a summary, a compaction, the stop hooks). Where the loop is waiting
on its turn (nearly all of a query's life), the ending is written at once, in the
abort's own call, once its handlers have returned (`_end_now`); elsewhere the
loop's task, woken by the abort, writes it. Both run the same synchronous ending
(`_end_early`, `_send_outcome`). The ModelCaller's and the executor's work is
abortable and is cancelled by the same `Abort` broadcast.

One iteration: the context pipeline (compaction) at the top, then
`stream_request_start` → model call (fallback retries inside) → the decisions
of `queryloop.runtime.loop.decisions`, in Claude Code's check order → a continue site of
`queryloop.runtime.loop.state` or a `Terminal`. Events are emitted in production order to the
query's bounded channel (a call's stream events and assistant messages by the
ModelCaller itself, which then hands each message to the loop); transcript
messages join the conversation as they are emitted, so the conversation is always
what the consumer saw. The `result` is sent as soon as the ending is known; the
stream ends once every helper's cancelled work has unwound.

With a `TranscriptLog`, every message that joins the conversation (and every
tombstone) is logged, in the order it was emitted, before the consumer can take it
(`runtime.loop.persistence`'s rule); the prompt is written to the OS as soon as it
joins the conversation, before any request; the log is fsynced (off the trio thread)
at each continue site and when the query ends, before its `result`. Each of these writes waits for
room while the disk is full (`run.wait_for_room`, `runtime.loop.disk`'s policy; an abort cuts the wait):
past the bound, or at another OSError, the query ends with an error `result` naming the file, never a crash.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.budget_guard import BudgetLedger
from queryloop.actors.compactor import StageCollapse, context_config
from queryloop.actors.query_loop.accounting import GuardAccounts, LedgerAccounts, QueryAccounts
from queryloop.actors.query_loop.context import QueryLoopContext
from queryloop.actors.query_loop.ending import unwritable_terminal
from queryloop.actors.query_loop.messages import GetConversation, GetSidechains, RunQuery
from queryloop.actors.query_loop.run import (
    BudgetExceeded,
    QueryPhase,
    QuerySetup,
    Run,
    SessionCaches,
    TranscriptUnwritable,
    Turn,
    flush_for_room,
    wait_for_room,
)
from queryloop.actors.query_loop.subagent import AgentsHost, Subagents
from queryloop.runtime._frozen import EMPTY_DICT
from queryloop.runtime.errors import SessionClosed
from queryloop.runtime.kernel.messages import AbortReason
from queryloop.runtime.kernel.supervisor import Supervisor
from queryloop.runtime.loop.context import collapse_may_stage
from queryloop.runtime.loop.decisions import abort_terminal, max_turns_reached
from queryloop.runtime.loop.event_hooks import QueryHooks
from queryloop.runtime.loop.events import AttachmentMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.options import DEFAULT_SYSTEM_PROMPT
from queryloop.runtime.loop.post_tool_use import legacy_matcher
from queryloop.runtime.loop.state import (
    COMPLETED,
    State,
    Terminal,
    initial_state,
    next_turn,
)
from queryloop.runtime.loop.structured_output import StructuredAnswer
from queryloop.runtime.loop.transcript import (
    build_system_prompt,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path
    from types import TracebackType

    from pykka import ActorRef

    from queryloop.actors.budget_guard import BudgetGuard
    from queryloop.actors.model_caller import CallEnded, ModelCaller
    from queryloop.actors.tool_executor import StreamingToolExecutor
    from queryloop.runtime.loop.hooks import StopFailureError
    from queryloop.runtime.loop.model import ModelProvider
    from queryloop.runtime.loop.options import QueryOptions
    from queryloop.runtime.loop.persistence import TranscriptLog
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.loop.tools import Tool


def _system_prompt(options: QueryOptions) -> list[dict[str, Any]]:
    """The query's system prompt; without a custom, appended or context part (most sessions), one list for all."""
    if options.system_prompt is None and not options.append_system_prompt and not options.system_context:
        return _DEFAULT_SYSTEM
    return build_system_prompt(
        DEFAULT_SYSTEM_PROMPT,
        custom=options.system_prompt,
        append=options.append_system_prompt,
        system_context=options.system_context,
    )


_DEFAULT_SYSTEM = build_system_prompt(DEFAULT_SYSTEM_PROMPT)
"""Shared by every query with the default system prompt (read only: requests and providers never change it)."""


class QueryLoop(QueryLoopContext):
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
        self.ledger = None
        self.accounts: QueryAccounts
        if budget_guard is None:
            self.ledger = ledger or BudgetLedger()
            self.accounts = LedgerAccounts(self.ledger)
        else:
            self.accounts = GuardAccounts(budget_guard)
        self._compactor = None
        self._summarizer = None
        self._compact_provider = compact_provider
        self._summary_provider = summary_provider
        self._session_dir = session_dir
        self.conversation: list[TranscriptMessage] = list(conversation or [])
        """Restored (resume) messages are in the log already: only what joins from now on is logged."""
        self.transcript = transcript
        self.sidechains: dict[str, Sidechain] = dict(sidechains) if sidechains else EMPTY_DICT
        """The subagents' conversations by agent id (`subagent`); the shared empty dict until the first."""
        self._agents_host = agents_host
        self._depth = depth
        self.mcp_tools = mcp_tools
        self.agent = agent
        self.detach = detach
        self._subagents: Subagents | None = None
        """Made for the first query that has `agents` (a session without them never has one)."""
        self._run: Run | None = None
        self._queued: deque[RunQuery] = deque()
        """Messages sent while a query runs, in order: taken in at its next turn boundary, or run after it."""
        self._caches = SessionCaches()
        """Shared by the session's queries: each one's requests build on the previous one's (its docstring)."""

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, RunQuery):
            self._submit(message)
            return None
        if isinstance(message, GetConversation):
            return list(self.conversation)
        if isinstance(message, GetSidechains):
            return dict(self.sidechains)
        return super().on_receive(message)

    def _submit(self, message: RunQuery) -> None:
        if self._run is None:
            self._run = self._new_run(message)
            # The prompt alone: the message's other parts are the run's now, and its work holds its arguments
            # for the whole query (one object fewer in flight a loop).
            self.start_work(self._query, message.prompt, abortable=False)
        elif message.interrupt:
            self._queued.appendleft(message)  # the session has aborted the running query: this one is next
        else:
            self._queued.append(message)  # it waits its turn (Claude Code's queued messages)

    def on_abort(self, reason: AbortReason) -> None:
        run = self._run
        if run is not None:
            # A broadcast aborts every helper in the same call (before any task runs): `_end_early` need not again.
            run.helpers_aborted = True
            run.abort(reason)
            if (
                run.phase is QueryPhase.AWAITING_TURN
                and run.setup.control.abort_reason is not None
                and not run.setup.control.decided
            ):
                self.after_handlers(lambda: self._end_now(run))

    def on_stop(self) -> None:
        # A message still waiting is never started now: its stream ends, without a result.
        while self._queued:
            left = self._queued.popleft()
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

    def on_failure(
        self,
        exception_type: type[BaseException] | None,
        exception_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.on_stop()

    def _with_mcp_tools(self, options: QueryOptions) -> list[Tool]:
        """The query's tools: its own, then its MCP servers' as listed now (which replace their namesakes)."""
        if self.mcp_tools is None:
            msg = "QueryOptions.mcp_servers needs a session of a runtime (Runtime.open_session)"
            raise ValueError(msg)
        live = self.mcp_tools(options.mcp_servers)
        names = {tool.name for tool in live}
        return [*(tool for tool in options.tools if tool.name not in names), *live]

    def _new_run(self, message: RunQuery) -> Run:
        # The config snapshot: taken once, used by every iteration of this query.
        options = message.options
        tools = options.tools if not options.mcp_servers else self._with_mcp_tools(options)
        if options.agents:
            subagents = self._subagents
            if subagents is None:
                subagents = self._subagents = Subagents(self, QueryLoop, self._agents_host or AgentsHost(), self._depth)
            agent_tool = subagents.tool_for(options)
            if agent_tool is not None:
                tools = [*tools, agent_tool]
        structured = None
        if options.output_type is not None:
            structured = StructuredAnswer(options.output_type)
            tools = [*tools, structured.tool()]
        caches = self._caches
        setup = QuerySetup(
            options=options,
            sink=message.sink,
            control=message.control,
            system=_system_prompt(options),
            tool_schemas=[t.api_schema() for t in tools],
            tools={t.name: t for t in tools},
            started=time.monotonic(),
            context_config=context_config(options),
            context_message=caches.context_message(options.user_context),
            prompt_uuid=message.prompt.uuid,
            hooks=self._hooks(options),
        )
        return Run(setup=setup, caches=caches, model=options.model, structured=structured)

    def _hooks(self, options: QueryOptions) -> QueryHooks | None:
        """The query's hooks and where it runs, or None without any (then no event runs any)."""
        if not options.hooks and not options.post_tool_use_hooks:
            return None
        group = self.supervisor
        while isinstance(group, Supervisor) and group.parent is not None:
            group = group.parent  # a subagent's hooks get its session's id, as Claude Code's do
        path = str(self.transcript.path) if self.transcript is not None else ""
        matchers = {event: tuple(listed) for event, listed in options.hooks.items() if listed}
        if options.post_tool_use_hooks:  # the older form, run as PostToolUse callbacks
            matchers["PostToolUse"] = (*matchers.get("PostToolUse", ()), legacy_matcher(options.post_tool_use_hooks))
        return QueryHooks(matchers, group.session_id, path, self.agent)

    async def _query(self, prompt: UserMessage) -> None:
        run = self._run
        assert run is not None
        try:
            self.accounts.begin_query(run.setup.options)
            self._record(prompt)  # written first thing in `_run_loop`
            if run.setup.options.memory_prefetch is None:
                terminal, turns = await self._run_loop(run)
            else:
                async with trio.open_nursery() as prefetch:
                    prefetch.start_soon(self._prefetch_memory, run, list(self.conversation))
                    terminal, turns = await self._run_loop(run)
                    # Disposed on every exit path, as Claude Code's `using` does.
                    prefetch.cancel_scope.cancel()
            run.calls.close()  # no more model calls: the ModelCaller's task for this query ends when it runs
            run.setup.control.decided = True
            if run.phase is not QueryPhase.RESULT_SENT:  # else an abort has sent it, in its own call (`_end_now`)
                if self.transcript is not None:
                    # Before the result: a consumer that saw it can rely on the file. Past the bound for a full
                    # disk the result is the disk's error (a success must not read as "all of it is in the file");
                    # an abort that cuts the wait keeps the ending decided, its `errors` naming the disk.
                    try:
                        await flush_for_room(run, self.transcript)
                    except TranscriptUnwritable as unwritable:
                        terminal = unwritable_terminal(str(unwritable))
                totals = await self._settle(run)
                self._send_outcome(run, terminal, terminal.turn_count or turns, totals)
            await self._stop_workers()  # before the stream ends: then no task of the session runs
        except SessionClosed:
            # A helper could not be spawned: the session is closing, and its stop is cancelling this work.
            pass
        finally:
            self._run = None
            run.setup.control.end()
            if run.absorbed is not None:
                _answer_absorbed(run)
            if self._queued:
                self._submit(self._queued.popleft())
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
            return self._end_early(run, run.turn, "max_budget_usd"), run.turn_count
        except TranscriptUnwritable as unwritable:  # the prompt's write, one before a request, or a continue site's
            return self._end_unwritable(run, str(unwritable)), run.turn_count
        return terminal, state.turn_count

    async def _loop(self, run: Run, state: State) -> tuple[Terminal, State]:
        """The query's iterations, each read top to bottom: make the last turn durable, the context pipeline, the
        model phase, then `_after_model`'s decisions, which end the query (a `Terminal`) or give the next State."""
        # Each step below that has nothing to do on most iterations is awaited only when it has: an
        # `async def` that returns at once still costs a coroutine (a thousand loops, a dozen a loop).
        while True:
            if state.transition is not None and self.transcript is not None:
                await flush_for_room(run, self.transcript)  # a continue site: the turn that ended is made durable
            messages_for_query = self._caches.boundary.after(state.messages)
            if self._pipeline_needed(run, messages_for_query):  # sent as they are on most iterations
                through = await self._through_pipeline(run, messages_for_query)
                if isinstance(through, Terminal):  # aborted while compacting, or at the blocking limit
                    return through, state
                messages_for_query = through
            turn, messages_for_query = await self._model_phase(run, state, messages_for_query)
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
            return self._end_early(run, turn, abort_terminal(ended is not None, bool(turn.tool_ids)))
        # The previous batch's summary was made while this call streamed: collect it now.
        if state.pending_tool_use_summary is not None:
            await self._consume_summary(run, state.pending_tool_use_summary)
        if ended.error is not None:
            if ended.withheld is None:
                return await self._model_error(run, turn, ended.error)
            return await self._retry_too_long(run, state, messages_for_query, turn, ended.withheld)  # the 413 cascade
        if ended.stop_reason == "refusal":  # no fallback model took it (`_model_phase`)
            return await self._refusal(run, turn, ended.stop_details)
        if ended.stop_reason == "pause_turn" and not turn.tool_ids:
            # Not an end: the server paused a long server-tool turn. No stop hooks; the response goes back.
            return await self._continue_paused(run, state, messages_for_query, turn)
        if not turn.tool_ids:
            return await self._after_final(run, state, messages_for_query, turn, ended)
        return await self._after_tool_use(run, state, messages_for_query, turn)

    async def _after_final(
        self, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn, ended: CallEnded
    ) -> Terminal | State:
        """A response without tool use: a cut-off one's recoveries, else the stop hooks' verdict."""
        if ended.withheld is None:
            return await self._after_final_response(run, state, messages_for_query, turn)
        # max_tokens or model_context_window_exceeded truncation
        retried = await self._recover_cut_off(run, state, messages_for_query, turn, ended)
        if retried is not None:
            return retried
        cut: StopFailureError = "max_output_tokens" if ended.stop_reason == "max_tokens" else "invalid_request"
        await self._surface_failure(run, ended.withheld, cut)
        return COMPLETED  # an API error never reaches stop hooks

    async def _after_tool_use(
        self, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
    ) -> Terminal | State:
        """A response with tool use, its tools done: a hook's stop, a structured answer, the turn cap, or the
        next turn with the results (and the attachments due)."""
        if turn.prevent_continuation:
            return Terminal(reason="hook_stopped")
        if run.structured is not None:
            answered = self._settle_answer(run, turn)
            if answered is not None:
                return answered
        attachments: list[TranscriptMessage] = []
        if self._attachments_due(run):
            attachments.extend(await self._attachments(run))
        if self._queued:  # messages sent while the tools ran join this turn
            attachments.extend(await self._take_in_queued(run))
        if max_turns_reached(state.turn_count, run.setup.options.max_turns):
            return await self._max_turns(run, state)
        state = next_turn(
            state,
            [*messages_for_query, *turn.assistant_messages, *turn.tool_results, *attachments],
            self._start_summary(run, turn),
        )
        run.transitions.append("next_turn")
        setup = run.setup
        if setup.options.context_collapse and collapse_may_stage(
            state.messages, setup.context_config.limits, run.caches.token_count
        ):
            self.compactor.tell(StageCollapse(messages=state.messages, config=setup.context_config))
        return state

    async def _take_in_queued(self, run: Run) -> list[TranscriptMessage]:
        """The messages waiting with this query's options, in order, taken in at this turn boundary as Claude
        Code takes queued messages in: each joins the conversation (a `queued_message` attachment for a text
        prompt, the user message itself for blocks), its own stream gets that event, and this query's `result`
        answers it. A message with other options (overrides), or an interrupt, waits for a query of its own."""
        taken: list[TranscriptMessage] = []
        queued = self._queued
        while queued and _joins(queued[0], run):
            message = queued.popleft()
            prompt = message.prompt
            joined: TranscriptMessage = (
                AttachmentMessage(attachment={"type": "queued_message", "content": prompt.content})
                if type(prompt.content) is str
                else prompt
            )
            await self._emit(run, joined)
            message.sink.push(joined)
            taken.append(joined)
            if run.absorbed is None:
                run.absorbed = []
            run.absorbed.append(message)
        return taken


def _joins(message: RunQuery, run: Run) -> bool:
    """Whether a waiting message may be taken into `run` (same options, not an interrupt, not aborted)."""
    if message.interrupt or message.control.abort_reason is not None:
        return False
    return message.options is run.setup.options or message.options == run.setup.options


def _answer_absorbed(run: Run) -> None:
    """The messages `run` took in get its `result` (its terminal and transitions too), and their streams end."""
    for message in run.absorbed or ():
        if run.outcome is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for event in run.outcome:
                    message.sink.push(event)
        message.sink.close()
        message.control.end()
