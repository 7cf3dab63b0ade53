"""`queryloop.runtime.loop.max_tokens`: reading the two "max_tokens too large" 400s and the `max_tokens` to resend.

The messages are read from the recorded error bodies (`tests/fixtures/errors`).
"""

from __future__ import annotations

import json

import pytest

from queryloop.runtime.loop.max_tokens import (
    CONTEXT_MARGIN,
    FLOOR_OUTPUT_TOKENS,
    ContextOverflow,
    MaxTokensFix,
    ModelOutputCap,
    fit_to_context,
    max_tokens_fix,
    parse_context_overflow,
    parse_model_output_cap,
)
from queryloop.runtime.loop.model import is_prompt_too_long
from tests.helpers import FIXTURES

ERRORS = FIXTURES / "errors"


def recorded_message(name: str) -> str:
    message: str = json.loads((ERRORS / f"{name}.json").read_text())["body"]["error"]["message"]
    return message


CONTEXT_OVERFLOW = recorded_message("400_input_plus_max_tokens_exceed_context")  # 178959 + 64000 > 200000
MODEL_CAP = recorded_message("400_max_tokens_above_model_limit")  # 128001 > 64000 … claude-opus-4-5-20251101


def test_the_recorded_context_overflow_message_is_parsed() -> None:
    assert parse_context_overflow(CONTEXT_OVERFLOW) == ContextOverflow(
        input_tokens=178_959, max_tokens=64_000, limit=200_000
    )
    assert parse_model_output_cap(CONTEXT_OVERFLOW) is None


def test_the_recorded_model_cap_message_is_parsed_with_its_model() -> None:
    assert parse_model_output_cap(MODEL_CAP) == ModelOutputCap(
        requested=128_001, cap=64_000, model="claude-opus-4-5-20251101"
    )
    assert parse_context_overflow(MODEL_CAP) is None


def test_a_context_overflow_is_not_a_prompt_too_long() -> None:
    assert not is_prompt_too_long(400, CONTEXT_OVERFLOW)
    assert is_prompt_too_long(400, recorded_message("400_prompt_too_long"))


def test_context_overflow_lowers_max_tokens_to_the_room_left_less_the_margin() -> None:
    fix = max_tokens_fix(CONTEXT_OVERFLOW, 64_000)

    assert fix == MaxTokensFix(max_tokens=200_000 - 178_959 - CONTEXT_MARGIN)
    assert fix.model_cap is None  # the room depends on this prompt: nothing to remember


@pytest.mark.parametrize(
    ("input_tokens", "fits"),
    [
        (200_000 - CONTEXT_MARGIN - FLOOR_OUTPUT_TOKENS, True),  # exactly the floor is left
        (200_000 - CONTEXT_MARGIN - FLOOR_OUTPUT_TOKENS + 1, False),  # one token short of it
        (199_999, False),
    ],
)
def test_context_overflow_below_the_floor_has_no_fix(input_tokens: int, fits: bool) -> None:
    overflow = ContextOverflow(input_tokens=input_tokens, max_tokens=64_000, limit=200_000)

    fix = fit_to_context(overflow, 64_000)

    assert (fix == MaxTokensFix(max_tokens=FLOOR_OUTPUT_TOKENS)) if fits else fix is None


def test_context_overflow_keeps_max_tokens_above_the_thinking_budget() -> None:
    thinking = {"type": "enabled", "budget_tokens": 20_000}
    # 200000 - 178959 - 1000 = 20041 > 20000: fits, and still above the budget.
    assert max_tokens_fix(CONTEXT_OVERFLOW, 64_000, thinking) == MaxTokensFix(max_tokens=20_041)
    # A budget the room cannot exceed: lowering max_tokens cannot help.
    assert max_tokens_fix(CONTEXT_OVERFLOW, 64_000, {"type": "enabled", "budget_tokens": 20_041}) is None


def test_context_overflow_that_asks_no_less_than_before_has_no_fix() -> None:
    # The request already asked for no more than the room: the same request would fail again.
    assert max_tokens_fix(CONTEXT_OVERFLOW, 20_041) is None


def test_model_cap_clamps_to_the_cap_and_is_remembered() -> None:
    assert max_tokens_fix(MODEL_CAP, 128_001) == MaxTokensFix(max_tokens=64_000, model_cap=64_000)


def test_model_cap_not_below_what_was_asked_has_no_fix() -> None:
    assert max_tokens_fix(MODEL_CAP, 64_000) is None


def test_other_400s_have_no_max_tokens_fix() -> None:
    assert max_tokens_fix(recorded_message("400_prompt_too_long"), 64_000) is None
    assert max_tokens_fix("max_tokens: 128001 > 64000", 128_001) is None
