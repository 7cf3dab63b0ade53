"""Pure functions over the conversation: what is sent to the API, and whether it is valid.

`normalize_messages_for_api` turns the session's transcript into the Messages
API's `messages`: internal fields and system messages dropped, attachments meant
for the model turned into user text, the blocks of one response merged into one
assistant message, consecutive same-role messages merged (tool results first),
and every `tool_use` paired with exactly one `tool_result` (a missing result is
synthesized, an orphan result dropped, both logged: they would be a 400).

`transcript_problems` checks the same property *without* repairing anything:
the tests and the scenario verdict use it, so a bug cannot hide behind the repair.

`IncrementalNormalizer` gives the same result as `normalize_messages_for_api` for a conversation
that grows between calls, normalising only what is new (the QueryLoop keeps one per session).
"""

from __future__ import annotations

from typing import Any

from loguru import logger

from queryloop.runtime.loop.deferred import pending_deferred
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    Block,
    SystemMessage,
    TranscriptMessage,
    UserMessage,
)

INTERRUPTED_BY_USER = "Interrupted by user"
INTERRUPT_MESSAGE = "[Request interrupted by user]"
INTERRUPT_MESSAGE_FOR_TOOL_USE = "[Request interrupted by user for tool use]"

MODEL_VISIBLE_ATTACHMENTS = frozenset(
    {"file_changed", "queued_message", "memory", "text", "hook_additional_context", "hook_blocking_error"}
)
"""Attachment types whose `content` the model sees (as a system reminder or, for queued messages, as is)."""


def tool_error(message: str) -> str:
    """The body of an error tool result, as Claude Code shapes it."""
    return f"<tool_use_error>{message}</tool_use_error>"


def tool_result_message(tool_use_id: str, content: str | list[Block], *, is_error: bool) -> UserMessage:
    block: Block = {
        "type": "tool_result",
        "tool_use_id": tool_use_id,
        "content": content,
        "is_error": is_error,
    }
    return UserMessage(content=[block])


