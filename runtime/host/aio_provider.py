"""`HostModelProvider`: a model provider written for asyncio, streamed on the host's loop.

A provider marked `runs_on = "asyncio"` awaits asyncio objects (an aiohttp session, the host's own
`AsyncAnthropic` client, an `asyncio.Queue`), which a trio task cannot. Under `AsyncioRuntime` its
stand-in takes its place in the options: each call's `stream(request)` runs as an asyncio task of
the host's loop, and its events cross to the ModelCaller's trio task through the bridge, in batches
(what the host's task yields before the trio run's next drain crosses in one hop).

Invariants:
* at most `WINDOW` events are in flight (yielded on the host, not yet taken on the trio side): a
  ModelCaller held back by a slow consumer holds the host's stream back, as on trio;
* each side's state is touched on its own side only (the host's in its loop's callbacks and task,
  the trio side's in the trio run), so thread mode needs no lock;
* the trio side leaving the stream (an abort, a retry, a fallback) cancels the host's task at once,
  without waiting: the provider's own cleanup (closing its HTTP response) runs on the host's loop, as
  an asyncio tool's does.
Imports `host.aio_bridge` and `loop`.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any, Literal

import outcome
from trio.lowlevel import Abort, RaiseCancelT, Task, current_task, reschedule, wait_task_rescheduled

from queryloop.runtime.errors import RuntimeClosed

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator

    from queryloop.runtime.host.aio_bridge import Bridge
    from queryloop.runtime.loop.model import ModelProvider, ModelRequest

WINDOW = 256
"""Events a host's stream may run ahead of the ModelCaller that takes them."""


class HostModelProvider:
    """The trio-side stand-in of a provider written for asyncio (made by `AsyncioRuntime`)."""

    runs_on: Literal["trio"] = "trio"

    def __init__(self, bridge: Bridge, provider: ModelProvider) -> None:
        self.provider = provider
        self._bridge = bridge

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        call = _HostStream(self._bridge)
        self._bridge.to_host(call.start, self.provider, request)
        try:
            while (batch := await call.take()) is not None:
                for event in batch:
                    yield event
        finally:
            call.leave()


class _HostStream:
    """One call's stream: its asyncio task on the host's side, its buffer on the trio side."""

    __slots__ = ("_bridge", "buffer", "end", "in_flight", "left", "room", "task", "waiter")

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        # The trio side's.
        self.buffer: list[dict[str, Any]] = []
        self.end: outcome.Outcome[None] | None = None
        """How the host's task ended (its provider's stream ran out, or raised), once it has."""
        self.waiter: Task | None = None
        self.left = False
        """The trio side has left the stream: what still crosses is dropped."""
        # The host's side.
        self.task: asyncio.Task[None] | None = None
        self.in_flight = 0
        self.room: asyncio.Event | None = None

    # -- on the host's loop ------------------------------------------------------------------

    def start(self, provider: ModelProvider, request: ModelRequest) -> None:
        # Before any `cancel`: the host's queue is FIFO, and `leave` queues `cancel` after `stream` queued this.
        bridge = self._bridge
        task = bridge.loop.create_task(self._pump(provider, request), context=bridge.context.copy())
        self.task = task
        bridge.host_tasks.add(task)
        task.add_done_callback(self._done)

    async def _pump(self, provider: ModelProvider, request: ModelRequest) -> None:
        send, deliver = self._bridge.send, self.deliver
        events = provider.stream(request)
        try:
            async for event in events:
                send(functools.partial(deliver, event))
                self.in_flight += 1
                while self.in_flight >= WINDOW:
                    self.room = asyncio.Event()
                    await self.room.wait()
        finally:
            await events.aclose()

    def taken(self, count: int) -> None:
        self.in_flight -= count
        if self.room is not None and self.in_flight < WINDOW:
            self.room.set()
            self.room = None

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def _done(self, task: asyncio.Task[None]) -> None:
        self._bridge.host_tasks.discard(task)
        result: outcome.Outcome[None]
        if task.cancelled():
            result = outcome.Error(RuntimeClosed("the model provider's asyncio task was cancelled"))
        elif (error := task.exception()) is not None:
            result = outcome.Error(error)
        else:
            result = outcome.Value(None)
        try:
            self._bridge.send(functools.partial(self.finish, result))
        except RuntimeClosed:  # the trio run has ended: nobody takes the stream any more
            pass

    # -- in the trio run ---------------------------------------------------------------------

    def deliver(self, event: dict[str, Any]) -> None:
        if not self.left:
            self.buffer.append(event)
            self._wake()

    def finish(self, result: outcome.Outcome[None]) -> None:
        if not self.left:
            self.end = result
            self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            reschedule(waiter)

    async def take(self) -> list[dict[str, Any]] | None:
        """The events that crossed since the last call (waiting for one); None at the end of the stream."""
        if not self.buffer and self.end is None:
            self.waiter = current_task()

            def abort(_: RaiseCancelT) -> Abort:
                self.waiter = None
                return Abort.SUCCEEDED

            await wait_task_rescheduled(abort)
        batch = self.buffer
        if batch:
            self.buffer = []
            self._bridge.to_host(self.taken, len(batch))
            return batch
        end = self.end
        assert end is not None  # woken by `deliver` or `finish`
        end.unwrap()
        return None

    def leave(self) -> None:
        if not self.left:
            self.left = True
            if self.end is None:  # the host's task still runs
                self._bridge.to_host(self.cancel)
