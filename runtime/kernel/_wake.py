"""`WOKEN`: the outcome to wake a parked task with, `trio.lowlevel.reschedule(task, WOKEN)`.

trio's `reschedule(task)` builds an `outcome.Value(None)` for every wake, and the woken task's
`unwrap()` marks it used: an allocation and two calls per wake. The kernel wakes a parked task for
every streamed event (the query's consumer) and every answered ask, and such a wake carries
nothing, so one immutable outcome serves them all. Imports nothing of queryloop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outcome import Outcome

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Generator


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
