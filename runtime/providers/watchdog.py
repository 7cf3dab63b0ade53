"""`IdleWatchdog`: a stream that goes quiet ends as a retryable connection error, as Claude Code's does.

Claude Code aborts a response stream that sends nothing for a while (its stream watchdog, on by default
since 2.1.198). Without one here, a server (or a proxy) that stalls mid-response held a query for the SDK's
read timeout, ten minutes per attempt; one that sends a `ping` every few seconds and nothing else held it
forever, since every ping is a successful read.

What it guarantees, with `timeout_s` set (None turns the watchdog off):

- **First byte.** The response's headers come within `timeout_s` of sending the request, or the call fails.
- **Idle.** Once they have come, at most `timeout_s` passes without an event other than `ping`: each
  other event (an unknown type too) restarts the count, a `ping` does not, nor do bytes that complete no
  event (comments, blank lines, an event trickled byte by byte).
- The time the consumer holds an event (a slow consumer's backpressure) is not counted: only the
  server's silence is. An event other than `ping` restarts the count when the consumer hands back
  (`heard`, one clock read an event); a `ping`'s time with the consumer is added back (`pause`/`resume`).
- When it fires, the call fails with a `connection` `ModelError`, the kind retried with backoff while
  nothing of the request has been shown: "Stream idle timeout - partial response received" once an event
  other than `ping` has come, "Stream idle timeout - no response received" otherwise (Claude Code's
  words), then how long it waited and the option that sets it.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import trio

from queryloop.runtime.providers.sse import WireDefenceError

__all__ = ["NO_RESPONSE", "PARTIAL_RESPONSE", "IdleWatchdog"]

NO_RESPONSE = "Stream idle timeout - no response received"
PARTIAL_RESPONSE = "Stream idle timeout - partial response received"


class IdleWatchdog:
    """One call's watchdog: its deadline, moved by the events heard and the consumer's pauses."""

    __slots__ = ("deadline", "fired", "paused_at", "received", "timeout_s")

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = math.inf if timeout_s is None else timeout_s
        self.deadline = math.inf
        self.paused_at = 0.0
        self.received = False
        """An event other than `ping` has come."""
        self.fired = False

    def start(self) -> None:
        """The count starts now (the request is sent, or its headers have come)."""
        self.deadline = trio.current_time() + self.timeout_s

    def heard(self) -> None:
        """An event other than a `ping` came and the consumer, which held it, hands back now: the count restarts
        from now (the same deadline as from its arrival plus the consumer's time, for one clock read)."""
        self.received = True
        self.deadline = trio.current_time() + self.timeout_s

    def pause(self) -> None:
        """The consumer holds a `ping` from now (the time until `resume` is not the server's)."""
        self.paused_at = trio.current_time()

    def resume(self) -> None:
        self.deadline += trio.current_time() - self.paused_at

    async def read(self, chunks: AsyncIterator[bytes]) -> bytes | None:
        """The body's next chunk (None at its end), or the idle error if the deadline passes first."""
        with trio.CancelScope(deadline=self.deadline):
            try:
                return await anext(chunks)
            except StopAsyncIteration:
                return None
        # Out of the scope without a return: its deadline passed.
        raise self.expired()

    def expired(self) -> WireDefenceError:
        """The error of a watchdog that fired (and marks it fired)."""
        self.fired = True
        said = PARTIAL_RESPONSE if self.received else NO_RESPONSE
        waited = f"no event but pings for {self.timeout_s:g}s: stream_idle_timeout_s"
        return WireDefenceError("connection", f"{said} ({waited})")
