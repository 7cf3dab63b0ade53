"""The blocking facade: a `Runtime` on its own trio thread, for threads and sync code.

    with BlockingRuntime() as rt:
        session = rt.open_session(QueryOptions(provider=..., tools=[...]))
        query = session.query("Fix the bug")
        for event in query:                 # blocks this thread between events
            print(event.label)
        print(query.terminal.reason)
        # from any other thread, at any moment: session.abort("user")

Every call is carried to the runtime's thread through its `TrioToken`, so it works from
any number of threads, and whether or not the calling thread runs an event loop of its
own (a notebook, an asyncio server): nothing here touches the caller's loop. Calling it
from the runtime's own trio thread would deadlock, and raises instead.

From asyncio, use `queryloop.aio.AsyncioRuntime` instead: each call here blocks the calling thread
until the runtime answers, so inside a coroutine it stalls that event loop for as long.

`BlockingRuntime(max_concurrent_model_calls=..., max_live_agents=..., tune_gc=...)` opens its runtime
with `Runtime.open(...)` of the same arguments and defaults (see `Runtime.open`); `tune_gc=True` only
for a host that owns its process.

Closing answers every consumer (`BlockingRuntime.close`): a query running then ends aborted
(`shutdown`) and its consumer gets the rest of its events and its `result`, whether it was blocked
in `wait()` then or iterates later; only a call that would start work after the close began (a
query, a session) is refused, with `RuntimeClosed`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Self, TypeVar

import trio

from queryloop.runtime.errors import BlockingCallOnTrioThread, QueryloopError, RuntimeClosed
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.loop.agents import DEFAULT_MAX_LIVE_AGENTS

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

    from queryloop.runtime.host.session import QueryHandle, Session
    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.context_usage import ContextUsageResponse
    from queryloop.runtime.loop.events import Block, QueryEvent, ResultMessage, SystemMessage, TranscriptMessage
    from queryloop.runtime.loop.options import QueryOptions
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.loop.state import ContinueReason, Terminal
    from queryloop.runtime.loop.tools import Tool
    from queryloop.runtime.mcp.elicitation import ElicitationHandler, McpElicitation, McpElicitationAnswer
    from queryloop.runtime.mcp.servers import McpServer

T = TypeVar("T")


class _Run:
    """One trio run of a `BlockingRuntime`, as its queries need it even once it has ended (`BlockingQuery`)."""

    __slots__ = ("ended", "served", "token")

    def __init__(self, token: trio.lowlevel.TrioToken) -> None:
        self.token = token
        self.ended = threading.Event()
        """Set once `trio.run` has returned: no task is left, every channel is the consumers' alone."""
        self.served = threading.Lock()
        """Held while a consumer takes from a channel after the run (two threads may iterate one query)."""


