"""The driver's `RemoteSession` and `RemoteQuery`: a session on a shard, and one query's events.

The same shape as `queryloop.aio`: `session.query(prompt, events=...)` returns a query to iterate
(`async for`), `await query.result()`, `query.terminal`; `query.abort()` from the driver's loop;
`async with query:` aborts it when the block is left early, and so does `aclose()` and dropping the
query unread (its finalizer hands the abort to the driver's loop). An abort goes to the shard on the
control lane. The events of a query are filled in by its `ShardedRuntime`'s stream from that shard.
Imports `queryloop.runtime.ray.wire`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol, Self

from loguru import logger

from queryloop.runtime.errors import QueryloopError, RuntimeClosed, ShardLost
from queryloop.runtime.loop.events import ResultMessage
from queryloop.runtime.ray.wire import EVENTS_MODES, EventsMode, Submission

if TYPE_CHECKING:
    from collections.abc import Mapping
    from types import TracebackType

    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.events import Block, QueryEvent, TranscriptMessage
    from queryloop.runtime.loop.state import ContinueReason, Terminal
    from queryloop.runtime.ray.wire import Ending


class _Router(Protocol):
    """What a session needs of its `ShardedRuntime`."""

    loop: asyncio.AbstractEventLoop
    stream: str

    def next_qid(self) -> int: ...
    def submit(self, session: RemoteSession, inbox: Inbox, submission: Submission) -> None: ...
    def send_abort(self, session: RemoteSession, qid: int | None, reason: AbortReason) -> asyncio.Future[int]: ...
    async def call(self, session: RemoteSession, name: str, *args: Any) -> Any: ...
    def forget(self, session: RemoteSession) -> None: ...


class RemoteSession:
    """A session on a shard (`key`, `id`, `shard`); made by `ShardedRuntime.open_session` or `resume`."""

    def __init__(self, router: _Router, key: str, session_id: str, shard: int, spec: Mapping[str, Any]) -> None:
        self._router = router
        self.key = key
        self.id = session_id
        self.shard = shard
        """The index of the shard it lives on."""
        self.spec = dict(spec)
        self.lost: ShardLost | None = None
        """Why the session is gone with its shard (None while it lives)."""
        self.closed = False

    def query(self, prompt: str | list[Block], *, events: EventsMode = "all", **overrides: Any) -> RemoteQuery:
        """Submit one user message; iterate the returned query for its events (`events="all"`), those
        but the raw stream deltas (`"messages"`), or only its result (`"result"`).

        `ShardLost` if the session's shard is gone (resume it), `SessionClosed`-like errors of the
        submission itself are raised by the first wait on the query. Overrides must pickle.
        """
        if events not in EVENTS_MODES:
            msg = f"events must be one of {EVENTS_MODES}, not {events!r}"
            raise ValueError(msg)
        if self.lost is not None:
            raise self.lost
        if self.closed:
            msg = f"session {self.key!r} is closed"
            raise RuntimeClosed(msg)
        router = self._router
        qid = router.next_qid()
        inbox = Inbox(self, qid)
        router.submit(self, inbox, Submission(self.key, qid, router.stream, prompt, events, overrides))
        return RemoteQuery(inbox)

    async def abort(self, reason: AbortReason = "user") -> int:
        """Abort whatever runs in the session, on its shard; returns how many actors acked."""
        return await self._router.send_abort(self, None, reason)

    async def transcript(self) -> list[TranscriptMessage]:
        messages: list[TranscriptMessage] = await self._router.call(self, "transcript", self.key)
        return messages

    async def close(self) -> None:
        """Abort what runs, then close the session on its shard (its transcript stays)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.lost is None:
                await self._router.call(self, "close_session", self.key)
        finally:
            self._router.forget(self)


