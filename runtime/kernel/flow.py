"""`EventChannel`: the bounded, single-consumer channel of the event path.

A model call's messages and its tools' results flow to the QueryLoop through one of
these (the turn channel), and the query's events to its `QueryHandle` through another,
which the ModelCaller feeds a call's stream events directly: tens of items per model
call, thousands of sessions at once. A trio memory channel would do, at
several times the cost per item (measured: `bench loops`), and its `send`/`receive`
are schedule points even when the item could move at once. Here:

* `send_nowait` appends, or raises `trio.WouldBlock` when the buffer is full;
  `send` waits for room only then (cancellable, or shielded by the caller), and
  blocked senders' items enter the buffer in the order they were sent.
* `push` appends past the bound, never waiting (after the items of blocked senders,
  which it lets in first: what was sent earlier is received earlier): for items whose
  number is bounded by construction (a response's block messages, whose stream events
  wait; a turn's tool results; a query's ending), which must neither wait for the
  consumer nor be dropped.
* One consumer: it reads the buffer `items` and `take()`s from it, and calls
  `wait()` only on an empty buffer: a burst costs one wakeup and no call per item
  to wait.
* The hottest paths may write a send or a take out (one call less an item, a few tenths
  of a per cent of a loop each): a producer appends to `items` while `len(items) < limit`,
  then calls `wake_receiver()` if `receiver` is set, and otherwise calls `send_nowait` or
  `send` (which raise or wait); a consumer pops `items`, then calls `admit_waiting_sender()`
  if `waiting_senders` holds any.
* `wake_receiver()` wakes a consumer waiting in `wait()` with nothing new (the QueryLoop's
  wait on its turn, which an abort wakes instead of cancelling a scope).
* `close()` (the producer side's end) lets the consumer drain what is buffered, after
  which `wait()` answers False; `close_receiver()` (the consumer went away)
  makes every send raise `trio.BrokenResourceError`, waiting ones included.

Everything runs on the trio thread: no locks.
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Generator
from typing import Any, Generic, NoReturn, TypeVar

import trio
from outcome import Error  # what `reschedule` takes to raise in the woken task (trio's documented `next_send`)
from trio.lowlevel import Abort, RaiseCancelT, Task, current_task, reschedule, wait_task_rescheduled

T = TypeVar("T")


def _abort_succeeds(_: RaiseCancelT) -> Abort:
    """A parked consumer's abort: always possible (its waker checks `custom_sleep_data` before it wakes it)."""
    return Abort.SUCCEEDED


