"""Per-model prices and context limits: one table, overridable per query.

Source: the Anthropic pricing and model-overview pages as collected in
`docs/api-facts.md` §4–§5 (snapshot 2026-11). Prices change: pass
`QueryOptions.pricing` rather than editing code at a
call site. A model missing from the table is an error, never a silent $0.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from queryloop.runtime.errors import QueryloopError


class Pricing(BaseModel):
    """USD per million tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    input: float
    output: float
    cache_write: float
    """A write to the five-minute cache (the API's default lifetime)."""
    cache_read: float
    cache_write_1h: float | None = None
    """A write to the one-hour cache; None: twice `input`, the API's multiplier for every model listed."""
    long_prompt_tokens: int | None = None
    long_prompt: Pricing | None = None
    """A tier of its own for long prompts: a request whose prompt (input, cache writes and cache reads)
    is over `long_prompt_tokens` is priced whole, output included, at `long_prompt` (Haiku 5.5's over
    100K tokens, api-facts §5)."""

    def for_prompt(self, prompt_tokens: int) -> Pricing:
        """The tier a request with `prompt_tokens` of prompt is priced at."""
        if (
            self.long_prompt is not None
            and self.long_prompt_tokens is not None
            and prompt_tokens > self.long_prompt_tokens
        ):
            return self.long_prompt
        return self

    @property
    def one_hour_cache_write(self) -> float:
        """The price of a one-hour cache write: `cache_write_1h`, or twice `input`."""
        return 2 * self.input if self.cache_write_1h is None else self.cache_write_1h


class UnknownModelPrice(QueryloopError, ValueError):
    """No price is known for a model: give `pricing` in the options."""


PRICES: dict[str, Pricing] = {
    "claude-fable-5-1": Pricing(input=10.0, output=50.0, cache_write=12.5, cache_read=0.25),
    "claude-mythos-5-1": Pricing(input=10.0, output=50.0, cache_write=12.5, cache_read=0.25),
    "claude-fable-5": Pricing(input=10.0, output=50.0, cache_write=12.5, cache_read=1.0),
    "claude-mythos-5": Pricing(input=10.0, output=50.0, cache_write=12.5, cache_read=1.0),
    "claude-opus-5-5": Pricing(input=4.0, output=20.0, cache_write=5.0, cache_read=0.2),
    "claude-opus-5": Pricing(input=5.0, output=25.0, cache_write=6.25, cache_read=0.5),
    "claude-opus-4-8": Pricing(input=5.0, output=25.0, cache_write=6.25, cache_read=0.5),
    "claude-opus-4-7": Pricing(input=5.0, output=25.0, cache_write=6.25, cache_read=0.5),
    "claude-opus-4-6": Pricing(input=5.0, output=25.0, cache_write=6.25, cache_read=0.5),
    "claude-opus-4-5": Pricing(input=5.0, output=25.0, cache_write=6.25, cache_read=0.5),
    "claude-sonnet-5-5": Pricing(input=2.0, output=10.0, cache_write=2.5, cache_read=0.1),
    "claude-sonnet-5": Pricing(input=2.0, output=10.0, cache_write=2.5, cache_read=0.2),
    "claude-sonnet-4-6": Pricing(input=3.0, output=15.0, cache_write=3.75, cache_read=0.3),
    "claude-sonnet-4-5": Pricing(input=3.0, output=15.0, cache_write=3.75, cache_read=0.3),
    "claude-haiku-5-5": Pricing(
        input=0.1,
        output=0.5,
        cache_write=0.125,
        cache_read=0.01,
        long_prompt_tokens=100_000,
        long_prompt=Pricing(input=0.5, output=2.5, cache_write=0.625, cache_read=0.05),
    ),
    "claude-haiku-4-5": Pricing(input=1.0, output=5.0, cache_write=1.25, cache_read=0.1),
}

CONTEXT_WINDOWS: dict[str, int] = {
    "claude-haiku-4-5": 200_000,
}
"""Context window per model where it is not the 1M of the current line-up (api-facts §4)."""
DEFAULT_CONTEXT_WINDOW = 1_000_000


def undated(model: str) -> str:
    """`model` without a release date (`claude-haiku-4-5-20251001` → `claude-haiku-4-5`): the table's key.

    Only an eight-digit date is taken off: `claude-fable-5-2` is not `claude-fable-5`, and is priced only
    once the table (or the query's `pricing`) knows it.
    """
    base, _, suffix = model.rpartition("-")
    return base if len(suffix) == 8 and suffix.isdigit() else model


def pricing_for(model: str, override: Pricing | None = None) -> Pricing:
    """The price of `model`: the override if given, else the table (dated ids accepted)."""
    if override is not None:
        return override
    price = PRICES.get(model) or PRICES.get(undated(model))
    if price is None:
        msg = f"no price known for model {model!r}: pass `pricing` in the query options"
        raise UnknownModelPrice(msg)
    return price


def context_window_for(model: str) -> int:
    """The context window of `model` (dated ids accepted): the table's, else the current line-up's 1M."""
    return CONTEXT_WINDOWS.get(undated(model), DEFAULT_CONTEXT_WINDOW)
