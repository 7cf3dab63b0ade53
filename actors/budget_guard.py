"""BudgetGuard: usage and cost of a session's queries, and the USD limit.

The QueryLoop reports each completed model call's usage (what `message_start`
and the cumulative `message_delta` said, taken at `message_stop`, as the
reference's QueryEngine does) and receives the query's running cost and
whether `max_budget_usd` is reached. It also keeps the query's `BudgetTracker` and answers `CheckTokenBudget` with
seed 003's `checkTokenBudget` decision. The loop checks the USD answer after every
event it emits; the cost only changes at a call's end, so the overshoot is at
most one model call (seed 000).

A guard may have a parent: a host-wide BudgetGuard whose `max_budget_usd` caps
the sum over every session that reports to it.
"""

from __future__ import annotations

from dataclasses import field
from typing import TYPE_CHECKING, Any

from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.messages import Message, record
from queryloop.runtime.loop.events import Usage
from queryloop.runtime.loop.pricing import Pricing, pricing_for
from queryloop.runtime.loop.token_budget import BudgetTracker, check_token_budget

if TYPE_CHECKING:
    from pykka import ActorRef


@record
class BeginQuery(Message):
    """Reset the per-query ledger; `max_budget_usd`, `token_budget` and `pricing` apply to this query."""

    max_budget_usd: float | None = None
    token_budget: int | None = None
    model: str | None = None
    pricing: Pricing | None = None
    """Overrides the table's price of `model` (this query's model) only; other models keep the table's."""


@record
class RecordUsage(Message):
    """One model call's usage, priced at `model`'s rates."""

    model: str
    usage: Usage
    query_usage: bool = True
    """False for the runtime's own calls (summaries, compaction): their cost counts, their tokens do not."""


@record
class SettleQuery(Message):
    """Record `calls` (an uncapped query's, collected by the loop) and answer the query's `BudgetStatus`."""

    calls: list[RecordUsage] = field(default_factory=list)


@record
class CheckTokenBudget(Message):
    """The token-budget gate (seed 003) for the current query, given its output tokens so far."""

    global_turn_tokens: int


@record
class BudgetStatus(Message):
    query_usage: Usage
    query_cost_usd: float
    exceeded: bool


@record
class HostSpend(Message):
    """A child guard's spend, reported to a host-wide parent; answered with whether the host cap is hit."""

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
        self._priced_model: str | None = None
        self._host_exceeded = False
        self._token_budget: int | None = None
        self._tracker = BudgetTracker()

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, RecordUsage):
            return self._record(message)
        if isinstance(message, BeginQuery):
            self._query_usage, self._query_cost = Usage(), 0.0
            self._query_max = message.max_budget_usd
            self._priced_model, self._pricing = message.model, message.pricing
            self._token_budget, self._tracker = message.token_budget, BudgetTracker()
            return None
        if isinstance(message, SettleQuery):
            cost = sum(self._account(call) for call in message.calls)
            if self.parent is not None and cost:
                self.parent.tell(HostSpend(cost_usd=cost))  # the host's total includes what was cut short
            return self._status()
        if isinstance(message, CheckTokenBudget):
            return check_token_budget(self._tracker, None, self._token_budget, message.global_turn_tokens)
        if isinstance(message, HostSpend):
            self.session_cost_usd += message.cost_usd
            return self.host_max_budget_usd is not None and self.session_cost_usd >= self.host_max_budget_usd
        return super().on_receive(message)

    def _record(self, message: RecordUsage) -> Any:
        cost = self._account(message)
        if self.parent is None:
            return self._status()
        return self._report_to_parent(cost)

    def _account(self, message: RecordUsage) -> float:
        # Accounting happens here, synchronously: an abort can never lose a recorded call.
        override = self._pricing if message.model == self._priced_model else None
        cost = cost_usd(message.usage, pricing_for(message.model, override))
        if message.query_usage:
            self._query_usage = self._query_usage + message.usage
        self._query_cost += cost
        self.session_usage = self.session_usage + message.usage
        self.session_cost_usd += cost
        return cost

    async def _report_to_parent(self, cost: float) -> BudgetStatus:
        assert self.parent is not None
        self._host_exceeded = bool(await self.parent.ask(HostSpend(cost_usd=cost), block=False))
        return self._status()

    def _status(self) -> BudgetStatus:
        exceeded = self._host_exceeded or (self._query_max is not None and self._query_cost >= self._query_max)
        return BudgetStatus(query_usage=self._query_usage, query_cost_usd=self._query_cost, exceeded=exceeded)
