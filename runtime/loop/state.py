"""The loop's `State`, its `Continue` transitions and its `Terminal`, as Claude Code's query loop has them.

Every continue site builds a *new* `State` from the old one with one of the
functions below, so what each site resets or keeps is written once, here, and
tested without any actor running. The only exception is the fallback retry,
which is a bare `continue` with the state untouched.

What each site does to the fields that carry across iterations:

| site | recovery count | reactive guard | output override | stop hook active | stop hook blocks |
|---|---|---|---|---|---|
| next_turn | 0 | reset | reset | cleared | 0 |
| max_output_tokens_escalate | kept | kept | ESCALATED | cleared | 0 |
| max_output_tokens_recovery | +1 | kept | kept | cleared | 0 |
| stop_hook_blocking | 0 | **kept** (the production incident) | reset | True | +1 |
| token_budget_continuation | 0 | reset | reset | cleared | 0 |
| reactive_compact_retry | kept | True | reset | cleared | 0 |
| collapse_drain_retry | kept | kept | reset | cleared | 0 |
| pause_turn_continuation | kept | kept | kept | cleared | 0 |
| thinking_only_retry | kept | kept | kept | cleared | 0 |
| truncated_response_recovery | +1 (the max-output-tokens cap, shared) | kept | kept | cleared | 0 |
| malformed_tool_use_retry | kept | kept | kept | cleared | 0 |

The last three are Claude Code 2.1's newer recoveries (`decisions` decides each): a final response with no
visible text is asked once per turn for one (`thinking_only_retry`); a stream cut after visible output is
resumed (`truncated_response_recovery`, under the max-output-tokens recovery cap of 3); a `tool_use` stop
with no `tool_use` block is retried once per turn (`malformed_tool_use_retry`). "Once per turn" is kept as
the turn it was used in (`thinking_only_retry_turn`, `malformed_tool_use_retry_turn`): a new turn
(`next_turn`) raises `turn_count` past it, so no site has to reset it.

`pause_turn_continuation` is not one of Claude Code's continue sites: the Messages API's `pause_turn` (a long
server-tool turn, paused by the server) asks for the paused response back as is, in a new request of
the same turn; it is named as Claude Code names a continuation (`token_budget_continuation`). It
counts `pause_turn_continuations` (capped by `QueryOptions.max_pause_turn_continuations`); every other
site resets that count but the recoveries of the same response (escalate, recovery, the 413 retries).

`stop_hook_blocks` is not a field of Claude Code's loop State either: it is the counter Claude Code added later
(2.1.143, `CLAUDE_CODE_STOP_HOOK_BLOCK_CAP`), which only a block raises and every other continuation
sets back to 0. A block does not count as a turn, so `max_turns` never sees a hook that blocks every
stop; the counter lets `QueryOptions.stop_hook_block_cap` end that loop (`decisions.stop_hook_block_capped`).

Every site also drops the pending tool-use summary it has consumed, except
`next_turn`, which installs the one for the batch that just ran.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from queryloop.runtime._records import record, replacer
from queryloop.runtime.loop.events import AssistantMessage, TranscriptMessage, UserMessage

MAX_OUTPUT_TOKENS_RECOVERY_LIMIT = 3
"""Recovery messages allowed per response chain before the withheld error surfaces."""

MAX_OUTPUT_TOKENS_RECOVERY_TEXT = (
    "Output token limit hit. Resume directly — no apology, no recap of what you were doing. "
    "Pick up mid-thought if that is where the cut happened. Break remaining work into smaller pieces."
)
"""The meta message of `max_output_tokens_recovery` (Claude Code's text, completed)."""

THINKING_ONLY_RETRY_TEXT = (
    "[Your previous response had no visible output. Please continue and produce a user-visible response.]"
)
"""The meta message of `thinking_only_retry` (Claude Code 2.1's text)."""

TRUNCATED_RESPONSE_RECOVERY_TEXT = (
    "Your response above was cut off mid-stream. Resume directly from where it stops — no apology, no recap. "
    "If none of it survived, answer the request from the start."
)
"""The meta message of `truncated_response_recovery` (Claude Code 2.1's text)."""

MALFORMED_TOOL_USE_RETRY_TEXT = "Your tool call was malformed and could not be parsed. Please retry."
"""The meta message of `malformed_tool_use_retry` (Claude Code 2.1's text, outside its clean-retry mode)."""

MALFORMED_TOOL_USE_EXHAUSTED_TEXT = "The model's tool call could not be parsed (retry also failed)."
"""The error a `malformed_tool_use_exhausted` query ends with (Claude Code 2.1's text)."""

RAPID_REFILL_LIMIT = 3
"""Refills in a row (right after an autocompaction, the context is due another) that trip the breaker."""

RAPID_REFILL_BREAKER_TEXT = (
    f"The context refilled to the autocompact threshold right after compaction {RAPID_REFILL_LIMIT} times in a "
    "row; stopped instead of compacting again."
)
"""The error a `rapid_refill_breaker` query ends with."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NextTurn(_Frozen):
    reason: Literal["next_turn"] = "next_turn"


class MaxOutputTokensEscalate(_Frozen):
    reason: Literal["max_output_tokens_escalate"] = "max_output_tokens_escalate"


class MaxOutputTokensRecovery(_Frozen):
    reason: Literal["max_output_tokens_recovery"] = "max_output_tokens_recovery"
    attempt: int


class ReactiveCompactRetry(_Frozen):
    reason: Literal["reactive_compact_retry"] = "reactive_compact_retry"


class CollapseDrainRetry(_Frozen):
    reason: Literal["collapse_drain_retry"] = "collapse_drain_retry"
    committed: int


class StopHookBlocking(_Frozen):
    reason: Literal["stop_hook_blocking"] = "stop_hook_blocking"


class TokenBudgetContinuation(_Frozen):
    reason: Literal["token_budget_continuation"] = "token_budget_continuation"


class PauseTurnContinuation(_Frozen):
    reason: Literal["pause_turn_continuation"] = "pause_turn_continuation"
    continuation: int
    """1 for the first continuation of a turn, 2 for the next, ..."""


class ThinkingOnlyRetry(_Frozen):
    reason: Literal["thinking_only_retry"] = "thinking_only_retry"


class TruncatedResponseRecovery(_Frozen):
    reason: Literal["truncated_response_recovery"] = "truncated_response_recovery"
    attempt: int
    """The shared recovery count after this one (`max_output_tokens_recovery_count`)."""


class MalformedToolUseRetry(_Frozen):
    reason: Literal["malformed_tool_use_retry"] = "malformed_tool_use_retry"


NEXT_TURN = NextTurn()
"""The one `NextTurn` (it has no field to tell two apart): the most common transition, made once."""
THINKING_ONLY_RETRY = ThinkingOnlyRetry()
MALFORMED_TOOL_USE_RETRY = MalformedToolUseRetry()

Continue = Annotated[
    NextTurn
    | MaxOutputTokensEscalate
    | MaxOutputTokensRecovery
    | ReactiveCompactRetry
    | CollapseDrainRetry
    | StopHookBlocking
    | TokenBudgetContinuation
    | PauseTurnContinuation
    | ThinkingOnlyRetry
    | TruncatedResponseRecovery
    | MalformedToolUseRetry,
    Field(discriminator="reason"),
]
ContinueReason = Literal[
    "next_turn",
    "max_output_tokens_escalate",
    "max_output_tokens_recovery",
    "reactive_compact_retry",
    "collapse_drain_retry",
    "stop_hook_blocking",
    "token_budget_continuation",
    "pause_turn_continuation",
    "thinking_only_retry",
    "truncated_response_recovery",
    "malformed_tool_use_retry",
]

TerminalReason = Literal[
    "completed",
    "max_turns",
    "max_budget_usd",
    "aborted_streaming",
    "aborted_tools",
    "blocking_limit",
    "stop_hook_prevented",
    "hook_stopped",
    "prompt_too_long",
    "model_error",
    "image_error",
    "max_structured_output_retries",
    "turn_setup_failed",
    "api_error",
    "malformed_tool_use_exhausted",
    "rapid_refill_breaker",
    "tool_deferred",
    "tool_deferred_unavailable",
]


class Terminal(_Frozen):
    """How a query ended."""

    reason: TerminalReason
    turn_count: int | None = None
    error: str | None = None
    stop_details: dict[str, Any] | None = None
    """A refusal's `stop_details` as the API sent them (`category`, `explanation`, ...). A refusal ends
    the query `completed` with the refusal surfaced as an API error, as Claude Code ends every
    surfaced API error (the result `is_error`, its `stop_reason` "refusal"): these say it was one."""


COMPLETED = Terminal(reason="completed")
"""The most common ending, made once (a `Terminal` is frozen)."""

RAPID_REFILL_BREAKER = Terminal(reason="rapid_refill_breaker", error=RAPID_REFILL_BREAKER_TEXT)
"""How a query ends when its context refills right after each autocompaction (`rapid_refill_breaker_holds`)."""


class AutoCompactTracking(_Frozen):
    """Usage of the latest response, for the autocompact threshold; None until a response arrived."""

    last_input_tokens: int
    compactions: int = 0


@record
class State:
    """What one iteration hands to the next (the fields of Claude Code's loop State): an internal record,
    built by the continue sites below from parts already valid (no validation, one object a State).

    `toolUseContext`, the one field Claude Code mutates inside an iteration, is
    the QueryLoop's per-query context instead (current model, tools, abort), so
    that a fallback can switch the model while this State stays the same object.
    """

    messages: list[TranscriptMessage]
    auto_compact_tracking: AutoCompactTracking | None = None
    max_output_tokens_recovery_count: int = 0
    has_attempted_reactive_compact: bool = False
    max_output_tokens_override: int | None = None
    pending_tool_use_summary: Any = None
    """An awaitable of the summary of the previous tool batch, or None."""
    stop_hook_active: bool = False
    turn_count: int = 1
    pause_turn_continuations: int = 0
    """`pause_turn` responses sent back in this turn so far (not a field of Claude Code's State: see above)."""
    stop_hook_blocks: int = 0
    """Stop-hook blocks in a row, since the last other continuation (not a field of Claude Code's State: see above)."""
    thinking_only_retry_turn: int = 0
    """The turn whose one `thinking_only_retry` has been used (0: none yet): the retry is once per turn."""
    malformed_tool_use_retry_turn: int = 0
    """The turn whose one `malformed_tool_use_retry` has been used (0: none yet): a second malformed stop ends it."""
    transition: Continue | None = None


# -- the continue sites ---------------------------------------------------------------


def initial_state(messages: list[TranscriptMessage]) -> State:
    """The first iteration's `State` of a query over `messages` (the loop's own list, not copied)."""
    return State(messages=messages)


_evolve = replacer(State)
"""A continue site's new State: the old one's fields, with the site's changes (`dataclasses.replace`'s work)."""


def next_turn(
    state: State,
    messages: list[TranscriptMessage],
    pending_tool_use_summary: Any = None,
) -> State:
    """Tools ran: go on with their results; a fresh response chain starts."""
    return _evolve(
        state,
        messages=messages,
        turn_count=state.turn_count + 1,
        max_output_tokens_recovery_count=0,
        has_attempted_reactive_compact=False,
        max_output_tokens_override=None,
        pending_tool_use_summary=pending_tool_use_summary,
        stop_hook_active=False,
        stop_hook_blocks=0,
        pause_turn_continuations=0,
        transition=NEXT_TURN,
    )


def max_output_tokens_escalate(
    state: State, messages_for_query: list[TranscriptMessage], escalated_max_tokens: int
) -> State:
    """First truncation: retry the same input, silently, with the larger output limit."""
    return _evolve(
        state,
        messages=messages_for_query,
        max_output_tokens_override=escalated_max_tokens,
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        transition=MaxOutputTokensEscalate(),
    )


def max_output_tokens_recovery(
    state: State,
    messages_for_query: list[TranscriptMessage],
    assistant_messages: list[AssistantMessage],
    recovery_message: UserMessage,
) -> State:
    """Truncated again: keep the partial answer and ask the model to resume (escalated limit kept)."""
    attempt = state.max_output_tokens_recovery_count + 1
    return _resumed(state, [*messages_for_query, *assistant_messages, recovery_message], attempt,
                    MaxOutputTokensRecovery(attempt=attempt))  # fmt: skip


def _resumed(state: State, messages: list[TranscriptMessage], attempt: int, transition: Continue) -> State:
    """The continue site of a response asked to resume (cut off or truncated): one count, one cap of 3."""
    return _evolve(
        state,
        messages=messages,
        max_output_tokens_recovery_count=attempt,
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        transition=transition,
    )


def stop_hook_blocking(
    state: State,
    messages_for_query: list[TranscriptMessage],
    assistant_messages: list[AssistantMessage],
    blocking_errors: list[UserMessage],
) -> State:
    """A stop hook objected: show the model its errors and let it answer again.

    `has_attempted_reactive_compact` is kept on purpose: resetting it caused an
    infinite compact → still too long → hook blocks → compact loop in production
    (Claude Code's incident). The recovery count is reset: the new response deserves all three
    attempts.
    """
    return _evolve(
        state,
        messages=[*messages_for_query, *assistant_messages, *blocking_errors],
        max_output_tokens_recovery_count=0,
        max_output_tokens_override=None,
        pending_tool_use_summary=None,
        stop_hook_active=True,
        stop_hook_blocks=state.stop_hook_blocks + 1,
        pause_turn_continuations=0,
        transition=StopHookBlocking(),
    )


def token_budget_continuation(
    state: State,
    messages_for_query: list[TranscriptMessage],
    assistant_messages: list[AssistantMessage],
    nudge: UserMessage,
) -> State:
    """The token budget allows more work: a normal continuation, so every recovery guard resets."""
    return _evolve(
        state,
        messages=[*messages_for_query, *assistant_messages, nudge],
        max_output_tokens_recovery_count=0,
        has_attempted_reactive_compact=False,
        max_output_tokens_override=None,
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        pause_turn_continuations=0,
        transition=TokenBudgetContinuation(),
    )


def reactive_compact_retry(state: State, post_compact_messages: list[TranscriptMessage]) -> State:
    """The 413 was answered by a full compaction: retry once with the compacted history."""
    return _evolve(
        state,
        messages=post_compact_messages,
        has_attempted_reactive_compact=True,
        auto_compact_tracking=None,
        max_output_tokens_override=None,
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        transition=ReactiveCompactRetry(),
    )


def collapse_drain_retry(state: State, drained_messages: list[TranscriptMessage], committed: int) -> State:
    """The 413 was answered by committing staged collapses: retry (never twice in a row)."""
    return _evolve(
        state,
        messages=drained_messages,
        max_output_tokens_override=None,
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        transition=CollapseDrainRetry(committed=committed),
    )


def pause_turn_continuation(
    state: State, messages_for_query: list[TranscriptMessage], assistant_messages: list[AssistantMessage]
) -> State:
    """The server paused a long server-tool turn: send the paused response back as is; the model goes on.

    No message is added: the request ends with the paused assistant response (which may end on a
    `server_tool_use` whose result the next response opens with). The same turn: `turn_count` is kept,
    and so are the recovery guards of the response chain.
    """
    continuation = state.pause_turn_continuations + 1
    return _evolve(
        state,
        messages=[*messages_for_query, *assistant_messages],
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        pause_turn_continuations=continuation,
        transition=PauseTurnContinuation(continuation=continuation),
    )


def thinking_only_retry(
    state: State,
    messages_for_query: list[TranscriptMessage],
    assistant_messages: list[AssistantMessage],
    retry: UserMessage,
) -> State:
    """A final response with no visible text (thinking only, or nothing): kept, and the model is asked once in this
    turn for a user-visible answer (`THINKING_ONLY_RETRY_TEXT`)."""
    return _evolve(
        state,
        messages=[*messages_for_query, *assistant_messages, retry],
        thinking_only_retry_turn=state.turn_count,
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        transition=THINKING_ONLY_RETRY,
    )


def truncated_response_recovery(
    state: State,
    messages_for_query: list[TranscriptMessage],
    assistant_messages: list[AssistantMessage],
    recovery_message: UserMessage,
) -> State:
    """The stream was cut after visible output: keep what completed, ask the model to resume from where it
    stops. Counted with the max-output-tokens recoveries (one cap of 3 for both, as Claude Code 2.1 shares it)."""
    attempt = state.max_output_tokens_recovery_count + 1
    return _resumed(state, [*messages_for_query, *assistant_messages, recovery_message], attempt,
                    TruncatedResponseRecovery(attempt=attempt))  # fmt: skip


def malformed_tool_use_retry(
    state: State,
    messages_for_query: list[TranscriptMessage],
    assistant_messages: list[AssistantMessage],
    retry: UserMessage,
) -> State:
    """A `tool_use` stop with no `tool_use` block: the malformed response stays (the model sees what it wrote) and
    the model is asked once in this turn to retry the call (`MALFORMED_TOOL_USE_RETRY_TEXT`)."""
    return _evolve(
        state,
        messages=[*messages_for_query, *assistant_messages, retry],
        malformed_tool_use_retry_turn=state.turn_count,
        pending_tool_use_summary=None,
        stop_hook_active=False,
        stop_hook_blocks=0,
        transition=MALFORMED_TOOL_USE_RETRY,
    )
