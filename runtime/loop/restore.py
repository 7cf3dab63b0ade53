"""Reading a durable transcript back (`load_transcript`), and the log a resumed session goes on in (`open_log`).

The file format is `persistence`'s (its module docstring).

`load_transcript` never raises on what the file holds. A line it cannot take, whatever its bytes
(not JSON, nested too deeply, an unknown type, a message whose fields or content blocks are malformed),
is skipped and reported in `problems` with its number. A crash cuts only the file's last line: that one
is `truncated`; a damaged line anywhere else is `corrupt` (`corrupt_lines`: the disk or a hand made it).
The load then answers every tool_use the crash left open with a synthetic error result
(`INTERRUPTED_BY_CRASH`), so that the conversation it returns is valid to send again.

Resuming asks more (`resume_refusal`; `refuse_damaged` raises `TranscriptDamaged` naming the lines). A
corrupt line may have held a real tool result, which a synthetic one would then silently replace, or
the prompt, without which every request would open with the model's turn. So a resume refuses when the
conversation is still invalid after the repair (a tool_use unpaired, a result orphaned, no user message
first), when a corrupt line comes after a tool_use the repair answered (the line may have been its real
result), and when a file with a corrupt line does not open with a user message. A line before every such
tool_use cannot have held one of their results (a result is always written after its tool_use): so the
fragment a first crash left, ended by its resume and a corrupt line from then on, never refuses the resume
after a second crash. A corrupt line whose loss leaves every tool_use paired with its own real result
(a system message, an attachment, a text) is repaired completely: the resume goes on, its problems
reported.

What the load decided is written back by `open_log` when the session goes on in the same file (held
messages released where the load joined them, the repairs, a sidechain's as the main conversation's),
so that every later load reads what this one did.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from queryloop.runtime.errors import TranscriptDamaged
from queryloop.runtime.loop.deferred import pending_deferred
from queryloop.runtime.loop.events import (
    AssistantMessage,
    SystemMessage,
    TombstoneEvent,
    TranscriptMessage,
    UserMessage,
)
from queryloop.runtime.loop.persistence import READABLE_VERSIONS, TRANSCRIPT_VERSION, SidechainLog, TranscriptLog
from queryloop.runtime.loop.transcript import (
    messages_after_compact_boundary,
    missing_tool_results,
    tool_use_ids,
    transcript_problems,
)

INTERRUPTED_BY_CRASH = "Interrupted: the session ended before this tool returned"
"""The synthetic result of a tool_use that a crash left without one."""

_MESSAGE_TYPES = frozenset({"user", "assistant", "system", "attachment"})
_messages: TypeAdapter[TranscriptMessage] = TypeAdapter(TranscriptMessage)
_UNOPENED = "the conversation does not open with a user message (its prompt may be on a damaged line)"


@dataclass(slots=True)
class Sidechain:
    """One subagent's conversation, restored from its parent's transcript."""

    agent_id: str
    agent_type: str
    parent_tool_use_id: str | None
    messages: list[TranscriptMessage]


@dataclass(frozen=True, slots=True)
class LoadedTranscript:
    """A transcript file read back (`load_transcript`): its conversation, sidechains and what was wrong."""

    session_id: str | None
    """The stored session id; None if the file has no readable session record."""
    messages: list[TranscriptMessage]
    """The conversation: tombstoned messages removed, open tool_uses answered (`repairs`, at the end)."""
    problems: list[str]
    """What was skipped or is still wrong, with line numbers; empty for an intact file."""
    repairs: list[UserMessage]
    """The synthetic results the loading added: new messages, not yet in the file."""
    sidechains: dict[str, Sidechain] = field(default_factory=dict)
    """The subagents' conversations, by agent id (each repaired as the main one is)."""
    corrupt_lines: list[int] = field(default_factory=list)
    """The damaged lines skipped that are not the file's cut last line (which a crash makes)."""
    truncated_line: int | None = None
    """The file's last line, skipped: a crash cut it short (it has no newline)."""
    unresolved: list[str] = field(default_factory=list)
    """What is still wrong once repaired (in `problems` too, prefixed `after repair:`): a resume refuses."""
    repaired_from_line: int | None = None
    """The first line holding a tool_use the loading answered (of any conversation); None if none."""
    unopened: list[str] = field(default_factory=list)
    """The conversations (main, sidechains) whose first message sent is not a user message."""
    unreleased: bool = False
    """Held messages no `release` record joined: the loading joined them at the end of the file."""
    sidechain_repairs: dict[str, list[UserMessage]] = field(default_factory=dict)
    """The synthetic results the loading added to each sidechain (at its end), by agent id."""
    unreleased_sidechains: frozenset[str] = frozenset()
    """The sidechains whose held messages no `release` joined (as `unreleased`), by agent id."""
    dropped: tuple[str, ...] = ()
    """The messages a resume at an earlier message left out (`resumed_at`), by uuid: retracted in the file."""

    @property
    def damaged_lines(self) -> list[int]:
        """Every line skipped: the corrupt ones and a crash's cut last line."""
        return sorted([*self.corrupt_lines, *([self.truncated_line] if self.truncated_line is not None else [])])


