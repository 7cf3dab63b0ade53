"""The model table (`runtime/loop/pricing.py`): prices and context windows by model id, dated ids included,
and Haiku 5.5's tier for long prompts (api-facts §4–§5)."""

from __future__ import annotations

import pytest

from queryloop import QueryOptions
from queryloop.actors.budget_guard import cost_usd
from queryloop.runtime.loop.events import Usage
from queryloop.runtime.loop.pricing import (
    PRICES,
    Pricing,
    UnknownModelPrice,
    context_window_for,
    pricing_for,
    undated,
)


def test_a_dated_model_id_takes_its_models_context_window() -> None:
    # Haiku 4.5 has 200K tokens, not the 1M of the current line-up: its dated id must not lose that,
    # or auto-compaction would wait for a context five times larger than the model has.
    assert context_window_for("claude-haiku-4-5-20251001") == 200_000
    assert context_window_for("claude-haiku-4-5") == 200_000
    assert context_window_for("claude-sonnet-4-5-20250929") == 1_000_000


def test_a_dated_model_id_is_priced_as_its_model() -> None:
    assert pricing_for("claude-sonnet-4-5-20250929") is PRICES["claude-sonnet-4-5"]
    assert pricing_for("claude-opus-4-5-20251101") is PRICES["claude-opus-4-5"]
    assert undated("claude-haiku-4-5-20251001") == "claude-haiku-4-5"


def test_a_newer_point_release_is_not_priced_as_its_predecessor() -> None:
    # `claude-fable-5-2` is not `claude-fable-5` (whose cache reads cost four times Fable 5.1's): an id the
    # table does not know is refused, as any unknown model is, instead of being priced silently wrong.
    assert undated("claude-fable-5-2") == "claude-fable-5-2"
    for model in ("claude-fable-5-2", "claude-mythos-5-2", "claude-opus-4-1"):
        with pytest.raises(UnknownModelPrice, match=model):
            pricing_for(model)
    with pytest.raises(ValueError, match="claude-fable-5-2"):
        QueryOptions(model="claude-fable-5-2")
    own = Pricing(input=8.0, output=40.0, cache_write=10.0, cache_read=0.2)
    assert QueryOptions(model="claude-fable-5-2", pricing=own).pricing is own


def test_haiku_5_5_prompts_over_100k_tokens_are_priced_whole_at_the_higher_tier() -> None:
    price = pricing_for("claude-haiku-5-5")
    short = Usage(input_tokens=60_000, cache_read_input_tokens=40_000, output_tokens=1_000)
    long = Usage(input_tokens=60_000, cache_read_input_tokens=40_001, output_tokens=1_000)
    assert cost_usd(short, price) == pytest.approx((60_000 * 0.1 + 40_000 * 0.01 + 1_000 * 0.5) / 1e6)
    # One token more of prompt (cache reads count) and the whole request, output included, is at $0.50/$2.50.
    assert cost_usd(long, price) == pytest.approx((60_000 * 0.5 + 40_001 * 0.05 + 1_000 * 2.5) / 1e6)
    written = Usage(input_tokens=1_000, cache_creation_input_tokens=100_000, output_tokens=10)
    assert cost_usd(written, price) == pytest.approx((1_000 * 0.5 + 100_000 * 0.625 + 10 * 2.5) / 1e6)


def test_a_price_without_a_long_prompt_tier_is_the_same_at_any_prompt_length() -> None:
    price = pricing_for("claude-sonnet-5-5")
    assert price.for_prompt(10) is price and price.for_prompt(10_000_000) is price
