"""`TrioActor`: a pykka actor whose loop is a trio task of its session's supervisor.

It is built on pykka's extension points for new actor types
(`_create_actor_inbox`, `_create_future`, `_start_actor_loop`) and keeps
pykka's contract: `tell`, `ask`, proxies, `on_start` / `on_stop` /
`on_failure`, `ActorDeadError` for mail to a dead actor. What differs, and why:

* **Handlers return at once.** `on_receive` and proxied methods are plain
  functions run on the trio thread. Long work is never awaited in a handler: a
  handler that returns a coroutine (an `async def` method called through a
  proxy, say) has that coroutine run as *work* in the actor's own nursery, under
  its own cancel scope, and its result answers the ask. `start_work` does the
  same for work nobody awaits. The mailbox stays responsive meanwhile.
* **Errors go to whoever asked.** An exception in a handler or in work that
  answers an ask is set on the asker's future. One that nobody would see (a
  `tell`, or `start_work`) crashes the actor: `on_failure` runs and the
  supervisor closes the session with an `ActorCrashed` error.
* **Supervisor messages overtake.** `Abort` arrives through the inbox's urgent
  lane; the actor runs `on_abort`, cancels all its work, waits until that work has
  unwound and answers `AbortAck`. Only then does it read ordinary mail again.
* **No global registry.** pykka's `ActorRegistry` is one locked list with O(n)
  removal; a `TrioActor` is owned by its `Supervisor` instead, so closing a
  session costs the same with ten or ten thousand sessions alive.
* **Started inside a session.** `Supervisor.spawn(Cls, ...)` starts one (from any
  thread); `Cls.start(...)` works from code already running in a session's actor.
"""

from __future__ import annotations

import contextvars
import itertools
from types import CoroutineType
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

import pykka
import trio
from loguru import logger
from pykka import ActorDeadError, ActorRef
from pykka.messages import _ActorStop

from runtime._future import TrioFuture
from runtime._inbox import PriorityInbox
from runtime.errors import NotInSession, WorkCancelled
from runtime.messages import Abort, AbortAck, AbortReason, Shutdown

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

    from loguru import Logger
    from pykka._actor import ActorInbox

    from runtime.supervisor import Supervisor

current_supervisor: contextvars.ContextVar[Supervisor] = contextvars.ContextVar("queryloop_current_supervisor")
"""The supervisor of the session whose code is running; set for every actor's task."""


A = TypeVar("A", bound="TrioActor")
_PendingWork = tuple["Coroutine[Any, Any, Any]", "TrioFuture[Any] | None", trio.CancelScope]
_urns = itertools.count(1)


class _StoppedFlag:
    """The actor's stopped flag: `is_set()` / `set()` as on the `threading.Event` pykka uses.

    Set once, read from any thread: a bool read is atomic, no lock is needed.
    """

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True


class TrioActorRef(ActorRef[A]):
    """pykka's `ActorRef`, with a `stop()` whose non-blocking future trio can await."""

    def stop(self, *, block: bool = True, timeout: float | None = None) -> Any:
        asked: TrioFuture[None] = self.ask(_ActorStop(), block=False)  # type: ignore[assignment]
        stopped: TrioFuture[bool] = TrioFuture()

        def settle(future: TrioFuture[None]) -> None:
            try:
                future.get_nowait()
            except ActorDeadError:
                stopped.set(False)  # it was already dead: pykka's answer
            except Exception as error:  # noqa: BLE001 - handed to whoever reads the future
                stopped.fail(error)
            else:
                stopped.set(True)

        asked.add_done_callback(settle)
        return stopped.get(timeout=timeout) if block else stopped

    def busy(self) -> int:
        """How many work tasks the actor is running: a cheap read, like pykka's `is_alive()`."""
        actor = self._actor_weakref()
        return 0 if actor is None else actor.busy


