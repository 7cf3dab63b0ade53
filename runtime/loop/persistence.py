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

`load_transcript` never fails on a damaged line: it skips it and says so in `problems`
(a crash mid-write leaves a partial last line; a corrupt line elsewhere is skipped the
same way). It then answers every tool_use the crash left open with a synthetic error
result, so that the conversation it returns is valid to send again.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import trio
from pydantic import TypeAdapter, ValidationError

from queryloop.runtime.loop.events import (
    AssistantMessage,
    SystemMessage,
    TombstoneEvent,
    TranscriptMessage,
    UserMessage,
)
from queryloop.runtime.loop.transcript import missing_tool_results, transcript_problems

TRANSCRIPT_VERSION = 2
"""2: held messages and `release` records (a version 1 file has neither, and reads the same)."""
_READABLE_VERSIONS = frozenset({1, 2})
_RELEASE = b'{"type":"release"}\n'

INTERRUPTED_BY_CRASH = "Interrupted: the session ended before this tool returned"
"""The synthetic result of a tool_use that a crash left without one."""

INLINE_FSYNC_S = 0.0002
"""An fsync faster than this (a tmpfs, a write-back cache) runs inline the next time: a hop to a worker
thread and back costs more (a GIL handoff and a scheduler pass or two, several ms on a busy run), and
an aborted query's result waits for its transcript's fsync. Slow (a disk), it goes back to the thread."""

_MESSAGE_TYPES = frozenset({"user", "assistant", "system", "attachment"})
_messages: TypeAdapter[TranscriptMessage] = TypeAdapter(TranscriptMessage)


def _line(record: dict[str, Any]) -> bytes:
    # json.dumps escapes newlines inside strings: one record is always exactly one line.
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


class TranscriptLog:
    """Appends a session's transcript records to `path`: in the file (the OS's) once `write()` has
    returned, on disk once `flush()` has (see the module docstring for who calls which, when).

    The file is opened at once (a bad path fails when the session opens, not mid-query).
    A new file starts with the session record; a file whose last line a crash cut short
    gets that line ended first, so the first new record is not glued to the fragment.
    """

    fsync: ClassVar[Callable[[int], None]] = staticmethod(os.fsync)
    """How `flush()` makes the file durable (run in a worker thread); a test may count the calls."""

    def __init__(self, path: str | os.PathLike[str], session_id: str) -> None:
        self.path = Path(path)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[bytes] = []
        self._unsynced = False
        """Something was written since the last fsync began."""
        self._lock = trio.Lock()
        self._inline = False
        """The last fsync took less than `INLINE_FSYNC_S`: the next runs on the trio thread."""
        self._close_error: OSError | None = None
        """Why `close()` could not write what was buffered."""
        size = os.fstat(self._fd).st_size
        self.is_new = size == 0
        """The file was empty when opened: it holds nothing but what this log writes."""
        if self.is_new:
            self._pending.append(_line({"type": "session", "session_id": session_id, "version": TRANSCRIPT_VERSION}))
        elif os.pread(self._fd, 1, size - 1) != b"\n":
            self._pending.append(b"\n")

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


@dataclass(slots=True)
class Sidechain:
    """One subagent's conversation, restored from its parent's transcript."""

    agent_id: str
    agent_type: str
    parent_tool_use_id: str | None
    messages: list[TranscriptMessage]


@dataclass(frozen=True, slots=True)
class LoadedTranscript:
    session_id: str | None
    """The stored session id; None if the file has no readable session record."""
    messages: list[TranscriptMessage]
    """The conversation: tombstoned messages removed, open tool_uses answered (`repairs`, at the end)."""
    problems: list[str]
    """What was skipped or is still wrong, with line numbers; empty for an intact file."""
    repairs: list[UserMessage]
    """The synthetic results the loading added: new messages, not yet in the file."""
    sidechains: dict[str, Sidechain] = field(default_factory=dict)
    """The subagents' conversations, by agent id (each repaired as the main one is, in memory only)."""


def load_transcript(path: str | os.PathLike[str]) -> LoadedTranscript:
    """Read a transcript log back; damaged lines are skipped and reported, never raised."""
    lines = Path(path).read_bytes().split(b"\n")
    session_id: str | None = None
    messages: list[TranscriptMessage] = []
    held: list[TranscriptMessage] = []  # waiting for their `release` (or the end of the file)
    problems: list[str] = []
    sides: dict[str, tuple[Sidechain, list[TranscriptMessage]]] = {}  # agent id -> (sidechain, its held)
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        # What follows the last newline is a record a crash cut short (unless only its newline is missing).
        damage = "truncated" if number == len(lines) else "corrupt"
        try:
            record = json.loads(raw)
        except ValueError:
            problems.append(f"line {number}: {damage} record skipped (not JSON)")
            continue
        kind = record.get("type") if isinstance(record, dict) else None
        if kind is not None and record.pop("isSidechain", False) is True:
            _load_sidechain_record(record, kind, number, damage, sides=sides, problems=problems)
            continue
        if kind == "session":
            version = record.get("version")
            if not isinstance(version, int) or version not in _READABLE_VERSIONS:
                problems.append(f"line {number}: transcript version {version!r}, read as version {TRANSCRIPT_VERSION}")
            if session_id is None and isinstance(record.get("session_id"), str):
                session_id = record["session_id"]
        elif kind == "tombstone":
            retracted = record.get("message_uuid")
            messages = [m for m in messages if m.uuid != retracted]
            held = [m for m in held if m.uuid != retracted]
        elif kind == "release":
            messages.extend(held)
            held.clear()
        elif kind in _MESSAGE_TYPES:
            waits = record.pop("held", False) is True
            try:
                (held if waits else messages).append(_messages.validate_python(record))
            except ValidationError as error:
                problems.append(f"line {number}: {damage} {kind} record skipped ({error.error_count()} invalid fields)")
        else:
            problems.append(f"line {number}: {damage} record skipped (unknown type {kind!r})")
    # Held messages never released: the crash came before their response was whole. They follow
    # what there is of it, as they would have followed all of it.
    messages.extend(held)
    if session_id is None:
        problems.append("no session record: the session id is unknown")
    repairs = answer_open_tool_uses(messages)
    messages.extend(repairs)
    problems.extend(f"after repair: {problem}" for problem in transcript_problems(messages))
    return LoadedTranscript(
        session_id=session_id,
        messages=messages,
        problems=problems,
        repairs=repairs,
        sidechains=_finish_sidechains(sides, problems),
    )


