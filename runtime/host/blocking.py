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

`BlockingRuntime(tune_gc=True)` opens its runtime with `Runtime.open(tune_gc=True)`: only
for a host that owns its process (see `Runtime.open`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Self, TypeVar

import trio

from queryloop.runtime.errors import BlockingCallOnTrioThread, QueryloopError
from queryloop.runtime.host.runtime import Runtime

if TYPE_CHECKING:
    from pathlib import Path
    from types import TracebackType

    from queryloop.runtime.host.session import QueryHandle, Session
    from queryloop.runtime.kernel.messages import AbortAck, AbortReason
    from queryloop.runtime.loop.events import Block, QueryEvent, ResultMessage, TranscriptMessage
    from queryloop.runtime.loop.options import QueryOptions
    from queryloop.runtime.loop.state import ContinueReason, Terminal
    from queryloop.runtime.loop.tools import Tool
    from queryloop.runtime.mcp.elicitation import ElicitationHandler, McpElicitation, McpElicitationAnswer
    from queryloop.runtime.mcp.servers import McpServer

T = TypeVar("T")


class BlockingRuntime:
    """Start with `with BlockingRuntime() as rt:` (or `.start()` / `.close()`)."""

    def __init__(self, *, tune_gc: bool = False) -> None:
        self._tune_gc = tune_gc
        self._runtime: Runtime | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self) -> Self:
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._main, name="queryloop-runtime", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def _main(self) -> None:
        async def serve() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with Runtime.open(tune_gc=self._tune_gc) as runtime:
                self._runtime = runtime
                self._ready.set()
                await self._stop.wait()

        try:
            trio.run(serve)
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits for start()
            self._error = error
        finally:
            self._ready.set()

    def call(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        """Run `await async_fn(*args)` on the runtime's thread and return its result here."""
        if trio.lowlevel.in_trio_run():
            msg = "the blocking facade cannot be used from a trio thread: use Runtime and await instead"
            raise BlockingCallOnTrioThread(msg)
        if self._token is None:
            msg = "the blocking runtime is not running: use it inside `with BlockingRuntime() as rt:`"
            raise QueryloopError(msg)
        return trio.from_thread.run(async_fn, *args, trio_token=self._token)

    def call_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the runtime's thread and return its result here."""
        if self._token is None:
            msg = "the blocking runtime is not running"
            raise QueryloopError(msg)
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def open_session(
        self,
        options: QueryOptions,
        *,
        transcript: Path | None = None,
        resume: Path | None = None,
        fork: bool = False,
    ) -> BlockingSession:
        """As `Runtime.open_session` (durable transcript, resume and fork included)."""
        assert self._runtime is not None
        runtime = self._runtime
        session: Session = self.call(
            lambda: runtime.open_session(options, transcript=transcript, resume=resume, fork=fork)
        )
        return BlockingSession(self, session)

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
        tools: list[Tool] = self.call(lambda: runtime.open_mcp(name, server, on_elicitation=handler))
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
        self.call(self._runtime.open_host_budget, max_budget_usd)

    def host_cost_usd(self) -> float:
        """As `Runtime.host_cost_usd`: what the sessions under the host budget have spent so far."""
        assert self._runtime is not None
        spent: float = self.call(self._runtime.host_cost_usd)
        return spent

    def close(self) -> None:
        """Close every session (their queries are aborted) and stop the runtime's thread."""
        thread, stop = self._thread, self._stop
        if thread is None or stop is None:
            return
        if self._token is not None and thread.is_alive():
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
    def __init__(self, runtime: BlockingRuntime, session: Session) -> None:
        self._runtime = runtime
        self.session = session

    @property
    def id(self) -> str:
        return self.session.id

    def query(self, prompt: str, **overrides: Any) -> BlockingQuery:
        handle: QueryHandle = self._runtime.call_sync(lambda: self.session.query(prompt, **overrides))
        return BlockingQuery(self._runtime, handle)

    def abort(self, reason: AbortReason = "user") -> list[AbortAck]:
        """Abort the running query; callable from any thread, at any moment."""
        acks: list[AbortAck] = self._runtime.call(self.session.abort, reason)
        return acks

    def transcript(self) -> list[TranscriptMessage]:
        messages: list[TranscriptMessage] = self._runtime.call(self.session.transcript)
        return messages

    def close(self) -> None:
        self._runtime.call(self.session.close)


class BlockingQuery:
    """Iterate for the events (blocking); then `terminal`, `result`, `transitions`."""

    def __init__(self, runtime: BlockingRuntime, handle: QueryHandle) -> None:
        self._runtime = runtime
        self._handle = handle

    def __iter__(self) -> Iterator[QueryEvent]:
        return self

    def __next__(self) -> QueryEvent:
        try:
            event: QueryEvent = self._runtime.call(self._handle.__anext__)
        except StopAsyncIteration:
            raise StopIteration from None
        return event

    def wait(self) -> ResultMessage:
        """Consume the remaining events; return the result."""
        for _ in self:
            pass
        assert self._handle.result is not None
        return self._handle.result

    def close(self) -> None:
        """Stop listening; a query still running is aborted."""
        self._runtime.call(self._handle.aclose)

    @property
    def terminal(self) -> Terminal | None:
        return self._handle.terminal

    @property
    def result(self) -> ResultMessage | None:
        return self._handle.result

    @property
    def transitions(self) -> list[ContinueReason]:
        return self._handle.transitions


def _threaded_elicitation(fn: Callable[[McpElicitation], McpElicitationAnswer]) -> ElicitationHandler:
    """A sync elicitation handler as the runtime's: each request answered on a worker thread, abandoned on abort."""

    async def on_thread(request: McpElicitation) -> McpElicitationAnswer:
        return await trio.to_thread.run_sync(fn, request, abandon_on_cancel=True)

    return on_thread