def messages_after_compact_boundary(messages: list[TranscriptMessage]) -> list[TranscriptMessage]:
    """Only what follows the last `compact_boundary` is sent: everything before it is in its summary."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, SystemMessage) and message.subtype == "compact_boundary":
            return messages[index + 1 :]
    return messages


class CompactBoundary:
    """`messages_after_compact_boundary` for a conversation that grows between calls, looking only at
    what is new.

    A session's conversation grows by appending: when the last conversation looked at is a prefix of
    this one (compared by identity first, a C-level pass), only the new messages are searched for a
    boundary; otherwise (a step rewrote the conversation) it is searched whole. Without it every
    model call of a long session would walk the whole history in Python.
    """

    __slots__ = ("_seen", "_start")

    def __init__(self) -> None:
        self._seen: list[TranscriptMessage] = []
        self._start = 0
        """Where what follows the last boundary of `_seen` begins."""

    def after(self, messages: list[TranscriptMessage]) -> list[TranscriptMessage]:
        seen = self._seen
        known = len(seen)
        if known and len(messages) >= known and messages[known - 1] is seen[-1] and messages[:known] == seen:
            start = self._start
            for index in range(len(messages) - 1, known - 1, -1):
                message = messages[index]
                if isinstance(message, SystemMessage) and message.subtype == "compact_boundary":
                    start = index + 1
                    break
        else:
            start = len(messages) - len(messages_after_compact_boundary(messages))
        self._seen, self._start = list(messages), start
        return messages[start:] if start else messages


def tool_use_ids(messages: list[AssistantMessage]) -> list[str]:
    return [b["id"] for m in messages for b in m.content if b.get("type") == "tool_use"]


def result_ids(messages: list[TranscriptMessage]) -> set[str]:
    return {
        b["tool_use_id"]
        for m in messages
        if isinstance(m, UserMessage) and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    }


def missing_tool_results(
    assistant_messages: list[AssistantMessage], results: list[TranscriptMessage], text: str
) -> list[UserMessage]:
    """Synthetic error results for every `tool_use` that has none yet (Claude Code's `yieldMissingToolResultBlocks`)."""
    have = result_ids(results)
    return [
        tool_result_message(tool_id, text, is_error=True)
        for tool_id in tool_use_ids(assistant_messages)
        if tool_id not in have
    ]


def strip_signature_blocks(messages: list[TranscriptMessage]) -> list[TranscriptMessage]:
    """Drop thinking blocks, whose signatures bind them to the model being left (on a fallback)."""
    out: list[TranscriptMessage] = []
    for message in messages:
        if isinstance(message, AssistantMessage) and any(_is_thinking(b) for b in message.content):
            kept = [b for b in message.content if not _is_thinking(b)]
            if kept:
                out.append(message.model_copy(update={"content": kept}))
        else:
            out.append(message)
    return out


def _is_thinking(block: Block) -> bool:
    return block.get("type") in ("thinking", "redacted_thinking")


def response_text(message_id: str, text: str, message: AssistantMessage) -> tuple[str, str]:
    """The `result`'s text (the last response's) with `message`, a block's message, added: its message id and text.

    A message of a new response (another `message_id`) starts the text again.
    """
    if message.message_id != message_id:
        message_id, text = message.message_id, ""
    for block in message.content:  # a loop, not a join over a generator: no generator per message
        if block.get("type") == "text":
            text += block.get("text", "")
    return message_id, text


def user_context_message(user_context: dict[str, str]) -> UserMessage | None:
    """The user context, prepended to the messages (not the system prompt) as Claude Code does."""
    if not user_context:
        return None
    lines = "\n".join(f"# {key}\n{value}" for key, value in user_context.items())
    text = (
        "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
        f"{lines}\n</system-reminder>"
    )
    return UserMessage(content=text, is_meta=True)


def build_system_prompt(
    default: list[str],
    *,
    custom: str | None = None,
    append: str | None = None,
    system_context: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Layered: the custom prompt or the default, then the appended prompt, then the system context."""
    parts = [custom] if custom is not None else list(default)
    if append:
        parts.append(append)
    if system_context:
        parts.append("\n".join(f"{key}: {value}" for key, value in system_context.items()))
    return [{"type": "text", "text": part} for part in parts if part]


# -- normalization ------------------------------------------------------------------------


def _api_blocks(message: TranscriptMessage) -> tuple[str, list[Block]] | None:
    """The role and content blocks one transcript message contributes, or None if it is not sent."""
    if isinstance(message, AssistantMessage):
        return None if message.is_api_error else ("assistant", list(message.content))
    if isinstance(message, UserMessage):
        content = message.content
        return "user", ([{"type": "text", "text": content}] if isinstance(content, str) else list(content))
    if isinstance(message, AttachmentMessage):
        kind = message.attachment.get("type")
        if kind not in MODEL_VISIBLE_ATTACHMENTS:
            return None
        text = str(message.attachment.get("content", ""))
        if kind != "queued_message":
            text = f"<system-reminder>\n{text}\n</system-reminder>"
        return "user", [{"type": "text", "text": text}]
    return None  # system messages are for the user only


_Part = tuple[str, list[Block]] | None


def _merge(messages: list[TranscriptMessage]) -> list[dict[str, Any]]:
    return _merge_parts([_api_blocks(m) for m in messages])


def _merge_parts(parts: list[_Part]) -> list[dict[str, Any]]:
    """Consecutive same-role parts joined into one message.

    The parts' block lists become the messages' content: each part must be fresh (`_api_blocks` makes it so).
    """
    merged: list[dict[str, Any]] = []
    for part in parts:
        if part is None:
            continue
        role, blocks = part
        if merged and merged[-1]["role"] == role:
            merged[-1]["content"].extend(blocks)
        else:
            merged.append({"role": role, "content": blocks})
    return merged


def normalize_messages_for_api(messages: list[TranscriptMessage]) -> list[dict[str, Any]]:
    """The Messages API `messages` for this transcript, paired and alternating (see module doc)."""
    return _normalize_parts([_api_blocks(m) for m in messages])


def _normalize_parts(parts: list[_Part]) -> list[dict[str, Any]]:
    """The messages `parts` make: merged, paired, emptied ones dropped, roles re-alternated.

    After the merge, one pass (the hot path of every model call):
    * an assistant message is kept as it is; the last one, if it has tool_uses, is followed by a user
      message answering them;
    * a user message becomes exactly one result per tool_use of the assistant message before it, in
      that order, then its other blocks (`_answer`): orphans dropped, gaps filled;
    * a message left empty is dropped, and two of one role side by side are then joined (every dict
      and list here is fresh: joining extends one in place).
    """
    merged = _merge_parts(parts)
    out: list[dict[str, Any]] = []
    last = len(merged) - 1
    uses: list[str] = []  # the tool_uses of the assistant message before the one at hand (merged roles alternate)
    for index, message in enumerate(merged):
        if message["role"] == "assistant":
            uses = [b["id"] for b in message["content"] if b.get("type") == "tool_use"]
            _put(out, message)
            if index == last and uses:
                _put(out, {"role": "user", "content": _answer(uses, [])})
        else:
            message["content"] = _answer(uses, message["content"])
            _put(out, message)
            uses = []
    return out


def _put(out: list[dict[str, Any]], message: dict[str, Any]) -> None:
    content = message["content"]
    if not content:
        return
    if out and out[-1]["role"] == message["role"]:  # an emptied message between two of one role: join them
        out[-1]["content"].extend(content)
    else:
        out.append(message)


def _answer(wanted: list[str], content: list[Block]) -> list[Block]:
    """A user message's blocks with exactly one result per id of `wanted`, first and in that order."""
    by_id: dict[str, Block] = {}
    others: list[Block] = []
    for block in content:
        if block.get("type") != "tool_result":
            others.append(block)
            continue
        tool_id = block["tool_use_id"]
        if tool_id in wanted and tool_id not in by_id:
            by_id[tool_id] = block
        else:
            logger.warning("dropped a tool_result with no matching tool_use: {}", tool_id)
    if len(by_id) != len(wanted):
        for tool_id in wanted:
            if tool_id not in by_id:
                logger.warning("synthesized a missing tool_result for {}", tool_id)
                by_id[tool_id] = {
                    "type": "tool_result",
                    "tool_use_id": tool_id,
                    "content": tool_error("Tool result missing"),
                    "is_error": True,
                }
    answered = [by_id[tool_id] for tool_id in wanted]
    if others:
        answered.extend(others)
    return answered


class IncrementalNormalizer:
    """`normalize_messages_for_api` for a conversation that grows between calls, normalising only what is new.

    It returns exactly what `normalize_messages_for_api(messages)` returns, but each call puts through
    the per-message normalisation only the messages from its last *checkpoint* on, and the checkpoint
    moves forward as the conversation grows.

    A checkpoint is the index of an *opener*: an assistant message that is sent and whose previous sent
    message is a user message, or that has none (system messages, API-error messages and the attachments
    the model does not see are not sent). An opener cuts the normalisation into two independent halves:
    merging never joins across it (the roles differ); a user message's pairing looks only at the
    assistant message just before it (on its own side), and an assistant message's only at whether
    anything follows it (something does, on its own side: the first half ends with a user message); the
    last step, re-alternation once empty messages are dropped, is a left fold whose only state is the last
    message it made. So the normalisation of `m` is that of `m[:c]` followed by that of `m[c:]`, except
    that where the two meet on one role their two messages are one (`_join_into`). Appending to `m` never
    makes an opener stop being one: that depends only on the opener and what precedes it.

    State: `_kept`, a copy of the messages up to the opener at the checkpoint, the opener included (empty
    while there is no checkpoint past 0), and `_frozen`, the normalisation of the messages before it.

    Invariant: `_frozen == normalize_messages_for_api(_kept[:-1])` and `_kept[-1]` is an opener in
    `_kept`; no dict of `_frozen` is changed once built (a join makes a new one), so the requests built
    earlier keep the messages they were given.

    A call whose `messages` does not begin with `_kept` starts again from nothing (`restarts`): a
    compaction replaced the history, a fallback stripped thinking blocks, a tombstone retracted a message,
    microcompact or a collapse rewrote an older one, or the opener itself was replaced. The comparison is
    list equality, which CPython makes identity first per element (pointer compares, a few ns a message);
    two distinct messages are equal only if all their fields are, and then they normalise the same, so
    equality is as sound as identity. Otherwise the call normalises `messages` from the opener on, in two
    pieces cut at their last opener, joins the first onto `_frozen` (the checkpoint moves to that opener)
    and returns a new list: `_frozen` joined with the second.

    Cost of a call: the per-message normalisation of what was appended since the previous call and of
    what that call had after its last opener (in the loop: the last response, its tool results and
    attachments), and O(n) pointer work for the comparison and the returned list. A restart costs what
    `normalize_messages_for_api` does. Warnings about repaired results are logged when their messages
    are normalised, so once or twice, not at every request.
    """

    __slots__ = ("_frozen", "_kept", "restarts")

    def __init__(self) -> None:
        self._kept: list[TranscriptMessage] = []
        self._frozen: list[dict[str, Any]] = []
        self.restarts = 0
        """Calls that found the history before the checkpoint changed, and normalised every message again."""

    def normalize(self, messages: list[TranscriptMessage]) -> list[dict[str, Any]]:
        """`normalize_messages_for_api(messages)`, a new list (its dicts may be shared with earlier results)."""
        kept = self._kept
        if kept and (len(messages) < len(kept) or messages[: len(kept)] != kept):
            self._kept, self._frozen = [], []
            kept = self._kept
            self.restarts += 1
        start = len(kept) - 1 if kept else 0
        window = messages[start:] if start else messages
        parts = [_api_blocks(m) for m in window]
        cut = _last_checkpoint(parts)
        frozen = self._frozen
        if cut:
            _join_into(frozen, _normalize_parts(parts[:cut]))
            kept[start:] = window[: cut + 1]
            del parts[:cut]
        rest = _normalize_parts(parts)
        if not frozen:
            return rest
        out = list(frozen)
        _join_into(out, rest)
        return out


def _last_checkpoint(parts: list[_Part]) -> int:
    """The index of the last opener's part (`IncrementalNormalizer`), else 0.

    The window's first sent part is an opener if it is an assistant's: the window starts at an opener or at 0.
    """
    checkpoint = 0
    previous: str | None = None
    for index, part in enumerate(parts):
        if part is None:
            continue
        role = part[0]
        if role == "assistant" and previous != "assistant":
            checkpoint = index
        previous = role
    return checkpoint


def _join_into(head: list[dict[str, Any]], tail: list[dict[str, Any]]) -> None:
    """`head` followed by `tail`, two messages of one role where they meet made one (a new dict)."""
    if head and tail and head[-1]["role"] == tail[0]["role"]:
        head[-1] = {"role": tail[0]["role"], "content": [*head[-1]["content"], *tail[0]["content"]]}
        head.extend(tail[1:])
    else:
        head.extend(tail)


def transcript_problems(messages: list[TranscriptMessage]) -> list[str]:
    """What would make this transcript invalid to send, without repairing anything (empty = valid).

    A deferred call waiting for the host's decision (`deferred.pending_deferred`) is no problem: the next query
    answers it before it sends anything."""
    merged = _merge(messages_after_compact_boundary(messages))
    pending = pending_deferred(messages)
    excused = pending[1]["id"] if pending is not None else None
    problems: list[str] = []
    if merged and merged[0]["role"] != "user":
        problems.append("the first message is not a user message")
    for index, message in enumerate(merged):
        previous = merged[index - 1] if index else None
        following = merged[index + 1] if index + 1 < len(merged) else None
        if previous is not None and previous["role"] == message["role"]:
            problems.append(f"messages {index - 1} and {index} share the role {message['role']}")
        if message["role"] == "user":
            problems.extend(_unmatched_results(index, message, previous))
        if message["role"] == "assistant":
            problems.extend(p for tool_id, p in _unanswered_uses(index, message, following) if tool_id != excused)
    return problems


def _block_ids(message: dict[str, Any], block_type: str, key: str) -> list[str]:
    """The `key` of each of a message's blocks of `block_type`, in order (a tool_use's id, a tool_result's)."""
    return [b[key] for b in message["content"] if b.get("type") == block_type]


def _unmatched_results(index: int, message: dict[str, Any], previous: dict[str, Any] | None) -> list[str]:
    """The problems of a user message's tool_results: one answering no tool_use of the assistant message just
    before it, and a tool_use answered more than once."""
    uses: set[str] = set()
    if previous is not None and previous["role"] == "assistant":
        uses = set(_block_ids(previous, "tool_use", "id"))
    seen = _block_ids(message, "tool_result", "tool_use_id")
    problems = [
        f"message {index}: tool_result {tool_id} answers no tool_use" for tool_id in seen if tool_id not in uses
    ]
    problems.extend(
        f"message {index}: tool_use {tool_id} has several tool_results"
        for tool_id in {t for t in seen if seen.count(t) > 1}
    )
    return problems


def _unanswered_uses(index: int, message: dict[str, Any], following: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The problems of an assistant message's tool_uses (with their ids): one that the message just after it
    answers with no tool_result."""
    answered = set(_block_ids(following, "tool_result", "tool_use_id")) if following is not None else set()
    return [
        (tool_id, f"message {index}: tool_use {tool_id} has no tool_result")
        for tool_id in _block_ids(message, "tool_use", "id")
        if tool_id not in answered
    ]