def _finish_sidechains(
    sides: dict[str, tuple[Sidechain, list[TranscriptMessage]]], problems: list[str]
) -> dict[str, Sidechain]:
    """Each sidechain with its held messages joined and its open tool_uses answered (in memory)."""
    sidechains: dict[str, Sidechain] = {}
    for agent_id, (side, side_held) in sides.items():
        side.messages.extend(side_held)
        side.messages.extend(answer_open_tool_uses(side.messages))
        problems.extend(f"sidechain {agent_id}: {problem}" for problem in transcript_problems(side.messages))
        sidechains[agent_id] = side
    return sidechains


def _load_sidechain_record(
    record: dict[str, Any],
    kind: str,
    number: int,
    damage: str,
    *,
    sides: dict[str, tuple[Sidechain, list[TranscriptMessage]]],
    problems: list[str],
) -> None:
    """One subagent's record (`isSidechain`) into its sidechain: messages, held ones, releases, tombstones."""
    agent_id = record.pop("agentId", None)
    agent_type = record.pop("agentType", "")
    if not isinstance(agent_id, str):
        problems.append(f"line {number}: {damage} sidechain record skipped (no agentId)")
        return
    found = sides.get(agent_id)
    if found is None:
        side = Sidechain(agent_id, str(agent_type), record.get("parent_tool_use_id"), [])
        found = sides[agent_id] = (side, [])
    side, held = found
    if kind == "tombstone":
        retracted = record.get("message_uuid")
        side.messages[:] = [m for m in side.messages if m.uuid != retracted]
        held[:] = [m for m in held if m.uuid != retracted]
    elif kind == "release":
        side.messages.extend(held)
        held.clear()
    elif kind in _MESSAGE_TYPES:
        waits = record.pop("held", False) is True
        try:
            (held if waits else side.messages).append(_messages.validate_python(record))
        except ValidationError as error:
            problems.append(
                f"line {number}: {damage} sidechain {kind} record skipped ({error.error_count()} invalid fields)"
            )
    else:
        problems.append(f"line {number}: {damage} sidechain record skipped (unknown type {kind!r})")


def answer_open_tool_uses(messages: list[TranscriptMessage]) -> list[UserMessage]:
    """Synthetic error results for the tool_uses of the last response that have none.

    Results join the conversation only after their whole response (the QueryLoop holds
    early ones back), and the log keeps the conversation's order; so a crash can leave
    open tool_uses only in the last response, answered (or not) by what follows it.
    Appended at the end, the results merge into the user message that follows the
    response, if any: the roles still alternate.
    """
    response: list[AssistantMessage] = []
    after: list[TranscriptMessage] = []
    for message in reversed(messages):
        if isinstance(message, AssistantMessage):
            response.append(message)
        elif isinstance(message, SystemMessage):
            continue  # never sent: it splits nothing
        elif response:
            break  # the user side before the last response
        else:
            after.append(message)
    response.reverse()
    return missing_tool_results(response, after, INTERRUPTED_BY_CRASH)


def open_log(
    path: str | os.PathLike[str],
    session_id: str,
    resumed: LoadedTranscript | None = None,
    resumed_from: str | os.PathLike[str] | None = None,
) -> TranscriptLog:
    """The log a session appends to, seeded so that its file alone restores the whole conversation.

    Back into the file it was loaded from, only what the loading added (the repairs) is
    written; the rest is there already. Into any other file, the restored conversation first.
    Written at once (a caller runs this in a worker thread: a whole history may be long); the
    caller's `flush()` then only fsyncs.
    """
    log = TranscriptLog(path, session_id)
    try:
        if resumed is not None:
            same = resumed_from is not None and not log.is_new and os.path.samefile(path, resumed_from)
            for message in resumed.repairs if same else resumed.messages:
                log.append(message)
            if not same:  # the sidechains too: the new file alone restores them
                for side in resumed.sidechains.values():
                    side_log = SidechainLog(
                        log,
                        agent_id=side.agent_id,
                        agent_type=side.agent_type,
                        parent_tool_use_id=side.parent_tool_use_id or "",
                    )
                    for message in side.messages:
                        side_log.append(message)
        log.write()
    except BaseException:
        with contextlib.suppress(OSError):  # its write fails again: the error being raised says why
            log.close()
        raise
    return log