class BlockingRuntime:
    """Start with `with BlockingRuntime() as rt:` (or `.start()` / `.close()`).

    `close()` answers everyone. It first refuses what would start work (`query()`, `open_session()`,
    `open_mcp()`, `open_host_budget()` raise `RuntimeClosed` from then on), then ends the trio run,
    whose `Runtime.open` exit closes every session: each running query is aborted (`shutdown`) and ends
    properly, its remaining events and its `result` buffered in its channel. A consumer blocked in a
    hop for its next event is answered from that channel while the run lives; one whose hop meets the
    run ending (refused, or cancelled before it took anything), and any that iterates after, is served
    the same channel in its own thread once `trio.run` has returned (`_Run.ended`): with no task left,
    the channel's items are plain objects, taken one at a time under a lock through
    `QueryHandle.next_buffered`, the logic `__anext__` applies. Waiting for the end of the run, not for
    consumers, keeps `close()` bounded (by `SHUTDOWN_GRACE_S`) however slowly its consumers drain.
    """

    def __init__(
        self,
        *,
        max_concurrent_model_calls: int | None = None,
        tune_gc: bool = False,
        max_live_agents: int | None = DEFAULT_MAX_LIVE_AGENTS,
    ) -> None:
        """The arguments are `Runtime.open`'s, passed to it on each start."""
        self._max_concurrent_model_calls = max_concurrent_model_calls
        self._tune_gc = tune_gc
        self._max_live_agents = max_live_agents
        self._runtime: Runtime | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._run: _Run | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closing = False
        """`close()` has begun: nothing more is started (read on the trio thread too, see `_refuse_when_closing`)."""

    def start(self) -> Self:
        if self._thread is not None:
            return self
        # A runtime started again after a close gets a new run: its state is made afresh.
        self._ready, self._error, self._closing, self._run = threading.Event(), None, False, None
        self._thread = threading.Thread(target=self._main, name="queryloop-runtime", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        async def serve() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._run = _Run(self._token)
            self._stop = trio.Event()
            async with Runtime.open(
                max_concurrent_model_calls=self._max_concurrent_model_calls,
                tune_gc=self._tune_gc,
                max_live_agents=self._max_live_agents,
            ) as runtime:
                self._runtime = runtime
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(serve)
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits for start()
            self._error = error
        finally:
            if self._run is not None:
                self._run.ended.set()  # the consumers still reading take the rest from the channels themselves
            self._ready.set()

    def _usable_token(self) -> trio.lowlevel.TrioToken:
        if trio.lowlevel.in_trio_run():
            msg = "the blocking facade cannot be used from a trio thread: use Runtime and await instead"
            raise BlockingCallOnTrioThread(msg)
        token = self._token
        if token is None:
            if self._closing:
                msg = "the blocking runtime is not running: it was closed"
                raise RuntimeClosed(msg)
            msg = "the blocking runtime is not running: use it inside `with BlockingRuntime() as rt:`"
            raise QueryloopError(msg)
        return token

    def call(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        """Run `await async_fn(*args)` on the runtime's thread and return its result here.

        `RuntimeClosed` if the run has ended, or ends before the call could finish (trio's own
        `RunFinishedError`, or the `Cancelled` of the run's last moments, is never raised here).
        """
        token = self._usable_token()
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=token)
        except (trio.RunFinishedError, trio.Cancelled):
            msg = "the blocking runtime closed before the call could finish"
            raise RuntimeClosed(msg) from None

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the runtime's thread and return its result here (`RuntimeClosed` as `call`)."""
        token = self._usable_token()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            msg = "the blocking runtime closed before the call could run"
            raise RuntimeClosed(msg) from None

    def _refuse_when_closing(self) -> None:
        """`RuntimeClosed` once `close()` has begun: called first by the calls that start work, in the calling
        thread and again on the trio thread. `close()` sets the flag before it hands the stop to the trio thread,
        so a start that runs there after the stop sees it; one that ran before is closed (and answered) with the
        rest: nothing is started that the close would miss."""
        if self._closing:
            msg = "the blocking runtime has been closed: it is not running anything new"
            raise RuntimeClosed(msg)

    def _query(self, session: Session, prompt: str | list[Block], overrides: dict[str, Any]) -> BlockingQuery:
        self._refuse_when_closing()
        run = self._run
        assert run is not None

        def submit() -> QueryHandle:
            self._refuse_when_closing()
            return session.query(prompt, **overrides)

        handle: QueryHandle = self.call_sync(submit)
        return BlockingQuery(self, handle, run)

    def open_session(
        self,
        options: QueryOptions,
        *,
        transcript: Path | None = None,
        resume: Path | None = None,
        fork: bool = False,
        resume_session_at: str | None = None,
    ) -> BlockingSession:
        """As `Runtime.open_session` (durable transcript, resume, fork and `resume_session_at` included)."""
        assert self._runtime is not None
        runtime = self._runtime
        session = self._start_work(
            lambda: runtime.open_session(
                options, transcript=transcript, resume=resume, fork=fork, resume_session_at=resume_session_at
            )
        )
        return BlockingSession(self, session)

    def _start_work(self, async_fn: Callable[[], Awaitable[T]]) -> T:
        """`call` for what starts work: refused once `close()` has begun (`_refuse_when_closing`)."""
        self._refuse_when_closing()

        async def unless_closing() -> T:
            self._refuse_when_closing()
            return await async_fn()

        result: T = self.call(unless_closing)
        return result

    def open_mcp(
        self,
        name: str,
        server: McpServer,
        *,
        on_elicitation: Callable[[McpElicitation], McpElicitationAnswer] | None = None,
    ) -> list[Tool]:
        """As `Runtime.open_mcp`: the server's one client lives on the runtime's thread, for every session.

        `on_elicitation`, a plain function, answers the server's requests for the user's input; it runs on a
        worker thread, so it may block (on a prompt, a queue). An abort of the call that asked stops waiting
        for it at once: its answer, when it comes, is dropped.
        """
        assert self._runtime is not None
        runtime = self._runtime
        handler = None if on_elicitation is None else _threaded_elicitation(on_elicitation)
        tools: list[Tool] = self._start_work(lambda: runtime.open_mcp(name, server, on_elicitation=handler))
        return tools

    def mcp_tools(self, name: str) -> list[Tool]:
        """As `Runtime.mcp_tools`: the server's tools as last listed."""
        assert self._runtime is not None
        return self.call_sync(self._runtime.mcp_tools, name)

    def mcp_tools_after(self, name: str, seen: list[Tool], *, timeout_s: float | None = None) -> list[Tool]:
        """As `Runtime.mcp_tools_after`: the server's tools once listed again after `seen`; `TimeoutError`
        if that takes longer than `timeout_s` (None: wait as long as it takes)."""
        assert self._runtime is not None
        runtime = self._runtime

        async def listed() -> list[Tool]:
            with trio.fail_after(math.inf if timeout_s is None else timeout_s):
                return await runtime.mcp_tools_after(name, seen)

        try:
            tools: list[Tool] = self.call(listed)
        except trio.TooSlowError:
            msg = f"the MCP server {name!r} did not list its tools again within {timeout_s} s"
            raise TimeoutError(msg) from None
        return tools

    def mcp_prompts(self, name: str) -> list[dict[str, Any]]:
        """As `Runtime.mcp_prompts`."""
        assert self._runtime is not None
        prompts: list[dict[str, Any]] = self.call(self._runtime.mcp_prompts, name)
        return prompts

    def mcp_prompt(self, name: str, prompt: str, arguments: dict[str, str] | None = None) -> list[Block]:
        """As `Runtime.mcp_prompt`: the prompt filled in, as one user message's blocks for `session.query`."""
        assert self._runtime is not None
        blocks: list[Block] = self.call(self._runtime.mcp_prompt, name, prompt, arguments)
        return blocks

    def open_host_budget(self, max_budget_usd: float) -> None:
        """As `Runtime.open_host_budget`: every session opened from now on counts toward one cap."""
        assert self._runtime is not None
        runtime = self._runtime
        self._start_work(lambda: runtime.open_host_budget(max_budget_usd))

    def host_cost_usd(self) -> float:
        """As `Runtime.host_cost_usd`: what the sessions under the host budget have spent so far."""
        assert self._runtime is not None
        spent: float = self.call(self._runtime.host_cost_usd)
        return spent

    def close(self) -> None:
        """Close every session (their queries are aborted, and end with their `result`) and stop the runtime's
        thread; returns once the run has ended. Every consumer is answered (see the class docstring)."""
        thread, stop = self._thread, self._stop
        if thread is None or stop is None:
            return
        self._closing = True  # first: a start handed to the trio thread after the stop below is refused
        if self._token is not None and thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):  # the run ended on its own meanwhile
                self._token.run_sync_soon(stop.set)  # works from any thread, a trio one included
        thread.join()
        self._thread = None
        self._token = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class BlockingSession:
    """A `Session` seen from threads and sync code: each call runs on the runtime's trio thread and blocks."""

    def __init__(self, runtime: BlockingRuntime, session: Session) -> None:
        self._runtime = runtime
        self.session = session

    @property
    def id(self) -> str:
        return self.session.id

    def query(self, prompt: str | list[Block], *, interrupt: bool = False, **overrides: Any) -> BlockingQuery:
        """Submit one user message (as `Session.query`: it waits its turn, or `interrupt`s); `RuntimeClosed` once
        the runtime's close has begun."""
        if interrupt:
            overrides = {**overrides, "interrupt": True}  # `Session.query`'s own keyword
        return self._runtime._query(self.session, prompt, overrides)  # noqa: SLF001 - the facade's own parts

    def abort(self, reason: AbortReason = "user") -> int:
        """Abort the running query; callable from any thread, at any moment. How many actors acknowledged it."""
        acked: int = self._runtime.call(self.session.abort, reason)
        return acked

    def transcript(self) -> list[TranscriptMessage]:
        messages: list[TranscriptMessage] = self._runtime.call(self.session.transcript)
        return messages

    def sidechains(self) -> dict[str, Sidechain]:
        """As `Session.sidechains`: the subagents' conversations, by agent id."""
        found: dict[str, Sidechain] = self._runtime.call(self.session.sidechains)
        return found

    def compact(self, instructions: str | None = None) -> SystemMessage:
        """As `Session.compact`: Claude Code's `/compact [instructions]`, between queries; the compact boundary."""
        boundary: SystemMessage = self._runtime.call(self.session.compact, instructions)
        return boundary

    def context_usage(self) -> ContextUsageResponse:
        """As `Session.context_usage`: the next query's context, keyed as the Agent SDK's `ContextUsageResponse`."""
        usage: ContextUsageResponse = self._runtime.call(self.session.context_usage)
        return usage

    def set_model(self, model: str | None = None) -> None:
        """As `Session.set_model`: the model of the session's next queries (None: the options' own again)."""
        self._runtime.call(self.session.set_model, model)

    def close(self) -> None:
        self._runtime.call(self.session.close)