class TrioActor(pykka.Actor):
    """Base class of every queryloop actor. Subclass it as you would `pykka.ThreadingActor`."""

    actor_name: ClassVar[str | None] = None
    """Name used in logs and `AbortAck`s; the class name when not set."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        supervisor = current_supervisor.get(None)
        if supervisor is None:
            msg = (
                f"{type(self).__name__} must be started inside a session: "
                "use `supervisor.spawn(...)`, or `.start()` from a running actor"
            )
            raise NotInSession(msg)
        # pykka.Actor.__init__'s contract (urn, inbox, stopped flag, ref), made cheaper: a counter
        # URN instead of uuid4, and a plain flag instead of a threading.Event (Condition, Lock and
        # deque, for every actor of every session) since only is_set()/set() are ever used.
        self.actor_urn = f"urn:queryloop:{supervisor.session_id}:{next(_urns)}"
        self.actor_inbox = self._create_actor_inbox()
        self.actor_stopped = _StoppedFlag()  # type: ignore[assignment]
        self._actor_ref = TrioActorRef(self)
        self.supervisor: Supervisor = supervisor
        self._work_nursery: trio.Nursery | None = None
        # Made on first use (most actors of most sessions never need them; the GC would still walk them).
        self._pending_work: list[tuple[Coroutine[Any, Any, Any], TrioFuture[Any] | None, trio.CancelScope]] | None = (
            None
        )
        self._running = False
        self._work_scopes: set[trio.CancelScope] | None = None
        self._work_drained: trio.lowlevel.ParkingLot | None = None
        self._log: Logger | None = None
        self._stop_reply: TrioFuture[Any] | None = None
        self._live_work = 0
        self._aborting = False

    # -- pykka's extension points -------------------------------------------------

    @classmethod
    def start(cls, *args: Any, **kwargs: Any) -> ActorRef[Self]:
        """Construct the actor and start its loop in the current session (no global registry)."""
        actor = cls(*args, **kwargs)
        actor._start_actor_loop()
        return actor.actor_ref

    @staticmethod
    def _create_actor_inbox() -> ActorInbox:
        return PriorityInbox()

    @staticmethod
    def _create_future() -> TrioFuture[Any]:
        return TrioFuture()

    def _start_actor_loop(self) -> None:
        self.supervisor._launch(self)  # noqa: SLF001 - the supervisor owns the actor's task

    # -- extension points of our own ----------------------------------------------

    @property
    def name(self) -> str:
        return self.actor_name or type(self).__name__

    @property
    def log(self) -> Logger:
        """A loguru logger bound to this actor's session and name (made on first use)."""
        if self._log is None:
            self._log = logger.bind(session=self.supervisor.session_id, actor=self.name)
        return self._log

    def on_abort(self, reason: AbortReason) -> None:
        """Called on `Abort`, before the actor's work is cancelled. Override to record what was cut."""

    def start_work(self, async_fn: Callable[..., Awaitable[Any]], *args: Any, abortable: bool = True) -> None:
        """Run `async_fn(*args)` in this actor's nursery; an error in it crashes the actor.

        An `Abort` cancels abortable work (and waits for it) before it is acked.
        Work started with `abortable=False` is left to the actor's `on_abort`, for
        work that must itself finish the job an abort interrupts; closing the
        session still cancels it.
        """
        self._start_work(async_fn(*args), None, abortable=abortable)  # type: ignore[arg-type]

    @property
    def busy(self) -> int:
        """How many work tasks of this actor are running (abortable or not)."""
        return self._live_work

    # -- the loop -------------------------------------------------------------------

    async def _actor_main(self) -> None:
        crashed = False
        self._running = True
        try:
            self.on_start()
            # The work nursery is opened on the first work only: many actors of many sessions
            # never need one, and an idle nursery costs time to open and memory to keep.
            if self._pending_work or await self._serve():
                async with trio.open_nursery() as work:
                    self._work_nursery = work
                    for coro, reply_to, scope in self._pending_work or ():
                        work.start_soon(self._run_work, coro, reply_to, scope)
                    self._pending_work = None
                    await self._serve()
                    work.cancel_scope.cancel()
        except* Exception as group:  # noqa: BLE001 - a crash of this actor, reported below
            crashed = True
            self._crash(group)
        finally:
            self._running = False
            self._work_nursery = None
            for coro, reply_to, scope in self._pending_work or ():
                coro.close()
                self._work_done(scope, reply_to)
            self._pending_work = None
            self.actor_stopped.set()
            if not crashed:
                try:
                    self.on_stop()
                except Exception:
                    self.log.exception("on_stop raised")
            self._fail_undelivered()
            if self._stop_reply is not None:
                self._stop_reply.set(None)

    async def _serve(self) -> bool:
        """Handle mail until the actor stops (False) or, before it has one, needs its work nursery (True)."""
        inbox: PriorityInbox = self.actor_inbox  # type: ignore[assignment]
        stopped = self.actor_stopped
        while not stopped.is_set():
            if self._pending_work:
                return True
            envelope = await inbox.receive()
            message = envelope.message
            reply_to: TrioFuture[Any] | None = envelope.reply_to  # type: ignore[assignment]
            if type(message) is Abort:
                await self._abort(message, reply_to)
                continue
            if type(message) is Shutdown:
                return False  # the caller cancels what work is left on its way out
            if type(message) is _ActorStop:
                # pykka answers a stop once on_stop has run: the reply waits for the teardown.
                self._stop_reply = reply_to
                return False
            try:
                response = self._handle_receive(message)
            except Exception as error:
                if reply_to is None:
                    raise
                reply_to.fail(error)
                continue
            if type(response) is CoroutineType:
                self._start_work(response, reply_to)
            elif reply_to is not None:
                reply_to.set(response)
        return False

    def _start_work(
        self, coro: Coroutine[Any, Any, Any], reply_to: TrioFuture[Any] | None, *, abortable: bool = True
    ) -> None:
        nursery = self._work_nursery
        if nursery is None and not self._running:
            coro.close()
            msg = f"{self} is not running"
            raise ActorDeadError(msg)
        # The scope is registered now, not when the task first runs: an Abort handled in between
        # must cancel this work too (it then stops at its first checkpoint).
        scope = trio.CancelScope()
        if abortable:
            if self._work_scopes is None:
                self._work_scopes = set()
            self._work_scopes.add(scope)
            if self._aborting:
                scope.cancel()  # started by work the abort is unwinding: it belongs to the abort
        self._live_work += 1
        if nursery is not None:
            nursery.start_soon(self._run_work, coro, reply_to, scope)
        else:
            if self._pending_work is None:
                self._pending_work = []
            self._pending_work.append((coro, reply_to, scope))  # started once the nursery is open

    def _work_done(self, scope: trio.CancelScope, reply_to: TrioFuture[Any] | None) -> None:
        self._live_work -= 1
        scopes = self._work_scopes
        if scopes is not None:
            scopes.discard(scope)
        if reply_to is not None and not reply_to.done():
            reply_to.fail(WorkCancelled(f"{self.name}: work cancelled before it answered"))
        if not scopes and self._work_drained is not None:
            self._work_drained.unpark_all()

    async def _run_work(
        self, coro: Coroutine[Any, Any, Any], reply_to: TrioFuture[Any] | None, scope: trio.CancelScope
    ) -> None:
        try:
            with scope:
                result = await coro
                if reply_to is not None:
                    reply_to.set(result)
        except Exception as error:
            if reply_to is None:
                raise
            reply_to.fail(error)
        finally:
            self._work_done(scope, reply_to)

    async def _abort(self, message: Abort, reply_to: TrioFuture[Any] | None) -> None:
        self.on_abort(message.reason)
        scopes = self._work_scopes or set()
        cancelled = len(scopes)
        for scope in scopes:
            scope.cancel()
        if scopes:
            if self._work_drained is None:
                self._work_drained = trio.lowlevel.ParkingLot()
            self._aborting = True
            try:
                while scopes:
                    await self._work_drained.park()
            finally:
                self._aborting = False
        if reply_to is not None:
            reply_to.set(AbortAck(actor=self.name, cancelled_work=cancelled))

    def _crash(self, group: BaseExceptionGroup[Exception]) -> None:
        error: BaseException = group
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        self.actor_stopped.set()
        self.log.opt(exception=error).error("actor crashed")
        try:
            self.on_failure(type(error), error, error.__traceback__)
        except Exception:
            self.log.exception("on_failure raised")
        self.supervisor._actor_crashed(self, error)  # noqa: SLF001

    def _fail_undelivered(self) -> None:
        inbox: PriorityInbox = self.actor_inbox  # type: ignore[assignment]
        inbox.close(f"{self} stopped before handling the message")
