"""`TrioActor`: a pykka actor whose handlers run on trio's thread and whose work runs as trio tasks.

It is built on pykka's extension points for new actor types
(`_create_actor_inbox`, `_create_future`, `_start_actor_loop`), on the underscored
members through which pykka's `ActorRef` and `ActorProxy` reach an actor, and on
its private `Envelope` and `_ActorStop`: pykka is pinned exactly for that, and
tests/kernel/test_pykka_contract.py checks each name. It keeps pykka's contract:
`tell`, `ask`, proxies, `on_start` / `on_stop` / `on_failure`,
`ActorDeadError` for mail to a dead actor. What differs, and why:

* **Handlers return at once.** `on_receive` and proxied methods are plain
  functions run on the trio thread, one message at a time, by the thread's
  `Dispatcher` (`queryloop.runtime.kernel._inbox`): an idle actor has no task of its own. Long work
  is never awaited in a handler: a handler that returns a coroutine (an
  `async def` method called through a proxy, say) has that coroutine run as
  *work*, a trio task in the runtime's nursery under a cancel scope the actor
  owns, and its result answers the ask. `start_work` does the same for work
  nobody awaits. The mailbox stays responsive meanwhile.
* **Errors go to whoever asked.** An exception in a handler or in work that
  answers an ask is set on the asker's future. One that nobody would see (a
  `tell`, or `start_work`) crashes the actor: `on_failure` runs and the
  supervisor closes the session with an `ActorCrashed` error.
* **Supervisor messages overtake.** `Abort` arrives through the inbox's urgent
  lane; the actor runs `on_abort`, cancels its abortable work and answers
  `AbortAck` once that work has unwound. Meanwhile only supervisor mail is
  delivered to it; ordinary mail waits, in order.
* **Stopping waits for the work.** `stop()` or the supervisor's `Shutdown` cancel
  all the actor's work; once it has unwound, `on_stop` runs, queued mail is refused
  and the stop is answered.
* **No global registry.** pykka's `ActorRegistry` is one locked list with O(n)
  removal; a `TrioActor` is owned by its `Supervisor` instead, so closing a
  session costs the same with ten or ten thousand sessions alive.
* **Started inside a session.** `Supervisor.spawn(Cls, ...)` starts one (from any
  thread); `Cls.start(...)` works from a handler or work of a session's actor.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
from types import CoroutineType
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Protocol, Self, TypeVar, cast

import pykka
import trio
from loguru import logger
from pykka import ActorDeadError, ActorRef
from pykka._envelope import Envelope  # private: pykka is pinned exactly (tests/kernel/test_pykka_contract.py)
from pykka.messages import ProxyCall, ProxyGetAttr, ProxySetAttr, _ActorStop  # `_ActorStop` likewise

from queryloop.runtime.errors import NotInSession, WorkCancelled
from queryloop.runtime.kernel._future import TrioFuture
from queryloop.runtime.kernel._inbox import OPEN, URGENT_ONLY, Dispatcher, PriorityInbox
from queryloop.runtime.kernel.messages import Abort, AbortAck, AbortReason, Shutdown

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Coroutine

    from loguru import Logger
    from trio.lowlevel import TrioToken

A = TypeVar("A", bound="TrioActor")


class ActorGroup(Protocol):
    """What an actor needs of the group it belongs to (a `Supervisor`).

    Declared here so that the kernel's imports run one way: `supervisor` imports this module,
    never the reverse. The underscored members are the kernel's own, not a host's API.
    """

    session_id: str
    _context: contextvars.Context
    """The session's context (it holds `current_supervisor`): the actor's work runs in it."""
    _nursery: trio.Nursery
    _token: TrioToken
    _thread: int
    _dispatcher: Dispatcher
    """The trio thread the group's actors live on: its token, its id and its dispatcher (their inboxes')."""

    def spawn(self, actor_class: type[A], *args: Any, **kwargs: Any) -> ActorRef[A]: ...

    def _launch(self, actor: TrioActor) -> None: ...

    def _actor_finished(self, actor: TrioActor) -> None: ...

    def _actor_crashed(self, actor: TrioActor, error: BaseException) -> None: ...


current_supervisor: contextvars.ContextVar[ActorGroup] = contextvars.ContextVar("queryloop_current_supervisor")
"""The supervisor of the session being spawned into, or whose work is running."""

_urns = itertools.count(1)

_SHUTDOWN = Shutdown()
"""Every close sends this one (frozen, no field): not validated again for each session."""

_PROXY_MESSAGES = frozenset({ProxyCall, ProxyGetAttr, ProxySetAttr})
"""What pykka's `_handle_receive` answers itself (a proxy's calls); any other message goes to `on_receive`."""

# Life of an actor: NEW → RUNNING ⇄ ABORTING → STOPPING → STOPPED.
_NEW, _RUNNING, _ABORTING, _STOPPING, _STOPPED = range(5)


@functools.cache
def _idle_ack(name: str) -> AbortAck:
    """The ack of an actor the abort found idle (frozen, so one per actor name serves every abort)."""
    return AbortAck(actor=name, cancelled_work=0)


class TrioActorRef(ActorRef[A]):
    """pykka's `ActorRef`, with a `stop()` whose non-blocking future trio can await."""

    actor_inbox: PriorityInbox

    def __init__(self, actor: A) -> None:
        # pykka's, but for its weakref to the actor (below): one object fewer per actor.
        self.actor_class = actor.__class__
        self.actor_urn = actor.actor_urn
        self.actor_inbox = actor.actor_inbox  # a TrioActor's is a PriorityInbox
        self.actor_stopped = actor.actor_stopped  # type: ignore[assignment]  # the inbox: see `TrioActor.__init__`

    @property
    def _actor_weakref(self) -> Callable[[], A | None]:  # type: ignore[override]
        """pykka's weakref to the actor (its proxies call it): the inbox holds the actor until it stops."""
        return self.actor_inbox.actor  # type: ignore[return-value]

    def tell(self, message: Any) -> None:
        """pykka's `tell`, reading the stopped flag itself: no two calls (`is_alive`, `is_set`) per message."""
        inbox = self.actor_inbox
        if inbox.stopped:
            msg = f"{self} not found"
            raise ActorDeadError(msg)
        # Mail an idle actor can take now (most mail) is handled without an envelope; a supervisor message
        # (its own lane) or mail that must queue goes through `put`.
        if not inbox.deliver_now(message):
            inbox.put(Envelope(message))

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

    actor_inbox: PriorityInbox  # pykka's `ActorInbox`, and more (`set_gate`, `stopped`)
    actor_stopped: PriorityInbox  # type: ignore[assignment]  # pykka's is a `threading.Event`: ours has its interface

    _work_task_name: ClassVar[str] = "queryloop.TrioActor work"
    """The name of this class's work tasks in trio (made once per class: trio would format one per task)."""

    _has_on_start: ClassVar[bool] = False
    _has_on_stop: ClassVar[bool] = False
    """Whether the class overrides pykka's `on_start` / `on_stop` (most do not: no call to the empty hook)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._work_task_name = f"{cls.__module__}.{cls.__qualname__} work"
        cls._has_on_start = cls.on_start is not pykka.Actor.on_start
        cls._has_on_stop = cls.on_stop is not pykka.Actor.on_stop

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        supervisor = current_supervisor.get(None)
        if supervisor is None:
            msg = (
                f"{type(self).__name__} must be started inside a session: "
                "use `supervisor.spawn(...)`, or `.start()` from a running actor"
            )
            raise NotInSession(msg)
        # pykka.Actor.__init__'s contract (urn, inbox, stopped flag, ref), made cheaper: a counter
        # URN instead of uuid4, and the inbox's flag instead of a threading.Event (Condition, Lock and
        # deque, for every actor of every session) since only is_set()/set() are ever used.
        self.actor_urn = f"urn:queryloop:{supervisor.session_id}:{next(_urns)}"
        self.actor_inbox = PriorityInbox(self, supervisor._token, supervisor._thread, supervisor._dispatcher)  # noqa: SLF001
        self.actor_stopped = self.actor_inbox  # the inbox carries the stopped flag (`PriorityInbox.is_set`)
        self._actor_ref = TrioActorRef(self)
        self.supervisor: ActorGroup = supervisor
        self._state = _NEW
        self._crashed = False
        # Made on first use (most actors of most sessions never need them; the GC would still walk them).
        self._work: dict[trio.CancelScope, bool] | None = None
        """Every running piece of work: its cancel scope → whether an `Abort` cancels it."""
        self._abortable_work = 0
        self._abort_acks: list[tuple[TrioFuture[Any] | None, int]] | None = None
        self._stop_reply: TrioFuture[Any] | None = None
        self._log: Logger | None = None

    # -- pykka's extension points -------------------------------------------------

    @classmethod
    def start(cls, *args: Any, **kwargs: Any) -> ActorRef[Self]:
        """Start an actor in the session whose handler or work calls this (no global registry)."""
        running = cast("TrioActor | None", Dispatcher.for_this_thread().current)
        supervisor = running.supervisor if running is not None else current_supervisor.get(None)
        if supervisor is None:
            msg = (
                f"{cls.__name__} must be started inside a session: "
                "use `supervisor.spawn(...)`, or `.start()` from a running actor"
            )
            raise NotInSession(msg)
        return supervisor.spawn(cls, *args, **kwargs)

    @staticmethod
    def _create_actor_inbox() -> NoReturn:
        msg = "a TrioActor makes its inbox itself (it needs the actor)"
        raise NotImplementedError(msg)

    @staticmethod
    def _create_future() -> TrioFuture[Any]:
        return TrioFuture()

    def _start_actor_loop(self) -> None:
        """Join the supervisor's group, run `on_start`, then open the inbox."""
        self.supervisor._launch(self)  # noqa: SLF001 - the supervisor owns the actor
        self._state = _RUNNING
        if self._has_on_start:
            try:
                self.on_start()
            except Exception as error:  # noqa: BLE001 - a crash of this actor, reported to its supervisor
                self._crash(error)
                return
        self.actor_inbox.set_gate(OPEN)

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

    def after_handlers(self, fn: Callable[[], None]) -> None:
        """Call `fn()` on the trio thread as soon as no handler is running (at once if none is).

        For a handler whose follow-up must ask other actors and use their answers before any
        task runs: there, as in work, an ask to an idle actor whose handler returns at once is
        answered before `ask` returns. An error in `fn` crashes this actor.
        """

        def guarded() -> None:
            if self._state >= _STOPPING:
                return
            try:
                fn()
            except Exception as error:  # noqa: BLE001 - a crash of this actor, reported to its supervisor
                self._crash(error)

        self.actor_inbox._dispatcher.after_handlers(guarded)  # noqa: SLF001

    def start_work(
        self, async_fn: Callable[..., Awaitable[Any]], *args: Any, abortable: bool = True
    ) -> trio.CancelScope:
        """Run `async_fn(*args)` as a task of this actor; an error in it crashes the actor.

        Returns the cancel scope the work runs under, for an actor that cancels one
        piece of work alone. An `Abort` cancels abortable work (and waits for it)
        before it is acked. Work started with `abortable=False` is left to the actor's
        `on_abort`, for work that must itself finish the job an abort interrupts;
        stopping the actor (or closing the session) still cancels it.
        """
        return self._start_work(async_fn(*args), None, abortable=abortable)  # type: ignore[arg-type]

    @property
    def busy(self) -> int:
        """How many work tasks of this actor are running (abortable or not)."""
        return len(self._work) if self._work else 0

    # -- delivery (called by the dispatcher, one envelope at a time) ----------------

    def _handle(self, message: Any, reply_to: TrioFuture[Any] | None) -> None:
        kind = type(message)
        if kind is Abort:
            self._abort(message.reason, reply_to)
            return
        if kind is Shutdown:
            self._begin_stop(None)
            return
        if kind is _ActorStop:
            self._begin_stop(reply_to)  # pykka answers a stop once on_stop has run
            return
        dispatcher = self.actor_inbox._dispatcher  # noqa: SLF001
        dispatcher.current = self
        try:
            # pykka's `_handle_receive` tests every message against its proxy messages first; ours go straight on.
            response = self._handle_receive(message) if kind in _PROXY_MESSAGES else self.on_receive(message)
        except Exception as error:  # noqa: BLE001 - to the asker, or a crash of this actor
            if reply_to is None:
                self._crash(error)
            else:
                reply_to.fail(error)
            return
        finally:
            dispatcher.current = None
        if type(response) is CoroutineType:
            try:
                self._start_work(response, reply_to)
            except ActorDeadError as error:
                if reply_to is None:
                    self._crash(error)
                else:
                    reply_to.fail(error)
        elif reply_to is not None:
            reply_to.set(response)

    # -- work -------------------------------------------------------------------------

    def _start_work(
        self, coro: Coroutine[Any, Any, Any], reply_to: TrioFuture[Any] | None, *, abortable: bool = True
    ) -> trio.CancelScope:
        if self._state >= _STOPPING:
            coro.close()
            msg = f"{self} is stopping"
            raise ActorDeadError(msg)
        # The scope is registered now, not when the task first runs: an Abort handled in between
        # must cancel this work too (it then stops at its first checkpoint).
        scope = trio.CancelScope()
        work = self._work
        if work is None:
            work = self._work = {}
        work[scope] = abortable
        if abortable:
            self._abortable_work += 1
            if self._state == _ABORTING:
                scope.cancel()  # started by work the abort is unwinding: it belongs to the abort
        supervisor = self.supervisor
        try:
            # In the session's context, whatever task's mail started it (a host's, another session's).
            context, spawn = supervisor._context, supervisor._nursery.start_soon  # noqa: SLF001
            # typeshed's `Context.run` does not pass keywords on to the callable's own signature.
            context.run(spawn, self._run_work, coro, reply_to, scope, name=self._work_task_name)  # type: ignore[arg-type]
        except RuntimeError as error:  # the runtime's nursery has closed under this actor
            coro.close()
            del work[scope]
            if abortable:
                self._abortable_work -= 1
            msg = f"{self} cannot start work: its runtime has closed"
            raise ActorDeadError(msg) from error
        return scope

    async def _run_work(
        self, coro: Coroutine[Any, Any, Any], reply_to: TrioFuture[Any] | None, scope: trio.CancelScope
    ) -> None:
        try:
            # `with scope:` written out: a `with` keeps its bound `__exit__` on the suspended frame, one object
            # more per piece of work in flight (two or three a loop, at every collection).
            scope.__enter__()
            try:
                result = await coro
                if reply_to is not None:
                    reply_to.set(result)
            except BaseException as raised:
                if not scope.__exit__(type(raised), raised, raised.__traceback__):
                    raise
            else:
                scope.__exit__(None, None, None)
        except Exception as error:  # noqa: BLE001 - to the asker, or a crash of this actor
            if reply_to is None:
                self._crash(error)
            else:
                reply_to.fail(error)
        finally:
            self._work_done(scope, reply_to)

    def _work_done(self, scope: trio.CancelScope, reply_to: TrioFuture[Any] | None) -> None:
        if self._work is not None and self._work.pop(scope):
            self._abortable_work -= 1
        if reply_to is not None and not reply_to.done():
            reply_to.fail(WorkCancelled(f"{self.name}: work cancelled before it answered"))
        if self._state == _ABORTING and not self._abortable_work:
            self._state = _RUNNING
            self._send_abort_acks()
            self.actor_inbox.set_gate(OPEN)
        elif self._state == _STOPPING and not self._work:
            self._finish()

    # -- supervision --------------------------------------------------------------------

    def _abort(self, reason: AbortReason, reply_to: TrioFuture[Any] | None) -> None:
        try:
            self.on_abort(reason)
        except Exception as error:  # noqa: BLE001 - a crash of this actor, reported to its supervisor
            self._crash(error)
            if reply_to is not None:
                reply_to.fail(ActorDeadError(f"{self} crashed in on_abort"))
            return
        cancelled = 0
        for scope, abortable in (self._work or {}).items():
            if abortable and not scope.cancel_called:
                scope.cancel()
                cancelled += 1
        if not self._abortable_work and self._state < _STOPPING:
            if reply_to is not None:
                reply_to.set(
                    _idle_ack(self.name) if not cancelled else AbortAck(actor=self.name, cancelled_work=cancelled)
                )
            return
        # Answered once the cancelled work has unwound; meanwhile only supervisor mail comes in.
        if self._abort_acks is None:
            self._abort_acks = []
        self._abort_acks.append((reply_to, cancelled))
        if self._state == _RUNNING:
            self._state = _ABORTING
            self.actor_inbox.set_gate(URGENT_ONLY)

    def _send_abort_acks(self) -> None:
        acks, self._abort_acks = self._abort_acks or [], None
        for reply_to, cancelled in acks:
            if reply_to is not None and not reply_to.done():
                reply_to.set(AbortAck(actor=self.name, cancelled_work=cancelled))

    def _shut_down(self) -> None:
        """`Shutdown`, from the supervisor: handled at once when its mail would be, without the mail
        (nothing, when the actor has stopped, or crashed and is stopping)."""
        if self.actor_inbox.stopped:
            return
        if not self.actor_inbox.handle_urgent_now(self._begin_stop):
            self.actor_ref.tell(_SHUTDOWN)

    def _begin_stop(self, reply_to: TrioFuture[Any] | None = None) -> None:
        """Cancel all work; finish (on_stop, refuse the mail left, answer) once it has unwound."""
        if reply_to is not None:
            self._stop_reply = reply_to
        if self._state >= _STOPPING:
            return
        self._state = _STOPPING
        work = self._work
        if not work:
            self._finish()  # nothing to unwind: the inbox closes now, with no gate in between
            return
        self.actor_inbox.set_gate(URGENT_ONLY)
        for scope in work:
            scope.cancel()

    def _finish(self) -> None:
        self._state = _STOPPED
        self.actor_inbox.stopped = True
        if self._has_on_stop and not self._crashed:
            try:
                self.on_stop()
            except Exception:
                self.log.exception("on_stop raised")
        # A string, not the actor (no actor <-> inbox cycle); formatted now, as cheap as a closure to format it later.
        why = f"{type(self).__name__} ({self.actor_urn}) stopped before handling the message"
        self.actor_inbox.close(why)
        if self._abort_acks:
            self._send_abort_acks()
        if self._stop_reply is not None:
            self._stop_reply.set(None)
            self._stop_reply = None
        self.supervisor._actor_finished(self)  # noqa: SLF001

    def _crash(self, error: BaseException) -> None:
        if self._crashed or self._state == _STOPPED:
            self.log.opt(exception=error).error("error after the actor crashed")
            return
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
            error = error.exceptions[0]
        self._crashed = True
        self.actor_inbox.stopped = True
        self.log.opt(exception=error).error("actor crashed")
        try:
            self.on_failure(type(error), error, error.__traceback__)
        except Exception:
            self.log.exception("on_failure raised")
        self.supervisor._actor_crashed(self, error)  # noqa: SLF001
        self._begin_stop(None)
