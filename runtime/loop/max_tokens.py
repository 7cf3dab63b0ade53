"""Fitting `max_tokens` to what the API accepts: the pure decision behind the ModelCaller's clamp-and-retry.

Two 400s ask for a smaller `max_tokens`, not a shorter prompt (api-facts §2):

- "input length and `max_tokens` exceed context limit: I + M > L, …": the prompt fits, the room left
  for the answer does not. Retried once with `max_tokens = L − I − CONTEXT_MARGIN`, as Claude Code
  does, provided that is at least `FLOOR_OUTPUT_TOKENS` (and above the thinking budget, which
  `max_tokens` must exceed); otherwise the prompt itself is the problem and the prompt-too-long
  cascade (reactive compaction) takes over.
- "max_tokens: N > M, which is the maximum allowed number of output tokens for MODEL": the request
  asked more than the model can ever give. Retried with `max_tokens = M`, and M is remembered for the
  model for the rest of the session, so no later call asks for more.

Why these numbers (Claude Code's retry loop uses the same two: a 1 000-token safety buffer and
`FLOOR_OUTPUT_TOKENS` = 3 000; its query loop does not state them):

- `CONTEXT_MARGIN` = 1 000 tokens: headroom between what the failed request was counted at and what
  its retry is counted at. The server counts the input, not the client, and what it counts besides
  the messages (tool definitions' system prompt, beta-dependent preambles) is not the client's to
  see, so an answer sized to the last token would risk the same 400 again; 1 000 is 0.5 % of a
  200 000 window, a price worth one sure retry.
- `FLOOR_OUTPUT_TOKENS` = 3 000 tokens: below that an answer is likely to be cut by `max_tokens`
  itself (a file edit in a `tool_use` alone takes that much), which costs a call and a
  max-output-tokens recovery and still leaves the context full. When that little room is left,
  compacting the prompt frees real room: the clamp gives way to the prompt-too-long cascade.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from queryloop.runtime.loop.events import AssistantMessage, api_error_message

CONTEXT_MARGIN = 1_000
"""Tokens kept free below the context limit when `max_tokens` is lowered to fit (see the module docstring)."""
FLOOR_OUTPUT_TOKENS = 3_000
"""The smallest `max_tokens` a context-overflow retry asks for; below it, the prompt is compacted instead."""

_CONTEXT_OVERFLOW = re.compile(
    r"input length and `?max_tokens`? exceed context limit:\s*(\d+)\s*\+\s*(\d+)\s*>\s*(\d+)", re.IGNORECASE
)
_MODEL_OUTPUT_CAP = re.compile(
    r"max_tokens`?:\s*(\d+)\s*>\s*(\d+), which is the maximum allowed number of output tokens for (\S+)",
    re.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class ContextOverflow:
    """`input_tokens + max_tokens > limit`, as the 400 states it."""

    input_tokens: int
    max_tokens: int
    limit: int


@dataclass(frozen=True, slots=True)
class ModelOutputCap:
    """`requested > cap`: the most output tokens `model` may ever be asked for."""

    requested: int
    cap: int
    model: str


@dataclass(frozen=True, slots=True)
class MaxTokensFix:
    """Send the request again with `max_tokens`; `model_cap`, when set, holds for the model from now on."""

    max_tokens: int
    model_cap: int | None = None


def parse_context_overflow(message: str) -> ContextOverflow | None:
    """The numbers of an "input length and `max_tokens` exceed context limit" message, or None."""
    match = _CONTEXT_OVERFLOW.search(message)
    if match is None:
        return None
    input_tokens, max_tokens, limit = (int(group) for group in match.groups())
    return ContextOverflow(input_tokens=input_tokens, max_tokens=max_tokens, limit=limit)


def parse_model_output_cap(message: str) -> ModelOutputCap | None:
    """The numbers of a "`max_tokens`: N > M, which is the maximum allowed …" message, or None."""
    match = _MODEL_OUTPUT_CAP.search(message)
    if match is None:
        return None
    # A sentence may end right after the model's name.
    return ModelOutputCap(requested=int(match[1]), cap=int(match[2]), model=match[3].rstrip(".,;"))


def thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """The request's extended-thinking budget (`max_tokens` must stay above it), if any."""
    if not thinking:
        return None
    budget = thinking.get("budget_tokens")
    return budget if isinstance(budget, int) else None


def fit_to_context(overflow: ContextOverflow, max_tokens: int, budget: int | None = None) -> MaxTokensFix | None:
    """`max_tokens` lowered to `limit − input − CONTEXT_MARGIN`; None when even the floor does not fit."""
    room = overflow.limit - overflow.input_tokens - CONTEXT_MARGIN
    least = FLOOR_OUTPUT_TOKENS if budget is None else max(FLOOR_OUTPUT_TOKENS, budget + 1)
    if room < least or room >= max_tokens:
        # Too little room: a shorter prompt is the fix. No less than asked: the same request would fail again.
        return None
    return MaxTokensFix(max_tokens=room)


def fit_to_model_cap(cap: ModelOutputCap, max_tokens: int, budget: int | None = None) -> MaxTokensFix | None:
    """`max_tokens` clamped to the model's cap, to remember; None if that changes nothing or leaves no room to think."""
    if cap.cap >= max_tokens or cap.cap <= 0 or (budget is not None and cap.cap <= budget):
        return None
    return MaxTokensFix(max_tokens=cap.cap, model_cap=cap.cap)


def max_tokens_fix(message: str, max_tokens: int, thinking: dict[str, Any] | None = None) -> MaxTokensFix | None:
    """How to resend a request refused with `message` (a 400's API message), or None if lowering
    `max_tokens` cannot help."""
    budget = thinking_budget(thinking)
    overflow = parse_context_overflow(message)
    if overflow is not None:
        return fit_to_context(overflow, max_tokens, budget)
    cap = parse_model_output_cap(message)
    if cap is not None:
        return fit_to_model_cap(cap, max_tokens, budget)
    return None


CONTEXT_WINDOW_EXCEEDED_MESSAGE = (
    "Claude's response stopped because the model's context window is full (model_context_window_exceeded)."
)


def max_output_tokens_message(max_tokens: int) -> str:
    return (
        f"Claude's response exceeded the {max_tokens} output token maximum. "
        "To configure this behavior, set the max_output_tokens option."
    )


def withheld_cut_off(stop_reason: str | None, model: str, max_tokens: int) -> AssistantMessage | None:
    """The error a response cut off by its length is withheld as, for the loop's recovery (None: not cut off)."""
    if stop_reason == "max_tokens":
        return api_error_message(model, max_output_tokens_message(max_tokens))
    if stop_reason == "model_context_window_exceeded":  # a cut-off too: recovered the same way
        return api_error_message(model, CONTEXT_WINDOW_EXCEEDED_MESSAGE)
    return None
