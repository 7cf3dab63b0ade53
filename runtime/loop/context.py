"""Context management as pure functions: token counts, thresholds and the lighter pipeline steps.

The Compactor actor calls these in the order of Claude Code's context pipeline, lightest
first. Each returns a new message list (messages are frozen; nothing is edited in
place) and keeps every `tool_use` paired with its `tool_result`.

Thresholds (`ContextLimits`), after Claude Code's autocompact module; every
number is a `QueryOptions` field:

    effective window   = context window - min(max output tokens, summary reserve 20,000)
    autocompact at     = effective - 13,000
    warning from       = autocompact threshold - 20,000   (microcompact and collapse staging start here)
    blocking limit     = effective - 3,000
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from queryloop.runtime.loop.events import AssistantMessage, Block, SystemMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.json_text import dumps
from queryloop.runtime.loop.token_budget import math_round

CLEARED_TOOL_RESULT = "[Old tool result content cleared]"
COMPACT_SUMMARY_PREFIX = (
    "This session is being continued from a previous conversation that ran out of context. "
    "The summary below covers the earlier portion of the conversation.\n\n"
)
COMPACT_INSTRUCTIONS = (
    "Your task is to create a detailed summary of the conversation so far: the user's requests, what was "
    "done (files, commands, tool results that matter), errors and how they were fixed, and what remains "
    "to be done. Reply with the summary only."
)


def compact_prompt(custom: str | None) -> str:
    """The compaction request's last message: the instructions, and the host's own after them under
    Claude Code's heading (`/compact <instructions>`, a CLAUDE.md's compact instructions)."""
    if not custom or not custom.strip():
        return COMPACT_INSTRUCTIONS
    return f"{COMPACT_INSTRUCTIONS}\n\nAdditional Instructions:\n{custom.strip()}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextLimits:
    """A query's context window and its thresholds (made by the loop from validated options)."""

    context_window: int
    max_output_tokens: int
    summary_output_reserve: int = 20_000
    autocompact_buffer: int = 13_000
    warning_buffer: int = 20_000
    blocking_buffer: int = 3_000
    # Worked out once, when made: the loop compares against them before every call.
    effective_window: int = field(init=False)
    autocompact_threshold: int = field(init=False)
    warning_threshold: int = field(init=False)
    blocking_limit: int = field(init=False)
    lowest_threshold: int = field(init=False)
    """The first threshold a growing context meets: below it no step of the pipeline acts."""

    def __post_init__(self) -> None:
        effective = self.context_window - min(self.max_output_tokens, self.summary_output_reserve)
        autocompact = effective - self.autocompact_buffer
        warning = autocompact - self.warning_buffer
        blocking = effective - self.blocking_buffer
        for name, value in (
            ("effective_window", effective),
            ("autocompact_threshold", autocompact),
            ("warning_threshold", warning),
            ("blocking_limit", blocking),
            ("lowest_threshold", min(warning, autocompact, blocking)),
        ):
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class TokenWarningState:
    percent_left: int
    above_warning: bool
    above_autocompact: bool
    at_blocking_limit: bool


def token_warning_state(tokens: int, limits: ContextLimits) -> TokenWarningState:
    left = max(0, limits.autocompact_threshold - tokens)
    return TokenWarningState(
        percent_left=math_round(100 * left / max(1, limits.autocompact_threshold)),
        above_warning=tokens >= limits.warning_threshold,
        above_autocompact=tokens >= limits.autocompact_threshold,
        at_blocking_limit=tokens >= limits.blocking_limit,
    )


# -- counting -------------------------------------------------------------------------------


def estimate_tokens(message: TranscriptMessage) -> int:
    """A rough count (4 characters a token), as Claude Code's estimation does between API counts."""
    content = getattr(message, "content", "") if not isinstance(message, SystemMessage) else ""
    if isinstance(content, str):
        return len(content) // 4 + 4
    return _blocks_chars(content) // 4 + 4


def _blocks_chars(blocks: list[Block]) -> int:
    # A loop, not sum() over a generator (a generator per message costs more than the counting): the loop
    # counts the new messages of every turn. `_estimate_all` is the same for messages.
    chars = 0
    for block in blocks:
        chars += _block_chars(block)
    return chars


