"""`queryloop.runtime.loop.state`: the loop State and what each continue site resets or keeps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pydantic
import pytest
from hypothesis import given
from hypothesis import strategies as st

from queryloop.runtime.loop.events import AssistantMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.state import (
    MAX_OUTPUT_TOKENS_RECOVERY_LIMIT,
    MAX_OUTPUT_TOKENS_RECOVERY_TEXT,
    AutoCompactTracking,
    CollapseDrainRetry,
    Continue,
    MaxOutputTokensEscalate,
    MaxOutputTokensRecovery,
    NextTurn,
    ReactiveCompactRetry,
    State,
    StopHookBlocking,
    Terminal,
    TokenBudgetContinuation,
    collapse_drain_retry,
    malformed_tool_use_retry,
    max_output_tokens_escalate,
    max_output_tokens_recovery,
    next_turn,
    reactive_compact_retry,
    stop_hook_blocking,
    thinking_only_retry,
    token_budget_continuation,
    truncated_response_recovery,
)

ESCALATED = 64000


def user(text: str, *, is_meta: bool = False) -> UserMessage:
    return UserMessage(content=text, is_meta=is_meta)


def assistant(text: str, message_id: str = "msg_1") -> AssistantMessage:
    return AssistantMessage(message_id=message_id, model="claude-sonnet-5-5", content=[{"type": "text", "text": text}])


SUMMARY = object()
"""Stands for the pending tool-use summary awaitable of the previous batch."""


def dirty_state() -> State:
    """A state deep in a query: every carried field away from its default."""
    return State(
        messages=[user("fix the bug"), assistant("looking"), user("tool output")],
        auto_compact_tracking=AutoCompactTracking(last_input_tokens=150_000, compactions=1),
        max_output_tokens_recovery_count=2,
        has_attempted_reactive_compact=True,
        max_output_tokens_override=ESCALATED,
        pending_tool_use_summary=SUMMARY,
        stop_hook_active=True,
        turn_count=4,
        transition=MaxOutputTokensRecovery(attempt=2),
    )


def fields_of(state: State) -> dict[str, Any]:
    """A State's fields as they are (not copied: `dataclasses.asdict` would copy the summary's stand-in)."""
    return {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}


def uuids(messages: list[TranscriptMessage]) -> list[str]:
    return [m.uuid for m in messages]


# Every continue site, applied with fixed inputs; the name is the Continue reason it records.
MESSAGES_FOR_QUERY: list[TranscriptMessage] = [user("compacted prompt"), assistant("earlier", "msg_0")]
ASSISTANT = [assistant("part one", "msg_9"), assistant("part two", "msg_9")]
NEW_SUMMARY = object()


def _next_turn(state: State) -> State:
    return next_turn(state, [*MESSAGES_FOR_QUERY, *ASSISTANT, user("results")], NEW_SUMMARY)


def _escalate(state: State) -> State:
    return max_output_tokens_escalate(state, MESSAGES_FOR_QUERY, ESCALATED)


def _recovery(state: State) -> State:
    return max_output_tokens_recovery(state, MESSAGES_FOR_QUERY, ASSISTANT, user("resume", is_meta=True))


def _stop_hook(state: State) -> State:
    return stop_hook_blocking(state, MESSAGES_FOR_QUERY, ASSISTANT, [user("hook says no", is_meta=True)])


def _token_budget(state: State) -> State:
    return token_budget_continuation(state, MESSAGES_FOR_QUERY, ASSISTANT, user("keep going", is_meta=True))


def _reactive(state: State) -> State:
    return reactive_compact_retry(state, [user("summary of everything")])


def _collapse(state: State) -> State:
    return collapse_drain_retry(state, [user("collapsed")], 3)


def _thinking_only(state: State) -> State:
    return thinking_only_retry(state, MESSAGES_FOR_QUERY, ASSISTANT, user("say something", is_meta=True))


def _truncated(state: State) -> State:
    return truncated_response_recovery(state, MESSAGES_FOR_QUERY, ASSISTANT, user("resume", is_meta=True))


def _malformed(state: State) -> State:
    return malformed_tool_use_retry(state, MESSAGES_FOR_QUERY, ASSISTANT, user("retry", is_meta=True))


SITES: dict[str, Callable[[State], State]] = {
    "next_turn": _next_turn,
    "max_output_tokens_escalate": _escalate,
    "max_output_tokens_recovery": _recovery,
    "stop_hook_blocking": _stop_hook,
    "token_budget_continuation": _token_budget,
    "reactive_compact_retry": _reactive,
    "collapse_drain_retry": _collapse,
    "thinking_only_retry": _thinking_only,
    "truncated_response_recovery": _truncated,
    "malformed_tool_use_retry": _malformed,
}

# The module docstring's table, evaluated on `dirty_state()` (count 2, guard True, override 64000, hook active).
KEEP = object()
TABLE: dict[str, dict[str, Any]] = {
    "next_turn": {
        "max_output_tokens_recovery_count": 0,
        "has_attempted_reactive_compact": False,
        "max_output_tokens_override": None,
        "stop_hook_active": False,
    },
    "max_output_tokens_escalate": {
        "max_output_tokens_recovery_count": KEEP,
        "has_attempted_reactive_compact": KEEP,
        "max_output_tokens_override": ESCALATED,
        "stop_hook_active": False,
    },
    "max_output_tokens_recovery": {
        "max_output_tokens_recovery_count": 3,
        "has_attempted_reactive_compact": KEEP,
        "max_output_tokens_override": KEEP,
        "stop_hook_active": False,
    },
    "stop_hook_blocking": {
        "max_output_tokens_recovery_count": 0,
        "has_attempted_reactive_compact": KEEP,
        "max_output_tokens_override": None,
        "stop_hook_active": True,
    },
    "token_budget_continuation": {
        "max_output_tokens_recovery_count": 0,
        "has_attempted_reactive_compact": False,
        "max_output_tokens_override": None,
        "stop_hook_active": False,
    },
    "reactive_compact_retry": {
        "max_output_tokens_recovery_count": KEEP,
        "has_attempted_reactive_compact": True,
        "max_output_tokens_override": None,
        "stop_hook_active": False,
    },
    "collapse_drain_retry": {
        "max_output_tokens_recovery_count": KEEP,
        "has_attempted_reactive_compact": KEEP,
        "max_output_tokens_override": None,
        "stop_hook_active": False,
    },
    "thinking_only_retry": {
        "max_output_tokens_recovery_count": KEEP,
        "has_attempted_reactive_compact": KEEP,
        "max_output_tokens_override": KEEP,
        "stop_hook_active": False,
        "thinking_only_retry_turn": 4,  # the turn it was used in
    },
    "truncated_response_recovery": {
        "max_output_tokens_recovery_count": 3,  # the max-output-tokens count, shared
        "has_attempted_reactive_compact": KEEP,
        "max_output_tokens_override": KEEP,
        "stop_hook_active": False,
    },
    "malformed_tool_use_retry": {
        "max_output_tokens_recovery_count": KEEP,
        "has_attempted_reactive_compact": KEEP,
        "max_output_tokens_override": KEEP,
        "stop_hook_active": False,
        "malformed_tool_use_retry_turn": 4,
    },
}


@pytest.mark.parametrize("site", list(SITES))
def test_each_continue_site_follows_the_docstring_table(site: str) -> None:
    old = dirty_state()
    new = SITES[site](old)
    for name, expected in TABLE[site].items():
        want = getattr(old, name) if expected is KEEP else expected
        assert getattr(new, name) == want, f"{site}: {name}"
    assert new.transition is not None
    assert new.transition.reason == site


@pytest.mark.parametrize("site", [s for s in SITES if s != "next_turn"])
def test_every_site_but_next_turn_drops_the_consumed_summary_and_keeps_the_turn_count(site: str) -> None:
    old = dirty_state()
    new = SITES[site](old)
    assert new.pending_tool_use_summary is None
    assert new.turn_count == old.turn_count == 4


def test_stop_hook_blocking_resets_max_output_tokens_recovery_count_and_keeps_reactive_compact_guard() -> None:
    query: list[TranscriptMessage] = [user("q")]
    answer = [assistant("a", "msg_2"), assistant("b", "msg_2")]
    errors = [user("lint failed", is_meta=True), user("tests failed", is_meta=True)]
    for guard in (True, False):
        old = dataclasses.replace(dirty_state(), has_attempted_reactive_compact=guard)
        new = stop_hook_blocking(old, query, answer, errors)
        assert new.max_output_tokens_recovery_count == 0
        assert new.has_attempted_reactive_compact is guard
        assert new.stop_hook_active is True
        assert new.max_output_tokens_override is None
        assert new.pending_tool_use_summary is None
        assert new.turn_count == old.turn_count
        assert new.auto_compact_tracking == old.auto_compact_tracking
        assert new.transition == StopHookBlocking()
        assert uuids(new.messages) == uuids([*query, *answer, *errors])


def test_token_budget_continuation_resets_both_recovery_guards() -> None:
    old = dirty_state()
    nudge = user("You have used 40% of the budget, keep working", is_meta=True)
    new = token_budget_continuation(old, MESSAGES_FOR_QUERY, ASSISTANT, nudge)
    assert new.max_output_tokens_recovery_count == 0
    assert new.has_attempted_reactive_compact is False
    assert new.max_output_tokens_override is None
    assert new.stop_hook_active is False
    assert new.pending_tool_use_summary is None
    assert new.turn_count == old.turn_count
    assert new.transition == TokenBudgetContinuation()
    assert uuids(new.messages) == uuids([*MESSAGES_FOR_QUERY, *ASSISTANT, nudge])
    assert new.messages[-1] is nudge


def test_reactive_compact_retry_is_single_fire_and_clears_autocompact_tracking() -> None:
    old = dataclasses.replace(dirty_state(), has_attempted_reactive_compact=False)
    compacted: list[TranscriptMessage] = [user("<summary>all of it</summary>")]
    new = reactive_compact_retry(old, compacted)
    assert new.has_attempted_reactive_compact is True  # a second 413 cannot compact again
    assert new.auto_compact_tracking is None  # the token count changed: old tracking is meaningless
    assert new.messages == compacted
    assert new.max_output_tokens_recovery_count == old.max_output_tokens_recovery_count
    assert new.max_output_tokens_override is None
    assert new.stop_hook_active is False
    assert new.pending_tool_use_summary is None
    assert new.turn_count == old.turn_count
    assert new.transition == ReactiveCompactRetry()
    # Nothing but a fresh-start site (next_turn, token budget) lowers the guard again.
    for site in (
        "max_output_tokens_escalate",
        "max_output_tokens_recovery",
        "stop_hook_blocking",
        "collapse_drain_retry",
    ):
        assert SITES[site](new).has_attempted_reactive_compact is True, site
    assert _next_turn(new).has_attempted_reactive_compact is False
    assert _token_budget(new).has_attempted_reactive_compact is False


def test_collapse_drain_retry_records_committed() -> None:
    old = dirty_state()
    drained: list[TranscriptMessage] = [user("a"), assistant("b"), user("c")]
    new = collapse_drain_retry(old, drained, 7)
    assert new.transition == CollapseDrainRetry(committed=7)
    assert isinstance(new.transition, CollapseDrainRetry)
    assert new.transition.committed == 7
    assert new.messages == drained
    assert new.has_attempted_reactive_compact is old.has_attempted_reactive_compact
    assert new.max_output_tokens_recovery_count == old.max_output_tokens_recovery_count
    assert new.auto_compact_tracking == old.auto_compact_tracking
    assert new.max_output_tokens_override is None
    assert new.stop_hook_active is False
    assert new.turn_count == old.turn_count


def test_max_output_tokens_escalate_retries_same_input_with_escalated_limit() -> None:
    old = dataclasses.replace(dirty_state(), max_output_tokens_override=None, max_output_tokens_recovery_count=0)
    query: list[TranscriptMessage] = [user("write a long essay")]
    new = max_output_tokens_escalate(old, query, ESCALATED)
    assert new.max_output_tokens_override == ESCALATED
    assert new.messages == query  # the same input: the truncated answer is not kept, no meta message
    assert uuids(new.messages) == uuids(query)
    assert not any(isinstance(m, UserMessage) and m.is_meta for m in new.messages)
    assert new.max_output_tokens_recovery_count == 0
    assert new.has_attempted_reactive_compact is old.has_attempted_reactive_compact
    assert new.stop_hook_active is False
    assert new.pending_tool_use_summary is None
    assert new.turn_count == old.turn_count
    assert new.transition == MaxOutputTokensEscalate()


def test_max_output_tokens_recovery_keeps_truncated_answer_and_escalated_limit() -> None:
    state = dataclasses.replace(dirty_state(), max_output_tokens_recovery_count=0)
    query: list[TranscriptMessage] = [user("write a long essay")]
    for attempt in range(1, MAX_OUTPUT_TOKENS_RECOVERY_LIMIT + 1):
        truncated = [assistant(f"half of part {attempt}", f"msg_{attempt}")]
        recovery = user(MAX_OUTPUT_TOKENS_RECOVERY_TEXT, is_meta=True)
        new = max_output_tokens_recovery(state, query, truncated, recovery)
        assert uuids(new.messages) == uuids([*query, *truncated, recovery])
        assert new.messages[-1] is recovery
        assert new.max_output_tokens_recovery_count == attempt
        assert new.transition == MaxOutputTokensRecovery(attempt=attempt)
        assert new.max_output_tokens_override == ESCALATED
        assert new.has_attempted_reactive_compact is True
        assert new.stop_hook_active is False
        assert new.turn_count == state.turn_count
        query, state = new.messages, new
    assert state.max_output_tokens_recovery_count == MAX_OUTPUT_TOKENS_RECOVERY_LIMIT
    assert MAX_OUTPUT_TOKENS_RECOVERY_TEXT.startswith("Output token limit hit. Resume directly")


def test_next_turn_increments_turn_count_and_starts_fresh_response_chain() -> None:
    old = dirty_state()
    history = [*MESSAGES_FOR_QUERY, *ASSISTANT, user("results")]
    summary = object()
    new = next_turn(old, history, summary)
    assert new.turn_count == old.turn_count + 1 == 5
    assert new.max_output_tokens_recovery_count == 0
    assert new.has_attempted_reactive_compact is False
    assert new.max_output_tokens_override is None
    assert new.stop_hook_active is False
    assert new.pending_tool_use_summary is summary  # installs the summary of the batch that just ran
    assert new.auto_compact_tracking == old.auto_compact_tracking
    assert new.transition == NextTurn()
    assert uuids(new.messages) == uuids(history)
    assert next_turn(new, history).pending_tool_use_summary is None
    assert next_turn(next_turn(new, history), history).turn_count == 7


def test_every_continue_site_but_stop_hook_blocking_clears_stop_hook_active() -> None:
    for site, apply in SITES.items():
        new = apply(dirty_state())
        assert new.stop_hook_active is (site == "stop_hook_blocking"), site
        # also when the flag was already clear
        assert apply(State(messages=[user("x")])).stop_hook_active is (site == "stop_hook_blocking"), site


def test_continue_sites_return_new_state_and_leave_old_untouched() -> None:
    for site, apply in SITES.items():
        old = dirty_state()
        before = fields_of(old)
        messages_before = list(old.messages)
        new = apply(old)
        assert new is not old, site
        assert isinstance(new, State)
        assert fields_of(old) == before, site
        assert old.messages == messages_before, site
        assert old.transition == MaxOutputTokensRecovery(attempt=2), site
        assert new.messages is not old.messages, site
    frozen = dirty_state()
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.turn_count = 9  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.transition = NextTurn()  # type: ignore[misc]
    with pytest.raises(pydantic.ValidationError):
        CollapseDrainRetry(committed=1).committed = 2  # type: ignore[misc]


def test_state_defaults_describe_the_first_iteration() -> None:
    state = State(messages=[user("hi")])
    assert state.turn_count == 1
    assert state.auto_compact_tracking is None
    assert state.max_output_tokens_recovery_count == 0
    assert state.has_attempted_reactive_compact is False
    assert state.max_output_tokens_override is None
    assert state.pending_tool_use_summary is None
    assert state.stop_hook_active is False
    assert state.transition is None


def test_state_and_continue_models_refuse_unknown_fields() -> None:
    with pytest.raises(TypeError, match="turns"):
        State(messages=[], turns=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="turns"):
        dataclasses.replace(dirty_state(), turns=3)  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError, match="attempt"):
        MaxOutputTokensRecovery()  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError, match="extra"):
        Terminal(reason="completed", why="x")  # type: ignore[call-arg]
    with pytest.raises(pydantic.ValidationError):
        Terminal(reason="finished")


def test_transition_is_a_discriminated_union_on_reason() -> None:
    adapter: pydantic.TypeAdapter[Continue] = pydantic.TypeAdapter(Continue)
    assert adapter.validate_python({"reason": "collapse_drain_retry", "committed": 4}) == CollapseDrainRetry(
        committed=4
    )
    assert adapter.validate_python({"reason": "max_output_tokens_recovery", "attempt": 2}) == MaxOutputTokensRecovery(
        attempt=2
    )
    assert isinstance(adapter.validate_python({"reason": "next_turn"}), NextTurn)
    with pytest.raises(pydantic.ValidationError):
        adapter.validate_python({"reason": "fallback"})  # the fallback retry is a bare continue, not a transition
    assert adapter.validate_python({"reason": "stop_hook_blocking"}) == StopHookBlocking()


# -- properties ---------------------------------------------------------------------------

TRANSITIONS: list[Any] = [
    None,
    NextTurn(),
    MaxOutputTokensEscalate(),
    MaxOutputTokensRecovery(attempt=1),
    MaxOutputTokensRecovery(attempt=3),
    ReactiveCompactRetry(),
    CollapseDrainRetry(committed=2),
    StopHookBlocking(),
    TokenBudgetContinuation(),
]

states = st.builds(
    State,
    messages=st.lists(st.text(max_size=8).map(user), max_size=3),
    auto_compact_tracking=st.none() | st.builds(AutoCompactTracking, last_input_tokens=st.integers(0, 10**6)),
    max_output_tokens_recovery_count=st.integers(0, MAX_OUTPUT_TOKENS_RECOVERY_LIMIT),
    has_attempted_reactive_compact=st.booleans(),
    max_output_tokens_override=st.none() | st.integers(1, 128_000),
    pending_tool_use_summary=st.none() | st.just(SUMMARY),
    stop_hook_active=st.booleans(),
    turn_count=st.integers(1, 1000),
    transition=st.sampled_from(TRANSITIONS),
)


@given(states)
def test_stop_hook_blocking_preserves_reactive_guard_and_zeroes_recovery_for_any_state(state: State) -> None:
    new = _stop_hook(state)
    assert new.has_attempted_reactive_compact is state.has_attempted_reactive_compact
    assert new.max_output_tokens_recovery_count == 0
    assert new.stop_hook_active is True
    assert new.turn_count == state.turn_count
    assert new.auto_compact_tracking == state.auto_compact_tracking


@given(states, st.sampled_from(list(SITES)))
def test_only_next_turn_grows_the_turn_count_for_any_state(state: State, site: str) -> None:
    before = fields_of(state)
    new = SITES[site](state)
    assert new.turn_count == state.turn_count + (1 if site == "next_turn" else 0)
    assert new.transition is not None
    assert new.transition.reason == site
    assert fields_of(state) == before  # the old state is untouched