def resume_refusal(loaded: LoadedTranscript) -> str | None:
    """Why a session must not go on from `loaded` (the module docstring's rule); None when it may."""
    reasons = [f"after repair, {problem}" for problem in loaded.unresolved]
    if loaded.corrupt_lines:
        start = loaded.repaired_from_line
        after = [number for number in loaded.corrupt_lines if start is not None and number > start]
        if after:
            reasons.append(
                f"line {start} holds a tool_use answered with a synthetic result, and {_lines(after)} after it"
                " may have held its real one"
            )
        reasons.extend(loaded.unopened)
    return "; ".join(reasons) or None


def refuse_damaged(loaded: LoadedTranscript, path: str | os.PathLike[str]) -> None:
    """Raise `TranscriptDamaged` if `resume_refusal` says no."""
    reason = resume_refusal(loaded)
    if reason is not None:
        raise TranscriptDamaged(os.fspath(path), loaded.damaged_lines, list(loaded.problems), reason)


def resumed_at(loaded: LoadedTranscript, uuid: str, path: str | os.PathLike[str]) -> LoadedTranscript:
    """`loaded` up to and including the message `uuid` of its conversation (the Agent SDK's `resume_session_at`):
    what follows it is `dropped`. `ValueError` naming `uuid` if no message of the conversation has it (a
    subagent's message included), or if the conversation up to it cannot be sent again (it ends on a tool_use
    without its result, say: resume at the end of a turn). The sidechains are kept whole."""
    index = next((i for i, message in enumerate(loaded.messages) if message.uuid == uuid), None)
    if index is None:
        msg = f"resume_session_at={uuid!r} names no message of the conversation in {os.fspath(path)}"
        raise ValueError(msg)
    kept = loaded.messages[: index + 1]
    problems = transcript_problems(kept)
    if problems:
        msg = f"resume_session_at={uuid!r}: the conversation up to it cannot be sent again ({'; '.join(problems)})"
        raise ValueError(msg)
    dropped = tuple(message.uuid for message in loaded.messages[index + 1 :])
    return dataclasses.replace(loaded, messages=kept, dropped=dropped)


def _lines(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:20])) + (f" and {len(numbers) - 20} more" if len(numbers) > 20 else "")
    return f"line {shown}" if len(numbers) == 1 else f"lines {shown}"


def _shown(value: Any) -> str:
    """A value of a hostile record, shown short (a container by its kind: its repr could be huge or recurse)."""
    if value is None or isinstance(value, str | int | float):
        text = repr(value)
        return text if len(text) <= 40 else f"{text[:37]}..."
    return "an array" if isinstance(value, list) else "an object"


