"""Claude Code 2.1's newer recoveries as pure decisions (`runtime.loop.decisions`) and continue sites
(`runtime.loop.state`): thinking-only retry, truncated-response recovery, malformed tool-use retry, the
`api_error` / `model_error` split and the rapid-refill breaker."""

from __future__ import annotations

from typing import Any, get_args

import pytest

from queryloop.runtime.loop.decisions import (
    api_failure_terminal,
    has_visible_text,
    malformed_tool_use_action,
    rapid_refill,
    rapid_refill_breaker_holds,
    refills_after_compaction,
    thinking_only_retry_due,
    truncated_response_recoverable,
)
from queryloop.runtime.loop.events import AssistantMessage, UserMessage
from queryloop.runtime.loop.model import ModelErrorKind
from queryloop.runtime.loop.state import (
    MALFORMED_TOOL_USE_RETRY_TEXT,
    MAX_OUTPUT_TOKENS_RECOVERY_LIMIT,
    RAPID_REFILL_LIMIT,
    THINKING_ONLY_RETRY_TEXT,
    TRUNCATED_RESPONSE_RECOVERY_TEXT,
    MalformedToolUseRetry,
    State,
    ThinkingOnlyRetry,
    TruncatedResponseRecovery,
    malformed_tool_use_retry,
    max_output_tokens_recovery,
    next_turn,
    stop_hook_blocking,
    thinking_only_retry,
    truncated_response_recovery,
)

PROMPT = UserMessage(content="go")


def said(*blocks: dict[str, Any]) -> list[AssistantMessage]:
    return [AssistantMessage(message_id="m", model="x", content=[block]) for block in blocks]


THINKING = {"type": "thinking", "thinking": "hmm", "signature": "s"}
TEXT = {"type": "text", "text": "Hello"}
EMPTY_TEXT = {"type": "text", "text": ""}


def fresh(**fields: Any) -> State:
    return State(messages=[PROMPT], **fields)


def test_the_injected_texts_are_claude_codes() -> None:
    assert THINKING_ONLY_RETRY_TEXT == (
        "[Your previous response had no visible output. Please continue and produce a user-visible response.]"
    )
    assert TRUNCATED_RESPONSE_RECOVERY_TEXT.startswith("Your response above was cut off mid-stream. Resume directly")
    assert MALFORMED_TOOL_USE_RETRY_TEXT == "Your tool call was malformed and could not be parsed. Please retry."


def test_visible_text_is_a_non_empty_text_block() -> None:
    assert has_visible_text(said(THINKING, TEXT))
    assert not has_visible_text(said(THINKING))
    assert not has_visible_text(said(EMPTY_TEXT, THINKING))
    assert not has_visible_text([])


@pytest.mark.parametrize("stop_reason", ["end_turn", "stop_sequence"])
def test_a_final_answer_of_thinking_only_or_nothing_is_retried(stop_reason: str) -> None:
    assert thinking_only_retry_due(fresh(), stop_reason, said(THINKING))
    assert thinking_only_retry_due(fresh(), stop_reason, [])
    assert thinking_only_retry_due(fresh(), stop_reason, said(EMPTY_TEXT))
    assert not thinking_only_retry_due(fresh(), stop_reason, said(THINKING, TEXT))


@pytest.mark.parametrize("stop_reason", ["tool_use", "max_tokens", "pause_turn", "refusal", None])
def test_only_a_finished_answer_is_retried_for_thinking_only(stop_reason: str | None) -> None:
    assert not thinking_only_retry_due(fresh(), stop_reason, said(THINKING))


def test_thinking_only_retry_is_once_per_turn() -> None:
    state = fresh(turn_count=2)
    retry = UserMessage(content=THINKING_ONLY_RETRY_TEXT, is_meta=True)
    thinking = said(THINKING)
    retried = thinking_only_retry(state, [PROMPT], thinking, retry)
    assert retried.messages == [PROMPT, *thinking, retry]
    assert retried.transition == ThinkingOnlyRetry()
    assert retried.thinking_only_retry_turn == 2 and retried.turn_count == 2
    assert not thinking_only_retry_due(retried, "end_turn", thinking)  # the second one ends as today
    blocked = stop_hook_blocking(retried, retried.messages, thinking, [PROMPT])
    assert not thinking_only_retry_due(blocked, "end_turn", thinking)  # still the same turn
    assert thinking_only_retry_due(next_turn(retried, retried.messages), "end_turn", thinking)  # a new turn


