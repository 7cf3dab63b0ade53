"""The loop's decisions as pure functions (Claude Code's check order and decision tree).

The QueryLoop gathers facts (did the stream end, was the query aborted, what
was withheld, did the hooks object) and asks these functions what to do, in Claude Code's
order:

1. abort  2. streaming error  3. image error  4. prompt-too-long recovery
5. max-output-tokens recovery (and `model_context_window_exceeded`: compaction first when the input
   filled the window)  6. API error message, or a `refusal` (no stop hooks)  6a. `pause_turn`: the
   paused response is sent back, up to a cap (no stop hooks: the turn has not ended)
7. stop hooks (a block past `stop_hook_block_cap` is overridden)  8. token budget  9. max turns
10. max budget USD  11. completed

Claude Code 2.1's newer recoveries come in at the steps they belong to: a stream cut after visible output
(`truncated_response_recoverable`) at 2, before the error ends the query (`api_failure_terminal` names
that end); a `tool_use` stop with no `tool_use` block (`malformed_tool_use_action`) and a final response
with no visible text (`thinking_only_retry_due`) before 7; and, before a model call, the context that
refills right after each autocompaction (`rapid_refill_breaker_holds`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

from queryloop.runtime.loop.context import ContextLimits
from queryloop.runtime.loop.events import AssistantMessage, ClaudeCodeTerminalReason, ResultSubtype, Usage
from queryloop.runtime.loop.state import (
    MAX_OUTPUT_TOKENS_RECOVERY_LIMIT,
    RAPID_REFILL_LIMIT,
    State,
    TerminalReason,
)

MaxOutputTokensAction = Literal["escalate", "recover", "surface"]


def max_output_tokens_action(state: State, *, max_output_tokens: int, escalated: int) -> MaxOutputTokensAction:
    """What to do with a withheld `max_tokens` truncation.

    Escalate once (silently, same input) while no override is set and the
    escalated limit is larger; then up to three recovery messages; then surface.
    """
    if state.max_output_tokens_override is None and escalated > max_output_tokens:
        return "escalate"
    if state.max_output_tokens_recovery_count < MAX_OUTPUT_TOKENS_RECOVERY_LIMIT:
        return "recover"
    return "surface"


def pause_turn_may_continue(continuations: int, cap: int) -> bool:
    """A `pause_turn` response is sent back while this turn has had fewer than `cap` continuations."""
    return continuations < cap


def stop_hook_block_capped(blocks: int, cap: int) -> bool:
    """Whether a stop hook's block, after `blocks` blocks in a row, is overridden and the query ends.

    Claude Code's rule (2.1.143): a cap of 0 means no cap; otherwise `cap` blocks in a row are honoured
    and the next one is not. A hook that ignores `stop_hook_active` would otherwise keep the model
    answering forever: a block is no turn, so `max_turns` does not bound it.
    """
    return cap > 0 and blocks >= cap


def context_is_full(usage: Usage, limits: ContextLimits) -> bool:
    """Whether a `model_context_window_exceeded` response was cut by its input, not by its own length.

    The input alone (cache included) past the autocompact threshold leaves a recovery message no
    room to work in: the context is compacted first. Below it, the response's own output filled
    the window, and the cut-off recovery (escalate, then recovery messages) is the answer.
    """
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens >= (
        limits.autocompact_threshold
    )


def max_turns_reached(turn_count: int, max_turns: int | None) -> bool:
    """Checked at the `next_turn` continue site: would the next turn exceed the limit?"""
    return max_turns is not None and turn_count + 1 > max_turns


def abort_terminal(stream_ended: bool, used_tools: bool) -> TerminalReason:
    """An abort during the stream (or before it) is `aborted_streaming`; once tools run, `aborted_tools`."""
    return "aborted_tools" if stream_ended and used_tools else "aborted_streaming"


def tools_stopped_terminal(deferred: bool) -> TerminalReason:
    """A turn whose tools stopped the query: the call a PreToolUse hook deferred ends it `tool_deferred`, a hook's
    `continue: false` `hook_stopped`."""
    return "tool_deferred" if deferred else "hook_stopped"


def has_visible_text(messages: Sequence[AssistantMessage]) -> bool:
    """Whether a response's blocks hold a non-empty `text` block: output the user sees (thinking is not)."""
    for message in messages:
        for block in message.content:
            if block.get("type") == "text" and block.get("text"):
                return True
    return False


FINAL_STOPS = frozenset({"end_turn", "stop_sequence"})
"""The stop reasons of a finished answer: the ones whose empty output `thinking_only_retry` asks again for."""


def thinking_only_retry_due(state: State, stop_reason: str | None, messages: Sequence[AssistantMessage]) -> bool:
    """Claude Code 2.1's `thinking_only_retry`: a finished answer (`end_turn`, `stop_sequence`) without a
    non-empty text block (thinking only, or nothing) is asked again, once per turn; the second one ends as
    any final response does."""
    return (
        stop_reason in FINAL_STOPS
        and state.thinking_only_retry_turn != state.turn_count
        and not has_visible_text(messages)
    )


MalformedToolUseAction = Literal["retry", "exhausted"]