def _malformed_block(message: TranscriptMessage) -> str | None:
    """What is wrong with a message's content blocks, which later steps index without checking; None if nothing.

    The loop reads a tool_use's id, name and input and a tool_result's tool_use_id as they are, and the
    API refuses (every time: the history is sent again) a block without a type or a text without text.
    """
    content = message.content if isinstance(message, UserMessage | AssistantMessage) else None
    if not isinstance(content, list):
        return None
    for index, block in enumerate(content, start=1):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            return f"content block {index} has no type"
        kind = block["type"]
        if kind == "tool_use" and not (
            isinstance(block.get("id"), str)
            and isinstance(block.get("name"), str)
            and isinstance(block.get("input"), dict)
        ):
            return f"content block {index}: a tool_use without a string id and name and an object input"
        if kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
            return f"content block {index}: a tool_result without a string tool_use_id"
        if kind == "text" and not isinstance(block.get("text"), str):
            return f"content block {index}: a text block without a string text"
    return None


def _message_of(record: dict[str, Any]) -> TranscriptMessage | str:
    """A message record read, or why it cannot be."""
    uuid = record.get("uuid")
    if not isinstance(uuid, str) or not uuid:  # one made up here would differ at each load
        return "no uuid"
    try:
        message: TranscriptMessage = _messages.validate_python(record)
    except ValidationError as error:
        return f"{error.error_count()} invalid fields"
    return _malformed_block(message) or message


@dataclass(slots=True)
class _Thread:
    """One conversation being read (the main one or a sidechain): its messages, its held ones."""

    messages: list[TranscriptMessage] = field(default_factory=list)
    held: list[TranscriptMessage] = field(default_factory=list)
    """Waiting for their `release` (or the end of the file)."""
    tool_use_lines: dict[str, int] = field(default_factory=dict)
    """The line of each tool_use's block (its first, if a hostile file repeats an id)."""

    def take(self, record: dict[str, Any], kind: str, number: int) -> str | None:
        """Read one record of this conversation; why it was skipped, or None."""
        if kind == "tombstone":
            retracted = record.get("message_uuid")
            if not isinstance(retracted, str):
                return "tombstone record skipped (no message_uuid)"
            self.messages[:] = [m for m in self.messages if m.uuid != retracted]  # in place: a Sidechain shares it
            self.held[:] = [m for m in self.held if m.uuid != retracted]
        elif kind == "release":
            self.messages.extend(self.held)
            self.held.clear()
        elif kind in _MESSAGE_TYPES:
            waits = record.pop("held", False)
            if not isinstance(waits, bool):
                return f"{kind} record skipped (held is {_shown(waits)})"
            message = _message_of(record)
            if isinstance(message, str):
                return f"{kind} record skipped ({message})"
            if isinstance(message, AssistantMessage):
                for tool_id in tool_use_ids([message]):
                    self.tool_use_lines.setdefault(tool_id, number)
            (self.held if waits else self.messages).append(message)
        else:
            return f"record skipped (unknown type {_shown(kind)})"
        return None

    def finish(self, parent_tool_use_id: str | None = None) -> tuple[bool, list[UserMessage], list[str], int | None]:
        """Held messages joined at the end, open tool_uses answered (their results tagged `parent_tool_use_id`,
        as a sidechain's records are).

        Whether held messages were left unreleased, the repairs, what is still wrong, and the first line
        holding a tool_use the repairs answer.
        """
        unreleased = bool(self.held)
        # Held messages never released: the crash came before their response was whole. They follow
        # what there is of it, as they would have followed all of it.
        self.messages.extend(self.held)
        self.held.clear()
        try:
            repairs = answer_open_tool_uses(self.messages)
            if parent_tool_use_id is not None:
                repairs = [r.model_copy(update={"parent_tool_use_id": parent_tool_use_id}) for r in repairs]
            self.messages.extend(repairs)
            left = transcript_problems(self.messages)
        except Exception as error:  # noqa: BLE001 - checks over hostile content: what they cannot read is damage
            return unreleased, [], [f"the conversation could not be checked ({type(error).__name__})"], None
        answered = [self.tool_use_lines.get(r.content[0]["tool_use_id"], 0) for r in repairs]  # type: ignore[index]
        return unreleased, repairs, left, min(answered, default=None)

    def opens_with_prompt(self) -> bool:
        for message in messages_after_compact_boundary(self.messages):
            if not isinstance(message, SystemMessage):
                return isinstance(message, UserMessage)
        return True