def test_a_tool_use_stop_without_a_tool_use_block_is_retried_once_then_exhausted() -> None:
    state = fresh()
    assert malformed_tool_use_action(state, "tool_use", 0) == "retry"
    assert malformed_tool_use_action(state, "tool_use", 1) is None  # parsed: the tools run
    assert malformed_tool_use_action(state, "end_turn", 0) is None
    retry = UserMessage(content=MALFORMED_TOOL_USE_RETRY_TEXT, is_meta=True)
    written = said({"type": "text", "text": "<invoke name=read>"})
    retried = malformed_tool_use_retry(state, [PROMPT], written, retry)
    assert retried.messages == [PROMPT, *written, retry]  # the malformed response stays
    assert retried.transition == MalformedToolUseRetry()
    assert malformed_tool_use_action(retried, "tool_use", 0) == "exhausted"
    assert malformed_tool_use_action(next_turn(retried, retried.messages), "tool_use", 0) == "retry"


def test_a_connection_cut_after_visible_text_is_recoverable() -> None:
    assert truncated_response_recoverable(fresh(), "connection", said(TEXT), used_tools=False)


@pytest.mark.parametrize(
    ("kind", "blocks", "used_tools"),
    [
        ("connection", [THINKING], False),  # nothing visible kept
        ("connection", [], False),  # cut inside the first block
        ("connection", [TEXT], True),  # a tool has started
        ("overloaded", [TEXT], False),  # an error event inside the stream: the API answered
        ("api_error", [TEXT], False),
        ("authentication", [TEXT], False),
    ],
)
def test_other_cuts_and_failures_are_not_recovered(kind: str, blocks: list[dict[str, Any]], used_tools: bool) -> None:
    assert not truncated_response_recoverable(fresh(), kind, said(*blocks), used_tools=used_tools)


def test_truncated_recovery_shares_the_max_output_tokens_cap() -> None:
    state = fresh()
    cut = said(TEXT)
    recovery = UserMessage(content=TRUNCATED_RESPONSE_RECOVERY_TEXT, is_meta=True)
    state = max_output_tokens_recovery(state, [PROMPT], cut, recovery)  # one max_tokens recovery first
    for attempt in range(2, MAX_OUTPUT_TOKENS_RECOVERY_LIMIT + 1):
        assert truncated_response_recoverable(state, "connection", cut, used_tools=False)
        state = truncated_response_recovery(state, state.messages, cut, recovery)
        assert state.transition == TruncatedResponseRecovery(attempt=attempt)
        assert state.messages[-2:] == [*cut, recovery]
    assert state.max_output_tokens_recovery_count == MAX_OUTPUT_TOKENS_RECOVERY_LIMIT == 3
    assert not truncated_response_recoverable(state, "connection", cut, used_tools=False)
    assert next_turn(state, state.messages).max_output_tokens_recovery_count == 0


def test_a_model_unavailable_is_model_error_and_every_other_api_failure_api_error() -> None:
    assert api_failure_terminal("not_found") == "model_error"
    assert api_failure_terminal("model_unavailable") == "model_error"
    for kind in get_args(ModelErrorKind):
        if kind not in ("not_found", "model_unavailable"):
            assert api_failure_terminal(kind) == "api_error", kind


def test_a_refill_is_a_compaction_due_in_the_iteration_right_after_one() -> None:
    assert rapid_refill(compacted_at=4, iteration=5)
    assert not rapid_refill(compacted_at=4, iteration=6)
    assert not rapid_refill(compacted_at=-2, iteration=0)  # no compaction yet
    assert refills_after_compaction(4, 5, 1) == 2
    assert refills_after_compaction(4, 7, 2) == 0  # a turn in between needed none: the streak starts again


def test_the_breaker_holds_the_third_refill_in_a_row() -> None:
    assert RAPID_REFILL_LIMIT == 3
    compacted_at, refills, held = -2, 0, None
    for iteration in range(6):  # the context is due a compaction at every iteration
        if rapid_refill_breaker_holds(compacted_at, iteration, refills):
            held = iteration
            break
        refills = refills_after_compaction(compacted_at, iteration, refills)
        compacted_at = iteration
    assert held == 3  # compactions at 0, 1 (refill 1), 2 (refill 2); the third refill ends the query
    assert not rapid_refill_breaker_holds(compacted_at=2, iteration=4, refills=2)  # not right after one
