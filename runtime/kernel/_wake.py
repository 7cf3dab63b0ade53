"""`park()` and `WOKEN`: a task parks with `await park()` and is woken with `reschedule(task, WOKEN)`.

Both do what `trio.lowlevel.wait_task_rescheduled` and `trio.lowlevel.reschedule(task)` do, at less
cost per wait; the kernel parks and wakes a task for every streamed event (the query's consumer)
and every answered ask.

* trio's `reschedule(task)` builds an `outcome.Value(None)` for every wake, and the woken task's
  `unwrap()` marks it used: an allocation and two calls. A wake here carries nothing, so one
  immutable outcome, `WOKEN`, serves them all.
* `wait_task_rescheduled(abort_fn)` is a coroutine that builds trio's trap object (an attrs
  instance holding `abort_fn`) and yields it through one more generator. `park()` yields one trap
  made once, whose abort function always succeeds: a frame and an allocation less per wait. The
  trap's class is trio's own, not exported (`trio._core._traps.WaitTaskRescheduled`, what trio's run
  loop tests a yielded value against); without it (a trio that moved it), `park()` is
  `wait_task_rescheduled` itself, with the same abort function.

A parked task is woken by whoever holds it, once: trio's contract. Since `park()`'s abort cannot say
which waiter it cancelled, a waker tells whether the task it holds is still parked *there* by trio's
public `Task.custom_sleep_data`, which trio resets to None whenever it reschedules a task (a wake,
or a cancellation; `wait_task_rescheduled`'s documentation promises it, and trio's own memory channels
rely on it): the waiter sets it to its own object before `park()`, and the waker wakes only a task
whose `custom_sleep_data` is still that object (`EventChannel`'s receiver).

Imports nothing of queryloop.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, cast

from outcome import Outcome
from trio.lowlevel import Abort, wait_task_rescheduled

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Awaitable, Callable, Generator

    from trio.lowlevel import RaiseCancelT


class _Woken(Outcome[None]):
    """The outcome of a plain wake: `None`, and nothing to use up, so it may be sent any number of times."""

    __slots__ = ()

    def unwrap(self) -> None:
        return None

    def send(self, gen: Generator[Any, None, object]) -> Any:
        return gen.send(None)

    async def asend(self, agen: AsyncGenerator[Any, None]) -> Any:
        return await agen.asend(None)


WOKEN = _Woken()


def _abort_succeeds(_: RaiseCancelT) -> Abort:
    """A parked task's abort: always possible (its waker checks `custom_sleep_data` before it wakes it)."""
    return Abort.SUCCEEDED


def _trap() -> object | None:
    try:
        from trio._core._traps import WaitTaskRescheduled  # trio's own trap, not exported
    except ImportError:  # pragma: no cover - a trio that moved it: `park` is the public call
        return None
    return WaitTaskRescheduled(_abort_succeeds)


_PARKED = _trap()


def woken(outcome: Outcome[Any]) -> None:
    """What a task parked on trio's trap was sent: a plain wake, or the cancellation (or KeyboardInterrupt)
    trio delivered instead, raised here."""
    if outcome is not WOKEN:
        outcome.unwrap()


@types.coroutine
def _park_with_trap() -> Generator[object, Outcome[Any], None]:
    woken((yield _PARKED))


async def _park_public() -> None:
    await wait_task_rescheduled(_abort_succeeds)


park: Callable[[], Awaitable[None]] = (
    _park_public if _PARKED is None else cast("Callable[[], Awaitable[None]]", _park_with_trap)
)
"""Park the current task until it is rescheduled; a cancellation is raised (see the module's docstring).

A generator-based coroutine that parks while it is awaited (`EventChannel.wait`) may yield `_PARKED` itself
when `park` is `_park_with_trap`, and pass what it is sent to `woken`: no generator of `park`'s per wait."""
