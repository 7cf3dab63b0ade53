"""Durable transcripts: a session's conversation as an append-only JSONL file, and its loading.

One JSON record a line:

* `{"type": "session", "session_id": ..., "version": 2}`: the first line of a new file;
* a transcript message (`user`, `assistant`, `system`, `attachment`), its `model_dump(mode="json")`;
  with `"held": true`, a tool's result (or a hook's message) emitted while its response still
  streamed: it joins the conversation at the next `release` record (or at the end of the file);
* `{"type": "release"}`: the held messages join the conversation here (their response is whole);
* `{"type": "tombstone", "message_uuid": ...}`: an earlier message retracted (a fallback's abandoned response);
* any of the three above with `"isSidechain": true, "agentId": ..., "agentType": ...` (and the message's
  `parent_tool_use_id`): a subagent's record, written by its `SidechainLog` into its parent's file, as
  Claude Code's transcripts keep subagents. It belongs to that agent's sidechain, never to the
  parent's conversation; `load_transcript` returns each sidechain apart (`sidechains`).

The rule (docs/design.md, "Durability"): nothing the consumer saw is lost to a crash.

* `append` only buffers a record; `write()` hands what is buffered to the OS in one `write`
  syscall on the calling (trio) thread: a few hundred bytes, microseconds. A killed process
  loses nothing that was written; only a lost machine can.
* Every message is in the buffer before its event is in the consumer's channel (the QueryLoop
  appends as it emits, the ModelCaller as it hands a response's block over), and the
  consumer's `QueryHandle` calls `write()` before it takes an event: whatever the consumer has
  received is in the file. Messages that arrive together share one write.
* The prompt is written as soon as it joins the conversation, and whatever the conversation
  holds is written before any model request goes out.
* `flush()` writes, then fsyncs in a worker thread (the trio thread never waits on the disk):
  at each continue site and at the end of a query, before its `result`; so a machine that
  loses power loses at most the turn in progress. An fsync measured faster than a thread hop
  (`INLINE_FSYNC_S`: a tmpfs, a write-back cache) runs inline instead, until one is slow again;
  `sync_now()` is that inline path alone (an abort ends its query inside its own call with it).

A failed write (a full disk) keeps what it did not write, first in line for the next; a log closed on
such a failure raises at every later write, so no consumer takes an event whose record is not in the file.

Every write happens on the trio thread, in the order of the appends: the worker thread only
fsyncs, so a write can never overtake another.

One file holds one session: a log holds an OS lock (`flock`, exclusive) on its file from its opening
to its close, and a new session's log takes only an absent or empty file (see `TranscriptLog`).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import trio

from queryloop.runtime.errors import TranscriptHoldsAnotherSession, TranscriptInUse
from queryloop.runtime.loop.events import (
    TombstoneEvent,
    TranscriptMessage,
)

TRANSCRIPT_VERSION = 2
"""2: held messages and `release` records (a version 1 file has neither, and reads the same)."""
READABLE_VERSIONS = frozenset({1, 2})
"""The versions `load_transcript` reads."""
_RELEASE = b'{"type":"release"}\n'

INLINE_FSYNC_S = 0.0002
"""An fsync faster than this (a tmpfs, a write-back cache) runs inline the next time: a hop to a worker
thread and back costs more (a GIL handoff and a scheduler pass or two, several ms on a busy run), and
an aborted query's result waits for its transcript's fsync. Slow (a disk), it goes back to the thread."""


def _line(record: dict[str, Any]) -> bytes:
    # json.dumps escapes newlines inside strings: one record is always exactly one line.
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


_HEAD_BYTES = 4096
"""How much of a file is read for its session record: the record is under a hundred bytes, and a first
line longer than this is not one (a hostile or damaged file is never read whole to find out)."""


def stored_session_id(fd: int) -> str | None:
    """The session id of the file's first line if it is a session record; None if it is not (damaged,
    hostile, or another record). Never raises on the bytes."""
    line = os.pread(fd, _HEAD_BYTES, 0).partition(b"\n")[0]
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser's depth
        return None
    if isinstance(record, dict) and record.get("type") == "session":
        session_id = record.get("session_id")
        if isinstance(session_id, str):
            return session_id
    return None


def _same_file(fd: int, other: str | os.PathLike[str]) -> bool:
    try:
        theirs = os.stat(other)
    except OSError:
        return False
    ours = os.fstat(fd)
    return (ours.st_dev, ours.st_ino) == (theirs.st_dev, theirs.st_ino)


def _last_line_start(fd: int, size: int) -> int:
    """Where the file's last line begins: just past its last newline (0 if it has none)."""
    end = size
    while end > 0:
        begin = max(0, end - 65536)
        newline = os.pread(fd, end - begin, begin).rfind(b"\n")
        if newline >= 0:
            return begin + newline + 1
        end = begin
    return 0


