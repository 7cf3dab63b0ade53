"""The kernel: TrioActor on pykka's extension points, its future, inbox and supervisor."""

from __future__ import annotations

import threading
from typing import Any

import pydantic
import pykka
import pytest
import trio
import trio.testing
from pykka import ActorRef

from queryloop import ActorCrashed, BlockingCallOnTrioThread, NotInSession, Runtime, SessionClosed, WorkCancelled
from queryloop.lowlevel import Abort, AbortAck, Supervisor, TrioActor, TrioFuture


class Recorder(TrioActor):
    """Records what it handled and in which order; a small calculator through its proxy."""

    def __init__(self, log: list[Any] | None = None) -> None:
        super().__init__()
        self.handled: list[Any] = [] if log is None else log
        self.thread = 0

    def on_receive(self, message: Any) -> Any:
        self.handled.append(message)
        self.thread = threading.get_ident()
        return ("echo", message)

    def add(self, a: int, b: int) -> int:
        return a + b

    def fail(self) -> None:
        raise ValueError("bad input")

    async def slow_double(self, x: int, seconds: float) -> int:
        await trio.sleep(seconds)
        return 2 * x


class Paired(TrioActor):
    """A named actor told its peer as a message (an `ActorRef`); every other message goes to `on_message`."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.label = name
        self.peer: Any = None

    def on_receive(self, message: Any) -> None:
        if isinstance(message, ActorRef):
            self.peer = message
        else:
            self.on_message(message)

    def on_message(self, message: Any) -> None:
        raise NotImplementedError


async def test_an_actors_work_runs_in_a_trio_task_named_after_its_class() -> None:
    # trio names a task after its function when it is not given a name: every piece of work would be
    # `TrioActor._run_work`. The kernel names it once per class instead (also what a debugger shows).
    spawned: list[str] = []

    class Spawns(trio.abc.Instrument):
        def task_spawned(self, task: trio.lowlevel.Task) -> None:
            spawned.append(task.name)

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Recorder)
        instrument = Spawns()
        trio.lowlevel.add_instrument(instrument)
        try:
            assert await ref.proxy().slow_double(4, 0) == 8
        finally:
            trio.lowlevel.remove_instrument(instrument)
        await group.close()
    assert spawned == [f"{__name__}.Recorder work"]


async def test_tell_ask_and_proxy_from_the_trio_thread() -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Recorder)
        ref.tell("told")
        assert await ref.ask("asked", block=False) == ("echo", "asked")
        proxy = ref.proxy()
        assert await proxy.add(2, 3) == 5
        assert await proxy.handled == ["told", "asked"]
        assert await proxy.thread == threading.get_ident()  # handlers run on the trio thread


async def test_tell_ask_and_proxy_from_a_foreign_thread() -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Recorder)
        trio_thread = threading.get_ident()

        def from_thread() -> tuple[Any, ...]:
            assert threading.get_ident() != trio_thread
            ref.tell("told from thread")
            answer = ref.ask("asked from thread", timeout=5)
            proxy = ref.proxy()
            total = proxy.add(20, 22).get(timeout=5)
            doubled = proxy.slow_double(8, 0.001).get(timeout=5)
            spawned = group.spawn(Recorder)  # spawning from a thread too
            return answer, total, doubled, spawned.ask("hi", timeout=5)

        answer, total, doubled, spawned_answer = await trio.to_thread.run_sync(from_thread)
        assert answer == ("echo", "asked from thread")
        assert (total, doubled, spawned_answer) == (42, 16, ("echo", "hi"))
        assert await ref.proxy().handled == ["told from thread", "asked from thread"]
        assert await ref.proxy().thread == threading.get_ident()


async def test_abort_overtakes_10000_queued_ordinary_messages() -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        handled: list[Any] = []

        class Counting(Recorder):
            def on_abort(self, reason: str) -> None:
                self.handled.append(("abort", reason))

        class Flooder(TrioActor):
            def on_receive(self, message: Any) -> Any:
                # Mail sent by a handler waits until the handler has returned: all of it is queued.
                for i in range(10_000):
                    target.tell(i)
                return target.ask(Abort(reason="user"), block=False)

        target = group.spawn(Counting, handled)
        ack_future = await group.spawn(Flooder).ask("flood", block=False)
        assert await ack_future == AbortAck(actor="Counting", cancelled_work=0)
        assert handled[0] == ("abort", "user")
        assert handled[1:] == list(range(10_000))  # ordinary mail keeps its order


async def test_mail_sent_by_a_handler_is_handled_after_it_returns_never_inside_it() -> None:
    order: list[str] = []

    class PingPong(Paired):
        def on_message(self, message: Any) -> None:
            order.append(f"{self.label} in {message}")
            if message < 3:
                self.peer.tell(message + 1)
            order.append(f"{self.label} out {message}")

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        a, b = group.spawn(PingPong, "a"), group.spawn(PingPong, "b")
        a.tell(b)
        b.tell(a)
        a.tell(0)
        assert order == ["a in 0", "a out 0", "b in 1", "b out 1", "a in 2", "a out 2", "b in 3", "b out 3"]


async def test_closing_a_group_stops_its_idle_actors_at_once_and_their_stop_mail_waits_for_the_stop() -> None:
    order: list[str] = []

    class Stopping(Paired):
        def on_message(self, message: Any) -> None:
            order.append(f"{self.label} got {message}")

        def on_stop(self) -> None:
            order.append(f"{self.label} stopping")
            if self.peer is not None:
                self.peer.tell(f"bye from {self.label}")
            order.append(f"{self.label} stopped")

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        a = group.spawn(Stopping, "a")
        b = group.spawn(Stopping, "b")
        a.tell(b)  # a, stopped first, tells b (still alive) from its on_stop
        group.close_nowait()
        # Nothing was running: both are stopped when the call returns, no task step later. The mail a's
        # on_stop sent is handled after on_stop returned, never inside it, and before b stops.
        assert not a.is_alive() and not b.is_alive()
        assert order == ["a stopping", "a stopped", "b got bye from a", "b stopping", "b stopped"]
        assert group.closed


async def test_a_group_closed_from_its_actors_handler_stops_that_actor_once_the_handler_returns() -> None:
    seen: list[bool] = []

    class Closer(TrioActor):
        def on_receive(self, message: Any) -> None:
            self.supervisor.close_nowait()  # type: ignore[attr-defined]
            seen.append(self.actor_stopped.is_set())  # still handling: the stop waits for the handler

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Closer)
        ref.tell("close")
        assert seen == [False]
        assert not ref.is_alive()
        await group.wait_closed()


async def test_ordinary_mail_waits_while_an_abort_unwinds_then_flows_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[Any] = []

    class Slow(TrioActor):
        async def work(self) -> None:
            try:
                await trio.sleep(60)
            finally:
                with trio.CancelScope(shield=True):
                    await trio.sleep(5)  # unwinding takes a while
                events.append("unwound")

        def on_receive(self, message: Any) -> Any:
            if message == "work":
                self.start_work(self.work)
                return None
            events.append(message)
            return message

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Slow)
        ref.tell("work")
        await trio.testing.wait_all_tasks_blocked()
        ack: TrioFuture[AbortAck] = ref.ask(Abort(reason="user"), block=False)  # type: ignore[assignment]
        first, second = ref.ask("first", block=False), ref.ask("second", block=False)
        await trio.testing.wait_all_tasks_blocked()
        assert events == [] and not ack.done()  # the abort waits for the work; the mail for the abort
        assert await ack == AbortAck(actor="Slow", cancelled_work=1)
        assert (await first, await second) == ("first", "second")
        assert events == ["unwound", "first", "second"]


async def test_crash_in_one_session_leaves_another_session_running() -> None:
    async with Runtime.open() as runtime:
        doomed = await runtime.start_group()
        healthy = await runtime.start_group()
        crashes: list[ActorCrashed] = []
        doomed.add_crash_listener(crashes.append)
        bystander = doomed.spawn(Recorder)
        victim = doomed.spawn(Recorder)
        survivor = healthy.spawn(Recorder)

        victim.proxy().fail.defer()  # a tell: nobody to hand the error to, so the actor crashes
        await doomed.wait_closed()

        assert isinstance(doomed.failure, ActorCrashed)
        assert isinstance(doomed.failure.error, ValueError)
        assert doomed.failure.actor == "Recorder"
        assert crashes == [doomed.failure]
        assert not bystander.is_alive() and not victim.is_alive()  # one for all, within the session
        assert doomed.live_tasks() == 0
        assert healthy.failure is None
        assert await survivor.ask("still here", block=False) == ("echo", "still here")
        assert set(runtime.groups) == {healthy.session_id}


async def test_error_in_an_ask_goes_to_the_asker_and_the_actor_lives_on() -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Recorder)
        with pytest.raises(ValueError, match="bad input"):
            await ref.proxy().fail()
        assert await ref.ask("after", block=False) == ("echo", "after")
        assert group.failure is None


async def test_no_task_of_a_session_runs_after_its_close(autojump_clock: trio.testing.MockClock) -> None:
    progress: list[str] = []

    class Worker(TrioActor):
        async def forever(self, label: str) -> None:
            try:
                while True:
                    await trio.sleep(1)
                    progress.append(label)
            finally:
                progress.append(f"{label} unwound")

        def on_receive(self, message: Any) -> None:
            self.start_work(self.forever, message)

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        first, second = group.spawn(Worker), group.spawn(Worker)
        first.tell("a")
        second.tell("b")
        pending = first.proxy().forever("asked")
        await trio.sleep(2.5)
        assert group.live_tasks() == 3  # three pieces of work (an idle actor has no task)
        await group.close()
        assert group.live_tasks() == 0
        assert sorted(p for p in progress if p.endswith("unwound")) == [
            "a unwound",
            "asked unwound",
            "b unwound",
        ]
        seen = len(progress)
        await trio.sleep(10)
        assert len(progress) == seen  # nothing of the session ran after close() returned
        with pytest.raises(WorkCancelled):
            await pending
        with pytest.raises(pykka.ActorDeadError):
            await first.ask("late", block=False)
        with pytest.raises(SessionClosed):
            group.spawn(Worker)


async def test_blocking_get_on_the_trio_thread_raises_instead_of_deadlocking() -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Recorder)
        with pytest.raises(BlockingCallOnTrioThread, match="await"):
            ref.ask("blocking")  # pykka's default block=True
        future = ref.ask("later", block=False)
        with pytest.raises(BlockingCallOnTrioThread):
            future.get()
        assert await future == ("echo", "later")
        with pytest.raises(BlockingCallOnTrioThread):
            future.get()  # deterministic: raised even when the value is there


async def test_handler_work_keeps_the_mailbox_responsive(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Recorder)
        slow = ref.proxy().slow_double(21, 60)
        start = trio.current_time()
        assert await ref.ask("meanwhile", block=False) == ("echo", "meanwhile")
        assert trio.current_time() == start  # answered while the slow work is still running
        assert await slow == 42
        assert trio.current_time() - start == pytest.approx(60)


async def test_abort_cancels_work_and_acks_after_it_unwound(autojump_clock: trio.testing.MockClock) -> None:
    events: list[str] = []

    class Tool(TrioActor):
        async def run(self) -> str:
            try:
                await trio.sleep(100)
                return "finished"
            finally:
                events.append("work unwound")

        def on_abort(self, reason: str) -> None:
            events.append(f"on_abort {reason} busy={self.busy}")

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Tool)
        pending = ref.proxy().run()
        await trio.testing.wait_all_tasks_blocked()
        acks = await group.abort("interrupt")
        events.append("acked")
        assert acks == [AbortAck(actor="Tool", cancelled_work=1)]
        assert events == ["on_abort interrupt busy=1", "work unwound", "acked"]
        with pytest.raises(WorkCancelled):
            await pending
        assert await group.abort("user") == [AbortAck(actor="Tool", cancelled_work=0)]  # idempotent
        assert group.failure is None and group.live_tasks() == 0


async def test_lifecycle_hooks_on_start_on_stop_on_failure() -> None:
    calls: list[str] = []

    class Hooked(TrioActor):
        def on_start(self) -> None:
            calls.append("start")

        def on_stop(self) -> None:
            calls.append("stop")

        def on_failure(self, exc_type: Any, exc: Any, tb: Any) -> None:
            calls.append(f"failure {exc_type.__name__}")

        def on_receive(self, message: Any) -> None:
            if message == "boom":
                raise RuntimeError("boom")

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Hooked)
        await ref.ask("ping", block=False)
        assert await ref.stop(block=False) is True
        assert calls == ["start", "stop"]
        assert not ref.is_alive()

        calls.clear()
        crashing = await runtime.start_group()
        crashing.spawn(Hooked).tell("boom")
        await crashing.wait_closed()
        assert calls == ["start", "failure RuntimeError"]  # on_stop is not run after a failure


async def test_actor_started_outside_a_session_is_a_clear_error() -> None:
    with pytest.raises(NotInSession, match=r"supervisor\.spawn"):
        Recorder.start()


async def test_actor_can_start_a_sibling_in_its_own_session() -> None:
    class Parent(TrioActor):
        def on_receive(self, message: Any) -> Any:
            return Recorder.start()

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        child = await group.spawn(Parent).ask("spawn", block=False)
        assert await child.ask("hi", block=False) == ("echo", "hi")
        assert len(group.actors) == 2


async def test_future_derivations_are_awaitable_and_thread_gettable() -> None:
    a: TrioFuture[int] = TrioFuture()
    b: TrioFuture[int] = TrioFuture()
    doubled = a.map(lambda x: x * 2)
    both = a.join(b)
    total = both.reduce(lambda x, y: x + y)
    big = both.filter(lambda x: x > 5)
    a.set(3)
    b.set(10)
    assert await doubled == 6
    assert list(await both) == [3, 10]
    assert await total == 13
    assert list(await big) == [10]

    late: TrioFuture[str] = TrioFuture()
    timed_out = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def get_in_thread() -> str:
        with pytest.raises(pykka.Timeout):
            late.get(timeout=0.001)
        trio.from_thread.run_sync(timed_out.set, trio_token=token)
        return late.get(timeout=5)

    async with trio.open_nursery() as nursery:
        results: list[str] = []

        async def reader() -> None:
            results.append(await trio.to_thread.run_sync(get_in_thread))

        nursery.start_soon(reader)
        await timed_out.wait()
        late.set("from trio")
    assert results == ["from trio"]


async def test_awaiting_a_future_is_cancellable() -> None:
    never: TrioFuture[int] = TrioFuture()
    with trio.move_on_after(0.001) as scope:
        await never
    assert scope.cancelled_caught
    never.set(1)  # no waiter left to wake: must not raise
    assert await never == 1


def test_supervisor_messages_are_frozen_and_validated() -> None:
    abort = Abort(reason="interrupt")
    with pytest.raises(pydantic.ValidationError):
        abort.reason = "user"  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError, match="reason"):
        Abort(reason="whenever")


async def test_abort_cancels_work_started_just_before_it_even_if_the_work_has_not_run_yet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    finished: list[int] = []

    class Starter(TrioActor):
        async def long_work(self, n: int) -> None:
            await trio.sleep(60)
            finished.append(n)

        def on_receive(self, message: Any) -> Any:
            # Work is started, then an Abort is mailed at once: whichever of the two the
            # scheduler runs first, the abort must reach the work.
            self.start_work(self.long_work, message)
            self.actor_ref.tell(Abort(reason="user"))

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Starter)
        for n in range(20):
            ref.tell(n)
            await trio.testing.wait_all_tasks_blocked()
            assert ref.busy() == 0  # type: ignore[attr-defined]
        await trio.sleep(120)
        assert finished == []


async def test_work_started_by_work_an_abort_is_unwinding_is_aborted_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    ran: list[str] = []

    class Chain(TrioActor):
        async def first(self) -> None:
            try:
                await trio.sleep(60)
            finally:
                self.start_work(self.second)  # a queue moving on as the first job ends

        async def second(self) -> None:
            await trio.sleep(60)
            ran.append("second finished")

        def on_receive(self, message: Any) -> None:
            self.start_work(self.first)

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(Chain)
        ref.tell("go")
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        await group.abort("user")
        assert trio.current_time() == start  # the ack did not wait for the second job's minute
        await trio.sleep(120)
        assert ran == []


async def test_work_asked_for_after_the_groups_nursery_closed_fails_the_ask_clearly() -> None:
    async with trio.open_nursery() as nursery:
        group = Supervisor("outlived", nursery)
        ref = group.spawn(Recorder)
    with pytest.raises(pykka.ActorDeadError, match="runtime has closed"):
        await ref.proxy().slow_double(1, 1)
    assert await ref.ask("still answering", block=False) == ("echo", "still answering")


async def test_closed_sessions_leave_no_cyclic_garbage_for_the_collector() -> None:
    import gc

    from bench import workload

    gc.collect()
    gc.disable()
    try:
        async with Runtime.open() as runtime:
            for index in range(5):
                session = await runtime.open_session(provider=workload.model(0), tools=workload.tools(0))
                handle = session.query(workload.PROMPT)
                if index % 2:
                    await session.abort("user")
                await handle.wait()
                await session.close()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.startswith("queryloop")]
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()
    # Freed by reference counting alone: a cycle here would wait for (and feed) full collections.
    assert ours == []


async def test_mail_queued_behind_a_handler_that_raises_a_base_exception_is_still_delivered() -> None:
    class Boom(BaseException):
        pass

    class Raising(TrioActor):
        def on_receive(self, message: Any) -> None:
            target.tell("first")
            target.tell("second")
            raise Boom  # not an Exception: it goes up to whoever sent the mail, as KeyboardInterrupt would

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        handled: list[Any] = []
        target = group.spawn(Recorder, handled)
        with pytest.raises(Boom):
            group.spawn(Raising).tell("go")
        assert handled == []  # queued behind the handler that raised
        await trio.testing.wait_all_tasks_blocked()
        assert handled == ["first", "second"]  # delivered on the trio thread's next turn, in order


async def test_after_handlers_runs_once_the_handlers_have_returned_and_asks_there_are_answered_at_once() -> None:
    order: list[str] = []

    class Follower(TrioActor):
        def __init__(self, peer: ActorRef[Recorder]) -> None:
            super().__init__()
            self.peer = peer

        def on_receive(self, message: Any) -> None:
            order.append(f"in {message}")
            self.after_handlers(self.follow_up)
            if message == "go":
                self.actor_ref.tell("queued meanwhile")
            order.append(f"out {message}")

        def follow_up(self) -> None:
            answer: TrioFuture[Any] = self.peer.ask("question", block=False)  # type: ignore[assignment]
            order.append(f"after: answered={answer.done()}")  # no handler runs: the peer answered inside ask

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        follower = group.spawn(Follower, group.spawn(Recorder))
        follower.tell("go")
        # The follow-ups run after the handler and the mail it queued, each once no handler runs.
        assert order == [
            "in go",
            "out go",
            "in queued meanwhile",
            "out queued meanwhile",
            "after: answered=True",
            "after: answered=True",
        ]


async def test_an_error_in_an_after_handlers_call_crashes_the_actor_not_the_caller() -> None:
    class Faulty(TrioActor):
        def on_receive(self, message: Any) -> None:
            def fail() -> None:
                raise ValueError("follow-up failed")

            self.after_handlers(fail)

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        group.spawn(Faulty).tell("go")  # the error does not come back through tell
        await group.wait_closed()
        assert isinstance(group.failure, ActorCrashed)
        assert isinstance(group.failure.error, ValueError)