class Inbox:
    """One query's events on the driver, between its shard's stream and its consumer. The
    consumer-facing `RemoteQuery` holds it, never the other way round: dropped, the query is collected
    and its finalizer aborts the query."""

    def __init__(self, session: RemoteSession, qid: int) -> None:
        self.session = session
        self.qid = qid
        self.buffer: deque[QueryEvent] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.end: asyncio.Future[None] | None = None
        self.ended = False
        self.error: BaseException | None = None
        self.gone = False
        self.terminal: Terminal | None = None
        self.transitions: list[ContinueReason] = []
        self.result: ResultMessage | None = None
        self.settled: Ending | None = None

    def receive(self, events: list[QueryEvent], ending: Ending | None, error: BaseException | None) -> None:
        if not self.gone:
            self.buffer.extend(events)
        for event in events:
            if type(event) is ResultMessage:
                self.result = event
        if error is not None:
            self.error = error
            self.finish()
        elif ending is not None:
            self.settled = ending
            self.finish()
        else:
            self.wake()

    def finish(self) -> None:
        self.ended = True
        if self.gone and self.settled is not None:
            self.terminal, self.transitions = self.settled.terminal, self.settled.transitions
        self.wake()
        if self.end is not None and not self.end.done():
            self.end.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.ended:
            self.error = error
            self.finish()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def leave(self, reason: AbortReason = "user") -> None:
        """The consumer goes away: the query is aborted on its shard (if it still runs)."""
        if self.gone:
            return
        self.gone = True
        self.buffer.clear()
        if not self.ended:
            self.session._router.send_abort(self.session, self.qid, reason)  # noqa: SLF001 - its own router


class RemoteQuery:
    """A query on a shard: `async for event in query`, `await query.result()`, `query.terminal`,
    `query.abort()`; `async with query:` aborts it when the block is left early."""

    def __init__(self, inbox: Inbox) -> None:
        self._inbox = inbox

    @property
    def terminal(self) -> Terminal | None:
        """How the query ended (`reason`, `error`); None until its end was read."""
        return self._inbox.terminal

    @property
    def transitions(self) -> list[ContinueReason]:
        return self._inbox.transitions

    @property
    def done(self) -> bool:
        return self._inbox.ended and not self._inbox.buffer

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> QueryEvent:
        inbox = self._inbox
        while not inbox.buffer:
            if inbox.ended or inbox.gone:
                self._settle()
                if inbox.error is not None and not inbox.gone:
                    error, inbox.error = inbox.error, None
                    raise error
                raise StopAsyncIteration
            waiter = inbox.waiter = inbox.session._router.loop.create_future()  # noqa: SLF001
            try:
                await waiter
            except asyncio.CancelledError:
                inbox.leave("user")  # the consumer is cancelled: the query is aborted, now
                raise
            finally:
                inbox.waiter = None
        event = inbox.buffer.popleft()
        if not inbox.buffer and inbox.ended:
            self._settle()
        return event

    def _settle(self) -> None:
        inbox = self._inbox
        if inbox.settled is not None and inbox.terminal is None:
            inbox.terminal, inbox.transitions = inbox.settled.terminal, inbox.settled.transitions

    async def result(self) -> ResultMessage:
        """Consume the remaining events and return the `ResultMessage`."""
        async for _ in self:
            pass
        inbox = self._inbox
        if inbox.result is None:
            if inbox.gone and not inbox.ended:
                await self._wait_ended()
            if inbox.error is not None:
                error, inbox.error = inbox.error, None
                raise error
            if inbox.result is None:
                msg = "the query ended without a result"
                raise QueryloopError(msg)
        return inbox.result

    wait = result

    def abort(self, reason: AbortReason = "user") -> None:
        """Abort the query on its shard (if it still runs); its events go on to its result."""
        inbox = self._inbox
        if not inbox.ended:
            inbox.session._router.send_abort(inbox.session, inbox.qid, reason)  # noqa: SLF001

    async def aclose(self) -> None:
        """Stop listening: a query still running is aborted (reason `user`); returns once it has ended."""
        self._inbox.leave("user")
        await self._wait_ended()

    async def _wait_ended(self) -> None:
        inbox = self._inbox
        if not inbox.ended:
            if inbox.end is None:
                inbox.end = inbox.session._router.loop.create_future()  # noqa: SLF001
            await asyncio.shield(inbox.end)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # Dropped unread: the consumer left. A finalizer may run anywhere: the abort goes through the loop.
        inbox = getattr(self, "_inbox", None)
        if inbox is not None and not inbox.ended and not inbox.gone:
            try:
                inbox.session._router.loop.call_soon_threadsafe(inbox.leave, "user")  # noqa: SLF001
            except RuntimeError:  # the driver's loop has closed
                pass
            except Exception:  # noqa: BLE001 - a finalizer must not raise
                logger.exception("abandoning a dropped query failed")
