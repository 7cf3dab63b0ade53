"""`TrioFuture`: a pykka future that trio tasks await and foreign threads block on.

Invariants:

* A future is resolved once (`set` or `set_exception`); a second resolution raises
  `queue.Full`, as pykka's own futures do.
* Trio waiters park with `wait_task_rescheduled` and are woken on their own trio
  thread: directly when the future is resolved there (the usual case: the actor
  answering runs on the same loop), through that loop's `TrioToken` otherwise.
* A thread waiter costs nothing until a thread actually blocks: the
  `threading.Event` is created lazily. `set` publishes the result before it reads
  the event and `get` publishes the event before it re-reads the result, so one
  of the two always sees the other.
* `get()` never blocks a thread that runs trio: it raises
  `BlockingCallOnTrioThread` whether or not the value is there yet, so the
  mistake shows on the first run rather than under load.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import pykka
from trio.lowlevel import (
    Abort,
    RaiseCancelT,
    Task,
    TrioToken,
    checkpoint_if_cancelled,
    current_task,
    current_trio_token,
    in_trio_run,
    reschedule,
    wait_task_rescheduled,
)

from queryloop.runtime.errors import BlockingCallOnTrioThread

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Iterable

T = TypeVar("T")
M = TypeVar("M")
J = TypeVar("J")
R = TypeVar("R")

OptExcInfo: TypeAlias = tuple[type[BaseException] | None, BaseException | None, TracebackType | None]
"""What `sys.exc_info()` returns: what pykka's `Future.set_exception` takes."""

_EVENT_LOCK = threading.Lock()
_PENDING: Any = object()