class _Loading:
    """What the lines read so far make: the conversation, the sidechains, the session id, the damage."""

    def __init__(self) -> None:
        self.session_id: str | None = None
        self.main = _Thread()
        self.sides: dict[str, tuple[Sidechain, _Thread]] = {}
        self.problems: list[str] = []
        self.corrupt: list[int] = []
        self.truncated: int | None = None

    def read(self, raw: bytes, number: int) -> str | None:
        """Take one line; why it was skipped, or None."""
        try:
            record = json.loads(raw)
        except ValueError:
            return "record skipped (not JSON)"
        except RecursionError:
            return "record skipped (nested too deeply)"
        kind = record.get("type") if isinstance(record, dict) else None
        if not isinstance(kind, str):
            return f"record skipped (unknown type {_shown(kind)})"
        side = record.pop("isSidechain", False)
        if side is True:
            why = self._read_sidechain(record, kind, number)
            return None if why is None else f"sidechain {why}"
        if side is not False:
            return f"{kind} record skipped (isSidechain is {_shown(side)})"
        if kind == "session":
            version = record.get("version")
            if not isinstance(version, int) or version not in READABLE_VERSIONS:
                self.problems.append(
                    f"line {number}: transcript version {_shown(version)}, read as version {TRANSCRIPT_VERSION}"
                )
            if self.session_id is None and isinstance(record.get("session_id"), str):
                self.session_id = record["session_id"]
            return None
        return self.main.take(record, kind, number)

    def _read_sidechain(self, record: dict[str, Any], kind: str, number: int) -> str | None:
        """One subagent's record (`isSidechain`) into its sidechain."""
        agent_id = record.pop("agentId", None)
        agent_type = record.pop("agentType", "")
        if not isinstance(agent_id, str):
            return "record skipped (no agentId)"
        if not isinstance(agent_type, str):
            return f"record skipped (agentType is {_shown(agent_type)})"
        found = self.sides.get(agent_id)
        thread = _Thread() if found is None else found[1]
        why = thread.take(record, kind, number)
        if why is not None:
            return why
        parent = record.get("parent_tool_use_id")
        parent = parent if isinstance(parent, str) else None
        if found is None:
            self.sides[agent_id] = (Sidechain(agent_id, agent_type, parent, thread.messages), thread)
        elif found[0].parent_tool_use_id is None:  # its first records said none (a release): a later one may
            found[0].parent_tool_use_id = parent
        return None

    def skip(self, number: int, why: str, *, truncated: bool) -> None:
        if truncated:
            self.truncated = number
        else:
            self.corrupt.append(number)
        self.problems.append(f"line {number}: {'truncated' if truncated else 'corrupt'} {why}")

    def finish(self) -> LoadedTranscript:
        problems = self.problems
        if self.session_id is None:
            problems.append("no session record: the session id is unknown")
        unreleased, repairs, unresolved, first = self.main.finish()
        unopened = [] if self.main.opens_with_prompt() else [_UNOPENED]
        starts = [first]
        sidechains: dict[str, Sidechain] = {}
        side_repairs: dict[str, list[UserMessage]] = {}
        side_unreleased: set[str] = set()
        for agent_id, (side, thread) in self.sides.items():
            # A sidechain's repairs carry its parent tool_use id, as its records in the file do.
            held, fixed, left, start = thread.finish(side.parent_tool_use_id or "")
            if held:
                side_unreleased.add(agent_id)
            if fixed:
                side_repairs[agent_id] = fixed
            unresolved.extend(f"sidechain {agent_id}: {problem}" for problem in left)
            if not thread.opens_with_prompt():
                unopened.append(f"sidechain {agent_id}: {_UNOPENED}")
            starts.append(start)
            sidechains[agent_id] = side
        problems.extend(f"after repair: {problem}" for problem in unresolved)
        return LoadedTranscript(
            session_id=self.session_id,
            messages=self.main.messages,
            problems=problems,
            repairs=repairs,
            sidechains=sidechains,
            corrupt_lines=self.corrupt,
            truncated_line=self.truncated,
            unresolved=unresolved,
            repaired_from_line=min((s for s in starts if s is not None), default=None),
            unopened=unopened,
            unreleased=unreleased,
            sidechain_repairs=side_repairs,
            unreleased_sidechains=frozenset(side_unreleased),
        )


