"""`PriorityInbox`: a single-consumer, unbounded, two-lane trio channel.

pykka delivers mail with a synchronous `inbox.put(envelope)`, so the inbox is
unbounded. Supervisor messages (`runtime.messages.SupervisorMessage`) go to the
urgent lane and are received before any ordinary message already queued; within
a lane, order is FIFO.

trio's memory channels cannot wait on two channels at once, hence this small
channel of its own, on trio's low-level parking: the one consumer (the actor's
loop task) parks when both lanes are empty and the next `put` reschedules it.

Threads: `put` from the inbox's own trio thread touches the deques directly;
from any other thread it is handed to that thread through the `TrioToken`, so
the deques are only ever touched on the trio thread.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from pykka import ActorDeadError
from pykka.messages import _ActorStop
from trio.lowlevel import (
    Abort,
    RaiseCancelT,
    Task,
    TrioToken,
    cancel_shielded_checkpoint,
    checkpoint_if_cancelled,
    current_task,
    current_trio_token,
    reschedule,
    wait_task_rescheduled,
)

from runtime.messages import SupervisorMessage

if TYPE_CHECKING:
    from pykka._envelope import Envelope

    from runtime._future import TrioFuture


class PriorityInbox:
    """An actor's mailbox; satisfies pykka's `ActorInbox` protocol (`put`, `get`, `empty`)."""

    __slots__ = ("_closed", "_consumer", "_normal", "_thread", "_token", "_urgent")

    def __init__(self) -> None:
        # Built on the trio thread (actors are constructed there), which it then belongs to.
        self._token: TrioToken = current_trio_token()
        self._thread = threading.get_ident()
        self._urgent: deque[Envelope[Any]] | None = None  # made on the first supervisor message
        self._normal: deque[Envelope[Any]] = deque()
        self._consumer: Task | None = None
        self._closed: str | None = None

    def put(self, envelope: Envelope[Any], /) -> None:
        if threading.get_ident() == self._thread:
            self._put(envelope)
        else:
            self._token.run_sync_soon(self._put, envelope)

    def _put(self, envelope: Envelope[Any]) -> None:
        if self._closed is not None:
            _refuse(envelope, self._closed)
            return
        if isinstance(envelope.message, SupervisorMessage):
            if self._urgent is None:
                self._urgent = deque()
            self._urgent.append(envelope)
        else:
            self._normal.append(envelope)
        consumer = self._consumer
        if consumer is not None:
            self._consumer = None
            reschedule(consumer)

    async def receive(self) -> Envelope[Any]:
        """Wait for the next envelope, urgent lane first. A checkpoint either way."""
        if self._urgent or self._normal:
            # Mail is waiting: still a schedule point, so a busy actor cannot
            # starve the other tasks of the loop (trio's channels do the same).
            await checkpoint_if_cancelled()
            await cancel_shielded_checkpoint()
        else:
            self._consumer = current_task()

            def abort(_: RaiseCancelT) -> Abort:
                self._consumer = None
                return Abort.SUCCEEDED

            await wait_task_rescheduled(abort)
        return self.get()

    def get(self) -> Envelope[Any]:
        """Take the next envelope without waiting (pykka uses this to drain a dead actor)."""
        return self._urgent.popleft() if self._urgent else self._normal.popleft()

    def empty(self) -> bool:
        return not (self._urgent or self._normal)

    def close(self, why: str) -> None:
        """Refuse what is queued and all later mail: asks fail with `ActorDeadError(why)`."""
        self._closed = why
        while self._urgent or self._normal:
            _refuse(self.get(), why)

    def __len__(self) -> int:
        return len(self._urgent or ()) + len(self._normal)


def _refuse(envelope: Envelope[Any], why: str) -> None:
    """Answer mail that reached a dead actor as pykka does: a stop succeeds, an ask fails."""
    reply_to: TrioFuture[Any] | None = envelope.reply_to  # type: ignore[assignment]
    if reply_to is None or reply_to.done():
        return
    if isinstance(envelope.message, _ActorStop):
        reply_to.set(None)
    else:
        reply_to.fail(ActorDeadError(why))
