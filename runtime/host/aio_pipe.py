"""`Pipe`: one query's events between its trio pump and its asyncio consumer (`AsyncioQuery`).

The trio side (`submit`, `pump`, `unpark`, `abandon`) runs on the trio thread; the host side
(`receive`, `finish`, `failed`, `wake`, `leave`) on the asyncio loop, reached through the bridge's
two hops. The consumer-facing `AsyncioQuery` holds the pipe, never the other way round: a query
dropped unread is collected, and its finalizer aborts the query. Imports `host.aio_bridge`,
`host.session` and `loop`.

`HostStream` and `StreamedQuery` are what a pipe shares with a Ray query's `Inbox` (`ray.query`): the
events of one query buffered on an asyncio loop, and the consumer's view of them (iteration, `wait`,
`result`, `terminal`, `aclose`, the abort of a consumer cancelled or dropped). Each feeder says how its
stream ends, is aborted and fails (`over`, `keep_result`, `abort`, `leave`, `no_result`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import trio
from loguru import logger

from queryloop.runtime import telemetry
from queryloop.runtime.errors import QueryloopError, RuntimeClosed
from queryloop.runtime.loop.events import ResultMessage

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from opentelemetry.context import Context

    from queryloop.runtime.host.aio_bridge import Bridge
    from queryloop.runtime.host.session import QueryHandle, Session
    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.events import Block, QueryEvent
    from queryloop.runtime.loop.state import ContinueReason, Terminal


class HostStream:
    """One query's events on the host's asyncio loop, between what feeds them and the consumer's `StreamedQuery`.
    Touched only on that loop (a finalizer hands `dropped` to it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.buffer: deque[QueryEvent] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.end: asyncio.Future[None] | None = None
        self.ended = False
        self.error: BaseException | None = None
        self.gone = False
        """The consumer left (closed, cancelled, dropped): nothing more is buffered."""
        self.consumed = 0
        self.terminal: Terminal | None = None
        self.transitions: list[ContinueReason] = []
        self.result: ResultMessage | None = None
        """Set as the consumer takes it (`keep_result`), or at the end of a query its consumer left."""

    def over(self) -> bool:
        """Nothing more for the consumer: the stream has ended (its error, if any, raised once) or it left."""
        raise NotImplementedError

    def keep_result(self, result: ResultMessage) -> None:
        """The consumer has taken the `result`: how the query ended is known on this side from now on."""
        raise NotImplementedError

    def ready_for_more(self) -> None:
        """The consumer is about to wait: its feeder may send more (a pipe's parked pump)."""

    def abort(self, reason: AbortReason) -> None:
        """Abort the query if it still runs; returns at once."""
        raise NotImplementedError

    def leave(self, reason: AbortReason = "user") -> None:
        """The consumer goes away: the query is aborted now, synchronously (before any await)."""
        raise NotImplementedError

    def dropped(self) -> None:
        """The consumer's view was collected unread: `leave`, from whatever thread the collector runs on."""
        self.leave("user")

    def no_result(self) -> BaseException:
        """Why a query that has ended has no `result`."""
        raise NotImplementedError

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_ended(self) -> None:
        if not self.ended:
            if self.end is None:
                self.end = self.loop.create_future()
            await asyncio.shield(self.end)  # a cancelled waiter leaves it to the next one (a shielded cleanup)


S = TypeVar("S", bound=HostStream)


class StreamedQuery(Generic[S]):
    """A query's events as its asyncio consumer sees them (`AsyncioQuery`, `RemoteQuery`): `async for`, `wait()`,
    `result`, `terminal`, `abort()`; `async with query:` aborts it when the block is left early, and so does a
    consumer cancelled while it waits for an event, and dropping the query unread. It holds its stream, never
    the other way round: dropped, it is collected, and its finalizer aborts the query."""

    def __init__(self, stream: S) -> None:
        self._stream = stream

    @property
    def result(self) -> ResultMessage | None:
        """The `ResultMessage` once the consumer has taken it, or the query ended after it left (None until then)."""
        return self._stream.result

    @property
    def terminal(self) -> Terminal | None:
        """How the query ended (`reason`, `error`); None until the `result` was read, or the query ended unread."""
        return self._stream.terminal

    @property
    def transitions(self) -> list[ContinueReason]:
        return self._stream.transitions

    @property
    def done(self) -> bool:
        """The `result` has been read (or the query ended after its consumer left)."""
        return self._stream.result is not None

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> QueryEvent:
        stream = self._stream
        buffer = stream.buffer
        while not buffer:
            if stream.over():
                raise StopAsyncIteration
            await self._arrival()
        stream.consumed += 1
        event = buffer.popleft()
        if type(event) is ResultMessage:
            stream.keep_result(event)
        return event

    async def _arrival(self) -> None:
        """Until events arrive or the stream ends; a consumer cancelled meanwhile aborts the query."""
        stream = self._stream
        stream.ready_for_more()
        waiter = stream.waiter = stream.loop.create_future()
        try:
            await waiter
        except asyncio.CancelledError:
            stream.leave("user")  # the consumer is cancelled: the query is aborted, now
            raise
        finally:
            stream.waiter = None

    async def wait(self) -> ResultMessage:
        """Consume the remaining events and return the `ResultMessage`."""
        async for _ in self:
            pass
        stream = self._stream
        if stream.result is None:
            if stream.gone and not stream.ended:
                await stream.wait_ended()
            if stream.result is None:
                raise stream.no_result()
        return stream.result

    def abort(self, reason: AbortReason = "user") -> None:
        """Abort the query (if it still runs); from any task or thread. Its events go on to its result."""
        self._stream.abort(reason)

    async def aclose(self) -> None:
        """Stop listening: a query still running is aborted (reason `user`); returns once it has ended
        (its `terminal` is then known). The abort is handed over before anything is awaited."""
        stream = self._stream
        stream.leave("user")
        await stream.wait_ended()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped unread: that is the consumer leaving. A finalizer may run on any thread, at any moment:
        # `dropped` only hands the abort on.
        stream = getattr(self, "_stream", None)
        if stream is not None and not stream.ended and not stream.gone:
            try:
                stream.dropped()
            except Exception:  # noqa: BLE001 - a finalizer must not raise
                logger.exception("abandoning a dropped query failed")


class Pipe(HostStream):
    """One query's events between its trio pump and its asyncio consumer (see the module docstring)."""

    def __init__(self, bridge: Bridge, session: Session) -> None:
        super().__init__(bridge.loop)
        self.bridge = bridge
        self.session = session
        self.handle: QueryHandle | None = None
        # Host side (and `HostStream`'s).
        self.listener: Callable[[], object] | None = None
        """Called on each arrival instead of (or as well as) waking a waiter (`AsyncioQuery.on_ready`)."""
        self.settled: tuple[Terminal | None, list[ContinueReason], ResultMessage | None] = (None, [], None)
        """How the query ended, as its pump saw it (read once the consumer has left)."""
        # Trio side.
        self.delivered = 0
        self.parked: trio.Event | None = None

    # -- trio side ------------------------------------------------------------------------

    def submit(self, prompt: str | list[Block], overrides: dict[str, Any], parent: Context | None = None) -> None:
        """Submit the query on the trio side; `parent`: the caller's trace context (`telemetry.caller_context`)."""
        bridge = self.bridge
        try:
            if parent is None:
                self.handle = self.session.query(prompt, **overrides)
            else:
                with telemetry.attached(parent):
                    self.handle = self.session.query(prompt, **overrides)
        except Exception as error:  # noqa: BLE001 - the consumer's first wait raises it
            bridge.to_host(self.failed, error)
            return
        if bridge.nursery is None or bridge.draining:
            bridge.to_host(self.failed, RuntimeClosed("the asyncio runtime is closed"))
            return
        bridge.pumps.add(self)
        bridge.nursery.start_soon(self.pump, self.handle)

    async def pump(self, handle: QueryHandle) -> None:
        bridge = self.bridge
        limit = handle.event_buffer
        try:
            while batch := await handle.next_batch():
                if self.gone:
                    continue  # the consumer left: the query ends (aborted), nothing more is delivered
                if handle.result is not None:
                    # The result: it crosses with the end of the stream (right after it), in one hop.
                    while await handle.next_batch():
                        pass
                    break
                self.delivered += len(batch)
                bridge.to_host(self.receive, batch)
                while self.delivered - self.consumed >= limit and not self.gone and not bridge.draining:
                    parked = self.parked = trio.Event()
                    if self.delivered - self.consumed < limit:  # consumed meanwhile (thread mode)
                        break
                    await parked.wait()
            else:
                batch = []
        except Exception as error:  # noqa: BLE001 - the consumer's next wait raises it
            bridge.to_host(self.failed, error)
            return
        except BaseException:
            bridge.to_host(self.failed, RuntimeClosed("the asyncio runtime closed during the query"))
            raise
        finally:
            self.parked = None
            bridge.pumps.discard(self)
        bridge.to_host(self.finish, [] if self.gone else batch, handle.terminal, handle.transitions, handle.result)

    def unpark(self) -> None:
        parked, self.parked = self.parked, None
        if parked is not None:
            parked.set()

    def abandon(self, reason: AbortReason) -> None:
        """The consumer is gone (or asked to abort): abort the query if it still runs."""
        handle = self.handle
        if handle is not None and not handle.done and handle.abort_reason is None:
            self.session.abort_nowait(reason)
        if self.gone:
            self.unpark()

    # -- host side ------------------------------------------------------------------------

    def receive(self, batch: list[QueryEvent]) -> None:
        self.buffer.extend(batch)
        self.wake()

    def finish(
        self,
        batch: list[QueryEvent],
        terminal: Terminal | None,
        transitions: list[ContinueReason],
        result: ResultMessage | None,
    ) -> None:
        self.buffer.extend(batch)
        self.settled = (terminal, transitions, result)
        if self.gone:
            self.terminal, self.transitions, self.result = self.settled
        self.ended = True
        self.bridge.pipes.discard(self)
        self.wake()
        if self.end is not None and not self.end.done():
            self.end.set_result(None)

    def failed(self, error: BaseException) -> None:
        self.error = error
        self.finish([], None, [], None)

    def over(self) -> bool:
        """Nothing more for the consumer: the stream has ended (its error, if any, raised once) or it left."""
        if self.ended:
            if self.error is not None:
                error, self.error = self.error, None
                raise error
            return True
        return self.gone

    def keep_result(self, result: ResultMessage) -> None:
        """The consumer has taken the `result`: how the query ended is known on this side from now on."""
        handle = self.handle
        assert handle is not None
        self.result, self.terminal, self.transitions = result, handle.terminal, handle.transitions

    def wants_more(self) -> None:
        """The consumer has taken what it had: a pump parked for it may go on."""
        if self.parked is not None:
            self.bridge.send(self.unpark)

    def ready_for_more(self) -> None:
        """`wants_more` for a consumer about to wait. Its wake-up call to a parked pump is refused only when the
        trio run has just ended (thread mode: the run's end not yet told on this loop): the pump has ended then,
        and its `finish` (or `runtime_finished`), queued on this loop, ends the wait with the rest of the events."""
        try:
            self.wants_more()
        except RuntimeClosed:
            pass

    def abort(self, reason: AbortReason) -> None:
        self.bridge.send(lambda: self.abandon(reason))

    def no_result(self) -> BaseException:
        if self.bridge.closing:  # a query the run's end cut short (it did not settle within the grace)
            return RuntimeClosed("the asyncio runtime closed before the query ended: it has no result")
        return QueryloopError("the query ended without a result (its consumer left before it ran)")

    def runtime_finished(self) -> None:
        if not self.ended:
            self.failed(RuntimeClosed("the asyncio runtime closed during the query"))

    def wake(self) -> None:
        super().wake()
        listener = self.listener
        if listener is not None:
            listener()

    def leave(self, reason: AbortReason = "user") -> None:
        """The consumer goes away: hand the abort to trio now (synchronously, before any await)."""
        if self.gone:
            return
        self.gone = True
        self.buffer.clear()
        if self.ended:  # it ended unread: how, the pump said
            if self.result is None:
                self.terminal, self.transitions, self.result = self.settled
            return
        try:
            self.bridge.send(lambda: self.abandon(reason))
        except RuntimeClosed:
            pass
