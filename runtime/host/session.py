"""`Session` and `QueryHandle`: the public face of one agent loop.

A session is one actor group holding one conversation: the QueryLoop, the
ModelCaller and the StreamingToolExecutor from the start; the Compactor, the
ToolUseSummarizer and the BudgetGuard spawned by the QueryLoop on first need (the
BudgetGuard from the start under a host budget; without one the loop accounts
inline). An abort reaches every actor alive at that moment.

`session.query(prompt)` submits a user message and returns a `QueryHandle`: a
view over the bounded trio channel the QueryLoop feeds, never an async generator
owning a nursery, so a consumer that stops early cannot corrupt a cancel scope
(trio #638). Closing the handle, or dropping it
before the end, aborts the query (reason `user`) and leaves the session usable.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Self

import trio

from queryloop.actors.query_loop import (
    CompactNow,
    GetContextUsage,
    GetConversation,
    GetSidechains,
    QueryControl,
    RunQuery,
    Settled,
)
from queryloop.actors.query_loop.controls import CANCELED, IN_PROGRESS
from queryloop.runtime import telemetry
from queryloop.runtime.errors import CompactFailed, QueryInProgress, SessionClosed, WorkCancelled
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop.disk import DISK_FULL_WAIT_S, is_disk_full, retry_while_full
from queryloop.runtime.loop.events import (
    Block,
    QueryEvent,
    ResultMessage,
    TranscriptMessage,
    UserMessage,
    stream_event,
)
from queryloop.runtime.loop.options import QueryOptions

if TYPE_CHECKING:
    from types import TracebackType

    from pykka import ActorRef

    from queryloop.actors.query_loop import QueryLoop
    from queryloop.runtime.errors import ActorCrashed
    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.kernel.supervisor import Supervisor
    from queryloop.runtime.loop.context_usage import ContextUsageResponse
    from queryloop.runtime.loop.events import SystemMessage
    from queryloop.runtime.loop.persistence import TranscriptLog
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.loop.state import ContinueReason, Terminal


_BOOKKEEPING = frozenset({Settled, ResultMessage})
"""What the handle itself looks at as it passes (`QueryHandle._received`). A plain dict is a raw stream event,
put in the channel as the provider streamed it and wrapped in its `StreamEvent` only as the consumer takes it:
an event waiting for the consumer then keeps one object alive, not two (fewer for the collector to walk at a
thousand queries at once). Every other item is an event as is."""

_setattr = object.__setattr__
"""Sets an event's `session_id` as the handle hands it out, past the record's frozen `__setattr__`: the events a
session's actors make (a thousand a query) get their session's id at the one place they all pass, not each where
it is made. An event is the session's own (no one else holds it), and its id the same wherever it is seen."""


