"""What the kernel relies on in pykka beyond its public API, one test per promise.

`TrioActor` and `TrioActorRef` (queryloop/runtime/kernel/actor.py, _inbox.py) are pykka actors and refs,
so that actors are written as pykka's, but they are built on names pykka keeps private: its `Envelope`,
its `_ActorStop` message, and the underscored members through which its `Actor`, `ActorRef` and
`ActorProxy` work together. Any pykka release may change those, so pyproject.toml pins pykka exactly,
and a new pykka is taken by moving the pin once these tests pass with it (a test failing here names
what the kernel must follow).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import sys
import tomllib
import typing
from typing import Any

import pykka
import pykka.messages
from pykka._envelope import Envelope
from pykka.messages import ProxyCall, ProxyGetAttr, ProxySetAttr, _ActorStop

from tests import helpers

PYPROJECT = helpers.REPO / "pyproject.toml"


def test_pykka_is_pinned_to_the_release_installed_here() -> None:
    # These tests speak for one release: the pin says which, and it is the one they ran against.
    dependencies: list[str] = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pins = [d for d in dependencies if re.match(r"pykka\b", d)]
    assert pins == [f"pykka=={importlib.metadata.version('pykka')}"]


# -- the messages ----------------------------------------------------------------------------


def test_an_envelope_carries_a_message_and_the_askers_future() -> None:
    # `PriorityInbox` queues pykka's envelopes and reads `message` and `reply_to` off them; a tell's
    # envelope (`TrioActorRef.tell`) is built with the message alone.
    future = pykka.Future[Any]()
    asked = Envelope("hello", reply_to=future)
    told = Envelope("hi")
    assert (asked.message, asked.reply_to) == ("hello", future)
    assert (told.message, told.reply_to) == ("hi", None)


def test_the_stop_message_takes_no_arguments_and_is_what_actor_stop_tells() -> None:
    # `TrioActor._handle` recognises a stop by `type(message) is _ActorStop`; an actor that calls pykka's
    # own `Actor.stop()` (not overridden) tells one through its ref.
    actor = pykka.ThreadingActor()  # never started: its inbox is a plain queue
    actor.stop()
    envelope = actor.actor_inbox.get()
    assert type(envelope) is Envelope
    assert type(envelope.message) is _ActorStop
    assert envelope.message == _ActorStop()


def test_a_proxys_messages_are_the_three_the_kernel_hands_to_handle_receive() -> None:
    # `TrioActor._handle` sends these three kinds (`_PROXY_MESSAGES`) to pykka's `_handle_receive` and every
    # other message straight to `on_receive`: a fourth kind of proxy message would reach `on_receive`.
    kinds = {
        value
        for value in vars(pykka.messages).values()
        if isinstance(value, type) and value.__module__ == pykka.messages.__name__
    }
    assert kinds == {_ActorStop, ProxyCall, ProxyGetAttr, ProxySetAttr}


def test_handle_receive_answers_a_proxys_call_read_and_write() -> None:
    class Counter(pykka.ThreadingActor):
        def __init__(self) -> None:
            super().__init__()
            self.count = 1

        def add(self, n: int) -> int:
            self.count += n
            return self.count

    actor = Counter()
    assert actor._handle_receive(ProxyCall(attr_path=("add",), args=(2,), kwargs={})) == 3
    assert actor._handle_receive(ProxyGetAttr(attr_path=("count",))) == 3
    actor._handle_receive(ProxySetAttr(attr_path=("count",), value=10))
    assert actor.count == 10


# -- Actor -------------------------------------------------------------------------------------


def test_actor_init_sets_only_the_four_attributes_trio_actor_sets_itself() -> None:
    # `TrioActor.__init__` does not call pykka's (a counter URN, its inbox as the stopped flag): anything
    # more pykka's `__init__` set would be missing on every TrioActor.
    actor = pykka.ThreadingActor()
    assert set(vars(actor)) == {"actor_urn", "actor_inbox", "actor_stopped", "_actor_ref"}


def test_actor_ref_is_the_underscored_attribute_trio_actor_sets() -> None:
    # `TrioActor.__init__` stores its ref as `_actor_ref` (the supervisor returns it from there); pykka's
    # public `actor_ref` property reads it.
    actor = pykka.ThreadingActor()
    sentinel = object()
    actor._actor_ref = sentinel  # type: ignore[assignment]
    assert actor.actor_ref is sentinel


def test_the_extension_points_trio_actor_overrides_are_pykkas() -> None:
    # pykka's documented way to make a new kind of actor: `TrioActor` overrides these three; under other
    # names its overrides would silently stop being called (`ActorRef.ask` calls `_create_future`).
    assert isinstance(inspect.getattr_static(pykka.Actor, "_create_actor_inbox"), staticmethod)
    assert isinstance(inspect.getattr_static(pykka.Actor, "_create_future"), staticmethod)
    assert inspect.signature(pykka.Actor._create_future).parameters == {}
    assert inspect.isfunction(inspect.getattr_static(pykka.Actor, "_start_actor_loop"))


# -- ActorRef ----------------------------------------------------------------------------------


class _Flag:
    def __init__(self, stopped: bool) -> None:
        self.stopped = stopped

    def is_set(self) -> bool:
        return self.stopped


class _Inbox:
    def __init__(self) -> None:
        self.put_envelopes: list[Envelope[Any]] = []

    def put(self, envelope: Envelope[Any], /) -> None:
        self.put_envelopes.append(envelope)


class _Future(pykka.Future[Any]):
    def __init__(self) -> None:
        super().__init__()
        self.set_exception_args: list[Any] = []
        self.errors: list[BaseException | None] = []

    def set_exception(self, exc_info: Any = None) -> None:
        self.set_exception_args.append(exc_info)
        self.errors.append(sys.exc_info()[1])


class _Actor:
    """Just what `ActorRef.__init__` and `ActorRef.ask` read of an actor."""

    @staticmethod
    def _create_future() -> _Future:
        return _Future()

    def __init__(self, *, stopped: bool = False) -> None:
        self.actor_urn = "urn:test"
        self.actor_inbox = _Inbox()
        self.actor_stopped = _Flag(stopped)


def test_actor_ref_init_sets_only_what_trio_actor_ref_sets_itself() -> None:
    # `TrioActorRef.__init__` does not call pykka's: it sets these four and makes `_actor_weakref` a property
    # (the actor through its inbox, no weakref per actor).
    actor = _Actor()
    ref = pykka.ActorRef(actor)  # type: ignore[type-var]
    assert set(vars(ref)) == {"_actor_weakref", "actor_class", "actor_urn", "actor_inbox", "actor_stopped"}
    assert ref._actor_weakref() is actor


def test_ask_makes_the_actor_classs_future_and_puts_an_envelope_in_the_inbox() -> None:
    # `TrioActorRef` keeps pykka's `ask`: the asker's future is a TrioFuture because `ask` takes it from
    # `actor_class._create_future()`, and the mail reaches `PriorityInbox.put` as an `Envelope`.
    actor = _Actor()
    ref = pykka.ActorRef(actor)  # type: ignore[type-var]
    future = ref.ask("ping", block=False)
    assert type(future) is _Future
    [envelope] = actor.actor_inbox.put_envelopes
    assert type(envelope) is Envelope
    assert (envelope.message, envelope.reply_to) == ("ping", future)


def test_ask_to_a_stopped_actor_fails_the_future_with_set_exception_and_puts_nothing() -> None:
    # The stopped flag is read through `actor_stopped.is_set()` (a TrioActor's is its inbox), and the dead
    # actor's error is set by `set_exception()` with no argument (`TrioFuture` reads `sys.exc_info()`).
    actor = _Actor(stopped=True)
    ref = pykka.ActorRef(actor)  # type: ignore[type-var]
    future = ref.ask("ping", block=False)
    assert isinstance(future, _Future)
    assert future.set_exception_args == [None]
    assert [type(error) for error in future.errors] == [pykka.ActorDeadError]
    assert actor.actor_inbox.put_envelopes == []


# -- ActorProxy --------------------------------------------------------------------------------


def test_a_proxy_finds_its_actor_through_the_refs_actor_weakref_and_asks_it() -> None:
    # `TrioActorRef._actor_weakref` is a property giving the inbox's actor: the proxy calls it once,
    # and its calls and reads reach the actor as `ask`s of the three proxy messages.
    class Greeter(pykka.ThreadingActor):
        def greet(self, name: str) -> str:
            return f"hello {name}"

    greeter = Greeter()
    asked: list[Any] = []

    class Ref(pykka.ActorRef[Greeter]):
        @property
        def _actor_weakref(self) -> typing.Callable[[], Greeter]:  # type: ignore[override]
            return lambda: greeter

        def ask(self, message: Any, *, block: bool = True, timeout: float | None = None) -> Any:
            asked.append(message)
            future = pykka.ThreadingFuture[Any]()
            future.set(greeter._handle_receive(message))
            return future if not block else future.get()

    ref = Ref.__new__(Ref)
    ref.actor_class, ref.actor_urn = Greeter, "urn:test"
    ref.actor_stopped = _Flag(stopped=False)  # type: ignore[assignment]
    proxy = ref.proxy()
    assert proxy.greet("you").get() == "hello you"
    assert asked == [ProxyCall(attr_path=("greet",), args=("you",), kwargs={})]


# -- Future ------------------------------------------------------------------------------------


def test_a_future_is_made_without_arguments_and_gets_through_its_hook() -> None:
    # `TrioFuture.__init__` calls pykka's with none; a future given a hook (`set_get_hook`, which
    # `TrioFuture` overrides to note it) is read by pykka's own `get`, which calls the hook with the timeout.
    future = pykka.Future[int]()
    future.set_get_hook(lambda timeout: 7 if timeout == 1.5 else 0)
    assert future.get(timeout=1.5) == 7