class BlockingQuery:
    """Iterate for the events (blocking); then `terminal`, `result`, `transitions`; `with query:` closes it.

    Iterating it after the runtime has closed still gives the rest of its events and its `result`
    (`BlockingRuntime`'s docstring says how).
    """

    def __init__(self, runtime: BlockingRuntime, handle: QueryHandle, run: _Run) -> None:
        self._runtime = runtime
        self._handle = handle
        self._run = run
        """The run that started the query: its channel is served from here once that run has ended."""

    def __iter__(self) -> Iterator[QueryEvent]:
        return self

    def __next__(self) -> QueryEvent:
        if trio.lowlevel.in_trio_run():
            msg = "the blocking facade cannot be used from a trio thread: use Runtime and await instead"
            raise BlockingCallOnTrioThread(msg)
        run, handle = self._run, self._handle
        if not run.ended.is_set():
            try:
                event: QueryEvent = trio.from_thread.run(handle.__anext__, trio_token=run.token)
            except StopAsyncIteration:
                raise StopIteration from None
            except (trio.RunFinishedError, trio.Cancelled):
                # The run is ending: the hop was refused, or cut while it waited on an empty channel, before
                # `__anext__` took anything (it takes only after its one await). The rest is in the channel.
                run.ended.wait()
            else:
                return event
        with run.served:
            buffered = handle.next_buffered()
        if buffered is None:
            raise StopIteration
        return buffered

    def wait(self) -> ResultMessage:
        """Consume the remaining events; return the result."""
        for _ in self:
            pass
        result = self._handle.result
        if result is None:
            # Only a query the run's end cut short (it did not settle within the runtime's shutdown grace).
            msg = "the blocking runtime closed before the query ended: it has no result"
            raise RuntimeClosed(msg)
        return result

    def abort(self, reason: AbortReason = "user") -> None:
        """Abort the query if it still runs; from any thread, returning at once (its events go on to its result)."""
        if self._run.ended.is_set():
            return
        with contextlib.suppress(trio.RunFinishedError):  # the run has ended, and the query with it
            self._run.token.run_sync_soon(self._handle.abort, reason)

    def close(self) -> None:
        """Stop listening; a query still running is aborted. Once the runtime has closed, nothing runs: a no-op."""
        if self._run.ended.is_set():
            return
        with contextlib.suppress(RuntimeClosed):  # the run ended meanwhile, and the query with it
            self._runtime.call(self._handle.aclose)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def terminal(self) -> Terminal | None:
        return self._handle.terminal

    @property
    def result(self) -> ResultMessage | None:
        return self._handle.result

    @property
    def transitions(self) -> list[ContinueReason]:
        return self._handle.transitions

    @property
    def done(self) -> bool:
        return self._handle.done


def _threaded_elicitation(fn: Callable[[McpElicitation], McpElicitationAnswer]) -> ElicitationHandler:
    """A sync elicitation handler as the runtime's: each request answered on a worker thread, abandoned on abort."""

    async def on_thread(request: McpElicitation) -> McpElicitationAnswer:
        return await trio.to_thread.run_sync(fn, request, abandon_on_cancel=True)

    return on_thread
