"""`Runtime`: the trio nursery that hosts every session's actor group."""

from __future__ import annotations

import itertools
import secrets
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from runtime.supervisor import Supervisor

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Mapping


class Runtime:
    """Hosts sessions side by side in one trio run; open it with `Runtime.open()`."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self._groups: dict[str, Supervisor] = {}
        self._prefix = secrets.token_hex(3)
        self._ids = itertools.count(1)

    @classmethod
    @asynccontextmanager
    async def open(cls) -> AsyncIterator[Runtime]:
        """Run a runtime for the duration of the `async with` block; leaving it closes every session."""
        async with trio.open_nursery() as nursery:
            runtime = cls(nursery)
            try:
                yield runtime
            finally:
                nursery.cancel_scope.cancel()

    @property
    def groups(self) -> Mapping[str, Supervisor]:
        """The open session groups, by session id (the runtime's own index, O(1) add and remove)."""
        return self._groups

    def new_session_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def start_group(self, session_id: str | None = None) -> Supervisor:
        """Open an empty actor group for a session; `Supervisor.spawn` fills it."""
        session_id = session_id or self.new_session_id()
        if session_id in self._groups:
            msg = f"session id {session_id!r} is already open"
            raise ValueError(msg)
        supervisor = Supervisor(session_id, on_closed=self._forget)
        await self._nursery.start(supervisor.run, name=f"session {session_id}")
        self._groups[session_id] = supervisor
        return supervisor

    def _forget(self, supervisor: Supervisor) -> None:
        self._groups.pop(supervisor.session_id, None)
