"""Durable transcripts: a session's conversation as an append-only JSONL file, and its loading.

One JSON record a line:

* `{"type": "session", "session_id": ..., "version": 1}`: the first line of a new file;
* a transcript message (`user`, `assistant`, `system`, `attachment`), its `model_dump(mode="json")`;
* `{"type": "tombstone", "message_uuid": ...}`: an earlier message retracted (a fallback's abandoned response).

`TranscriptLog` buffers records in memory; `flush()` writes and fsyncs them in a worker
thread, so the trio thread never waits on the disk. The QueryLoop flushes at turn
boundaries: a crash loses at most the turn in progress.

`load_transcript` never fails on a damaged line: it skips it and says so in `problems`
(a crash mid-write leaves a partial last line; a corrupt line elsewhere is skipped the
same way). It then answers every tool_use the crash left open with a synthetic error
result, so that the conversation it returns is valid to send again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

TRANSCRIPT_VERSION = 1

INTERRUPTED_BY_CRASH = "Interrupted: the session ended before this tool returned"
"""The synthetic result of a tool_use that a crash left without one."""

_MESSAGE_TYPES = frozenset({"user", "assistant", "system", "attachment"})
_messages: TypeAdapter[TranscriptMessage] = TypeAdapter(TranscriptMessage)


def _line(record: dict[str, Any]) -> bytes:
    # json.dumps escapes newlines inside strings: one record is always exactly one line.
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_durably(fd: int, data: bytes) -> None:
    _write_all(fd, data)
    os.fsync(fd)


class TranscriptLog:
    """Appends a session's transcript records to `path`; durable once `flush()` has returned.

    The file is opened at once (a bad path fails when the session opens, not mid-query).
    A new file starts with the session record; a file whose last line a crash cut short
    gets that line ended first, so the first new record is not glued to the fragment.
    """

    def __init__(self, path: str | os.PathLike[str], session_id: str) -> None:
        self.path = Path(path)
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[bytes] = []
        self._lock = trio.Lock()
        size = os.fstat(self._fd).st_size
        self.is_new = size == 0
        """The file was empty when opened: it holds nothing but what this log writes."""
        if self.is_new:
            self._pending.append(_line({"type": "session", "session_id": session_id, "version": TRANSCRIPT_VERSION}))
        elif os.pread(self._fd, 1, size - 1) != b"\n":
            self._pending.append(b"\n")

    def append(self, message: TranscriptMessage | TombstoneEvent) -> None:
        """Buffer one record: a transcript message, or the tombstone that retracts one."""
        if self._fd is None:
            msg = f"transcript log {self.path} is closed"
            raise ValueError(msg)
        self._pending.append(_line(message.model_dump(mode="json")))

    async def flush(self) -> None:
        """Write what is buffered and fsync it, off the trio thread; on disk when this returns.

        Shielded from cancellation: taking the records from the buffer and writing them is one
        step (to_thread checks for cancellation before its thread starts, which would drop what
        was taken). It is bounded by the disk, not by anything that can hang.
        """
        with trio.CancelScope(shield=True):
            async with self._lock:
                if not self._pending or self._fd is None:
                    return
                data = b"".join(self._pending)
                self._pending.clear()
                await trio.to_thread.run_sync(_write_durably, self._fd, data)

    def close(self) -> None:
        """Write what is still buffered (not fsynced: this must not wait on the disk), then close. Idempotent."""
        fd = self._fd
        if fd is None:
            return
        if self._lock.locked():
            msg = "TranscriptLog.close() while a flush is running"
            raise RuntimeError(msg)
        self._fd = None
        try:
            if self._pending:
                _write_all(fd, b"".join(self._pending))
                self._pending.clear()
        finally:
            os.close(fd)


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


def load_transcript(path: str | os.PathLike[str]) -> LoadedTranscript:
    """Read a transcript log back; damaged lines are skipped and reported, never raised."""
    lines = Path(path).read_bytes().split(b"\n")
    session_id: str | None = None
    messages: list[TranscriptMessage] = []
    problems: list[str] = []
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
        if kind == "session":
            if record.get("version") != TRANSCRIPT_VERSION:
                problems.append(f"line {number}: transcript version {record.get('version')!r}, read as version 1")
            if session_id is None and isinstance(record.get("session_id"), str):
                session_id = record["session_id"]
        elif kind == "tombstone":
            messages = [m for m in messages if m.uuid != record.get("message_uuid")]
        elif kind in _MESSAGE_TYPES:
            try:
                messages.append(_messages.validate_python(record))
            except ValidationError as error:
                problems.append(f"line {number}: {damage} {kind} record skipped ({error.error_count()} invalid fields)")
        else:
            problems.append(f"line {number}: {damage} record skipped (unknown type {kind!r})")
    if session_id is None:
        problems.append("no session record: the session id is unknown")
    repairs = answer_open_tool_uses(messages)
    messages.extend(repairs)
    problems.extend(f"after repair: {problem}" for problem in transcript_problems(messages))
    return LoadedTranscript(session_id=session_id, messages=messages, problems=problems, repairs=repairs)


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
    """
    log = TranscriptLog(path, session_id)
    if resumed is not None:
        same = resumed_from is not None and not log.is_new and os.path.samefile(path, resumed_from)
        for message in resumed.repairs if same else resumed.messages:
            log.append(message)
    return log
