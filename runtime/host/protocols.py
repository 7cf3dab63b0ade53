"""One vocabulary for every host: `QueryView`, `SessionView` and their synchronous `SyncQueryView`, `SyncSessionView`.

Each host shows a session and its queries its own way: trio (`Session`, `QueryHandle`), asyncio
(`AsyncioSession`, `AsyncioQuery`), Ray (`RemoteSession`, `RemoteQuery`), awaited; threads
(`BlockingSession`, `BlockingQuery`), blocking. The same word means the same thing in all of them:

* a query: iterate it for its events; `wait()` consumes the rest and returns the `ResultMessage`;
  `result`, `terminal`, `transitions` are None (the empty list) until its end was read, `done` says
  whether it was; `abort(reason)` asks for its abort and returns at once (from any task or thread), its
  events then going on to its result; closing it (`aclose()`, or leaving `async with`) aborts it if it
  still runs;
* a session: `id`; `query(prompt, **overrides)`; `abort(reason)` aborts whatever runs in it and returns
  how many of its actors acknowledged the abort (0 when nothing could be reached: the session closed,
  its Ray shard gone, its runtime closing), a count each host can give, Ray's across processes too;
  `transcript()`, `sidechains()` and `close()`; the Agent SDK's session controls: `compact(instructions)`
  (Claude Code's `/compact`, between queries), `context_usage()` (its `/context`, no model call) and
  `set_model(model)` (from the next query on).

Members beyond these are a host's own (tests/hosts/test_host_parity.py lists them, with why). Imports `loop`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator
    from types import TracebackType

    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.context_usage import ContextUsageResponse
    from queryloop.runtime.loop.events import Block, QueryEvent, ResultMessage, SystemMessage, TranscriptMessage
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.loop.state import ContinueReason, Terminal


@runtime_checkable
class QueryView(Protocol):
    """A query seen from an async host (trio, asyncio, Ray): `async for event in query`, `await query.wait()`."""

    @property
    def result(self) -> ResultMessage | None:
        """The query's `ResultMessage` once the consumer has taken it (or the query ended after it left)."""

    @property
    def terminal(self) -> Terminal | None:
        """How the query ended (`reason`, `error`); None until its end was read."""

    @property
    def transitions(self) -> list[ContinueReason]:
        """The query's continue reasons, in order, once its end was read (empty until then)."""

    @property
    def done(self) -> bool:
        """The `result` is known (`result is not None`)."""

    def __aiter__(self) -> AsyncIterator[QueryEvent]: ...

    async def __anext__(self) -> QueryEvent: ...

    async def wait(self) -> ResultMessage:
        """Consume the remaining events and return the `ResultMessage`."""

    def abort(self, reason: AbortReason = "user") -> None:
        """Abort the query if it still runs; returns at once (its events go on to its result)."""

    async def aclose(self) -> None:
        """Stop listening: a query still running is aborted (reason `user`)."""

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@runtime_checkable
class SessionView(Protocol):
    """A session seen from an async host (trio, asyncio, Ray)."""

    @property
    def id(self) -> str: ...

    def query(self, prompt: str | list[Block], *, interrupt: bool = False, **overrides: Any) -> QueryView:
        """Submit one user message; `overrides` change options for this query only. Sent while a query runs, it
        waits its turn (taken in at that query's next turn boundary, or run next); `interrupt` interrupts it."""

    async def abort(self, reason: AbortReason = "user") -> int:
        """Abort whatever runs in the session; how many of its actors acknowledged it (0: none was reached)."""

    async def transcript(self) -> list[TranscriptMessage]:
        """The conversation so far."""

    async def sidechains(self) -> dict[str, Sidechain]:
        """The subagents' conversations, by agent id."""

    async def compact(self, instructions: str | None = None) -> SystemMessage:
        """Compact the conversation now (Claude Code's `/compact [instructions]`, trigger `manual`), between
        queries (`QueryInProgress` while one runs or waits); the compact boundary. `CompactFailed` if it did not."""

    async def context_usage(self) -> ContextUsageResponse:
        """The context the next query would start with, keyed as the Agent SDK's `ContextUsageResponse`."""

    async def set_model(self, model: str | None = None) -> None:
        """The model of the session's next queries (None: the options' own again); a running query keeps its."""

    async def close(self) -> None:
        """Abort what runs, then close the session (its transcript stays)."""


@runtime_checkable
class SyncQueryView(Protocol):
    """`QueryView` for threads and sync code (`BlockingQuery`): `for event in query`, `query.wait()`."""

    @property
    def result(self) -> ResultMessage | None: ...

    @property
    def terminal(self) -> Terminal | None: ...

    @property
    def transitions(self) -> list[ContinueReason]: ...

    @property
    def done(self) -> bool: ...

    def __iter__(self) -> Iterator[QueryEvent]: ...

    def __next__(self) -> QueryEvent: ...

    def wait(self) -> ResultMessage: ...

    def abort(self, reason: AbortReason = "user") -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


@runtime_checkable
class SyncSessionView(Protocol):
    """`SessionView` for threads and sync code (`BlockingSession`): each call blocks until it is answered."""

    @property
    def id(self) -> str: ...

    def query(self, prompt: str | list[Block], *, interrupt: bool = False, **overrides: Any) -> SyncQueryView: ...

    def abort(self, reason: AbortReason = "user") -> int: ...

    def transcript(self) -> list[TranscriptMessage]: ...

    def sidechains(self) -> dict[str, Sidechain]: ...

    def compact(self, instructions: str | None = None) -> SystemMessage: ...

    def context_usage(self) -> ContextUsageResponse: ...

    def set_model(self, model: str | None = None) -> None: ...

    def close(self) -> None: ...
