"""`queryloop.runtime.loop.token_budget`: the token-budget continuation gate, Claude Code's `checkTokenBudget`."""

from __future__ import annotations

import dataclasses
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queryloop.runtime.loop.token_budget import (
    COMPLETION_THRESHOLD,
    DIMINISHING_THRESHOLD,
    BudgetTracker,
    TokenBudgetDecision,
    budget_continuation_message,
    check_token_budget,
)


def snapshot(tracker: BudgetTracker) -> tuple[int, int, int, float]:
    return dataclasses.astuple(tracker)


def tracker_after(count: int, last_delta: int, last_global: int) -> BudgetTracker:
    return BudgetTracker(continuation_count=count, last_delta_tokens=last_delta, last_global_turn_tokens=last_global)


def test_the_thresholds_are_claude_codes_constants() -> None:
    assert COMPLETION_THRESHOLD == 0.9
    assert DIMINISHING_THRESHOLD == 500


@pytest.mark.parametrize(
    ("agent_id", "budget"),
    [(None, None), (None, 0), (None, -1000), ("subagent-1", 10_000)],
    ids=["no-budget", "zero-budget", "negative-budget", "subagent"],
)
def test_no_budget_or_a_subagent_stops_without_a_completion_event(agent_id: str | None, budget: int | None) -> None:
    tracker = tracker_after(2, 800, 1_000)
    before = snapshot(tracker)

    decision = check_token_budget(tracker, agent_id, budget, 100)

    assert decision == TokenBudgetDecision(action="stop")
    assert decision.completion_event is None
    assert decision.nudge_message is None
    assert snapshot(tracker) == before


def test_first_check_below_ninety_percent_continues_and_updates_the_tracker() -> None:
    tracker = BudgetTracker()

    decision = check_token_budget(tracker, None, 10_000, 1_234)

    assert decision.action == "continue"
    assert decision.continuation_count == 1
    assert decision.pct == 12
    assert decision.turn_tokens == 1_234
    assert decision.budget == 10_000
    assert decision.completion_event is None
    assert tracker.continuation_count == 1
    assert tracker.last_delta_tokens == 1_234
    assert tracker.last_global_turn_tokens == 1_234
    assert decision.nudge_message is not None
    assert "12%" in decision.nudge_message
    assert "1,234" in decision.nudge_message
    assert "10,000" in decision.nudge_message


def test_the_continuation_message_is_claude_codes_text() -> None:
    assert budget_continuation_message(12, 1_234, 10_000) == (
        "Stopped at 12% of token target (1,234 / 10,000). Keep working \u2014 do not summarize."
    )


def test_a_continue_records_the_delta_since_the_previous_check() -> None:
    tracker = BudgetTracker()
    check_token_budget(tracker, None, 100_000, 10_000)

    decision = check_token_budget(tracker, None, 100_000, 13_500)

    assert decision.action == "continue"
    assert decision.continuation_count == 2
    assert tracker.continuation_count == 2
    assert tracker.last_delta_tokens == 3_500
    assert tracker.last_global_turn_tokens == 13_500


def test_check_token_budget_continues_below_ninety_percent_and_stops_at_it() -> None:
    fresh_at_899 = BudgetTracker()
    assert check_token_budget(fresh_at_899, None, 1_000, 899).action == "continue"
    assert fresh_at_899.continuation_count == 1

    fresh_at_900 = BudgetTracker()
    decision = check_token_budget(fresh_at_900, None, 1_000, 900)
    assert decision.action == "stop"
    assert decision.completion_event is None  # no continuation happened: nothing to report
    assert fresh_at_900.continuation_count == 0

    # The same line reached after a continuation: stop, with the completion event.
    stopped = check_token_budget(fresh_at_899, None, 1_000, 900)
    assert stopped.action == "stop"
    assert stopped.completion_event is not None
    assert stopped.completion_event.pct == 90
    assert stopped.completion_event.diminishing_returns is False


def test_a_stop_after_a_continuation_carries_the_completion_event() -> None:
    tracker = BudgetTracker(started_at=time.monotonic() - 2.0)
    check_token_budget(tracker, None, 1_000, 400)
    check_token_budget(tracker, None, 1_000, 800)

    decision = check_token_budget(tracker, None, 1_000, 950)

    assert decision.action == "stop"
    assert decision.nudge_message is None
    event = decision.completion_event
    assert event is not None
    assert event.continuation_count == 2
    assert event.pct == 95
    assert event.turn_tokens == 950
    assert event.budget == 1_000
    assert event.diminishing_returns is False
    assert 2_000 <= event.duration_ms < 60_000


def test_check_token_budget_stops_on_diminishing_returns_after_three_continuations() -> None:
    tracker = BudgetTracker()
    budget = 100_000
    assert check_token_budget(tracker, None, budget, 10_000).action == "continue"  # delta 10,000
    assert check_token_budget(tracker, None, budget, 10_100).action == "continue"  # count 1: too early
    # count 2, last delta 100, new delta 100: both small but not yet three continuations
    assert check_token_budget(tracker, None, budget, 10_200).action == "continue"
    assert tracker.continuation_count == 3
    before = snapshot(tracker)

    decision = check_token_budget(tracker, None, budget, 10_300)  # 10 %, far below 90 %

    assert decision.action == "stop"
    event = decision.completion_event
    assert event is not None
    assert event.diminishing_returns is True
    assert event.continuation_count == 3
    assert event.pct == 10
    assert event.turn_tokens == 10_300
    assert snapshot(tracker) == before


