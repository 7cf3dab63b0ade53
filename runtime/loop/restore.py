"""Reading a durable transcript back (`load_transcript`), and the log a resumed session goes on in (`open_log`).

The file format is `persistence`'s (its module docstring).

`load_transcript` never fails on a damaged line: it skips it and says so in `problems`
(a crash mid-write leaves a partial last line; a corrupt line elsewhere is skipped the
same way). It then answers every tool_use the crash left open with a synthetic error
result, so that the conversation it returns is valid to send again.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from queryloop.runtime.loop.events import AssistantMessage, SystemMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.persistence import READABLE_VERSIONS, TRANSCRIPT_VERSION, SidechainLog, TranscriptLog
from queryloop.runtime.loop.transcript import missing_tool_results, transcript_problems

INTERRUPTED_BY_CRASH = "Interrupted: the session ended before this tool returned"
"""The synthetic result of a tool_use that a crash left without one."""

_MESSAGE_TYPES = frozenset({"user", "assistant", "system", "attachment"})
_messages: TypeAdapter[TranscriptMessage] = TypeAdapter(TranscriptMessage)


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
            if not isinstance(version, int) or version not in READABLE_VERSIONS:
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