class QueryHandle:
    """Iterate it for the query's events; then read `terminal`, `result`, `transitions`.

    Before it hands out an event, the handle writes the session's transcript (docs/design.md, "Durability"),
    so the event's record is in the file. While the disk is full (ENOSPC, EDQUOT) it waits for room, with
    `runtime.loop.disk`'s backoff (the consumer's own cancellation cuts the wait; nothing is taken, iterate
    again), and takes the event once the write succeeds. It stops waiting once its query is over (its
    `result` sent: the loop has given up on the disk for this query, past its bound, at another write error
    or cut by an abort, and said so in the `result`) or after `DISK_FULL_WAIT_S` of its own: it then hands
    out the remaining events and the `result` although their records are NOT in the file yet. They stay
    buffered in the log, first in line, and the session's next successful write (its next query's, or its
    close) puts them there. Any other write error, while the query runs, is raised and takes no event; so is
    any error once the session is closed (a log closed on a failure raises `EIO`: those records are lost).
    """

    def __init__(
        self, session: Session, events: EventChannel[Any], control: QueryControl, transcript: TranscriptLog | None
    ) -> None:
        self._session = session
        self._session_id = session.id
        """Set on every event as it is handed out (`Event.session_id`: the SDK's field, a subagent's events too)."""
        self._events = events
        self._control = control
        self._transcript = transcript
        self._terminal: Terminal | None = None
        self._transitions: list[ContinueReason] = []
        self._result: ResultMessage | None = None
        self._gave_up_on_disk = False
        """The disk stayed full past this handle's wait: its remaining events are handed out unwritten."""

    @property
    def result(self) -> ResultMessage | None:
        """The `ResultMessage`, once the consumer has taken it (None until then)."""
        return self._result

    @property
    def terminal(self) -> Terminal | None:
        """How the query ended (`reason`, `error`); None until its end was read."""
        return self._terminal

    @property
    def transitions(self) -> list[ContinueReason]:
        """The query's continue reasons, in order, once it has ended (an empty list of its own until then)."""
        return self._transitions

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def abort_reason(self) -> AbortReason | None:
        """Why this query was aborted; None if no abort reached it before it had decided how it ends."""
        return self._control.abort_reason

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> QueryEvent:
        events, transcript = self._events, self._transcript
        while True:
            # What is buffered already is returned at once; the loop waits only on an empty channel.
            if not events.items and not await events.wait():
                self._raise_failure()
                raise StopAsyncIteration from None
            if transcript is not None:
                # Every message in the channel has its record in the log's buffer: written now, one syscall
                # for all that arrived together, so nothing the consumer receives is lost to a kill.
                try:
                    transcript.write()
                except OSError as error:  # the only path that does more: a disk that is fine costs nothing
                    await self._wait_for_room(transcript, error)
            item = events.items.popleft()  # `events.take()` written out: one call less an event (0.7 % of a W loop)
            if events.waiting_senders:
                events.admit_waiting_sender()
            kind = type(item)
            if kind is dict:  # a raw stream event (most of them): wrapped as it is handed out
                return stream_event(item, self._session_id)
            if kind not in _BOOKKEEPING:  # every other event: returned as it is, its session's id set
                _setattr(item, "session_id", self._session_id)
                event: QueryEvent = item
                return event
            received = self._received(item)
            if received is not None:
                return received

    @property
    def event_buffer(self) -> int:
        """How many events the query's channel buffers for a slow consumer (`options.event_buffer`)."""
        return self._events.max_buffer

    async def next_batch(self) -> list[QueryEvent]:
        """Every event buffered now, waiting only if none is; [] once the stream has ended.

        For a consumer that moves events on in batches (the asyncio facade hops once per batch).
        `terminal`, `transitions` and `result` are kept, and the transcript written, as `__anext__` does.
        """
        events, transcript = self._events, self._transcript
        batch: list[QueryEvent] = []
        while not batch:
            if not events.items and not await events.wait():
                self._raise_failure()
                return batch
            if transcript is not None:
                try:
                    transcript.write()
                except OSError as error:
                    await self._wait_for_room(transcript, error)
            while events.items:
                event = self._received(events.take())
                if event is not None:
                    batch.append(event)
        return batch

    async def _wait_for_room(self, transcript: TranscriptLog, error: OSError) -> None:
        """The write before an event failed with `error`: return once the events may be handed out (written,
        or given up on: the class docstring); else raise `error` (or a retry's)."""
        supervisor = self._session.supervisor  # a closed (or crashed) session's log is closed: its records are lost
        if supervisor.closed:
            raise error
        if self._gave_up_on_disk or self._query_over():
            return  # the log keeps them buffered, first in line for the session's next write
        control = self._control

        async def pause(delay: float) -> None:
            with trio.move_on_after(delay):
                await control.wait_ended()  # woken at once when the query ends (the loop gave up, or an abort)

        async def attempt() -> None:
            try:
                transcript.write()
            except OSError:
                if self._query_over() and not supervisor.closed:
                    return  # the query is over: what is left is handed out unwritten
                raise

        try:
            await retry_while_full(attempt, error, bound_s=DISK_FULL_WAIT_S, pause=pause)
        except OSError as failed:
            if not is_disk_full(failed):
                raise
            self._gave_up_on_disk = True

    def _query_over(self) -> bool:
        """The loop will write nothing more of this query: its work is over, or its `result` is in the channel
        (sent after the query's last write, or once the loop gave up on it)."""
        return self._control.finished or any(type(item) is ResultMessage for item in self._events.items)

    def _received(self, item: Any) -> QueryEvent | None:
        """What one item of the channel is to the consumer: an event, or None for the end's bookkeeping."""
        kind = type(item)
        if kind is dict:
            return stream_event(item, self._session_id)
        if kind is Settled:
            self._terminal, self._transitions = item.terminal, item.transitions
            return None
        if kind is ResultMessage:
            self._result = item
        _setattr(item, "session_id", self._session_id)
        event: QueryEvent = item
        return event

    def _raise_failure(self) -> None:
        """At the end of the stream: a crash of the session's actors ends it, raised to the consumer."""
        failure = self._session.failure
        if failure is not None and self._result is None:
            raise failure from None

    async def wait(self) -> ResultMessage:
        """Consume the remaining events and return the result."""
        async for _ in self:
            pass
        assert self._result is not None
        return self._result

    def abort(self, reason: AbortReason = "user") -> None:
        """Abort this query if it still runs (not a later one of the session); returns at once, its events then
        going on to its result. On the trio thread (`BlockingQuery.abort` hands it there)."""
        control = self._control
        if self._result is None and not control.finished and control.abort_reason is None:
            self._session._abort_query(control, reason)  # noqa: SLF001 - its own session

    async def aclose(self) -> None:
        """Stop listening; a query still running is aborted (reason `user`)."""
        control = self._control
        if not self.done and control.abort_reason is None and not control.finished:
            if self._session._running() is control:  # noqa: SLF001 - its own session
                await self._session.abort("user")
            else:
                control.request_abort("user")  # it waits its turn: it ends without running
        self._events.close_receiver()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped without aclose(): that is the user's abort. A finalizer runs wherever the
        # collector happens to run, even inside trio's scheduler, so nothing is done here: the
        # abort and the closing of the channel are handed to the trio thread to run next.
        session, control, events = self._session, self._control, self._events
        if self.done:
            return

        def abandoned() -> None:
            if control.abort_reason is None and not control.finished:
                session._abort_query(control, "user")  # noqa: SLF001 - its own session
            events.close_receiver()

        try:
            session.supervisor._token.run_sync_soon(abandoned)  # noqa: SLF001
        except trio.RunFinishedError:
            pass  # the run is over: nothing is left to abort

    def next_buffered(self) -> QueryEvent | None:
        """`__anext__` without waiting: the next event the channel holds, or None once it holds none (the stream
        ends there; a crash of the session's actors is raised, as `__anext__` raises it).

        Only for a consumer served after the trio run has ended (`BlockingQuery`): no task is left to send, to
        wait or to be admitted, so the channel is plain Python objects. The items go through `_received`, as
        `__anext__`'s do (the transcript written first, a raw stream event wrapped, the end's bookkeeping kept).
        """
        items, transcript = self._events.items, self._transcript
        while items:
            if transcript is not None:
                transcript.write()
            event = self._received(items.popleft())
            if event is not None:
                return event
        self._raise_failure()
        return None