def _block_chars(block: Block) -> int:
    kind = block.get("type")
    if kind == "text":
        return len(block.get("text", ""))
    if kind == "tool_result":
        content = block.get("content", "")
        return len(content) if isinstance(content, str) else _blocks_chars(content)
    if kind == "tool_use":
        return len(dumps(block.get("input", {}))) + len(block.get("name", ""))
    return len(dumps(block))


def token_count_with_estimation(messages: list[TranscriptMessage]) -> int:
    """The usage of the last response (input + cache + output) plus an estimate of every message since.

    Without a response in `messages` (a new query, or just after a compaction) the
    whole count is an estimate.
    """
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, AssistantMessage) and message.usage is not None:
            usage = message.usage
            counted = (
                usage.input_tokens
                + usage.cache_creation_input_tokens
                + usage.cache_read_input_tokens
                + usage.output_tokens
            )
            return counted + _estimate_all(messages, index + 1)
    return _estimate_all(messages, 0)


def _estimate_all(messages: list[TranscriptMessage], start: int) -> int:
    tokens = 0
    for index in range(start, len(messages)):
        tokens += estimate_tokens(messages[index])
    return tokens


class TokenCountMemo:
    """`token_count_with_estimation`, remembering the last conversation it counted.

    The loop counts a turn's conversation twice: whether a collapse may stage, at the turn's end, and
    whether the next call needs the pipeline. In between it is the same list, unchanged (the loop's
    conversations grow by new lists, and a step that rewrites one makes a new one): counted once.
    """

    __slots__ = ("_counted", "_length", "_tokens")

    def __init__(self) -> None:
        self._counted: list[TranscriptMessage] | None = None
        self._length = 0
        self._tokens = 0

    def __call__(self, messages: list[TranscriptMessage]) -> int:
        if messages is self._counted and len(messages) == self._length:
            return self._tokens
        tokens = token_count_with_estimation(messages)
        self._counted, self._length, self._tokens = messages, len(messages), tokens
        return tokens


def pipeline_needed(
    messages: list[TranscriptMessage],
    limits: ContextLimits,
    *,
    max_tool_result_chars: int,
    snip_max_rounds: int | None,
    scan: OversizedResultScan | None = None,
    count: Callable[[list[TranscriptMessage]], int] = token_count_with_estimation,
) -> bool:
    """Whether any step of the pipeline could change `messages` (False: the Compactor need not be asked).

    Below every threshold, with no oversized tool result and no snip configured, every
    step is the identity; most iterations of most queries are there. `scan` (one per session)
    looks at each message for an oversized result once, not at every call; `count` counts the
    conversation's tokens (a session's `TokenCountMemo`).
    """
    if snip_max_rounds is not None:
        return True
    scan = scan if scan is not None else OversizedResultScan()
    if scan.found(messages, max_tool_result_chars):
        return True
    return count(messages) >= limits.lowest_threshold


class OversizedResultScan:
    """Whether a conversation holds a tool result over the size limit, looking only at what is new.

    A session's conversation grows by appending between calls: the messages already looked at (and
    found under the limit) are a prefix of the next call's, compared by identity first (a C-level
    pass), so each message is measured once, not once per call (a long conversation would make that
    quadratic: a list result's text is joined to be measured). A conversation rewritten by a step
    (compaction, microcompact, a tombstone), or a query with another limit, is looked at whole again.
    """

    __slots__ = ("_clean", "_limit")

    def __init__(self) -> None:
        self._clean: list[TranscriptMessage] = []
        """A prefix of the last conversation looked at, every tool result in it under `_limit`."""
        self._limit = 0

    def found(self, messages: list[TranscriptMessage], limit: int) -> bool:
        clean = self._clean
        start = (
            len(clean)
            if clean and limit == self._limit and len(messages) >= len(clean) and messages[: len(clean)] == clean
            else 0
        )
        for message in messages[start:] if start else messages:
            if isinstance(message, UserMessage) and isinstance(message.content, list):
                for block in message.content:
                    text = _result_text(block)
                    if text is not None and len(text) > limit and not text.startswith("<persisted-output>"):
                        self._clean = []
                        return True
        self._clean, self._limit = list(messages), limit
        return False