def malformed_tool_use_action(state: State, stop_reason: str | None, tool_uses: int) -> MalformedToolUseAction | None:
    """Claude Code 2.1's `malformed_tool_use_retry`: a `tool_use` stop whose response holds no `tool_use` block
    (none could be parsed: the model wrote its call as text, or the block never came) is retried once per
    turn; a second one in the turn is `exhausted` (`malformed_tool_use_exhausted`). None: not malformed.

    A `tool_use` block whose input is not valid JSON is no such case: it is a block, answered with an
    `InputValidationError` result the model reads on the next turn (Claude Code's own handling)."""
    if stop_reason != "tool_use" or tool_uses:
        return None
    return "exhausted" if state.malformed_tool_use_retry_turn == state.turn_count else "retry"


TRUNCATION_KINDS = frozenset({"connection"})
"""The failures that cut a stream: it ended before `message_stop`, its connection broke, or it went idle past
the watchdog. An `error` event inside the stream (the API's own overloaded or server error) is no cut: the
API answered, with an error, and the query ends `api_error`."""


def truncated_response_recoverable(
    state: State, error_kind: str, messages: Sequence[AssistantMessage], used_tools: bool
) -> bool:
    """Claude Code 2.1's `truncated_response_recovery` (its non-interactive sessions: every queryloop session is
    one): a stream cut (`TRUNCATION_KINDS`) after at least one completed block of visible text is resumed,
    sharing the max-output-tokens recovery cap.

    Which cuts qualify: the ModelCaller retries a failed request while nothing of it was shown, so what reaches
    the loop was shown in part. With a visible block kept, the model resumes from it. A cut before any visible
    block (inside the first text, after thinking only) ends as before: nothing of it joins the conversation. A
    cut after a `tool_use` block ends as before too: that tool has started, and its call is answered with an
    error result, which a resumed answer would not see."""
    return (
        error_kind in TRUNCATION_KINDS
        and not used_tools
        and state.max_output_tokens_recovery_count < MAX_OUTPUT_TOKENS_RECOVERY_LIMIT
        and has_visible_text(messages)
    )


MODEL_UNAVAILABLE_KINDS = frozenset({"not_found", "model_unavailable"})
"""The failures that say the model itself cannot be used (not found; unavailable, with no fallback model)."""


def api_failure_terminal(error_kind: str) -> TerminalReason:
    """How a query ends on a model call that failed for good (after the ModelCaller's retries, if any): the model
    unavailable is `model_error` (Claude Code 2.1's fallback error, "X is currently unavailable."); any other
    API failure, `api_error` (Claude Code 2.1's reason for exhausted API retries). An image too large has its own
    ending (`image_error`), decided before."""
    return "model_error" if error_kind in MODEL_UNAVAILABLE_KINDS else "api_error"


def rapid_refill(compacted_at: int, iteration: int) -> bool:
    """Whether the context is due an autocompaction right after one: the iteration that follows the one that
    compacted (its request sent, its response and results added) is over the threshold again."""
    return compacted_at == iteration - 1


def rapid_refill_breaker_holds(compacted_at: int, iteration: int, refills: int) -> bool:
    """Whether an autocompaction due now is held and the query ends `rapid_refill_breaker`: it would be the
    `RAPID_REFILL_LIMIT`-th refill in a row (`refills` so far). Claude Code 2.1's breaker: compacting again
    would only refill again, each compaction a summary call that loses detail."""
    return rapid_refill(compacted_at, iteration) and refills + 1 >= RAPID_REFILL_LIMIT


def refills_after_compaction(compacted_at: int, iteration: int, refills: int) -> int:
    """The refills in a row once an autocompaction ran at `iteration`: one more if it was due right after the
    previous one (`rapid_refill`), else none (a compaction after a turn that did not need one starts afresh)."""
    return refills + 1 if rapid_refill(compacted_at, iteration) else 0


def result_subtype(reason: TerminalReason) -> ResultSubtype:
    if reason == "max_turns":
        return "error_max_turns"
    if reason == "max_budget_usd":
        return "error_max_budget_usd"
    if reason in ("aborted_streaming", "aborted_tools", "turn_setup_failed"):
        return "error_during_execution"
    if reason == "max_structured_output_retries":
        return "error_max_structured_output_retries"
    return "success"


ERROR_TERMINALS: frozenset[str] = frozenset(
    {
        "model_error",
        "image_error",
        "prompt_too_long",
        "blocking_limit",
        "max_turns",
        "max_budget_usd",
        "aborted_streaming",
        "aborted_tools",
        "max_structured_output_retries",
        "turn_setup_failed",
        "api_error",
        "malformed_tool_use_exhausted",
        "rapid_refill_breaker",
        "tool_deferred_unavailable",
    }
)


def result_is_error(reason: TerminalReason, api_error_surfaced: bool) -> bool:
    """Errors, aborts and limits are errors; so is a `completed` query whose last word was an API error."""
    return reason in ERROR_TERMINALS or api_error_surfaced


_CLAUDE_CODE_NAMES: dict[str, ClaudeCodeTerminalReason] = {
    "max_budget_usd": "budget_exhausted",
    "max_structured_output_retries": "structured_output_retry_exhausted",
}
"""The runtime's reasons Claude Code names otherwise; every other reason is Claude Code's own name
(`api_error`: a model call that failed for good; `model_error`: a model that cannot be used, docs/design.md,
"Terminal reasons")."""


def claude_code_terminal_reason(reason: TerminalReason) -> ClaudeCodeTerminalReason:
    """The result's `terminal_reason`: `reason` in Claude Code's vocabulary (`ClaudeCodeTerminalReason`)."""
    named = _CLAUDE_CODE_NAMES.get(reason)
    return named if named is not None else cast("ClaudeCodeTerminalReason", reason)