class EventChannel(Generic[T]):
    """A bounded FIFO from any number of producer tasks to one consumer task."""

    __slots__ = ("_closed", "_receiver_gone", "items", "limit", "max_buffer", "receiver", "waiting_senders")

    def __init__(self, max_buffer: int) -> None:
        if max_buffer < 1:
            msg = f"max_buffer must be at least 1, not {max_buffer}"
            raise ValueError(msg)
        self.items: deque[T] = deque()
        """The buffer, oldest first (the consumer may read and `take()` from it directly)."""
        self.max_buffer = max_buffer
        self.limit = max_buffer
        """`send_nowait` appends while `len(items) < limit`: `max_buffer` while both ends are open, 0 after."""
        self.receiver: Task | None = None
        """The consumer's task while it is parked in `wait()`, else None."""
        self.waiting_senders: deque[tuple[Task, T]] | None = None
        """Senders blocked on a full buffer with their items, oldest first (None until one has waited)."""
        self._closed = False
        self._receiver_gone = False

    # -- the producer side ----------------------------------------------------------

    def send_nowait(self, item: T) -> None:
        items = self.items
        if len(items) >= self.limit:
            self._refuse()
        items.append(item)
        if self.receiver is not None:
            self.wake_receiver()

    def _refuse(self) -> NoReturn:
        if self._receiver_gone:
            raise trio.BrokenResourceError
        if self._closed:
            raise trio.ClosedResourceError
        raise trio.WouldBlock

    def push(self, item: T) -> None:
        """Append `item` even past `max_buffer` (see the module's note: only for a bounded number of items)."""
        if self._receiver_gone:
            raise trio.BrokenResourceError
        if self._closed:
            raise trio.ClosedResourceError
        waiting = self.waiting_senders
        while waiting:
            task, queued = waiting.popleft()
            self.items.append(queued)
            reschedule(task)
        self.items.append(item)
        if self.receiver is not None:
            self.wake_receiver()

    async def send(self, item: T) -> None:
        """Send `item`, waiting for room only if the buffer is full."""
        try:
            self.send_nowait(item)
        except trio.WouldBlock:
            pass
        else:
            return
        task = current_task()
        waiting = self.waiting_senders
        if waiting is None:
            waiting = self.waiting_senders = deque()
        entry = (task, item)
        waiting.append(entry)

        def abort(_: RaiseCancelT) -> Abort:
            waiting.remove(entry)  # cancelled while waiting: the item is not sent
            return Abort.SUCCEEDED

        await wait_task_rescheduled(abort)  # raises BrokenResourceError if the consumer went away meanwhile

    @property
    def closed(self) -> bool:
        """The producer side has ended (`close`)."""
        return self._closed

    def close(self) -> None:
        """No more items: the consumer gets what is buffered, then `EndOfChannel`."""
        self._closed = True
        self.limit = 0
        if self.receiver is not None:
            self.wake_receiver()

    # -- the consumer side ----------------------------------------------------------

    def take(self) -> T:
        """The oldest buffered item (the buffer must not be empty); a waiting sender moves in."""
        item = self.items.popleft()
        if self.waiting_senders:
            self.admit_waiting_sender()
        return item

    def admit_waiting_sender(self) -> None:
        """The oldest blocked sender's item joins the buffer (the consumer has made room); that sender goes on."""
        waiting = self.waiting_senders
        assert waiting, "no sender is waiting"
        task, queued = waiting.popleft()
        self.items.append(queued)
        reschedule(task)

    @types.coroutine
    def wait(self) -> Generator[Any, Any, bool]:
        """Wait until an item is buffered (True) or the channel is closed and empty (False).

        Awaited as any coroutine (`await channel.wait()`): a generator that delegates to trio's
        `wait_task_rescheduled` itself, with no coroutine of its own in between."""
        if self.items:
            return True
        if self._closed:
            return False
        # A waker wakes this task only while its `custom_sleep_data` is this channel: trio resets it to
        # None whenever it reschedules the task (a wake, or a cancellation; `wait_task_rescheduled`'s
        # documentation promises it), so the abort, which cannot say which wait it cancelled, always
        # succeeds.
        receiver = self.receiver = current_task()
        receiver.custom_sleep_data = self
        try:
            # A generator-based coroutine may `yield from` a coroutine: no `__await__()` wrapper held while parked.
            yield from wait_task_rescheduled(_abort_succeeds)  # noqa: ASYNC105 - it is awaited
        except BaseException:
            if self.receiver is receiver:
                self.receiver = None  # cancelled: hold no task that is not parked here
            raise
        return bool(self.items)

    def wake_receiver(self) -> None:
        """Wake the consumer if it waits in `wait()`, with nothing new (its `wait` then answers whether
        anything is buffered): for a consumer that also has something else to look at, an abort say."""
        receiver = self.receiver
        if receiver is not None:
            self.receiver = None
            if receiver.custom_sleep_data is self:
                reschedule(receiver)

    def close_receiver(self) -> None:
        """The consumer is gone: every send from now on (and every waiting one) raises `BrokenResourceError`."""
        self._receiver_gone = True
        self.limit = 0
        self.items.clear()
        waiting, self.waiting_senders = self.waiting_senders, None
        for task, _ in waiting or ():
            reschedule(task, Error(trio.BrokenResourceError()))