class TranscriptLog:
    """Appends a session's transcript records to `path`: in the file (the OS's) once `write()` has
    returned, on disk once `flush()` has (see the module docstring for who calls which, when).

    The file is opened at once (a bad path fails when the session opens, not mid-query).
    A new file starts with the session record; a file whose last line a crash cut short has that
    fragment cut off first (`_end_last_line`), so no new record is glued to it.

    One file, one session. The log holds an exclusive `flock` on the file until `close()` (or its
    process's end): a file another log holds, in this process or another, is refused with
    `TranscriptInUse` (flock locks belong to the open file description, so a second `open()` in the
    same process conflicts as another process's does). Then, locked (so that two racing openers
    cannot both find it empty), the file must be absent or empty, unless it is `resumes`, the file
    this session was restored from: that one may already hold this session, and only this one.
    Anything else is refused with `TranscriptHoldsAnotherSession`; nothing is written either way.
    """

    fsync: ClassVar[Callable[[int], None]] = staticmethod(os.fsync)
    """How `flush()` makes the file durable (run in a worker thread); a test may count the calls."""

    def __init__(
        self, path: str | os.PathLike[str], session_id: str, *, resumes: str | os.PathLike[str] | None = None
    ) -> None:
        self.path = Path(path)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            self._claim(fd, session_id, resumes)
        except BaseException:
            os.close(fd)  # the lock, if it was taken, goes with it
            raise
        self._fd: int | None = fd
        self._pending: list[bytes] = []
        self._unsynced = False
        """Something was written since the last fsync began."""
        self._lock = trio.Lock()
        self._inline = False
        """The last fsync took less than `INLINE_FSYNC_S`: the next runs on the trio thread."""
        self._close_error: OSError | None = None
        """Why `close()` could not write what was buffered."""
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            size = self._end_last_line(fd, size)
        self.is_new = size == 0
        """The file was empty when opened: it holds nothing but what this log writes."""
        if self.is_new:
            self._pending.append(_line({"type": "session", "session_id": session_id, "version": TRANSCRIPT_VERSION}))

    def _end_last_line(self, fd: int, size: int) -> int:
        """A file a crash cut: a last line that is a whole record but for its newline gets the newline;
        a fragment (the load that preceded this resume reported it, and skipped it) is cut off, so
        that later loads read the file whole rather than report the same old damage again. Returns
        the file's size after."""
        start = _last_line_start(fd, size)
        fragment = os.pread(fd, size - start, start)
        try:
            whole = isinstance(json.loads(fragment), dict)
        except (ValueError, RecursionError):
            whole = False
        if whole:
            self._pending.append(b"\n")
            return size
        os.ftruncate(fd, start)
        return start

    def _claim(self, fd: int, session_id: str, resumes: str | os.PathLike[str] | None) -> None:
        """Lock the file for this log, then refuse it if it holds anything but this session resumed."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise TranscriptInUse(str(self.path), stored_session_id(fd)) from None
        if os.fstat(fd).st_size == 0:
            return
        stored = stored_session_id(fd)
        # Resumed in place, a file whose first line is damaged is still this session's: its loading
        # reported the damage, and found no other session to go on with.
        if resumes is not None and stored in (session_id, None) and _same_file(fd, resumes):
            return
        raise TranscriptHoldsAnotherSession(str(self.path), stored)

    def append(self, message: TranscriptMessage | TombstoneEvent, *, held: bool = False) -> None:
        """Buffer one record: a transcript message, or the tombstone that retracts one.

        `held`: a message that joins the conversation only at the next `release()` (a tool's
        result emitted while its response still streams: the file keeps the order of the
        emission, the conversation its own)."""
        if self._fd is None:
            msg = f"transcript log {self.path} is closed"
            raise ValueError(msg)
        record = message.model_dump(mode="json")
        if record.get("parent_tool_use_id", 0) is None:
            del record["parent_tool_use_id"]  # a session's own message: the file keeps its shape
        if held:
            record["held"] = True
        self._pending.append(_line(record))

    def release(self) -> None:
        """Buffer a `release` record: the held messages join the conversation here."""
        if self._fd is None:
            msg = f"transcript log {self.path} is closed"
            raise ValueError(msg)
        self._pending.append(_RELEASE)

    def write(self) -> None:
        """Hand what is buffered to the OS, in one syscall (none if nothing is): a SIGKILL keeps it.

        Synchronous, on the trio thread: the records are small, and a write that waited for a
        thread could be overtaken by the next one. An error (a full disk) is raised here, and loses
        nothing: what did not reach the file stays buffered, and the next call goes on from the byte
        this one stopped at (so no record is cut in two, and none is skipped).
        """
        pending = self._pending
        if not pending:
            return
        fd = self._fd
        if fd is None:  # closed by a `close()` whose write failed: these records are not in the file
            msg = f"transcript {self.path} was closed with {sum(map(len, pending))} bytes it could not write"
            raise OSError(errno.EIO, msg) from self._close_error
        data = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        self._unsynced = True
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            pending.append(bytes(view))  # first in line: the buffer was emptied above, and nothing ran since
            raise

    def sync_now(self) -> bool:
        """`write()`, then fsync inline if the last fsync was fast (`INLINE_FSYNC_S`): True when the
        file is on disk on return (or nothing was unsynced), False when `flush()` must do it.
        """
        self.write()
        if not self._unsynced or self._fd is None:
            return True
        if not self._inline or self._lock.locked():
            return False
        self._unsynced = False
        self._inline = self._timed_fsync(self._fd) < INLINE_FSYNC_S
        return True

    async def flush(self) -> None:
        """`write()`, then fsync (skipped if nothing was written since the last): inline when the last
        one was fast, else off the trio thread.

        On disk when this returns. Shielded from cancellation: an fsync is bounded by the disk,
        not by anything that can hang, and a caller cut mid-way would not know what is durable.
        """
        if self.sync_now():
            return
        with trio.CancelScope(shield=True):
            async with self._lock:
                if not self._unsynced or self._fd is None:
                    return
                self._unsynced = False  # what is written from now on waits for the next fsync
                elapsed = await trio.to_thread.run_sync(self._timed_fsync, self._fd)
                self._inline = elapsed < INLINE_FSYNC_S

    @classmethod
    def _timed_fsync(cls, fd: int) -> float:
        start = time.perf_counter()
        cls.fsync(fd)
        return time.perf_counter() - start

    def close(self) -> None:
        """Write what is still buffered (not fsynced: this must not wait on the disk), then close. Idempotent.

        A failed write is raised after the file is closed; what it could not write stays buffered, so
        `write()` raises from then on, and no consumer takes an event whose record is not in the file.
        """
        fd = self._fd
        if fd is None:
            return
        if self._lock.locked():
            msg = "TranscriptLog.close() while a flush is running"
            raise RuntimeError(msg)
        try:
            self.write()
        except OSError as error:
            self._close_error = error
            raise
        finally:
            self._fd = None
            os.close(fd)


class SidechainLog(TranscriptLog):
    """A subagent's log: its records go into its parent's log (the same buffer, the same file), tagged.

    What the subagent's loop appends joins the parent log's buffer in emission order, so the parent's
    consumer, whose handle writes that buffer before it takes an event, never sees a forwarded child
    event whose record is not written. `flush` fsyncs the parent's file; `close` only writes (the
    parent owns the file). Records appended after the parent's log has closed are dropped.
    """

    def __init__(self, parent: TranscriptLog, *, agent_id: str, agent_type: str, parent_tool_use_id: str) -> None:
        # The base's state is the parent's: nothing of it is made here.
        self.path = parent.path
        self.is_new = False
        self._parent = parent
        self._parent_tool_use_id = parent_tool_use_id
        self._tags: dict[str, Any] = {"isSidechain": True, "agentId": agent_id, "agentType": agent_type}

    def append(self, message: TranscriptMessage | TombstoneEvent, *, held: bool = False) -> None:
        parent = self._parent
        if parent._fd is None:  # noqa: SLF001 - the parent's own log
            return
        record = message.model_dump(mode="json")
        if held:
            record["held"] = True
        record["parent_tool_use_id"] = self._parent_tool_use_id
        record.update(self._tags)
        parent._pending.append(_line(record))  # noqa: SLF001

    def release(self) -> None:
        if self._parent._fd is not None:  # noqa: SLF001
            self._parent._pending.append(_line({"type": "release", **self._tags}))  # noqa: SLF001

    def write(self) -> None:
        self._parent.write()

    def sync_now(self) -> bool:
        return self._parent.sync_now()

    async def flush(self) -> None:
        await self._parent.flush()

    def close(self) -> None:
        self._parent.write()
