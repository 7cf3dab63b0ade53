"""The exceptions of every layer that a host may catch. Every one names what went wrong and what to do."""

from __future__ import annotations


class QueryloopError(Exception):
    """Base of every error raised by queryloop itself."""


class BlockingCallOnTrioThread(QueryloopError, RuntimeError):
    """A blocking wait was attempted on a thread that runs a trio loop.

    Blocking that thread would stop every actor it schedules, including the one
    that would have answered: a deadlock. Await instead.
    """


class NotInTrio(QueryloopError, RuntimeError):
    """A trio entry point was called outside a trio run (under asyncio, say).

    queryloop's actors are trio tasks; they cannot run on another event loop. From asyncio,
    `queryloop.aio.AsyncioRuntime` runs a runtime as a trio guest on the running asyncio loop; from
    threads and sync code, `BlockingRuntime` runs one on its own trio thread.
    """

    def __init__(self, entry: str = "Runtime.open()") -> None:
        super().__init__(
            f"queryloop runs on trio: call {entry} inside trio.run(...); from asyncio use"
            " queryloop.aio.AsyncioRuntime (a trio guest on the asyncio loop), from threads BlockingRuntime"
        )
        self.entry = entry


class RuntimeClosed(QueryloopError, RuntimeError):
    """The runtime this call goes through has closed (or is closing, or its run ended): nothing more
    can be started or asked through it."""


class NotInSession(QueryloopError, RuntimeError):
    """A `TrioActor` was constructed outside a session's supervisor."""


class ActorCrashed(QueryloopError):
    """An actor of a session raised; its session was closed, other sessions run on.

    The original exception is the `__cause__`.
    """

    def __init__(self, session_id: str, actor: str, error: BaseException) -> None:
        super().__init__(f"actor {actor!r} of session {session_id!r} crashed: {error!r}")
        self.session_id = session_id
        self.actor = actor
        self.error = error
        self.__cause__ = error


class WorkCancelled(QueryloopError):
    """The actor's work that would have answered this ask was cancelled by an abort or a close."""


class SessionClosed(QueryloopError):
    """The session's actor group is closed; nothing more can be started in it."""


class QueryInProgress(QueryloopError):
    """A query is already running in this session, and another is already queued behind it."""


class McpServerUnavailable(QueryloopError):
    """`Runtime.open_mcp` could not start or reach an MCP server, or list its tools (the message says why).

    Nothing of it was kept: fix the command or the URL and open it again. Once open, a server that
    fails is never raised: its calls become error results and it is restarted on next use.
    """


class McpRequestFailed(QueryloopError):
    """A host's request to an open MCP server (a prompt, say) failed: the server's error as it said it, or
    a connection that failed (the server is restarted, or reached again, on next use)."""


class ShardLost(QueryloopError):
    """The Ray shard that hosted this session died (or was restarted by Ray, empty): its open queries
    ended without a result. `await rt.resume(key, spec)` restores the session from its transcript on a
    live shard."""

    def __init__(self, message: str, shard: int | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.shard = shard
        self.key = key

    def __reduce__(self) -> tuple[type[ShardLost], tuple[str, int | None, str | None]]:
        return (type(self), (str(self), self.shard, self.key))


class FactoryError(QueryloopError):
    """A shard could not build a session's `QueryOptions` from its spec: the factory is not importable,
    raised, or returned something else (the message names the factory, the shard and the cause)."""


class RemoteError(QueryloopError):
    """An error raised on a shard that could not be rebuilt on the driver (its type and message kept)."""
