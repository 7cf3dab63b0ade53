"""The driver's `RemoteSession` and `RemoteQuery`: a session on a shard, and one query's events.

The same shape as `queryloop.aio` (the same `aio_pipe.StreamedQuery`): `session.query(prompt, events=...)`
returns a query to iterate (`async for`), `await query.wait()` (then `query.result`), `query.terminal`;
`query.abort()` from the driver's loop; `async with query:` aborts it when the block is left early, and so
does `aclose()` and dropping the query unread (its finalizer hands the abort to the driver's loop). An
abort goes to the shard on the control lane. The events of a query are filled in by its `ShardedRuntime`'s
stream from that shard. Imports `queryloop.runtime.ray.wire`, `host.aio_pipe` and `telemetry` (the driver's
trace context goes with each submission).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from queryloop.runtime import telemetry
from queryloop.runtime.errors import QueryloopError, RuntimeClosed, ShardLost
from queryloop.runtime.host.aio_pipe import HostStream, StreamedQuery
from queryloop.runtime.loop.events import ResultMessage
from queryloop.runtime.ray.wire import EVENTS_MODES, EventsMode, Submission

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.context_usage import ContextUsageResponse
    from queryloop.runtime.loop.events import Block, QueryEvent, SystemMessage, TranscriptMessage
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.ray.wire import Ending


class _Router(Protocol):
    """What a session needs of its `ShardedRuntime`: its routing, private to the runtime and its sessions."""

    loop: asyncio.AbstractEventLoop
    stream: str

    def _next_qid(self) -> int: ...
    def _submit(self, session: RemoteSession, inbox: Inbox, submission: Submission) -> None: ...
    def _send_abort(self, session: RemoteSession, qid: int | None, reason: AbortReason) -> asyncio.Future[int]: ...
    async def _ask_shard(self, session: RemoteSession, request: Callable[[Any], Any]) -> Any: ...
    def _forget(self, session: RemoteSession) -> None: ...


class RemoteSession:
    """A session on a shard (`key`, `id`, `shard`); made by `ShardedRuntime.open_session` or `resume`."""

    def __init__(self, router: _Router, key: str, session_id: str, shard: int, spec: Mapping[str, Any]) -> None:
        self._router = router
        self.key = key
        self._id = session_id
        self.shard = shard
        """The index of the shard it lives on."""
        self.spec = dict(spec)
        self.lost: ShardLost | None = None
        """Why the session is gone with its shard (None while it lives)."""
        self.closed = False

    @property
    def id(self) -> str:
        return self._id

    def query(
        self, prompt: str | list[Block], *, interrupt: bool = False, events: EventsMode = "all", **overrides: Any
    ) -> RemoteQuery:
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
        if interrupt:
            overrides = {**overrides, "interrupt": True}  # `Session.query`'s own keyword, on the shard
        router = self._router
        qid = router._next_qid()  # noqa: SLF001 - its own runtime's routing
        inbox = Inbox(self, qid)
        trace = telemetry.caller_carrier()  # the driver's span, the parent of the query's spans on the shard
        router._submit(self, inbox, Submission(self.key, qid, router.stream, prompt, events, overrides, trace))  # noqa: SLF001
        return RemoteQuery(inbox)

    async def abort(self, reason: AbortReason = "user") -> int:
        """Abort whatever runs in the session, on its shard; returns how many of its actors acknowledged it
        (0 when none was reached: the shard gone, the session closed there, the shard's runtime closing)."""
        return await self._router._send_abort(self, None, reason)  # noqa: SLF001 - its own runtime's routing

    async def transcript(self) -> list[TranscriptMessage]:
        key, router = self.key, self._router
        messages: list[TranscriptMessage] = await router._ask_shard(self, lambda shard: shard.transcript.remote(key))  # noqa: SLF001
        return messages

    async def sidechains(self) -> dict[str, Sidechain]:
        """As `Session.sidechains`: the subagents' conversations, by agent id (from its shard)."""
        key = self.key
        router = self._router
        found: dict[str, Sidechain] = await router._ask_shard(self, lambda shard: shard.sidechains.remote(key))  # noqa: SLF001
        return found

    async def compact(self, instructions: str | None = None) -> SystemMessage:
        """As `Session.compact`, on its shard: Claude Code's `/compact [instructions]`; the compact boundary."""
        key, router = self.key, self._router
        boundary: SystemMessage = await router._ask_shard(self, lambda shard: shard.compact.remote(key, instructions))  # noqa: SLF001
        return boundary

    async def context_usage(self) -> ContextUsageResponse:
        """As `Session.context_usage`, on its shard: keyed as the Agent SDK's `ContextUsageResponse`."""
        key, router = self.key, self._router
        usage: ContextUsageResponse = await router._ask_shard(self, lambda shard: shard.context_usage.remote(key))  # noqa: SLF001
        return usage

    async def set_model(self, model: str | None = None) -> None:
        """As `Session.set_model`, on its shard: the model of the session's next queries (None: the options')."""
        key = self.key
        await self._router._ask_shard(self, lambda shard: shard.set_model.remote(key, model))  # noqa: SLF001

    async def close(self) -> None:
        """Abort what runs, then close the session on its shard (its transcript stays)."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.lost is None:
                key = self.key
                await self._router._ask_shard(self, lambda shard: shard.close_session.remote(key))  # noqa: SLF001
        finally:
            self._router._forget(self)  # noqa: SLF001 - its own runtime's routing


class Inbox(HostStream):
    """One query's events on the driver, between its shard's stream and its consumer (`RemoteQuery`)."""

    def __init__(self, session: RemoteSession, qid: int) -> None:
        super().__init__(session._router.loop)  # noqa: SLF001 - its own router
        self.session = session
        self.qid = qid
        self.settled: Ending | None = None
        self.arrived: ResultMessage | None = None
        """The query's result as it arrived (`result` once the consumer takes it, or at the end if it left)."""

    def receive(self, events: list[QueryEvent], ending: Ending | None, error: BaseException | None) -> None:
        if not self.gone:
            self.buffer.extend(events)
        for event in events:
            if type(event) is ResultMessage:
                self.arrived = event
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
        if self.gone:
            self._settle()
            self.result = self.arrived
        self.wake()
        if self.end is not None and not self.end.done():
            self.end.set_result(None)

    def fail(self, error: BaseException) -> None:
        if not self.ended:
            self.error = error
            self.finish()

    def _settle(self) -> None:
        if self.settled is not None and self.terminal is None:
            self.terminal, self.transitions = self.settled.terminal, self.settled.transitions

    def over(self) -> bool:
        if not (self.ended or self.gone):
            return False
        self._settle()
        if self.error is not None and not self.gone:
            error, self.error = self.error, None
            raise error
        return True

    def keep_result(self, result: ResultMessage) -> None:
        self.result = result
        if not self.buffer and self.ended:
            self._settle()

    def abort(self, reason: AbortReason) -> None:
        if not self.ended:
            self.session._router._send_abort(self.session, self.qid, reason)  # noqa: SLF001 - its own router

    def leave(self, reason: AbortReason = "user") -> None:
        """The consumer goes away: the query is aborted on its shard (if it still runs)."""
        if self.gone:
            return
        self.gone = True
        self.buffer.clear()
        if self.ended:  # it ended unread: how, its shard said
            self._settle()
            self.result = self.result or self.arrived
            return
        self.session._router._send_abort(self.session, self.qid, reason)  # noqa: SLF001 - its own router

    def dropped(self) -> None:
        # A finalizer may run on any thread: the abort goes through the driver's loop.
        try:
            self.loop.call_soon_threadsafe(self.leave, "user")
        except RuntimeError:  # the driver's loop has closed
            pass

    def no_result(self) -> BaseException:
        if self.error is not None:
            error, self.error = self.error, None
            return error
        return QueryloopError("the query ended without a result")


class RemoteQuery(StreamedQuery[Inbox]):
    """A query on a shard: `async for event in query`, `await query.wait()` (then `query.result`), `query.terminal`,
    `query.abort()`; `async with query:` aborts it when the block is left early (`aio_pipe.StreamedQuery`)."""