def load_transcript(path: str | os.PathLike[str]) -> LoadedTranscript:
    """Read a transcript log back; whatever its bytes, damaged lines are skipped and reported, never raised."""
    lines = Path(path).read_bytes().split(b"\n")
    loading = _Loading()
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            why = loading.read(raw, number)
        except Exception as error:  # noqa: BLE001 - a hostile line: whatever reading it raises is its damage
            why = f"record skipped (unreadable: {type(error).__name__})"
        if why is not None:
            # What follows the last newline is a record a crash cut short (unless only its newline is missing).
            loading.skip(number, why, truncated=number == len(lines))
    return loading.finish()


def answer_open_tool_uses(messages: list[TranscriptMessage]) -> list[UserMessage]:
    """Synthetic error results for the tool_uses of the last response that have none.

    Results join the conversation only after their whole response (the QueryLoop holds
    early ones back), and the log keeps the conversation's order; so a crash can leave
    open tool_uses only in the last response, answered (or not) by what follows it.
    Appended at the end, the results merge into the user message that follows the
    response, if any: the roles still alternate. A call a PreToolUse hook deferred
    (`deferred.pending_deferred`) is left open: no crash left it so.
    """
    if pending_deferred(messages) is not None:
        return []  # no crash: a call a PreToolUse hook deferred, open for the resumed session to replay
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

    Back into the file it was loaded from, only what the loading decided is written (`_write_back`);
    the rest is there already. Into any other file, the restored conversation first.
    Written at once (a caller runs this in a worker thread: a whole history may be long); the
    caller's `flush()` then only fsyncs.
    """
    # Only the file it was restored from may already hold the session (one file, one session).
    log = TranscriptLog(path, session_id, resumes=resumed_from if resumed is not None else None)
    try:
        if resumed is not None:
            same = resumed_from is not None and not log.is_new and os.path.samefile(path, resumed_from)
            if same:
                _write_back(log, resumed)
            else:
                for message in resumed.messages:
                    log.append(message)
                for side in resumed.sidechains.values():  # the sidechains too: the new file alone restores them
                    side_log = _sidechain_log(log, side)
                    for message in side.messages:
                        side_log.append(message)
        log.write()
    except BaseException:
        with contextlib.suppress(OSError):  # its write fails again: the error being raised says why
            log.close()
        raise
    return log


def _write_back(log: TranscriptLog, resumed: LoadedTranscript) -> None:
    """What the loading decided, into the file it read, so that every later load reads the same.

    Held messages that no `release` joined were joined at the end of the file: a `release` there says
    so (else the next release the session writes, or the next end of the file, would move them). Then
    the synthetic results, then a tombstone for each message a resume at an earlier message dropped. The same
    for each sidechain, in its own records.
    """
    if resumed.unreleased:
        log.release()
    for message in resumed.repairs:
        log.append(message)
    for uuid in resumed.dropped:  # a resume at an earlier message: what followed it is retracted, as a tombstone does
        log.append(TombstoneEvent(message_uuid=uuid))
    for agent_id, side in resumed.sidechains.items():
        repairs = resumed.sidechain_repairs.get(agent_id, [])
        if agent_id not in resumed.unreleased_sidechains and not repairs:
            continue
        side_log = _sidechain_log(log, side)
        if agent_id in resumed.unreleased_sidechains:
            side_log.release()
        for message in repairs:
            side_log.append(message)


def _sidechain_log(log: TranscriptLog, side: Sidechain) -> SidechainLog:
    return SidechainLog(
        log, agent_id=side.agent_id, agent_type=side.agent_type, parent_tool_use_id=side.parent_tool_use_id or ""
    )
