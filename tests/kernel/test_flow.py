"""`EventChannel`: the bounded single-consumer channel of the event path."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from queryloop.runtime.kernel.flow import EventChannel


async def test_items_arrive_in_order_and_a_receiver_parks_only_on_an_empty_buffer() -> None:
    channel = EventChannel[int](4)
    received: list[int] = []

    async def consumer() -> None:
        while channel.items or await channel.wait():
            received.append(channel.take())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(3):
            channel.send_nowait(i)
        await trio.testing.wait_all_tasks_blocked()
        assert received == [0, 1, 2]
        channel.send_nowait(3)
        channel.close()  # what is buffered is still delivered, then EndOfChannel
    assert received == [0, 1, 2, 3]
    with pytest.raises(trio.ClosedResourceError):
        channel.send_nowait(4)


async def test_a_full_buffer_makes_senders_wait_and_their_items_enter_in_send_order() -> None:
    channel = EventChannel[str](2)
    channel.send_nowait("a")
    channel.send_nowait("b")
    with pytest.raises(trio.WouldBlock):
        channel.send_nowait("c")
    async with trio.open_nursery() as nursery:
        for item in ("c", "d", "e"):
            nursery.start_soon(channel.send, item)
            await trio.testing.wait_all_tasks_blocked()  # each waits, in this order
        taken: list[str] = []
        while len(taken) < 5:
            if not channel.items:
                await channel.wait()
            taken.append(channel.take())
            assert len(channel.items) <= 2
    assert taken == ["a", "b", "c", "d", "e"]


async def test_a_cancelled_waiting_send_drops_its_item_and_the_others_keep_their_place() -> None:
    channel = EventChannel[str](1)
    channel.send_nowait("a")
    doomed = trio.CancelScope()

    async def cancelled_send() -> None:
        with doomed:
            await channel.send("dropped")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(channel.send, "kept")
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(cancelled_send)
        await trio.testing.wait_all_tasks_blocked()
        doomed.cancel()
        await trio.testing.wait_all_tasks_blocked()
        first = channel.take()  # room for the waiting sender's item, which moves in at once
        assert [first, channel.take()] == ["a", "kept"]
    assert not channel.items


async def test_a_consumer_that_goes_away_breaks_every_send_waiting_ones_included() -> None:
    channel = EventChannel[int](1)
    channel.send_nowait(1)
    failures: list[type[BaseException]] = []

    async def blocked_send() -> None:
        try:
            await channel.send(2)
        except trio.BrokenResourceError as error:
            failures.append(type(error))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(blocked_send)
        await trio.testing.wait_all_tasks_blocked()
        channel.close_receiver()
    assert failures == [trio.BrokenResourceError]
    assert not channel.items  # what was buffered is dropped, as trio's channels do
    with pytest.raises(trio.BrokenResourceError):
        channel.send_nowait(3)


async def test_a_waiting_receiver_is_cancellable_and_wakes_at_close() -> None:
    channel = EventChannel[int](1)
    with trio.move_on_after(1) as scope:
        await channel.wait()
    assert scope.cancelled_caught
    channel.send_nowait(7)  # the cancelled receiver is forgotten: nothing to wake
    assert await channel.wait() is True
    assert channel.take() == 7
    async with trio.open_nursery() as nursery:
        ended: list[bool] = []

        async def wait_for_end() -> None:
            ended.append(await channel.wait())

        nursery.start_soon(wait_for_end)
        await trio.testing.wait_all_tasks_blocked()
        channel.close()
    assert ended == [False]
    assert await channel.wait() is False  # closed and empty: at once


def test_a_channel_needs_room_for_one_item() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        EventChannel[int](0)


async def test_push_goes_past_the_bound_without_waiting_and_wakes_the_consumer() -> None:
    channel = EventChannel[str](1)
    channel.send_nowait("a")
    got: list[str] = []

    async def consume() -> None:
        while await channel.wait():
            got.append(channel.take())

    async with trio.open_nursery() as nursery:
        channel.push("b")  # the buffer is full: a send would wait, a push does not
        assert list(channel.items) == ["a", "b"]
        nursery.start_soon(consume)
        await trio.testing.wait_all_tasks_blocked()
        channel.push("c")  # wakes the waiting consumer
        await trio.testing.wait_all_tasks_blocked()
        channel.close()
    assert got == ["a", "b", "c"]
    gone = EventChannel[str](1)
    gone.close_receiver()
    with pytest.raises(trio.BrokenResourceError):
        gone.push("x")


async def test_push_lets_blocked_senders_in_first_so_order_is_kept() -> None:
    channel = EventChannel[str](1)
    channel.send_nowait("a")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(channel.send, "b")
        await trio.testing.wait_all_tasks_blocked()  # "b" waits for room
        channel.push("last")
        assert list(channel.items) == ["a", "b", "last"]
        await trio.testing.wait_all_tasks_blocked()  # the sender of "b" has returned: its send is done


async def test_a_receiver_cancelled_out_of_its_wait_is_not_woken_by_a_send_before_it_runs() -> None:
    # The cancellation reschedules the receiver; a send in the same step must not wake it a second time
    # (trio would fail its own assertion): the item stays buffered for the next wait.
    channel = EventChannel[int](4)
    scope = trio.CancelScope()
    outcome: list[str] = []

    async def receiver() -> None:
        with scope:
            await channel.wait()
            outcome.append("woken")
        if scope.cancelled_caught:
            outcome.append("cancelled")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        await trio.testing.wait_all_tasks_blocked()
        scope.cancel()
        channel.send_nowait(1)
        channel.wake_receiver()
        channel.push(2)
    assert outcome == ["cancelled"]
    assert list(channel.items) == [1, 2]
    assert await channel.wait() is True  # a later wait finds them at once
