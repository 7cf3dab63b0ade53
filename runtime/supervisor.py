"""`Supervisor`: owns one session's actor group and carries its aborts.

The group is one trio task in the runtime's nursery holding one nursery; every
actor of the session is a task in it. Hence:

* closing the group tells every actor `Shutdown` (urgent lane): each cancels its
  own work and leaves its loop; `close()` returns when every task of the session,
  actors and their work alike, has finished: nothing of a session runs after it;
* an actor's crash is caught at the actor (its loop never raises), so the
  failure is this session's alone: the supervisor records it as
  `ActorCrashed`, tells its listeners, and closes the group (one for all);
  other sessions never see it;
* closing is O(this session's tasks), whatever else is alive.

`spawn`, `abort` and `close` may be called from the trio thread or from any other
thread (they are then run on the trio thread through its token).
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from loguru import logger
from pykka import ActorDeadError

from runtime.actor import TrioActor, current_supervisor
from runtime.errors import ActorCrashed, SessionClosed
from runtime.messages import Abort, AbortAck, AbortReason, Shutdown

if TYPE_CHECKING:
    from collections.abc import Callable

    from pykka import ActorRef

A = TypeVar("A", bound=TrioActor)


class Supervisor:
    """The parent of one session's actors."""

    def __init__(self, session_id: str, *, on_closed: Callable[[Supervisor], None] | None = None) -> None:
        self.session_id = session_id
        self.failure: ActorCrashed | None = None
        """Set when an actor of the group crashed; the group is then closed."""
        self.actors: list[TrioActor] = []
        self._nursery: trio.Nursery | None = None
        self._closing = trio.Event()
        self._closed = trio.Event()
        self._on_closed = on_closed
        self._crash_listeners: list[Callable[[ActorCrashed], None]] = []
        self._context: contextvars.Context | None = None
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Supervisor {self.session_id} {state} actors={len(self.actors)}>"

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    async def run(self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED) -> None:
        """The group's task: hold the nursery open until `close()` or a crash."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self)
                await self._closing.wait()
                # Leaving the block waits for every actor: each was told to shut down.
        finally:
            self._nursery = None
            self._closed.set()
            if self._on_closed is not None:
                self._on_closed(self)
            # Break the reference cycles (actors ↔ supervisor, listeners ↔ session) so that a
            # closed session is freed by reference counting, not left to the garbage collector.
            self.actors = []
            self._crash_listeners = []
            self._on_closed = None

    # -- starting actors --------------------------------------------------------

    def spawn(self, actor_class: type[A], *args: Any, **kwargs: Any) -> ActorRef[A]:
        """Start `actor_class(*args, **kwargs)` in this session and return its ref."""
        if threading.get_ident() != self._thread:
            return trio.from_thread.run_sync(lambda: self.spawn(actor_class, *args, **kwargs), trio_token=self._token)
        if self._context is None:
            # One context holding `current_supervisor` for the whole session: every actor task then
            # shares its mapping, rather than each spawn setting (and allocating) the variable anew.
            self._context = contextvars.copy_context()
            self._context.run(current_supervisor.set, self)
        return self._context.copy().run(actor_class.start, *args, **kwargs)

    def _launch(self, actor: TrioActor) -> None:
        if self._nursery is None or self._closing.is_set():
            msg = f"session {self.session_id} is closed; cannot start {actor.name}"
            raise SessionClosed(msg)
        self.actors.append(actor)
        self._nursery.start_soon(actor._actor_main, name=actor.name)  # noqa: SLF001

    # -- supervision ------------------------------------------------------------

    async def abort(self, reason: AbortReason) -> list[AbortAck]:
        """Send `Abort(reason)` to every live actor, urgent lane; return their acks.

        Each actor cancels its work and answers once that work has unwound, so when
        this returns no work of the session started before the abort is running.
        Idempotent: a second abort finds nothing to cancel.
        """
        if threading.get_ident() != self._thread:
            return trio.from_thread.run(self.abort, reason, trio_token=self._token)
        message = Abort(reason=reason)
        futures = [
            actor.actor_ref.ask(message, block=False) for actor in self.actors if not actor.actor_stopped.is_set()
        ]
        acks: list[AbortAck] = []
        for future in futures:
            try:
                acks.append(await future)
            except ActorDeadError:
                continue  # it stopped (or the group closed) while the abort was on its way
        return acks

    def abort_nowait(self, reason: AbortReason) -> None:
        """Send `Abort(reason)` to every live actor without waiting for acks (usable where nothing can await)."""
        message = Abort(reason=reason)
        for actor in self.actors:
            if not actor.actor_stopped.is_set():
                actor.actor_ref.tell(message)

    async def close(self) -> None:
        """Stop every actor of the session and return when none of its tasks runs. Idempotent."""
        if threading.get_ident() != self._thread:
            trio.from_thread.run(self.close, trio_token=self._token)
            return
        if not self._closing.is_set():
            shutdown = Shutdown()
            for actor in self.actors:
                if not actor.actor_stopped.is_set():
                    actor.actor_ref.tell(shutdown)
            self._closing.set()
        await self._closed.wait()

    async def wait_closed(self) -> None:
        """Wait until the group has closed, by `close()` or by a crash."""
        await self._closed.wait()

    def add_crash_listener(self, listener: Callable[[ActorCrashed], None]) -> None:
        """Call `listener(error)` on the trio thread when an actor of this session crashes."""
        self._crash_listeners.append(listener)

    def live_tasks(self) -> int:
        """How many trio tasks of this session are running (actors and their work)."""
        return 0 if self._nursery is None else _count_tasks(self._nursery)

    def _actor_crashed(self, actor: TrioActor, error: BaseException) -> None:
        if self.failure is None:
            self.failure = ActorCrashed(self.session_id, actor.name, error)
            logger.bind(session=self.session_id).error("session closed: actor {} crashed with {!r}", actor.name, error)
            for listener in self._crash_listeners:
                listener(self.failure)
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()


def _count_tasks(nursery: trio.Nursery) -> int:
    total = 0
    for task in nursery.child_tasks:
        total += 1
        for child in task.child_nurseries:
            total += _count_tasks(child)
    return total
