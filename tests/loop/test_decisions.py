"""`queryloop.runtime.loop.decisions`: the loop's decisions as pure functions."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from queryloop.runtime.loop.decisions import (
    abort_terminal,
    max_output_tokens_action,
    max_turns_reached,
    result_is_error,
    result_subtype,
)
from queryloop.runtime.loop.events import AssistantMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.state import (
    MAX_OUTPUT_TOKENS_RECOVERY_LIMIT,
    State,
    TerminalReason,
    max_output_tokens_escalate,
    max_output_tokens_recovery,
    next_turn,
    reactive_compact_retry,
    stop_hook_blocking,
    token_budget_continuation,
)

LIMIT = 8000
ESCALATED = 64000


def fresh() -> State:
    return State(messages=[UserMessage(content="write the whole novel")])


def truncated(n: int) -> list[AssistantMessage]:
    return [AssistantMessage(message_id=f"msg_{n}", model="m", content=[{"type": "text", "text": f"part {n}"}])]


def action(state: State) -> str:
    return max_output_tokens_action(state, max_output_tokens=LIMIT, escalated=ESCALATED)


def test_max_output_tokens_escalates_once_then_recovers_three_times_then_surfaces() -> None:
    state = fresh()
    query: list[TranscriptMessage] = list(state.messages)
    taken: list[str] = []
    while (step := action(state)) != "surface":
        taken.append(step)
        if step == "escalate":
            state = max_output_tokens_escalate(state, query, ESCALATED)
        else:
            state = max_output_tokens_recovery(state, query, truncated(len(taken)), UserMessage(content="go on"))
            query = state.messages
        assert len(taken) <= 10, "the sequence must end"
    assert taken == ["escalate", "recover", "recover", "recover"]
    assert state.max_output_tokens_recovery_count == MAX_OUTPUT_TOKENS_RECOVERY_LIMIT
    assert state.max_output_tokens_override == ESCALATED
    assert action(state) == "surface"


def test_max_output_tokens_does_not_escalate_when_escalated_limit_is_not_larger() -> None:
    state = fresh()
    assert max_output_tokens_action(state, max_output_tokens=LIMIT, escalated=LIMIT) == "recover"
    assert max_output_tokens_action(state, max_output_tokens=LIMIT, escalated=LIMIT - 1) == "recover"
    assert max_output_tokens_action(state, max_output_tokens=LIMIT, escalated=LIMIT + 1) == "escalate"
    spent = dataclasses.replace(state, max_output_tokens_recovery_count=MAX_OUTPUT_TOKENS_RECOVERY_LIMIT)
    assert max_output_tokens_action(spent, max_output_tokens=LIMIT, escalated=LIMIT) == "surface"


def test_max_output_tokens_does_not_escalate_again_when_an_override_is_set() -> None:
    for override in (ESCALATED, LIMIT, 1):
        state = dataclasses.replace(fresh(), max_output_tokens_override=override)
        assert action(state) == "recover"
        for count in range(MAX_OUTPUT_TOKENS_RECOVERY_LIMIT):
            assert action(dataclasses.replace(state, max_output_tokens_recovery_count=count)) == "recover"
        spent = dataclasses.replace(state, max_output_tokens_recovery_count=MAX_OUTPUT_TOKENS_RECOVERY_LIMIT)
        assert action(spent) == "surface"


def test_max_output_tokens_recovery_limit_is_three() -> None:
    assert MAX_OUTPUT_TOKENS_RECOVERY_LIMIT == 3
    state = dataclasses.replace(fresh(), max_output_tokens_override=ESCALATED)
    outcomes = [action(dataclasses.replace(state, max_output_tokens_recovery_count=n)) for n in range(6)]
    assert outcomes == ["recover", "recover", "recover", "surface", "surface", "surface"]


def test_a_fresh_response_chain_may_escalate_again() -> None:
    # The output-token override is reset by the sites that start a fresh response; the recovery path keeps it.
    escalated = max_output_tokens_escalate(fresh(), list(fresh().messages), ESCALATED)
    assert action(escalated) == "recover"
    recovered = max_output_tokens_recovery(escalated, escalated.messages, truncated(1), UserMessage(content="go"))
    assert action(recovered) == "recover"
    for restarted in (
        next_turn(recovered, recovered.messages),
        stop_hook_blocking(recovered, recovered.messages, [], [UserMessage(content="hook")]),
        token_budget_continuation(recovered, recovered.messages, [], UserMessage(content="more")),
        reactive_compact_retry(recovered, [UserMessage(content="summary")]),
    ):
        assert action(restarted) == "escalate", restarted.transition


@pytest.mark.parametrize(
    ("turn_count", "max_turns", "reached"),
    [
        (1, 1, True),
        (1, 2, False),
        (2, 2, True),
        (2, 3, False),
        (3, 3, True),
        (4, 3, True),
        (10, 10, True),
        (9, 10, False),
        (8, 10, False),
    ],
)
def test_max_turns_fires_when_the_next_turn_would_exceed_the_limit(
    turn_count: int, max_turns: int, reached: bool
) -> None:
    assert max_turns_reached(turn_count, max_turns) is reached
    assert reached is (turn_count + 1 > max_turns)


@pytest.mark.parametrize("turn_count", [1, 2, 50, 10**9])
def test_max_turns_none_means_no_limit(turn_count: int) -> None:
    assert max_turns_reached(turn_count, None) is False


def test_max_turns_allows_exactly_max_turns_model_calls() -> None:
    # turn_count starts at 1 and next_turn is the only site that grows it.
    state = fresh()
    calls = 1
    while not max_turns_reached(state.turn_count, 3):
        state = next_turn(state, state.messages)
        calls += 1
    assert calls == 3
    assert state.turn_count == 3


@pytest.mark.parametrize(
    ("stream_ended", "used_tools", "reason"),
    [
        (False, False, "aborted_streaming"),
        (False, True, "aborted_streaming"),  # tools that started mid-stream: still an abort of the stream
        (True, False, "aborted_streaming"),
        (True, True, "aborted_tools"),
    ],
)
def test_abort_during_stream_is_aborted_streaming_and_during_tools_aborted_tools(
    stream_ended: bool, used_tools: bool, reason: str
) -> None:
    assert abort_terminal(stream_ended, used_tools) == reason


ALL_REASONS: tuple[TerminalReason, ...] = get_args(TerminalReason)


def test_result_subtype_maps_limits_and_aborts_and_everything_else_is_success() -> None:
    expected = {
        "max_turns": "error_max_turns",
        "max_budget_usd": "error_max_budget_usd",
        "aborted_streaming": "error_during_execution",
        "aborted_tools": "error_during_execution",
        "max_structured_output_retries": "error_max_structured_output_retries",
        "turn_setup_failed": "error_during_execution",
    }
    assert len(ALL_REASONS) == 18
    for reason in ALL_REASONS:
        assert result_subtype(reason) == expected.get(reason, "success"), reason


def test_result_is_error_for_errors_aborts_and_limits_only() -> None:
    errors = {
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
        "tool_deferred_unavailable",  # a deferred call whose tool is gone: an error; `tool_deferred` is not
    }
    for reason in ALL_REASONS:
        assert result_is_error(reason, api_error_surfaced=False) is (reason in errors), reason
        assert result_is_error(reason, api_error_surfaced=True) is True, reason


def test_a_completed_query_whose_last_word_was_an_api_error_is_an_error() -> None:
    assert result_is_error("completed", api_error_surfaced=False) is False
    assert result_is_error("completed", api_error_surfaced=True) is True
    assert result_subtype("completed") == "success"
    assert result_is_error("stop_hook_prevented", api_error_surfaced=False) is False
    assert result_is_error("hook_stopped", api_error_surfaced=False) is False


def test_an_api_error_ending_is_a_success_result_that_is_an_error() -> None:
    """The Python SDK's shape (`_errors.py`): `terminal_reason == "api_error"`, `subtype: "success"`, `is_error`."""
    for reason in ("api_error", "model_error", "malformed_tool_use_exhausted", "rapid_refill_breaker"):
        assert result_subtype(reason) == "success", reason
        assert result_is_error(reason, api_error_surfaced=False) is True, reason
