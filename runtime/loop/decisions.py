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
"""

from __future__ import annotations

from typing import Literal, cast

from queryloop.runtime.loop.context import ContextLimits
from queryloop.runtime.loop.events import ClaudeCodeTerminalReason, ResultSubtype, Usage
from queryloop.runtime.loop.state import MAX_OUTPUT_TOKENS_RECOVERY_LIMIT, State, TerminalReason

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
    }
)


def result_is_error(reason: TerminalReason, api_error_surfaced: bool) -> bool:
    """Errors, aborts and limits are errors; so is a `completed` query whose last word was an API error."""
    return reason in ERROR_TERMINALS or api_error_surfaced


_CLAUDE_CODE_NAMES: dict[str, ClaudeCodeTerminalReason] = {
    "max_budget_usd": "budget_exhausted",
    "max_structured_output_retries": "structured_output_retry_exhausted",
    "model_error": "api_error",
}
"""The runtime's reasons Claude Code names otherwise; every other reason is Claude Code's own name.

`model_error` is a model call that failed for good (after its retries, or at once for an error no retry
mends): Claude Code's `api_error`. Its own `model_error` is a model it may not use ("X is currently
unavailable"), which this runtime has no path to (docs/design.md, "Terminal reasons")."""


def claude_code_terminal_reason(reason: TerminalReason) -> ClaudeCodeTerminalReason:
    """The result's `terminal_reason`: `reason` in Claude Code's vocabulary (`ClaudeCodeTerminalReason`)."""
    named = _CLAUDE_CODE_NAMES.get(reason)
    return named if named is not None else cast("ClaudeCodeTerminalReason", reason)
