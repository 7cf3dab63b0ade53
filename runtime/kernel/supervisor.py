"""`Supervisor`: owns one session's actor group and carries its aborts.

A group has no task of its own: its actors' handlers run on the dispatcher
(`queryloop.runtime.kernel._inbox`) and their work runs as tasks of the nursery the group was
opened in (the runtime's), each under a cancel scope its actor owns. Hence:

* closing the group tells every actor `Shutdown` (urgent lane): each cancels its
  work and, once that has unwound, stops; `close()` returns when every actor has
  stopped, so no task of the session runs after it;
* an actor's crash is caught at the actor (its work never raises into the
  nursery), so the failure is this session's alone: the supervisor records it as
  `ActorCrashed`, tells its listeners, and closes the group (one for all);
  other sessions never see it;
* opening and closing a group is O(this session's actors and work), whatever
  else is alive;
* groups form a tree: `child(id)` opens a group supervised by this one (a subagent's). An
  abort of the parent reaches every descendant's actors and is answered once all of them
  have acked; closing the parent closes the children first, and the parent counts as closed
  only when every descendant has. A child's crash closes the child alone: whoever opened it
  reads `failure` (the parent session goes on).

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

from queryloop.runtime._frozen import EMPTY_LIST
from queryloop.runtime.errors import ActorCrashed, SessionClosed
from queryloop.runtime.kernel._inbox import Dispatcher
from queryloop.runtime.kernel.actor import TrioActor, current_supervisor
from queryloop.runtime.kernel.messages import Abort, AbortAck, AbortReason

if TYPE_CHECKING:
    from collections.abc import Callable

    from pykka import ActorRef

A = TypeVar("A", bound=TrioActor)
_CLOSED_CONTEXT = contextvars.Context()


class Supervisor:
    """The parent of one session's actors."""

    def __init__(
        self,
        session_id: str,
        nursery: trio.Nursery,
        *,
        on_closed: Callable[[Supervisor], None] | None = None,
        parent: Supervisor | None = None,
    ) -> None:
        self.session_id = session_id
        self.parent = parent
        """The group this one is a child of (a subagent's), or None for a session's own group."""
        self.children: list[Supervisor] = EMPTY_LIST
        """Open child groups (`child`): aborts and closes reach them, and their descendants (the shared empty
        list until the first: most groups never have one, and an empty list per session is one more object
        in flight for the collector)."""
        self.failure: ActorCrashed | None = None
        """Set when an actor of the group crashed; the group is then closed."""
        self.actors: list[TrioActor] = []
        self._nursery = nursery
        """Where the actors' work runs (the runtime's nursery)."""
        self._live = 0
        """Actors started and not stopped yet."""
        self._closing = False
        self._closed = False
        self._closed_event: trio.Event | None = None
        """Made only for a caller that has to wait for the close: most groups are closed when asked to be."""
        self._on_closed = on_closed
        self._crash_listeners: list[Callable[[ActorCrashed], None]] = []
        # One context holding `current_supervisor` for the whole session: the work of its actors runs in it,
        # whichever task's mail started that work.
        self._context = contextvars.copy_context()
        self._context.run(current_supervisor.set, self)
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.get_ident()
        self._dispatcher = Dispatcher.for_this_thread()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Supervisor {self.session_id} {state} actors={len(self.actors)}>"

    @property
    def closed(self) -> bool:
        return self._closed

    # -- starting actors --------------------------------------------------------

    def spawn(self, actor_class: type[A], *args: Any, **kwargs: Any) -> ActorRef[A]:
        """Start `actor_class(*args, **kwargs)` in this session and return its ref."""
        if threading.get_ident() != self._thread:
            return trio.from_thread.run_sync(lambda: self.spawn(actor_class, *args, **kwargs), trio_token=self._token)
        if self._closing:
            msg = f"session {self.session_id} is closed; cannot start {actor_class.__name__}"
            raise SessionClosed(msg)
        token = current_supervisor.set(self)
        try:
            actor = actor_class(*args, **kwargs)
            actor._start_actor_loop()  # noqa: SLF001
        finally:
            current_supervisor.reset(token)
        return actor._actor_ref  # noqa: SLF001 - pykka's `actor_ref`, without its property's call

    def _launch(self, actor: TrioActor) -> None:
        if self._closing:
            msg = f"session {self.session_id} is closed; cannot start {actor.name}"
            raise SessionClosed(msg)
        self.actors.append(actor)
        self._live += 1

    def child(self, session_id: str) -> Supervisor:
        """Open a child group under this one (same nursery): aborted and closed with it (module docstring)."""
        if self._closing:
            msg = f"session {self.session_id} is closed; cannot open the child group {session_id}"
            raise SessionClosed(msg)
        group = Supervisor(session_id, self._nursery, parent=self)
        if self.children is EMPTY_LIST:
            self.children = []
        self.children.append(group)
        return group

    def _child_closed(self, child: Supervisor) -> None:
        if child not in self.children:
            return
        self.children.remove(child)
        if self._closing and not self._live and not self.children:
            self._closed_now()

    def _actor_finished(self, actor: TrioActor) -> None:
        self._live -= 1
        if self._closing and not self._live and not self.children:
            self._closed_now()

    def _closed_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._closed_event is not None:
            self._closed_event.set()
        parent, self.parent = self.parent, None
        if parent is not None:
            parent._child_closed(self)  # noqa: SLF001 - the tree's own bookkeeping
        if self._on_closed is not None:
            self._on_closed(self)
        # Break the reference cycles (actors ↔ supervisor, listeners ↔ session) so that a
        # closed session is freed by reference counting, not left to the garbage collector.
        self.actors = []
        self._crash_listeners = []
        self._on_closed = None
        self._context = _CLOSED_CONTEXT  # it holds `current_supervisor`, this supervisor: a cycle too

    # -- supervision ------------------------------------------------------------

    async def abort(self, reason: AbortReason) -> list[AbortAck]:
        """Send `Abort(reason)` to every live actor, urgent lane; return their acks.

        Each actor cancels its work and answers once that work has unwound, so when
        this returns no work of the session started before the abort is running.
        Idempotent: a second abort finds nothing to cancel. Child groups are aborted in
        the same call, depth first: the acks of every descendant are awaited too.
        """
        if threading.get_ident() != self._thread:
            return trio.from_thread.run(self.abort, reason, trio_token=self._token)
        message = Abort(reason=reason)
        futures: list[Any] = []
        self._ask_abort(message, futures)
        acks: list[AbortAck] = []
        for future in futures:
            try:
                acks.append(await future)
            except ActorDeadError:
                continue  # it stopped (or the group closed) while the abort was on its way
        return acks

    def _ask_abort(self, message: Abort, futures: list[Any]) -> None:
        """Send `message` to every live actor of this group and of its descendants, collecting the futures."""
        futures.extend(
            actor.actor_ref.ask(message, block=False) for actor in self.actors if not actor.actor_stopped.is_set()
        )
        for child in list(self.children):
            child._ask_abort(message, futures)  # noqa: SLF001 - the same class

    def abort_nowait(self, reason: AbortReason) -> None:
        """Send `Abort(reason)` to every live actor without waiting for acks (usable where nothing can await)."""
        message = Abort(reason=reason)
        for actor in self.actors:
            if not actor.actor_stopped.is_set():
                actor.actor_ref.tell(message)
        for child in list(self.children):
            child.abort_nowait(reason)

    async def close(self) -> None:
        """Stop every actor of the session and return when none of its tasks runs. Idempotent."""
        if threading.get_ident() != self._thread:
            trio.from_thread.run(self.close, trio_token=self._token)
            return
        self.close_nowait()
        await self.wait_closed()

    def close_nowait(self) -> None:
        """Give every actor `Shutdown` without waiting for them to stop (`wait_closed` does)."""
        if self._closing:
            return
        self._closing = True
        for child in list(self.children):
            child.close_nowait()
        for actor in list(self.actors):
            actor._shut_down()  # noqa: SLF001 - the supervisor's own message to its actor (a stopped one ignores it)
        if not self._live and not self.children:
            self._closed_now()

    async def wait_closed(self) -> None:
        """Wait until the group has closed, by `close()` or by a crash."""
        if self._closed:
            # A checkpoint still, as trio's own `Event.wait` makes: without it a host's task that closes a
            # session and opens the next goes on in the same step, and `bench abort`'s p99 at C=1000 rose
            # by about a fifth (five interleaved runs each: 235–263 against 177–230 ms).
            await trio.lowlevel.checkpoint()
            return
        if self._closed_event is None:
            self._closed_event = trio.Event()
        await self._closed_event.wait()

    def add_crash_listener(self, listener: Callable[[ActorCrashed], None]) -> None:
        """Call `listener(error)` on the trio thread when an actor of this session crashes."""
        self._crash_listeners.append(listener)

    def live_tasks(self) -> int:
        """How many trio tasks of this session and of its child groups are running (their actors' work)."""
        return sum(actor.busy for actor in self.actors) + sum(child.live_tasks() for child in self.children)

    def _actor_crashed(self, actor: TrioActor, error: BaseException) -> None:
        if self.failure is None:
            self.failure = ActorCrashed(self.session_id, actor.name, error)
            logger.bind(session=self.session_id).error("session closed: actor {} crashed with {!r}", actor.name, error)
            for listener in self._crash_listeners:
                listener(self.failure)
        self.close_nowait()