def collapse_may_stage(
    messages: list[TranscriptMessage],
    limits: ContextLimits,
    count: Callable[[list[TranscriptMessage]], int] = token_count_with_estimation,
) -> bool:
    """Whether staging a context collapse could do anything (False: the Compactor need not be told).

    The Compactor stages only above the warning threshold (`token_warning_state`).
    """
    return count(messages) >= limits.warning_threshold


# -- rounds: the unit every step removes or rewrites, so pairing survives --------------------


def split_rounds(messages: list[TranscriptMessage]) -> tuple[list[TranscriptMessage], list[list[TranscriptMessage]]]:
    """(what precedes the first response, then one list per response with everything up to the next)."""
    head: list[TranscriptMessage] = []
    rounds: list[list[TranscriptMessage]] = []
    previous_assistant = False
    for message in messages:
        is_assistant = isinstance(message, AssistantMessage)
        if is_assistant and not previous_assistant:
            rounds.append([])
        if rounds:
            rounds[-1].append(message)
        else:
            head.append(message)
        if not isinstance(message, SystemMessage):
            previous_assistant = is_assistant
    return head, rounds


# -- step 1: tool-result budget ----------------------------------------------------------------


def apply_tool_result_budget(
    messages: list[TranscriptMessage],
    *,
    max_chars: int,
    preview_chars: int,
    store: Callable[[str, str], str],
) -> tuple[list[TranscriptMessage], int]:
    """Oversized tool results go to `store(tool_use_id, text) -> path`; a preview and the path stay."""
    replaced = 0
    out: list[TranscriptMessage] = []
    for message in messages:
        if isinstance(message, UserMessage) and isinstance(message.content, list):
            blocks = []
            changed = False
            for block in message.content:
                text = _result_text(block)
                # A result already persisted is never persisted again: its file holds the full output.
                if text is not None and len(text) > max_chars and not text.startswith("<persisted-output>"):
                    path = store(block["tool_use_id"], text)
                    preview = (
                        f"<persisted-output>\nOutput too large ({len(text)} characters). "
                        f"Full output saved to: {path}\n\nPreview (first {preview_chars} characters):\n"
                        f"{text[:preview_chars]}\n</persisted-output>"
                    )
                    blocks.append({**block, "content": preview})
                    changed = True
                    replaced += 1
                else:
                    blocks.append(block)
            out.append(message.model_copy(update={"content": blocks}) if changed else message)
        else:
            out.append(message)
    return out, replaced


def _result_text(block: Block) -> str | None:
    if block.get("type") != "tool_result":
        return None
    content = block.get("content", "")
    if isinstance(content, str):
        return content
    if all(b.get("type") == "text" for b in content):
        return "".join(b.get("text", "") for b in content)
    return None  # images and other blocks are not persisted


# -- step 2: snip ------------------------------------------------------------------------------


def snip(messages: list[TranscriptMessage], max_rounds: int | None) -> tuple[list[TranscriptMessage], int]:
    """Drop the oldest whole rounds beyond `max_rounds` (None: off); returns the tokens freed."""
    if max_rounds is None:
        return messages, 0
    head, rounds = split_rounds(messages)
    if len(rounds) <= max_rounds:
        return messages, 0
    dropped = rounds[: len(rounds) - max_rounds]
    freed = sum(estimate_tokens(m) for r in dropped for m in r)
    kept = [m for r in rounds[len(rounds) - max_rounds :] for m in r]
    return [*head, *kept], freed


# -- step 3: microcompact ------------------------------------------------------------------------


def microcompact(messages: list[TranscriptMessage], keep_recent: int) -> tuple[list[TranscriptMessage], int]:
    """Clear the content of every tool result but the `keep_recent` newest; the blocks (and pairing) stay."""
    every_result = _tool_result_positions(messages)
    older = every_result[: max(0, len(every_result) - keep_recent)]
    # Only what is not cleared yet: the newest `keep_recent` always stay whole, whatever ran before.
    to_clear = {(i, j) for i, j in older if _content_at(messages, i, j) != CLEARED_TOOL_RESULT}
    if not to_clear:
        return messages, 0
    return [_cleared(i, message, to_clear) for i, message in enumerate(messages)], len(to_clear)


