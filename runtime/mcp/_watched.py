"""`WatchedStream`: an MCP transport's read stream that says when the server's side has closed."""

from __future__ import annotations

from types import TracebackType
from typing import Any

import anyio
import trio
from mcp.shared.message import SessionMessage


class WatchedStream:
    """A transport's read stream that sets `ended` once it is exhausted or closed: the server's side closed."""

    def __init__(self, stream: Any, ended: trio.Event) -> None:
        self._stream = stream
        self._ended = ended

    async def receive(self) -> SessionMessage | Exception:
        try:
            item: SessionMessage | Exception = await self._stream.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._ended.set()
            raise
        return item

    async def aclose(self) -> None:
        self._ended.set()
        await self._stream.aclose()

    def __aiter__(self) -> WatchedStream:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> WatchedStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc_val: BaseException | None, exc_tb: TracebackType | None
    ) -> None:
        await self.aclose()