class TrioFuture(pykka.Future[T]):
    """A handle to a value that an actor will produce.

    `await future` in a trio task; `future.get(timeout=...)` in any thread that
    does not run trio. `map`, `filter`, `join` and `reduce` derive new futures
    eagerly, so derived futures are awaitable too.
    """

    _hooked = False
    """Whether `set_get_hook` was called (a class default: set on the rare future that has a hook)."""

    def __init__(self) -> None:
        super().__init__()
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._trio_waiters: list[Task] | None = None
        self._trio_thread: int = 0
        self._trio_token: TrioToken | None = None
        self._thread_event: threading.Event | None = None
        self._callbacks: list[Callable[[TrioFuture[T]], None]] | None = None

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("error" if self._error else "value")
        return f"<TrioFuture {state}>"

    # -- resolution (normally on the trio thread, by the answering actor) ---------

    def done(self) -> bool:
        """True once a value or an exception has been set."""
        return self._value is not _PENDING or self._error is not None

    def set(self, value: T | None = None) -> None:
        if self.done() or self._hooked:
            raise queue.Full
        self._value = value
        self._wake()

    def set_exception(self, exc_info: OptExcInfo | None = None) -> None:
        if exc_info is None:
            exc_info = sys.exc_info()
        error = exc_info[1]
        if error is None:
            assert exc_info[0] is not None, "set_exception() needs an exception"
            error = exc_info[0]()
        self.fail(error)

    def fail(self, error: BaseException) -> None:
        """Resolve the future with `error` (the exception-object form of `set_exception`)."""
        if self.done() or self._hooked:
            raise queue.Full
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._trio_waiters:
            if threading.get_ident() == self._trio_thread:
                self._wake_trio_waiters()
            else:
                assert self._trio_token is not None
                self._trio_token.run_sync_soon(self._wake_trio_waiters)
        event = self._thread_event
        if event is not None:
            event.set()
        callbacks = self._callbacks
        if callbacks:
            self._callbacks = None
            for callback in callbacks:
                callback(self)

    def _wake_trio_waiters(self) -> None:
        # Runs on the waiters' trio thread, so it cannot race with their abort_fn.
        waiters, self._trio_waiters = self._trio_waiters, None
        for task in waiters or ():
            reschedule(task)

    def get_nowait(self) -> T:
        """The value of a resolved future (or its exception raised); `LookupError` if pending."""
        if not self.done():
            msg = "the future is not resolved yet"
            raise LookupError(msg)
        return self._unwrap()

    def _unwrap(self) -> T:
        if self._error is not None:
            raise self._error
        return cast("T", self._value)

    # -- waiting ---------------------------------------------------------------

    def set_get_hook(self, func: Callable[[float | None], T]) -> None:
        """pykka's: `get()` returns `func(timeout)` (from a thread; such a future is never resolved or awaited)."""
        self._hooked = True
        super().set_get_hook(func)

    def get(self, *, timeout: float | None = None) -> T:
        if self._hooked:
            return super().get(timeout=timeout)
        if in_trio_run():
            msg = (
                "Future.get() would block the trio thread and deadlock the runtime; "
                "use `await future` (and `ask(..., block=False)`) inside trio"
            )
            raise BlockingCallOnTrioThread(msg)
        if not self.done():
            event = self._thread_event
            if event is None:
                with _EVENT_LOCK:
                    event = self._thread_event
                    if event is None:
                        event = self._thread_event = threading.Event()
            if not self.done() and not event.wait(timeout):
                msg = f"{timeout} seconds"
                raise pykka.Timeout(msg)
        return self._unwrap()

    def __await__(self) -> Generator[Any, None, T]:
        if self._hooked:
            msg = "a future built with set_get_hook() can only be read with get() from a thread"
            raise TypeError(msg)
        if self.done():
            yield from checkpoint_if_cancelled().__await__()  # noqa: ASYNC105 - it is awaited
            return self._unwrap()
        task = current_task()
        thread = threading.get_ident()
        if self._trio_waiters is None:
            self._trio_waiters = [task]
        else:
            if thread != self._trio_thread:
                msg = "a TrioFuture can be awaited from one trio loop only"
                raise RuntimeError(msg)
            self._trio_waiters.append(task)
        self._trio_thread = thread
        self._trio_token = current_trio_token()

        def abort(_: RaiseCancelT) -> Abort:
            waiters = self._trio_waiters
            if waiters is not None:
                waiters.remove(task)
            return Abort.SUCCEEDED

        yield from wait_task_rescheduled(abort).__await__()  # noqa: ASYNC105 - it is awaited
        return self._unwrap()

    __iter__ = __await__

    # -- derivation: eager, so the derived future is awaitable as well --------------

    def add_done_callback(self, callback: Callable[[TrioFuture[T]], None]) -> None:
        """Call `callback(self)` once resolved (at once if it already is), on the resolving thread."""
        if self.done():
            callback(self)
        elif self._callbacks is None:
            self._callbacks = [callback]
        else:
            self._callbacks.append(callback)

    def _derive(self, func: Callable[[T], M]) -> TrioFuture[M]:
        derived: TrioFuture[M] = TrioFuture()

        def forward(source: TrioFuture[T]) -> None:
            if source._error is not None:
                derived.fail(source._error)
                return
            try:
                result = func(cast("T", source._value))
            except Exception as error:  # noqa: BLE001 - handed to whoever reads the future
                derived.fail(error)
            else:
                derived.set(result)

        self.add_done_callback(forward)
        return derived

    def map(self, func: Callable[[T], M]) -> TrioFuture[M]:
        return self._derive(func)

    def filter(self: TrioFuture[Iterable[J]], func: Callable[[J], bool]) -> TrioFuture[Iterable[J]]:
        return self._derive(lambda items: list(filter(func, items)))

    def reduce(self: TrioFuture[Iterable[J]], func: Callable[[R, J], R], *args: R) -> TrioFuture[R]:
        return self._derive(lambda items: functools.reduce(func, items, *args))

    def join(self: TrioFuture[Any], *futures: pykka.Future[Any]) -> TrioFuture[Iterable[Any]]:
        sources = [self, *futures]
        if not all(isinstance(f, TrioFuture) for f in sources):
            msg = "TrioFuture.join() takes TrioFutures only"
            raise TypeError(msg)
        joined: TrioFuture[Iterable[Any]] = TrioFuture()
        remaining = [len(sources)]

        def arrived(source: TrioFuture[Any]) -> None:
            if joined.done():
                return
            if source._error is not None:
                joined.fail(source._error)
                return
            remaining[0] -= 1
            if remaining[0] == 0:
                joined.set([cast("TrioFuture[Any]", f).get_nowait() for f in sources])

        for future in sources:
            cast("TrioFuture[Any]", future).add_done_callback(arrived)
        return joined