def _tool_result_positions(messages: list[TranscriptMessage]) -> list[tuple[int, int]]:
    """Where each tool result is, oldest first: its message's index and its block's."""
    return [
        (i, j)
        for i, m in enumerate(messages)
        if isinstance(m, UserMessage) and isinstance(m.content, list)
        for j, b in enumerate(m.content)
        if b.get("type") == "tool_result"
    ]


def _cleared(i: int, message: TranscriptMessage, to_clear: set[tuple[int, int]]) -> TranscriptMessage:
    """Message `i` with the content of its tool results at positions in `to_clear` cleared (itself if none is)."""
    if not (
        isinstance(message, UserMessage)
        and isinstance(message.content, list)
        and any((i, j) in to_clear for j in range(len(message.content)))
    ):
        return message
    blocks = [{**b, "content": CLEARED_TOOL_RESULT} if (i, j) in to_clear else b for j, b in enumerate(message.content)]
    return message.model_copy(update={"content": blocks})


def _content_at(messages: list[TranscriptMessage], i: int, j: int) -> Any:
    content = messages[i].content  # type: ignore[union-attr]
    return content[j].get("content")  # type: ignore[union-attr]


# -- step 4: context collapse ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StagedCollapse:
    """A span of older rounds and the one message that would replace it."""

    first_uuid: str
    last_uuid: str
    replacement: UserMessage
    messages: int


def stage_collapse(messages: list[TranscriptMessage], keep_recent_rounds: int) -> StagedCollapse | None:
    """Fold every round but the `keep_recent_rounds` newest into one note (None if nothing to fold)."""
    _, rounds = split_rounds(messages)
    if len(rounds) <= keep_recent_rounds:
        return None
    span = [m for r in rounds[: len(rounds) - keep_recent_rounds] for m in r]
    tools: dict[str, int] = {}
    said: list[str] = []
    for message in span:
        if isinstance(message, AssistantMessage):
            for block in message.content:
                if block.get("type") == "tool_use":
                    tools[block["name"]] = tools.get(block["name"], 0) + 1
                elif block.get("type") == "text" and block.get("text"):
                    said.append(block["text"][:200])
    used = ", ".join(f"{name} ×{count}" for name, count in tools.items()) or "none"
    note = f"[Collapsed {len(span)} earlier messages. Tools used: {used}.]" + (
        "\nThe assistant said: " + " / ".join(said[-5:]) if said else ""
    )
    return StagedCollapse(
        first_uuid=span[0].uuid,
        last_uuid=span[-1].uuid,
        replacement=UserMessage(content=note, is_meta=True),
        messages=len(span),
    )


def commit_collapses(
    messages: list[TranscriptMessage], staged: list[StagedCollapse]
) -> tuple[list[TranscriptMessage], int]:
    """Apply every staged collapse whose span is still there, whole; returns how many were committed."""
    committed = 0
    for collapse in staged:
        uuids = [m.uuid for m in messages]
        if collapse.first_uuid not in uuids or collapse.last_uuid not in uuids:
            continue
        start, end = uuids.index(collapse.first_uuid), uuids.index(collapse.last_uuid)
        if end < start:
            continue
        messages = [*messages[:start], collapse.replacement, *messages[end + 1 :]]
        committed += 1
    return messages, committed


# -- step 6: compaction --------------------------------------------------------------------------


def post_compact_messages(summary: str, *, trigger: str, pre_tokens: int) -> list[TranscriptMessage]:
    """The boundary (everything before it is no longer sent) and the summary that replaces it."""
    return [
        SystemMessage(
            subtype="compact_boundary",
            content="Conversation compacted",
            data={"trigger": trigger, "pre_tokens": pre_tokens},
        ),
        UserMessage(content=COMPACT_SUMMARY_PREFIX + summary, is_meta=True),
    ]


def fit_for_summary(messages: list[TranscriptMessage], budget_tokens: int) -> list[TranscriptMessage]:
    """Drop the oldest rounds until the compaction request itself fits (it must not fail for being full)."""
    head, rounds = split_rounds(messages)
    while rounds and sum(estimate_tokens(m) for m in [*head, *(m for r in rounds for m in r)]) > budget_tokens:
        rounds = rounds[1:]
    return [*head, *(m for r in rounds for m in r)]
