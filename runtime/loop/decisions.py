"""The loop's decisions as pure functions (seed 000's check order, seed 004's decision tree).

The QueryLoop gathers facts (did the stream end, was the query aborted, what
was withheld, did the hooks object) and asks these functions what to do, in the
reference's order:

1. abort  2. streaming error  3. image error  4. prompt-too-long recovery
5. max-output-tokens recovery  6. API error message (no stop hooks)
7. stop hooks  8. token budget  9. max turns  10. max budget USD  11. completed
"""

from __future__ import annotations

from typing import Literal

from queryloop.runtime.loop.events import ResultSubtype
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
    if reason in ("aborted_streaming", "aborted_tools"):
        return "error_during_execution"
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
    }
)


def result_is_error(reason: TerminalReason, api_error_surfaced: bool) -> bool:
    """Errors, aborts and limits are errors; so is a `completed` query whose last word was an API error."""
    return reason in ERROR_TERMINALS or api_error_surfaced
