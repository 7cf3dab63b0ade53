"""Moving items between tasks without a scheduler trip per item.

A trio memory channel's `send` and `receive` are each a full schedule point, even when
the item could move at once. On the event path (a model stream, tool results, the
query's events) that is several task switches per token-sized event. These helpers
move what can move now, and wait (with trio's backpressure and cancellation) only when
they must, so a burst of events costs one wakeup of the receiver, not one per event.
"""

from __future__ import annotations

from typing import Any, TypeVar

import trio

T = TypeVar("T")


async def deliver(channel: trio.MemorySendChannel[T], item: T) -> None:
    """Send `item`; wait only if the channel is full."""
    try:
        channel.send_nowait(item)
    except trio.WouldBlock:
        await channel.send(item)


def drain(channel: trio.MemoryReceiveChannel[Any], into: list[Any]) -> None:
    """Move every item already buffered in `channel` to `into`, without waiting."""
    while True:
        try:
            into.append(channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return
