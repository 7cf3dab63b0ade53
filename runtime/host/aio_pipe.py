"""`Pipe`: one query's events between its trio pump and its asyncio consumer (`AsyncioQuery`).

The trio side (`submit`, `pump`, `unpark`, `abandon`) runs on the trio thread; the host side
(`receive`, `finish`, `failed`, `wake`, `leave`) on the asyncio loop, reached through the bridge's
two hops. The consumer-facing `AsyncioQuery` holds the pipe, never the other way round: a query
dropped unread is collected, and its finalizer aborts the query. Imports `host.aio_bridge`,
`host.session` and `loop`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from queryloop.runtime.errors import RuntimeClosed

if TYPE_CHECKING:
    from collections.abc import Callable

    from queryloop.runtime.host.aio_bridge import Bridge
    from queryloop.runtime.host.session import QueryHandle, Session
    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.events import Block, QueryEvent, ResultMessage
    from queryloop.runtime.loop.state import ContinueReason, Terminal


class Pipe:
    """One query's events between its trio pump and its asyncio consumer (see the module docstring)."""

    def __init__(self, bridge: Bridge, session: Session) -> None:
        self.bridge = bridge
        self.session = session
        self.handle: QueryHandle | None = None
        # Host side.
        self.buffer: deque[QueryEvent] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False
        self.error: BaseException | None = None
        self.end: asyncio.Future[None] | None = None
        self.listener: Callable[[], object] | None = None
        """Called on each arrival instead of (or as well as) waking a waiter (`AsyncioQuery.on_ready`)."""
        self.consumed = 0
        self.gone = False
        self.terminal: Terminal | None = None
        self.transitions: list[ContinueReason] = []
        self.result: ResultMessage | None = None
        self.settled: tuple[Terminal | None, list[ContinueReason], ResultMessage | None] = (None, [], None)
        """How the query ended, as its pump saw it (read once the consumer has left)."""
        # Trio side.
        self.delivered = 0
        self.parked: trio.Event | None = None

    # -- trio side ------------------------------------------------------------------------

    def submit(self, prompt: str | list[Block], overrides: dict[str, Any]) -> None:
        bridge = self.bridge
        try:
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

    def runtime_finished(self) -> None:
        if not self.ended:
            self.failed(RuntimeClosed("the asyncio runtime closed during the query"))

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
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
