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

    def __reduce__(self) -> tuple[type[NotInTrio], tuple[str]]:
        return type(self), (self.entry,)  # rebuilt from what `__init__` takes (it crosses Ray)


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

    def __reduce__(self) -> tuple[type[ActorCrashed], tuple[str, str, BaseException]]:
        return type(self), (self.session_id, self.actor, self.error)  # rebuilt from what `__init__` takes


class WorkCancelled(QueryloopError):
    """The actor's work that would have answered this ask was cancelled by an abort or a close."""


class SessionClosed(QueryloopError):
    """The session's actor group is closed; nothing more can be started in it."""


class QueryInProgress(QueryloopError):
    """A session control that works between queries (`compact()`) was called while a query of the session runs,
    or waits its turn: wait for its result (or abort it), then call it again."""


class CompactFailed(QueryloopError):
    """`session.compact()` did not compact: nothing to compact, a PreCompact hook blocked it, the summary call
    failed, or an abort cut it (the message says which, in Claude Code's words). The conversation is as it was,
    but for what the PreCompact hooks added."""


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


class TranscriptRefused(QueryloopError):
    """A session could not take its transcript file: `TranscriptInUse` or `TranscriptHoldsAnotherSession`.

    One file holds one session: two sessions in one file would interleave their records, and a resume
    would send the model both conversations. Nothing was written to the file.
    """

    def __init__(self, path: str, session_id: str | None, message: str | None = None) -> None:
        super().__init__(message or self.describe(path, session_id))
        self.path = path
        """The transcript file."""
        self.session_id = session_id
        """The session the file holds (its first line's), None if that could not be read."""

    @staticmethod
    def describe(path: str, session_id: str | None) -> str:
        return f"transcript {path} holds {_holder(session_id)}: one file holds one session"

    def __reduce__(self) -> tuple[type[TranscriptRefused], tuple[str, str | None, str]]:
        return (type(self), (self.path, self.session_id, str(self)))


def _holder(session_id: str | None) -> str:
    if session_id is None:
        return "a session whose id could not be read (its first line is not a readable session record)"
    shown = session_id if len(session_id) <= 80 else f"{session_id[:80]}..."
    return f"session {shown!r}"


class TranscriptInUse(TranscriptRefused):
    """Another open session, of this process or another, holds the transcript file (its OS lock, `flock`)."""

    @staticmethod
    def describe(path: str, session_id: str | None) -> str:
        return (
            f"transcript {path} is in use: {_holder(session_id)} has it open, in this process or another."
            " Close that session first (then resume= the file to go on with it), or give another transcript="
            " path; resume= it with fork=True and a new transcript= file branches from what it holds now"
        )


class TranscriptHoldsAnotherSession(TranscriptRefused):
    """`transcript=` named a file that is not empty: it holds another session (open or closed) already.

    A new session (and a fork, and a resume into another file) starts a file of its own: an absent or
    empty one. `resume=` that file goes on with the session it holds.
    """

    @staticmethod
    def describe(path: str, session_id: str | None) -> str:
        return (
            f"transcript {path} already holds {_holder(session_id)}: one file holds one session."
            " resume= that file to go on with it, resume= it with fork=True and a new transcript= file to"
            " branch from it, or give another (absent or empty) path for a new session"
        )


class TranscriptDamaged(QueryloopError):
    """`resume=` refused a transcript whose damage its loading could not repair completely.

    A crash cuts only a file's last line, and the loading repairs that (a tool_use left open gets an
    error result). A damaged line elsewhere may have held a real tool result, which a synthetic one
    would silently replace, or the prompt; resuming then would send the model another conversation
    than the one it had (or one the API refuses every time). Nothing was opened or written:
    `load_transcript(path)` still reads the file and says what it skipped (`problems`, by line).
    """

    def __init__(self, path: str, lines: list[int], problems: list[str], reason: str) -> None:
        where = "no line is damaged" if not lines else _numbered(lines)
        super().__init__(
            f"transcript {path} cannot be resumed ({where}): {reason}. load_transcript(path) shows what was read"
            " (its problems name every line skipped); resume= needs an intact conversation: mend or remove"
            " the damaged lines, then resume again"
        )
        self.path = path
        """The transcript file."""
        self.lines = lines
        """The damaged lines, skipped (numbered from 1)."""
        self.problems = problems
        """Everything the loading reported (`LoadedTranscript.problems`)."""
        self.reason = reason
        """Why the resume was refused."""

    def __reduce__(self) -> tuple[type[TranscriptDamaged], tuple[str, list[int], list[str], str]]:
        return (type(self), (self.path, self.lines, self.problems, self.reason))


def _numbered(lines: list[int]) -> str:
    shown = ", ".join(map(str, lines[:20])) + (f" and {len(lines) - 20} more" if len(lines) > 20 else "")
    return f"line {shown} is damaged" if len(lines) == 1 else f"lines {shown} are damaged"