class Session:
    """One conversation with its own actor group. Made by `Runtime.open_session`."""

    def __init__(
        self,
        supervisor: Supervisor,
        options: QueryOptions,
        loop: ActorRef[QueryLoop],
        transcript: TranscriptLog | None = None,
    ) -> None:
        self.supervisor = supervisor
        self.options = options
        self._next_options = options
        """What the next query starts from: `options`, with the model `set_model` set."""
        self._loop = loop
        self._transcript = transcript
        """The session's log (the QueryLoop appends to it): each handle writes it before its consumer takes an event."""
        self._pending: deque[tuple[QueryControl, EventChannel[Any]]] = deque()
        """Every query submitted and not yet over, in the order the QueryLoop takes them: the first is the one
        that runs (`_running`), the rest wait their turn."""
        supervisor.add_crash_listener(self._crashed)

    @property
    def id(self) -> str:
        return self.supervisor.session_id

    @property
    def failure(self) -> ActorCrashed | None:
        return self.supervisor.failure

    def query(self, prompt: str | list[Block], *, interrupt: bool = False, **overrides: Any) -> QueryHandle:
        """Submit one user message; `overrides` change options for this query only (validated).

        Submitted while a query runs, it waits its turn, as Claude Code's queued messages do: it is taken in
        at that query's next turn boundary (its stream then gets the `queued_message` attachment that joined
        the conversation, and that query's `result` answers it), or, if that query ends first, it runs as a
        query of its own. Messages sent back to back are all answered, in order. A message with `overrides`
        always runs as its own query. `interrupt=True` interrupts the running query instead (reason
        `interrupt`: no interruption message, as Claude Code's submit-interrupt), and runs next.
        """
        if self.supervisor.closed:
            msg = f"session {self.id} is closed"
            raise SessionClosed(msg)
        # The host's input, validated (and copied) before anything changes: a bad prompt interrupts nothing.
        prompt_message = (
            UserMessage(content=prompt) if type(prompt) is str else UserMessage.model_validate({"content": prompt})
        )
        options = self._next_options
        if overrides:
            options = QueryOptions.model_validate({**dict(options), **overrides})
            refuse_asyncio_provider(options)
        running = self._running()
        interrupting = interrupt and running is not None
        if interrupting and running is not None and not running.decided and running.abort_reason is None:
            self.abort_nowait("interrupt")
        events: EventChannel[Any] = EventChannel(options.event_buffer)
        control = QueryControl()
        telemetry.query_submitted(control)  # on or off for this query; its spans' parent: the host's current span
        handle = QueryHandle(self, events, control, self._transcript)
        if interrupting:
            self._pending.insert(1, (control, events))  # next, after the interrupted one
        else:
            self._pending.append((control, events))
        self._loop.tell(
            RunQuery(prompt=prompt_message, options=options, sink=events, control=control, interrupt=interrupting)
        )
        return handle

    def _running(self) -> QueryControl | None:
        """The query that runs now (or is about to start), if any: the first one submitted that is not over."""
        pending = self._pending
        while pending and pending[0][0].finished:
            pending.popleft()
        return pending[0][0] if pending else None

    async def abort(self, reason: AbortReason = "user") -> int:
        """Abort the running query (if any) and every actor's in-flight work; returns how many actors acknowledged
        it (their `AbortAck`s are `session.supervisor.abort`'s, the kernel's). Idempotent."""
        self._mark_aborted(reason)
        return len(await self.supervisor.abort(reason))

    def abort_nowait(self, reason: AbortReason = "user") -> None:
        """`abort` without waiting for the actors' acks: for code that cannot await."""
        self._mark_aborted(reason)
        self.supervisor.abort_nowait(reason)

    def _abort_query(self, control: QueryControl, reason: AbortReason) -> None:
        """Abort one query without waiting: the one that runs by the session's broadcast; one that waits its
        turn by its own control (it then ends, aborted, when its turn comes, without running)."""
        if self._running() is control:
            self.abort_nowait(reason)
        else:
            control.request_abort(reason)

    def _mark_aborted(self, reason: AbortReason) -> None:
        # Before the broadcast: an Abort that overtakes the RunQuery still reaches the query. Only the query
        # that runs: the messages waiting their turn go on (the session's close ends them too).
        running = self._running()
        if running is not None:
            running.request_abort(reason)

    async def transcript(self) -> list[TranscriptMessage]:
        """The conversation so far: every transcript message emitted, tombstoned ones removed."""
        conversation: list[TranscriptMessage] = await self._loop.ask(GetConversation(), block=False)
        return conversation

    async def sidechains(self) -> dict[str, Sidechain]:
        """The subagents' conversations, by agent id: restored on resume, and each one's as it ended."""
        found: dict[str, Sidechain] = await self._loop.ask(GetSidechains(), block=False)
        return found

    async def compact(self, instructions: str | None = None) -> SystemMessage:
        """Compact the conversation now, as Claude Code's `/compact [instructions]`; returns the compact boundary
        (`data`: `trigger` `manual`, `pre_tokens`), which the summary follows in the conversation.

        Between queries only: `QueryInProgress` while a query runs or waits its turn (a message sent while the
        compaction runs waits for it). The PreCompact and PostCompact hooks fire with trigger `manual`,
        `custom_instructions` being `instructions` (else the options' `compact_instructions`), which the summary
        request appends under `Additional Instructions:`; the next query sends the summary, not what it replaced.
        `CompactFailed` if nothing was compacted: no message since the last boundary ("Not enough messages to
        compact."), a PreCompact block, the summary request's error, or an abort ("Compaction canceled.")."""
        if self.supervisor.closed:
            msg = f"session {self.id} is closed"
            raise SessionClosed(msg)
        if self._running() is not None:
            raise QueryInProgress(IN_PROGRESS)
        try:
            boundary: SystemMessage = await self._loop.ask(
                CompactNow(options=self._next_options, instructions=instructions), block=False
            )
        except WorkCancelled:  # an abort (or the close) cut the loop's work
            raise CompactFailed(CANCELED) from None
        return boundary

    async def context_usage(self) -> ContextUsageResponse:
        """The context the next query would start with, keyed as the Agent SDK's `ContextUsageResponse`
        (`runtime.loop.context_usage` says what is counted, how, and what is left empty); no model call."""
        usage: ContextUsageResponse = await self._loop.ask(GetContextUsage(options=self._next_options), block=False)
        return usage

    async def set_model(self, model: str | None = None) -> None:
        """The model of the session's next queries (None: the options' own again), validated as `QueryOptions`
        validates its `model` (an unknown model without `pricing` is a `ValueError`). A query that runs keeps its
        model, and so does a message already sent that waits its turn: every message sent from now on uses this
        one (its overrides apply after it). The Agent SDK's `set_model` changes the model "during conversation";
        a query's options being fixed when it starts, here that is from the next query on."""
        options = self.options
        if model is not None:
            options = QueryOptions.model_validate({**dict(options), "model": model})
        self._next_options = options

    def live_tasks(self) -> int:
        """Work tasks of this session and its subagents still running (0 once a query's stream has ended)."""
        return self.supervisor.live_tasks()

    async def close(self) -> None:
        """Abort what runs and what waits its turn, then stop every actor of the session."""
        if self._running() is not None and not self.supervisor.closed:
            for control, _ in self._pending:
                control.request_abort("shutdown")  # a waiting one then ends at once when its turn comes
            last = self._pending[-1][0]
            await self.abort("shutdown")
            await last.wait_ended()  # every query ends properly, in order, before the actors stop
        await self.supervisor.close()
        for _, events in self._pending:
            events.close()

    def _crashed(self, failure: ActorCrashed) -> None:
        for _, events in self._pending:
            events.close()  # each handle ends and raises the failure


def refuse_asyncio_provider(options: QueryOptions) -> None:
    """A provider written for asyncio cannot stream in a trio task: say where it can."""
    provider = options.asyncio_provider()
    if provider is not None:
        msg = (
            f"{type(provider).__name__} is written for asyncio (runs_on='asyncio'): open the session "
            "through queryloop.aio.AsyncioRuntime, which streams it on the host's loop"
        )
        raise ValueError(msg)
