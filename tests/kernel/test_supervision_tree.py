"""The kernel's supervision tree: child groups under a session's `Supervisor` (what subagents run in)."""

from __future__ import annotations

import trio
import trio.testing

from queryloop import ActorCrashed, Runtime, SessionClosed
from queryloop.lowlevel import TrioActor


class Sleeper(TrioActor):
    """Its `nap` is work that runs until cancelled; it records how that work ended."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.record = log

    def on_receive(self, message: object) -> object:
        if message == "nap":
            self.start_work(self._nap)
        if message == "fail":
            raise ValueError("child actor failed")
        return None

    async def _nap(self) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self.record.append(f"{self.name} unwound")


async def test_aborting_a_group_reaches_every_descendant_and_waits_for_their_acks() -> None:
    async with Runtime.open() as runtime:
        root = await runtime.start_group()
        child = root.child(f"{root.session_id}/a")
        grandchild = child.child(f"{root.session_id}/a/b")
        log: list[str] = []
        for group in (root, child, grandchild):
            group.spawn(Sleeper, log).tell("nap")
        await trio.testing.wait_all_tasks_blocked()
        assert root.live_tasks() == 3

        acks = await root.abort("user")

        assert [ack.cancelled_work for ack in acks] == [1, 1, 1]
        assert log == ["Sleeper unwound"] * 3  # every descendant's work unwound before the acks came back
        assert root.live_tasks() == 0
        assert root.children == [child] and child.children == [grandchild]  # an abort closes nothing


async def test_closing_a_group_closes_its_children_and_counts_closed_only_after_them() -> None:
    async with Runtime.open() as runtime:
        root = await runtime.start_group()
        child = root.child(f"{root.session_id}/a")
        grandchild = child.child(f"{root.session_id}/a/b")
        log: list[str] = []
        for group in (root, child, grandchild):
            group.spawn(Sleeper, log).tell("nap")
        await trio.testing.wait_all_tasks_blocked()

        await root.close()

        assert root.closed and child.closed and grandchild.closed
        assert len(log) == 3 and root.live_tasks() == 0
        assert root.children == []
        try:
            root.child("late")
        except SessionClosed:
            pass
        else:
            raise AssertionError("a closed group opened a child")


async def test_a_crash_in_a_child_group_closes_that_group_alone() -> None:
    async with Runtime.open() as runtime:
        root = await runtime.start_group()
        child = root.child(f"{root.session_id}/a")
        sibling = root.child(f"{root.session_id}/b")
        log: list[str] = []
        survivor = root.spawn(Sleeper, log)
        child.spawn(Sleeper, log).tell("fail")  # a tell: nobody to hand the error to, so the actor crashes
        await child.wait_closed()

        assert isinstance(child.failure, ActorCrashed)
        assert root.failure is None and sibling.failure is None and not root.closed and not sibling.closed
        assert root.children == [sibling]  # the closed child left the tree
        assert await survivor.ask("still here", block=False) is None
        await root.close()
        assert sibling.closed
