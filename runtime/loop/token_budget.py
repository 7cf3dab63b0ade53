"""The token-budget continuation gate, Claude Code's `checkTokenBudget`, to the letter.

When a query has a token budget and the model stops early, the loop nudges it to
go on (`token_budget_continuation`) until 90 % of the budget is used, unless
the gains have dwindled: after three continuations, two consecutive checks
that each added fewer than 500 tokens stop it with `diminishing_returns`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

COMPLETION_THRESHOLD = 0.9
DIMINISHING_THRESHOLD = 500


@dataclass(slots=True)
class BudgetTracker:
    """What the gate remembers between checks of one query (mutated by `check_token_budget`)."""

    continuation_count: int = 0
    last_delta_tokens: int = 0
    last_global_turn_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)


class CompletionEvent(BaseModel):
    model_config = ConfigDict(frozen=True)

    continuation_count: int
    pct: int
    turn_tokens: int
    budget: int
    diminishing_returns: bool
    duration_ms: int


class TokenBudgetDecision(BaseModel):
    model_config = ConfigDict(frozen=True)

    action: Literal["continue", "stop"]
    nudge_message: str | None = None
    completion_event: CompletionEvent | None = None
    continuation_count: int | None = None
    pct: int | None = None
    turn_tokens: int | None = None
    budget: int | None = None


def math_round(value: float) -> int:
    """JavaScript's `Math.round`, which Claude Code uses: floor(x + 0.5) (Python's round() rounds half to even)."""
    return math.floor(value + 0.5)


def budget_continuation_message(pct: int, turn_tokens: int, budget: int) -> str:
    return f"Stopped at {pct}% of token target ({turn_tokens:,} / {budget:,}). Keep working \u2014 do not summarize."


def check_token_budget(
    tracker: BudgetTracker, agent_id: str | None, budget: int | None, global_turn_tokens: int
) -> TokenBudgetDecision:
    """Continue or stop; mutates `tracker` on continue, exactly as Claude Code's `checkTokenBudget` does."""
    if agent_id or budget is None or budget <= 0:
        return TokenBudgetDecision(action="stop")

    turn_tokens = global_turn_tokens
    pct = math_round(turn_tokens / budget * 100)
    delta_since_last_check = global_turn_tokens - tracker.last_global_turn_tokens

    is_diminishing = (
        tracker.continuation_count >= 3
        and delta_since_last_check < DIMINISHING_THRESHOLD
        and tracker.last_delta_tokens < DIMINISHING_THRESHOLD
    )

    if not is_diminishing and turn_tokens < budget * COMPLETION_THRESHOLD:
        tracker.continuation_count += 1
        tracker.last_delta_tokens = delta_since_last_check
        tracker.last_global_turn_tokens = global_turn_tokens
        return TokenBudgetDecision(
            action="continue",
            nudge_message=budget_continuation_message(pct, turn_tokens, budget),
            continuation_count=tracker.continuation_count,
            pct=pct,
            turn_tokens=turn_tokens,
            budget=budget,
        )

    if is_diminishing or tracker.continuation_count > 0:
        return TokenBudgetDecision(
            action="stop",
            completion_event=CompletionEvent(
                continuation_count=tracker.continuation_count,
                pct=pct,
                turn_tokens=turn_tokens,
                budget=budget,
                diminishing_returns=is_diminishing,
                duration_ms=int((time.monotonic() - tracker.started_at) * 1000),
            ),
        )

    return TokenBudgetDecision(action="stop")
