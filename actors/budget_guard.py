"""BudgetGuard: usage and cost of a session's queries, and the USD limit.

The QueryLoop reports each completed model call's usage (what `message_start`
and the cumulative `message_delta` said, taken at `message_stop`, as the
reference's QueryEngine does) and receives the query's running cost and
whether `max_budget_usd` is reached. The loop checks that answer after every
event it emits; the cost only changes at a call's end, so the overshoot is at
most one model call (seed 000).

A guard may have a parent: a host-wide BudgetGuard whose `max_budget_usd` caps
the sum over every session that reports to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ConfigDict

from runtime.actor import TrioActor
from runtime.events import Usage
from runtime.messages import Message
from runtime.pricing import Pricing, pricing_for

if TYPE_CHECKING:
    from pykka import ActorRef


class BeginQuery(Message):
    """Reset the per-query ledger; `max_budget_usd` and `pricing` apply to this query."""

    max_budget_usd: float | None = None
    pricing: Pricing | None = None


class RecordUsage(Message):
    """One model call's usage, priced at `model`'s rates."""

    model: str
    usage: Usage


class BudgetStatus(Message):
    query_usage: Usage
    query_cost_usd: float
    exceeded: bool


class HostSpend(Message):
    """A child guard's spend, reported to a host-wide parent; answered with whether the host cap is hit."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    cost_usd: float


def cost_usd(usage: Usage, price: Pricing) -> float:
    """USD for one call's usage at `price` (USD per million tokens)."""
    return (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + usage.cache_creation_input_tokens * price.cache_write
        + usage.cache_read_input_tokens * price.cache_read
    ) / 1_000_000


class BudgetGuard(TrioActor):
    actor_name = "BudgetGuard"

    def __init__(self, *, max_budget_usd: float | None = None, parent: ActorRef[BudgetGuard] | None = None) -> None:
        super().__init__()
        self.host_max_budget_usd = max_budget_usd
        self.parent = parent
        self.session_usage = Usage()
        self.session_cost_usd = 0.0
        self._query_usage = Usage()
        self._query_cost = 0.0
        self._query_max: float | None = None
        self._pricing: Pricing | None = None
        self._host_exceeded = False

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, RecordUsage):
            return self._record(message)
        if isinstance(message, BeginQuery):
            self._query_usage, self._query_cost = Usage(), 0.0
            self._query_max, self._pricing = message.max_budget_usd, message.pricing
            return None
        if isinstance(message, HostSpend):
            self.session_cost_usd += message.cost_usd
            return self.host_max_budget_usd is not None and self.session_cost_usd >= self.host_max_budget_usd
        return super().on_receive(message)

    def _record(self, message: RecordUsage) -> Any:
        # Accounting happens here, synchronously: an abort can never lose a recorded call.
        cost = cost_usd(message.usage, pricing_for(message.model, self._pricing))
        self._query_usage = self._query_usage + message.usage
        self._query_cost += cost
        self.session_usage = self.session_usage + message.usage
        self.session_cost_usd += cost
        if self.parent is None:
            return self._status()
        return self._report_to_parent(cost)

    async def _report_to_parent(self, cost: float) -> BudgetStatus:
        assert self.parent is not None
        self._host_exceeded = bool(await self.parent.ask(HostSpend(cost_usd=cost), block=False))
        return self._status()

    def _status(self) -> BudgetStatus:
        exceeded = self._host_exceeded or (self._query_max is not None and self._query_cost >= self._query_max)
        return BudgetStatus(query_usage=self._query_usage, query_cost_usd=self._query_cost, exceeded=exceeded)
