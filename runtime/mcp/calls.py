"""The calls a connection has in flight, and the elicitation handlers waiting on their behalf.

A server asks for the user's input during one of its calls. A handler still waiting once that call has
ended (answered, aborted, timed out) waits for an answer nobody needs, maybe for a person who never
comes: so each handler runs in a cancel scope that the end of the call that asked cancels.

Which call asked: on the 2026-07-28 protocol the question is the call's own answer (`input_required`),
handled in the call's task, so it is that call. Before it, the server's request names no call; it can
only come from one of the calls in flight when it arrived, so the handler is tied to all of them and
cancelled when the last of them has ended (and told the call's `tool_use_id` when there was only one).
Plain trio, importable without the `mcp` SDK.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio


@dataclass(eq=False, slots=True)
class Asking:
    """One handler waiting: its scope is cancelled when `callers` (the calls that may have asked) reaches 0."""

    scope: trio.CancelScope
    callers: int


@dataclass(eq=False, slots=True)
class Call:
    """One call in flight, and the handlers it may have asked for."""

    tool_use_id: str
    waiting: set[Asking] = field(default_factory=set)


class CallsInFlight:
    """A connection's calls in flight (`call`), and the handlers they asked for (`asking`)."""

    def __init__(self) -> None:
        self._calls: set[Call] = set()

    @contextmanager
    def call(self, tool_use_id: str) -> Iterator[Call]:
        """A call in flight for the `with` block; on leaving it, every handler only it could have asked for
        is cancelled (it returned, raised or was cancelled: its questions have no one to answer to)."""
        made = Call(tool_use_id)
        self._calls.add(made)
        try:
            yield made
        finally:
            self._calls.discard(made)
            for asking in made.waiting:
                asking.callers -= 1
                if asking.callers == 0:
                    asking.scope.cancel()

    def who_may_ask(self, current: Call | None) -> list[Call]:
        """The calls a question may come from: `current` when known (the question came in its task), else
        every call in flight now (none: the server asks outside any call)."""
        return [current] if current is not None else list(self._calls)

    @contextmanager
    def asking(self, callers: list[Call]) -> Iterator[trio.CancelScope]:
        """A cancel scope around a handler for the `with` block, cancelled once every one of `callers` has
        ended (never, if there are none); check its `cancelled_caught` after the block."""
        asking = Asking(trio.CancelScope(), len(callers))
        for caller in callers:
            caller.waiting.add(asking)
        try:
            with asking.scope:
                yield asking.scope
        finally:
            for caller in callers:
                caller.waiting.discard(asking)
