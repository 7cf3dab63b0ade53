"""`Bridge`: the trio run of an `AsyncioRuntime` and its two hops to and from the asyncio loop.

The trio run is a guest on the running asyncio loop (`trio.lowlevel.start_guest_run`: trio's
scheduler runs as callbacks of that loop, on its thread, and waits for I/O in a worker thread), or
(`mode="thread"`) a plain `trio.run` on a thread of its own. Either way the two sides meet only here:

* asyncio → trio: `to_trio(fn)` queues a plain function; the first one queued since the last drain
  asks the trio run for one `TrioToken.run_sync_soon(drain)`, which runs everything queued by then.
  Callable from any thread, from finalizers too; never raises into trio: a function that raises is
  logged there (trio would end its run with `TrioInternalError`).
* trio → asyncio: `to_host(fn, *args)` the same way, one `loop.call_soon` (guest: the same thread)
  or `loop.call_soon_threadsafe` (thread mode) per drain.

So a thousand queries whose events became ready in one trio tick cost one hop, not a thousand. On
top: `call`/`acall` (await a trio function or coroutine from asyncio), `run_on_host` (await an
asyncio coroutine from trio, cancelled when the trio side is), and the counters `bench loops
--host asyncio` reads; `host_tool`, an asyncio tool's trio-side stand-in. Imports `host.runtime`
and `loop`; `host.aio` is built on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import signal
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import outcome
import trio
from loguru import logger
from trio.lowlevel import Abort, RaiseCancelT, current_task, reschedule, wait_task_rescheduled

from queryloop.runtime.errors import QueryloopError, RuntimeClosed
from queryloop.runtime.host.runtime import SHUTDOWN_GRACE_S, Runtime
from queryloop.runtime.loop.tools import AsyncToolFunction, Tool, ToolContext, ToolOutput

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

T = TypeVar("T")
Mode = Literal["guest", "thread"]

log = logger.bind(actor="asyncio-bridge")


class Bridge:
    """One trio run (guest or thread) serving one asyncio loop. Made by `AsyncioRuntime.start`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, mode: Mode) -> None:
        if mode not in ("guest", "thread"):
            msg = f"mode must be 'guest' or 'thread', not {mode!r}"
            raise ValueError(msg)
        self.loop = loop
        self.mode = mode
        self.token: trio.lowlevel.TrioToken | None = None
        self.runtime: Runtime | None = None
        self.nursery: trio.Nursery | None = None
        self.closing = False
        """No new work is accepted (`aclose` has begun, or the run has ended)."""
        self.finished = False
        """The trio run has ended."""
        self.draining = False
        """The sessions are closed: pumps deliver what is left without waiting for their consumers."""
        self.pumps: set[Any] = set()
        """The live event pumps (trio side), each with an `unpark()`; the facade fills it."""
        self.pipes: set[Any] = set()
        """The queries whose streams have not ended (host side), each with a `runtime_finished()`."""
        self.host_tasks: set[asyncio.Task[Any]] = set()
        self._stop: trio.Event | None = None
        self._done: asyncio.Future[None] = loop.create_future()
        self._to_trio: deque[Callable[[], object]] = deque()
        self._to_trio_scheduled = False
        self._to_host: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        self._to_host_scheduled = False
        self.context = contextvars.copy_context()
        """The host's context (its caller's, as `start` found it): the calls made on the host's loop and the
        asyncio tools run in it, not in the trio task's that handed them over (whose sniffio says "trio")."""
        post = loop.call_soon if mode == "guest" else loop.call_soon_threadsafe
        self._post = functools.partial(post, context=self.context)
        self.hops_to_trio = 0
        self.calls_to_trio = 0
        self.hops_to_host = 0
        self.calls_to_host = 0

    # -- starting and stopping -----------------------------------------------------------

    async def start(self, **runtime_options: Any) -> None:
        loop = self.loop
        ready: asyncio.Future[None] = loop.create_future()
        if self.mode == "guest":
            if trio.lowlevel.in_trio_run():
                msg = "this thread already runs trio (a trio guest?): use AsyncioRuntime.open(mode='thread')"
                raise QueryloopError(msg)
            main = threading.current_thread() is threading.main_thread()
            before = signal.getsignal(signal.SIGINT) if main else None
            trio.lowlevel.start_guest_run(
                self._serve,
                ready,
                runtime_options,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon,
                done_callback=self._run_ended,
                host_uses_signal_set_wakeup_fd=True,  # the host's wakeup fd is its own
            )
            if before is signal.default_int_handler and signal.getsignal(signal.SIGINT) is not before:
                # trio installs its Ctrl+C handler where the default one is in place: a library changes
                # nothing process-wide, so the host's is put back (Ctrl+C stays the host's business).
                signal.signal(signal.SIGINT, before)
        else:

            def thread_main() -> None:
                result = outcome.capture(trio.run, self._serve, ready, runtime_options)
                try:
                    loop.call_soon_threadsafe(self._run_ended, result)
                except RuntimeError:  # the host's loop has closed: nobody waits for us
                    pass

            threading.Thread(target=thread_main, name="queryloop-aio-runtime", daemon=True).start()
        await asyncio.wait([ready, self._done], return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            self._done.result()  # raises what ended the run
            raise RuntimeClosed("the runtime's trio run ended before it was ready")

    async def _serve(self, ready: asyncio.Future[None], runtime_options: dict[str, Any]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            async with Runtime.open(**runtime_options) as runtime:
                self.runtime = runtime
                self.to_host(_resolve, ready, None)
                await self._stop.wait()
            # Every session is closed and its query ended: the pumps deliver what their streams hold.
            self.draining = True
            for pump in list(self.pumps):
                pump.unpark()
            nursery.cancel_scope.deadline = trio.current_time() + SHUTDOWN_GRACE_S

    def _run_ended(self, result: outcome.Outcome[None]) -> None:
        """On the host's loop, once the trio run has ended (however it ended)."""
        self.finished = self.closing = True
        self._to_trio.clear()
        for pipe in list(self.pipes):
            try:
                pipe.runtime_finished()
            except Exception:
                log.exception("ending a query's stream at the end of the trio run failed")
        if isinstance(result, outcome.Error):
            log.opt(exception=result.error).error("the runtime's trio run ended with an error")
            _fail(self._done, RuntimeClosed(f"the runtime's trio run ended with {result.error!r}"))
        else:
            _resolve(self._done, None)

    async def aclose(self) -> None:
        """Close every session (their queries are aborted and end properly), then end the trio run."""
        if not self.closing:
            self.closing = True
            stop = self._stop
            if stop is not None:
                self.send(stop.set)
        await asyncio.shield(self._done)

    # -- the two hops ------------------------------------------------------------------------

    def to_trio(self, fn: Callable[[], object]) -> None:
        """Queue `fn()` to run on the trio side, soon; `RuntimeClosed` if no new work is accepted."""
        if self.closing:
            raise RuntimeClosed("the asyncio runtime is closed")
        self.send(fn)

    def send(self, fn: Callable[[], object]) -> None:
        """`to_trio` for what the facade itself must still carry while the runtime closes (until its
        run has ended): an abort, a consumer's wake-up call to its pump."""
        token = self.token
        if token is None or self.finished:
            raise RuntimeClosed("the runtime's trio run has ended")
        self._to_trio.append(fn)
        if not self._to_trio_scheduled:
            self._to_trio_scheduled = True
            try:
                token.run_sync_soon(self._drain_to_trio)
            except trio.RunFinishedError:
                raise RuntimeClosed("the runtime's trio run has ended") from None

    def _drain_to_trio(self) -> None:
        self.hops_to_trio += 1
        self._to_trio_scheduled = False  # first: what is queued from now on asks for another drain
        queue = self._to_trio
        while queue:
            fn = queue.popleft()
            self.calls_to_trio += 1
            try:
                fn()
            except BaseException:  # raised into trio's scheduler it would end the run
                log.exception("a call handed to the trio run raised")

    def to_host(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue `fn(*args)` to run on the asyncio loop, soon (from the trio side)."""
        self._to_host.append((fn, args))
        if not self._to_host_scheduled:
            self._to_host_scheduled = True
            try:
                self._post(self._drain_to_host)
            except RuntimeError:  # the host's loop has closed
                self._to_host.clear()

    def _drain_to_host(self) -> None:
        self.hops_to_host += 1
        self._to_host_scheduled = False
        queue = self._to_host
        while queue:
            fn, args = queue.popleft()
            self.calls_to_host += 1
            try:
                fn(*args)
            except Exception:
                log.exception("a call handed to the asyncio loop raised")

    # -- calls across ------------------------------------------------------------------------

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the trio side and return (or raise) what it did, here."""
        future: asyncio.Future[T] = self.loop.create_future()

        def run() -> None:
            try:
                value = fn()
            except Exception as error:  # noqa: BLE001 - raised by the awaiting caller
                self.to_host(_fail, future, error)
            else:
                self.to_host(_resolve, future, value)

        self.to_trio(run)
        return await future

    async def acall(self, async_fn: Callable[[], Awaitable[T]], orphan: Callable[[T], object] | None = None) -> T:
        """Await `async_fn()` in a task of the trio run and return (or raise) its outcome here.

        The trio task runs to its end even if this caller is cancelled; `orphan(value)` then receives
        what nobody is waiting for any more (a session to close, say).
        """
        future: asyncio.Future[T] = self.loop.create_future()

        def settle(result: outcome.Outcome[T]) -> None:  # on the host's loop
            if future.cancelled():
                if orphan is not None and isinstance(result, outcome.Value):
                    try:
                        self.send(lambda: orphan(result.value))
                    except RuntimeClosed:
                        pass
            elif isinstance(result, outcome.Value):
                future.set_result(result.value)
            elif isinstance(result, outcome.Error):
                future.set_exception(result.error)

        async def task() -> None:
            try:
                value = await async_fn()
            except Exception as error:  # noqa: BLE001 - raised by the awaiting caller
                self.to_host(settle, outcome.Error(error))
            except BaseException:  # cancelled: the runtime is closing
                self.to_host(settle, outcome.Error(RuntimeClosed("the runtime closed during the call")))
                raise
            else:
                self.to_host(settle, outcome.Value(value))

        def start() -> None:
            if self.nursery is None:
                self.to_host(settle, outcome.Error(RuntimeClosed("the runtime's trio run has ended")))
            else:
                self.nursery.start_soon(task)

        self.to_trio(start)
        return await future

    async def run_on_host(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """From a trio task: run `make()` as a task of the asyncio loop and return its outcome.

        Cancelled on the trio side (an abort, a timeout), it answers at once and cancels the asyncio task.
        """
        trio_task = current_task()
        call = _HostCall()

        def start() -> None:  # on the host's loop
            if call.cancelled:
                return
            try:
                task = self.loop.create_task(make(), context=self.context.copy())
            except BaseException as error:  # noqa: BLE001 - handed back to the trio task
                finish(outcome.Error(error))
                return
            call.task = task
            self.host_tasks.add(task)
            task.add_done_callback(done)

        def done(task: asyncio.Task[T]) -> None:  # on the host's loop
            self.host_tasks.discard(task)
            if task.cancelled():
                finish(outcome.Error(RuntimeClosed("the tool's asyncio task was cancelled")))
            elif (error := task.exception()) is not None:
                finish(outcome.Error(error))
            else:
                finish(outcome.Value(task.result()))

        def finish(result: outcome.Outcome[T]) -> None:
            try:
                self.send(lambda: None if call.cancelled else reschedule(trio_task, result))
            except RuntimeClosed:
                pass

        def cancel() -> None:  # on the host's loop
            if call.task is not None:
                call.task.cancel()

        def abort(_: RaiseCancelT) -> Abort:
            call.cancelled = True
            self.to_host(cancel)
            return Abort.SUCCEEDED

        self.to_host(start)
        result: T = await wait_task_rescheduled(abort)
        return result

    def from_thread(
        self, async_fn: Callable[[], Awaitable[T]], first: Callable[[], object] | None = None
    ) -> concurrent.futures.Future[T]:
        """From any thread, not through the host's loop: `first()` runs in the trio run's next tick,
        then `async_fn()` as a task of the run, whose outcome the returned future gets (`RuntimeClosed`
        if the run ends first). `RuntimeClosed` at once if it has ended."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        async def task() -> None:
            try:
                future.set_result(await async_fn())
            except Exception as error:  # noqa: BLE001 - the caller's future raises it
                future.set_exception(error)
            except BaseException:
                future.set_exception(RuntimeClosed("the runtime's trio run ended during the call"))
                raise

        def start() -> None:
            if first is not None:
                first()
            if self.nursery is None or self.draining:
                future.set_exception(RuntimeClosed("the runtime's trio run is ending"))
            else:
                self.nursery.start_soon(task)

        self.send(start)
        return future

    def counters(self) -> dict[str, int]:
        return {
            "hops_to_trio": self.hops_to_trio,
            "calls_to_trio": self.calls_to_trio,
            "hops_to_host": self.hops_to_host,
            "calls_to_host": self.calls_to_host,
        }


def host_tool(bridge: Bridge, tool: Tool) -> Tool:
    """The trio-side stand-in of an async tool that runs on the host's asyncio loop."""
    fn = cast("AsyncToolFunction", tool.call)

    async def on_host(args: Any, context: ToolContext) -> ToolOutput:
        try:
            return await bridge.run_on_host(lambda: _as_coroutine(fn(args, AsyncioToolContext(context, bridge))))
        finally:
            context.abandon()  # its progress reaches no one once it has been answered

    return Tool(
        name=tool.name,
        call=on_host,
        description=tool.description,
        input_model=tool.input_model,
        concurrency_safe=tool.concurrency_safe,
        timeout_s=tool.timeout_s,
        runs_on="trio",
        backfill_observable_input=tool.backfill_observable_input,
    )


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def host_callback(bridge: Bridge, fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """The trio-side stand-in of an async callback of the host's (`can_use_tool`, a stop or PostToolUse
    hook, `memory_prefetch`): each call runs on the host's asyncio loop, as an asyncio tool does, and an
    abort cancels it there. It keeps the callback's `__qualname__`, which a `hook_error` event names."""

    async def on_host(*args: Any) -> T:
        return await bridge.run_on_host(lambda: _as_coroutine(fn(*args)))

    on_host.__qualname__ = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    on_host.__name__ = getattr(fn, "__name__", on_host.__qualname__)
    on_host.__wrapped__ = fn  # type: ignore[attr-defined]  # its signature is the callback's (`can_use_tool`'s form)
    return on_host


class HostAttachmentSource:
    """The trio-side stand-in of an attachment source of the host's: its `collect()` runs on the host's loop."""

    def __init__(self, bridge: Bridge, source: Any) -> None:
        self.source = source
        self._collect = host_callback(bridge, source.collect)

    async def collect(self) -> list[dict[str, Any]]:
        collected: list[dict[str, Any]] = await self._collect()
        return collected


class AsyncioToolContext(ToolContext):
    """What an asyncio tool gets as its `ctx`: its `tool_use_id` and `await ctx.progress(data)`."""

    __slots__ = ("_bridge", "_trio_context")

    def __init__(self, context: ToolContext, bridge: Bridge) -> None:
        self.tool_use_id = context.tool_use_id
        self._trio_context = context
        self._bridge = bridge
        self._abandoned = False
        self._sending = None
        self._token = None

    async def progress(self, data: Any) -> None:
        """Emit a `progress` event for this tool (waits while the consumer is behind, as on trio)."""
        send = functools.partial(self._trio_context._send_unless_abandoned, data)  # noqa: SLF001
        await self._bridge.acall(send)

    def progress_from_thread(self, data: Any) -> None:
        """From a thread the tool started: as `ToolContext.progress_from_thread`."""
        self._trio_context.progress_from_thread(data)


class _HostCall:
    __slots__ = ("cancelled", "task")

    def __init__(self) -> None:
        self.cancelled = False
        self.task: asyncio.Task[Any] | None = None


def _resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
