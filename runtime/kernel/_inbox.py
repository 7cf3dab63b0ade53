"""`PriorityInbox` and `Dispatcher`: how mail reaches a `TrioActor`'s handlers.

An actor's handlers are plain functions that return at once (long work runs in
trio tasks of its own), so an idle actor needs no task parked on its mailbox:
a message is handled by the trio thread's `Dispatcher`, right when it is put
if nothing else is being handled, else as soon as the handler running now (and
the mail queued before it) has returned. Invariants:

* **One handler at a time per thread**, never re-entered: mail sent by a handler
  is queued and handled after that handler returns, not inside it.
* **Per-actor order**: an actor's ordinary mail is handled in the order it was
  put; its urgent lane (`queryloop.runtime.kernel.messages.SupervisorMessage`) is handled before
  any ordinary mail still queued.
* **Gates**: an actor that is not started yet gets nothing delivered; one that is
  aborting or stopping (waiting for its work to unwind) only its urgent lane.
  Mail waits in the inbox meanwhile and flows again when the gate opens.
* **After the handlers**: `after_handlers(fn)` runs `fn` once no handler is running
  (at once if none is; else when the mail queued meanwhile has been handled too).
  There, as in work, an ask to an idle actor whose handler returns at once is
  answered before `ask` returns.
* **Threads**: `put` from the inbox's own trio thread queues directly; from any
  other thread it is handed to that thread through the `TrioToken`, so an inbox
  and its dispatcher are only ever touched on their trio thread.

Why not a task per actor: a parked task costs a coroutine stack, a context and a
cancel status per actor, kept by every idle session, and every message costs a
reschedule and a task switch; trio's run queue then carries six tasks per
session. Delivery here costs a function call. What is awaited (model calls,
tools) still runs as trio tasks, under cancel scopes the actor owns.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from pykka import ActorDeadError
from pykka.messages import _ActorStop  # private: pykka is pinned exactly (tests/kernel/test_pykka_contract.py)
from trio.lowlevel import TrioToken, current_trio_token

from queryloop.runtime.kernel.messages import SupervisorMessage

if TYPE_CHECKING:
    from collections.abc import Callable

    from pykka._envelope import Envelope  # private, as above

    from queryloop.runtime.kernel._future import TrioFuture


class Recipient(Protocol):
    """What the dispatcher needs of an actor (a `TrioActor`): declared here, so that the kernel's
    imports run one way (`actor` imports this module, never the reverse)."""

    def _handle(self, message: Any, reply_to: TrioFuture[Any] | None) -> None:
        """Handle one message (`reply_to`: its asker's future); route every `Exception` itself (to the asker,
        or as a crash)."""


CLOSED = 0
"""Gate: nothing is delivered (not started yet)."""
URGENT_ONLY = 1
"""Gate: supervisor mail only (the actor waits for its work to unwind)."""
OPEN = 2
"""Gate: all mail, urgent lane first."""


class Dispatcher:
    """Runs the handlers of every actor of one trio thread, one message at a time."""

    __slots__ = ("_after", "_ready", "_running", "current")

    _local = threading.local()

    def __init__(self) -> None:
        self._ready: deque[PriorityInbox] = deque()
        self._after: deque[Callable[[], None]] = deque()
        self._running = False
        self.current: Recipient | None = None
        """The actor whose handler is running now (None between handlers)."""

    @classmethod
    def for_this_thread(cls) -> Dispatcher:
        try:
            dispatcher: Dispatcher = cls._local.dispatcher
        except AttributeError:
            dispatcher = cls._local.dispatcher = cls()
        return dispatcher

    def schedule(self, inbox: PriorityInbox) -> None:
        """`inbox` has deliverable mail (it is not queued here already): deliver it in turn."""
        self._ready.append(inbox)
        if not self._running:
            self._run()

    def after_handlers(self, fn: Callable[[], None]) -> None:
        """Call `fn()` once no handler is running: now, or when the current run of handlers ends."""
        if self._running:
            self._after.append(fn)
        else:
            fn()

    def deliver(self, recipient: Recipient, message: Any, reply_to: TrioFuture[Any] | None) -> None:
        """Handle `message` now, as `_run` would: no handler is running and nothing waits ahead of it
        (`PriorityInbox.deliver_now`, for the mail of an idle actor: most mail)."""
        self._running = True
        try:
            recipient._handle(message, reply_to)  # noqa: SLF001 - it routes every Exception itself
        except BaseException:
            self._running = False
            if self._ready:  # only a BaseException (KeyboardInterrupt) gets here: the mail it sent goes on later
                current_trio_token().run_sync_soon(self._resume)
            raise
        self._running = False
        if self._ready or self._after:
            self._run()  # the mail the handler sent, then the callbacks

    def handle_now(self, fn: Callable[[], None]) -> bool:
        """Run `fn()` as a handler, now, if no handler is running (else do nothing): the mail it sends is
        handled after it, then the `after_handlers` callbacks, as for a handler of queued mail. Whether it ran."""
        if self._running:
            return False
        self._running = True
        try:
            fn()
        finally:
            self._running = False
        if self._ready or self._after:
            self._run()  # the mail `fn` sent, then the callbacks
        return True

    def _run(self) -> None:
        self._running = True
        ready = self._ready
        try:
            while ready:
                inbox = ready.popleft()
                inbox._scheduled = False  # noqa: SLF001 - the inbox's delivery state is the dispatcher's
                envelope = inbox._next()  # noqa: SLF001
                if envelope is None:
                    continue
                actor = inbox._actor  # noqa: SLF001
                assert actor is not None
                actor._handle(envelope.message, envelope.reply_to)  # type: ignore[arg-type]  # noqa: SLF001 - ours are TrioFutures
                if inbox._normal or inbox._urgent:  # noqa: SLF001 - more mail: in turn again (most inboxes: none)
                    inbox.wake()
        finally:
            self._running = False
            if ready:
                # Only a BaseException (KeyboardInterrupt) gets here with mail left: go on later.
                current_trio_token().run_sync_soon(self._resume)
        after = self._after
        while after and not self._running:
            after.popleft()()  # each routes its own errors (`TrioActor.after_handlers`)

    def _resume(self) -> None:
        if self._ready and not self._running:
            self._run()


class PriorityInbox:
    """An actor's mailbox; satisfies pykka's `ActorInbox` protocol (`put`, `get`, `empty`)."""

    __slots__ = (
        "_actor",
        "_closed",
        "_dispatcher",
        "_gate",
        "_normal",
        "_scheduled",
        "_thread",
        "_token",
        "_urgent",
        "stopped",
    )

    def __init__(self, actor: Recipient, token: TrioToken, thread: int, dispatcher: Dispatcher) -> None:
        # Built on the trio thread (actors are constructed there), which it then belongs to: `token`, `thread`
        # and `dispatcher` are that thread's (the actor's group keeps them, for all its actors).
        self._token = token
        self._thread = thread
        self._dispatcher = dispatcher
        self._actor: Recipient | None = actor
        # Each lane made when mail first waits in it: most actors' mail is handled as it is put (`_put`).
        self._urgent: deque[Envelope[Any]] | None = None
        self._normal: deque[Envelope[Any]] | None = None
        self._gate = CLOSED
        self._scheduled = False
        self._closed: str | None = None
        """Why mail is refused (None: it is not)."""
        self.stopped = False
        """The actor's stopped flag (`is_set`), set when it stops or crashes; a bool, read from any thread."""

    # -- the actor's stopped flag -----------------------------------------------------
    # pykka's `Actor.actor_stopped` is a `threading.Event` (a Condition, a Lock and a deque per actor) of which
    # only `is_set()` and `set()` are used: a `TrioActor`'s is its inbox, through these two (an object fewer
    # per actor, and its refs' `tell` reads `stopped` on the inbox it holds anyway).

    def is_set(self) -> bool:
        return self.stopped

    def set(self) -> None:
        self.stopped = True

    def actor(self) -> Recipient | None:
        """The actor until it stops (`close`), else None: what a `TrioActorRef` has for pykka's weakref."""
        return self._actor

    def put(self, envelope: Envelope[Any], /) -> None:
        if threading.get_ident() == self._thread:
            self._put(envelope)
        else:
            self._token.run_sync_soon(self._put, envelope)

    def _takes_mail_now(self) -> bool:
        """The actor is open (not starting, aborting, stopping or stopped: a closed inbox's gate is CLOSED) and
        idle (nothing of it queued), and no handler runs: ordinary mail put now is handled now."""
        return self._gate == OPEN and not (
            self._scheduled or self._normal or self._urgent or self._dispatcher._running  # noqa: SLF001
        )

    def deliver_now(self, message: Any) -> bool:
        """Handle ordinary `message` now, without an envelope, if `put` would (`_takes_mail_now`, on the inbox's
        thread): a `tell` to an idle actor. Whether it was."""
        if (
            isinstance(message, SupervisorMessage)  # its own lane: `put`
            or threading.get_ident() != self._thread
            or not self._takes_mail_now()
        ):
            return False
        self._dispatcher.deliver(self._actor, message, None)  # type: ignore[arg-type]  # open: the actor is set
        return True

    def _put(self, envelope: Envelope[Any]) -> None:
        if self._closed is not None:
            _refuse(envelope, self._closed)
            return
        if isinstance(envelope.message, SupervisorMessage):
            if self._urgent is None:
                self._urgent = deque()
            self._urgent.append(envelope)
        elif self._takes_mail_now():  # handled now, as `_run` would, without the queue (an ask, a foreign put)
            self._dispatcher.deliver(self._actor, envelope.message, envelope.reply_to)  # type: ignore[arg-type]
            return
        else:
            if self._normal is None:
                self._normal = deque()
            self._normal.append(envelope)
        self.wake()

    def handle_urgent_now(self, fn: Callable[[], None]) -> bool:
        """Run `fn()` now, as the handler of supervisor mail put now would run (the caller on the inbox's
        thread, no handler running, the gate letting urgent mail through, none queued), without the
        mail; else do nothing. Whether it ran."""
        if self._gate == CLOSED or self._urgent or threading.get_ident() != self._thread:
            return False
        return self._dispatcher.handle_now(fn)

    def set_gate(self, gate: int) -> None:
        """Let through nothing (`CLOSED`), supervisor mail only (`URGENT_ONLY`) or all (`OPEN`)."""
        self._gate = gate
        self.wake()

    def wake(self) -> None:
        """Hand the inbox to the dispatcher if it holds mail its gate lets through."""
        if self._scheduled:
            return
        gate = self._gate
        if (gate and self._urgent) or (gate == OPEN and self._normal):
            self._scheduled = True
            self._dispatcher.schedule(self)

    def _next(self) -> Envelope[Any] | None:
        if self._gate and self._urgent:
            return self._urgent.popleft()
        if self._gate == OPEN and self._normal:
            return self._normal.popleft()
        return None

    def get(self) -> Envelope[Any]:
        """Take the next envelope, urgent lane first, whatever the gate."""
        return self._urgent.popleft() if self._urgent else self._normal.popleft()  # type: ignore[union-attr]

    def empty(self) -> bool:
        return not (self._urgent or self._normal)

    def close(self, why: str) -> None:
        """Refuse what is queued and all later mail: asks fail with `ActorDeadError(why)`."""
        self._closed = why
        self._gate = CLOSED
        self._actor = None  # the actor ↔ inbox cycle is broken: a stopped actor is freed by refcount
        while self._urgent or self._normal:
            _refuse(self.get(), why)

    def __len__(self) -> int:
        return len(self._urgent or ()) + len(self._normal or ())


def _refuse(envelope: Envelope[Any], why: str) -> None:
    """Answer mail that reached a dead actor as pykka does: a stop succeeds, an ask fails."""
    reply_to: TrioFuture[Any] | None = envelope.reply_to  # type: ignore[assignment]
    if reply_to is None or reply_to.done():
        return
    if isinstance(envelope.message, _ActorStop):
        reply_to.set(None)
    else:
        reply_to.fail(ActorDeadError(why))