def test_two_small_deltas_still_continue_before_the_third_continuation() -> None:
    tracker = tracker_after(2, 100, 1_000)

    decision = check_token_budget(tracker, None, 100_000, 1_100)

    assert decision.action == "continue"
    assert tracker.continuation_count == 3
    assert tracker.last_delta_tokens == 100


def test_diminishing_returns_win_over_the_ninety_percent_line() -> None:
    tracker = tracker_after(3, 100, 95_000)

    decision = check_token_budget(tracker, None, 100_000, 95_100)

    assert decision.action == "stop"
    assert decision.completion_event is not None
    assert decision.completion_event.diminishing_returns is True


@pytest.mark.parametrize(
    ("last_delta", "new_total"),
    [(100, 1_500), (500, 1_100), (499, 1_500), (500, 1_500)],
    ids=["new-delta-500", "last-delta-500", "new-delta-500-last-499", "both-500"],
)
def test_a_delta_of_exactly_five_hundred_is_not_diminishing(last_delta: int, new_total: int) -> None:
    tracker = tracker_after(3, last_delta, 1_000)

    decision = check_token_budget(tracker, None, 100_000, new_total)

    assert decision.action == "continue"
    assert tracker.continuation_count == 4


def test_two_deltas_of_four_hundred_ninety_nine_are_diminishing() -> None:
    tracker = tracker_after(3, 499, 1_000)

    decision = check_token_budget(tracker, None, 100_000, 1_499)

    assert decision.action == "stop"
    assert decision.completion_event is not None
    assert decision.completion_event.diminishing_returns is True


def test_a_large_previous_delta_keeps_one_small_delta_from_being_diminishing() -> None:
    tracker = tracker_after(3, 2_000, 5_000)

    first = check_token_budget(tracker, None, 100_000, 5_100)  # new delta small, last delta large
    assert first.action == "continue"
    assert tracker.last_delta_tokens == 100

    second = check_token_budget(tracker, None, 100_000, 5_200)  # now both small
    assert second.action == "stop"
    assert second.completion_event is not None
    assert second.completion_event.diminishing_returns is True
    assert second.completion_event.continuation_count == 4


@pytest.mark.parametrize(
    ("budget", "tokens", "expected", "python_round"),
    [(200, 1, 1, 0), (200, 5, 3, 2), (200, 3, 2, 2), (1_000, 4, 0, 0), (1_000, 5, 1, 0)],
)
def test_pct_rounds_half_up_like_math_round(budget: int, tokens: int, expected: int, python_round: int) -> None:
    assert round(tokens / budget * 100) == python_round  # what the naive translation would report

    decision = check_token_budget(BudgetTracker(), None, budget, tokens)

    assert decision.action == "continue"
    assert decision.pct == expected
    assert decision.nudge_message is not None
    assert decision.nudge_message.startswith(f"Stopped at {expected}% of token target")


def test_the_completion_event_pct_rounds_half_up() -> None:
    tracker = tracker_after(1, 5_000, 5_000)

    decision = check_token_budget(tracker, None, 1_000, 905)  # 90.5 %

    assert decision.completion_event is not None
    assert decision.completion_event.pct == 91


@pytest.mark.parametrize(
    ("tracker", "tokens"),
    [
        (BudgetTracker(), 900),
        (tracker_after(1, 800, 800), 950),
        (tracker_after(3, 100, 1_000), 1_100),
        (tracker_after(5, 10, 99_000), 99_100),
    ],
    ids=["fresh-at-90", "after-one", "diminishing", "diminishing-over-90"],
)
def test_a_stop_leaves_the_tracker_untouched(tracker: BudgetTracker, tokens: int) -> None:
    before = snapshot(tracker)
    budget = 100_000 if tokens > 1_000 else 1_000

    decision = check_token_budget(tracker, None, budget, tokens)

    assert decision.action == "stop"
    assert snapshot(tracker) == before


def test_pct_of_a_negative_count_rounds_like_math_round() -> None:
    # Unreachable from the loop (output tokens are never negative), but the helper claims Math.round.
    decision = check_token_budget(BudgetTracker(), None, 200, -1)  # -0.5 %: Math.round gives -0 == 0

    assert decision.pct == 0


@given(
    budget=st.integers(min_value=1, max_value=2_000_000),
    steps=st.lists(st.integers(min_value=0, max_value=50_000), min_size=1, max_size=30),
)
def test_no_check_at_or_above_ninety_percent_ever_continues(budget: int, steps: list[int]) -> None:
    tracker = BudgetTracker()
    total = 0
    continues = 0
    for step in steps:
        total += step  # globalTurnTokens only grows within a query
        before = snapshot(tracker)
        decision = check_token_budget(tracker, None, budget, total)
        at_line = 10 * total >= 9 * budget  # exact: total >= 90 % of budget
        diminishing = before[0] >= 3 and total - before[2] < DIMINISHING_THRESHOLD and before[1] < DIMINISHING_THRESHOLD
        if at_line or diminishing:
            assert decision.action == "stop"
            assert snapshot(tracker) == before
            assert (decision.completion_event is not None) == (before[0] > 0 or diminishing)
            if decision.completion_event is not None:
                assert decision.completion_event.diminishing_returns is diminishing
        else:
            continues += 1
            assert decision.action == "continue"
            assert decision.continuation_count == continues
            assert tracker.continuation_count == continues
            assert tracker.last_global_turn_tokens == total
            assert tracker.last_delta_tokens == total - before[2]
