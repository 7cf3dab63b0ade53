"""Per-model prices and context limits: one table, overridable per query.

Source: the Anthropic pricing and model-overview pages as collected in
`shared/research/API_FACTS.md` §4–§5 (snapshot 2026-11). Prices change: pass
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
    # Haiku 5.5's lower tier (prompt <= 100K tokens); the runtime's small-model calls stay there.
    "claude-haiku-5-5": Pricing(input=0.1, output=0.5, cache_write=0.125, cache_read=0.01),
    "claude-haiku-4-5": Pricing(input=1.0, output=5.0, cache_write=1.25, cache_read=0.1),
}

CONTEXT_WINDOWS: dict[str, int] = {
    "claude-haiku-4-5": 200_000,
}
"""Context window per model where it is not the 1M of the current line-up (API_FACTS §4)."""
DEFAULT_CONTEXT_WINDOW = 1_000_000


def pricing_for(model: str, override: Pricing | None = None) -> Pricing:
    """The price of `model`: the override if given, else the table (dated suffixes accepted)."""
    if override is not None:
        return override
    price = PRICES.get(model) or PRICES.get(model.rsplit("-", 1)[0])
    if price is None:
        msg = f"no price known for model {model!r}: pass `pricing` in the query options"
        raise UnknownModelPrice(msg)
    return price


def context_window_for(model: str) -> int:
    return CONTEXT_WINDOWS.get(model, DEFAULT_CONTEXT_WINDOW)
