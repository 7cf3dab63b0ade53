"""BudgetGuard: usage and cost of a session's queries, and the USD limit.

The QueryLoop reports each completed model call's usage (what `message_start`
and the cumulative `message_delta` said, taken at `message_stop`, as
Claude Code's QueryEngine does) and receives the query's running cost and
whether `max_budget_usd` is reached. It also keeps the query's `BudgetTracker` and answers `CheckTokenBudget` with
Claude Code's `checkTokenBudget` decision. The loop checks the USD answer after every
event it emits; the cost only changes at a call's end, so the overshoot is at
most one model call, as in Claude Code's loop.

The accounting itself is a `BudgetLedger`, a plain object. Where no host budget is
set, nothing but the session's own queries can change it, so the QueryLoop keeps the
ledger and does the per-query accounting inline (no message per call or per query);
the BudgetGuard actor is then spawned only when the Compactor or the ToolUseSummarizer is,
around the same ledger, to take the spend they report as messages. Where a host
budget is set, the guard is an actor from the session's start and every query talks
to it by message (`BeginQuery`, `RecordUsage`, `SettleQuery`, `CheckTokenBudget`).

A guard may have a parent: a host-wide BudgetGuard whose `max_budget_usd` caps
the sum over every session that reports to it.

A subagent's ledger has an `above`: a function of its parent's (`SpendAbove`) that every
cost it accounts is handed to as it is accounted, so the parent's query (and, through the
parent, the host) counts a child's spend call by call; it answers whether the parent's cap is
reached, which stops the child as its own cap would. Its `agent_id` stops the
token-budget gate for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import TYPE_CHECKING, Any

from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.messages import Message, record
from queryloop.runtime.loop.events import NO_USAGE, Usage
from queryloop.runtime.loop.pricing import Pricing, pricing_for
from queryloop.runtime.loop.token_budget import BudgetTracker, TokenBudgetDecision, check_token_budget

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
class RecordSpend(Message):
    """Spend already priced (a subagent's, reported up call by call): its cost counted as the query's, its tokens
    in the query's `model_usage` but not in its `usage` (the main loop's own calls only, as Claude Code counts)."""

    model: str
    usage: Usage
    cost_usd: float
    agent_usage: bool = True
    """False for a subagent's side calls (summaries, compaction): not in its `usage_by_agent` tokens."""


@record
class SettleQuery(Message):
    """Record `calls` (an uncapped query's, collected by the loop) and answer the query's `BudgetStatus`."""

    calls: list[RecordUsage] = field(default_factory=list)


@record
class CheckTokenBudget(Message):
    """The token-budget gate for the current query, given its output tokens so far."""

    global_turn_tokens: int


@record
class BudgetStatus(Message):
    query_usage: Usage
    query_cost_usd: float
    exceeded: bool
    models: dict[str, ModelTally] | None = None
    """Per model, what the query's calls used and cost (its subagents', summaries' and compactions' too); only
    in the answer that settles the query (`BudgetLedger.status(models=True)`)."""


@record
class HostSpend(Message):
    """A child guard's spend, reported to a host-wide parent; answered with whether the host cap is hit."""

    cost_usd: float


def cost_usd(usage: Usage, price: Pricing) -> float:
    """USD for one call's usage at `price` (USD per million tokens; its long-prompt tier if the prompt is one)."""
    if price.long_prompt is not None:
        price = price.for_prompt(usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens)
    one_hour = usage.cache_creation_1h_input_tokens  # part of the cache writes, at their own price
    cost = (
        usage.input_tokens * price.input
        + usage.output_tokens * price.output
        + (usage.cache_creation_input_tokens - one_hour) * price.cache_write
        + usage.cache_read_input_tokens * price.cache_read
    )
    if one_hour:
        cost += one_hour * price.one_hour_cache_write
    return cost / 1_000_000


SpendAbove = Callable[[str, Usage, float, bool], bool]
"""A subagent's report of one priced call to its parent (model, usage, cost, and whether its tokens are an
agent's own query tokens, not a summary's or a compaction's); True when the parent's cap is reached."""


class ModelTally:
    """One model's calls in a query: tokens and cost, summed as they are accounted (`BudgetLedger.models`)."""

    __slots__ = ("cache_creation_input_tokens", "cache_read_input_tokens", "cost_usd", "input_tokens", "output_tokens")

    def __init__(self) -> None:
        self.input_tokens = 0
        self.output_tokens = 0
        self.cache_read_input_tokens = 0
        self.cache_creation_input_tokens = 0
        self.cost_usd = 0.0

    def add(self, usage: Usage, cost: float) -> None:
        self.input_tokens += usage.input_tokens
        self.output_tokens += usage.output_tokens
        self.cache_read_input_tokens += usage.cache_read_input_tokens
        self.cache_creation_input_tokens += usage.cache_creation_input_tokens
        self.cost_usd += cost


class BudgetLedger:
    """The accounting of one session's queries (see the module docstring); used on the trio thread only."""

    __slots__ = (
        "_above_exceeded",
        "_priced_model",
        "_pricing",
        "_query_max",
        "_token_budget",
        "_tracker",
        "above",
        "agent_id",
        "models",
        "query_cost_usd",
        "query_usage",
        "session_cost_usd",
        "session_usage",
    )

    def __init__(self, *, agent_id: str | None = None, above: SpendAbove | None = None) -> None:
        self.agent_id = agent_id
        """Set for a subagent's ledger: the token-budget gate stops for it."""
        self.above = above
        """A subagent's: every accounted cost is reported to its parent through it, at once."""
        self._above_exceeded = False
        self.session_usage = NO_USAGE  # a frozen record: one zero serves every ledger until its first call
        self.session_cost_usd = 0.0
        self.query_usage = NO_USAGE
        self.query_cost_usd = 0.0
        self.models: dict[str, ModelTally] = {}
        """The query's calls per model: its `model_usage`."""
        self._query_max: float | None = None
        self._pricing: Pricing | None = None
        self._priced_model: str | None = None
        self._token_budget: int | None = None
        self._tracker: BudgetTracker | None = None
        """The token-budget gate's memory: a query's own, made only for a query with a token budget."""

    def begin_query(
        self,
        *,
        max_budget_usd: float | None = None,
        token_budget: int | None = None,
        model: str | None = None,
        pricing: Pricing | None = None,
    ) -> None:
        """Reset the per-query ledger (`BeginQuery`)."""
        self.query_usage, self.query_cost_usd, self.models = NO_USAGE, 0.0, {}
        self._query_max = max_budget_usd
        self._priced_model, self._pricing = model, pricing
        self._token_budget, self._tracker = token_budget, None if token_budget is None else BudgetTracker()

    def account(self, model: str, usage: Usage, *, query_usage: bool = True) -> float:
        """Record one call's usage, priced at `model`'s rates; its cost in USD."""
        override = self._pricing if model == self._priced_model else None
        cost = cost_usd(usage, pricing_for(model, override))
        if query_usage:
            self.query_usage = self.query_usage + usage
        self.query_cost_usd += cost
        self.session_usage = self.session_usage + usage
        self.session_cost_usd += cost
        self._tally(model, usage, cost)
        if self.above is not None and self.above(model, usage, cost, query_usage):
            self._above_exceeded = True
        return cost

    def add(self, model: str, usage: Usage, cost: float, *, agent_usage: bool = True) -> None:
        """Record spend priced already (a subagent's call at `model`): its cost is the query's, its tokens are in
        the query's `models` but not its `query_usage` (the main loop's own calls only); reported further up."""
        self.query_cost_usd += cost
        if agent_usage:
            self.session_usage = self.session_usage + usage
        self.session_cost_usd += cost
        self._tally(model, usage, cost)
        if self.above is not None and self.above(model, usage, cost, agent_usage):
            self._above_exceeded = True

    def _tally(self, model: str, usage: Usage, cost: float) -> None:
        tally = self.models.get(model)
        if tally is None:
            tally = self.models[model] = ModelTally()
        tally.add(usage, cost)

    def query_cap_reached(self) -> bool:
        """The query's own `max_budget_usd` is reached (or, for a subagent, its parent's)."""
        return self._above_exceeded or (self._query_max is not None and self.query_cost_usd >= self._query_max)

    def status(self, *, host_exceeded: bool = False, models: bool = False) -> BudgetStatus:
        """The query's totals so far; with `models`, its calls per model too (`SettleQuery`'s answer)."""
        return BudgetStatus(
            query_usage=self.query_usage,
            query_cost_usd=self.query_cost_usd,
            exceeded=host_exceeded or self.query_cap_reached(),
            models=dict(self.models) if models else None,
        )

    def check_token_budget(self, global_turn_tokens: int) -> TokenBudgetDecision:
        """The token-budget gate for the current query (`CheckTokenBudget`)."""
        # Without a budget the gate stops at once, reading nothing of the tracker it is given.
        tracker = self._tracker if self._tracker is not None else BudgetTracker()
        return check_token_budget(tracker, self.agent_id, self._token_budget, global_turn_tokens)


class BudgetGuard(TrioActor):
    actor_name = "BudgetGuard"

    def __init__(
        self,
        *,
        max_budget_usd: float | None = None,
        parent: ActorRef[BudgetGuard] | None = None,
        ledger: BudgetLedger | None = None,
    ) -> None:
        super().__init__()
        self.host_max_budget_usd = max_budget_usd
        self.parent = parent
        self.ledger = ledger if ledger is not None else BudgetLedger()
        """Shared with the session's QueryLoop where no host budget is set (it accounts inline then)."""
        self._host_exceeded = False

    @property
    def session_usage(self) -> Usage:
        return self.ledger.session_usage

    @property
    def session_cost_usd(self) -> float:
        return self.ledger.session_cost_usd

    def on_receive(self, message: Any) -> Any:
        ledger = self.ledger
        if isinstance(message, RecordUsage):
            return self._record(message)
        if isinstance(message, RecordSpend):
            ledger.add(message.model, message.usage, message.cost_usd, agent_usage=message.agent_usage)
            if self.parent is None:
                return self._status()
            return self._report_to_parent(message.cost_usd)
        if isinstance(message, BeginQuery):
            ledger.begin_query(
                max_budget_usd=message.max_budget_usd,
                token_budget=message.token_budget,
                model=message.model,
                pricing=message.pricing,
            )
            return None
        if isinstance(message, SettleQuery):
            cost = sum(ledger.account(call.model, call.usage, query_usage=call.query_usage) for call in message.calls)
            if self.parent is not None and cost:
                self.parent.tell(HostSpend(cost_usd=cost))  # the host's total includes what was cut short
            return ledger.status(host_exceeded=self._host_exceeded, models=True)
        if isinstance(message, CheckTokenBudget):
            return ledger.check_token_budget(message.global_turn_tokens)
        if isinstance(message, HostSpend):
            ledger.session_cost_usd += message.cost_usd
            return self.host_max_budget_usd is not None and ledger.session_cost_usd >= self.host_max_budget_usd
        return super().on_receive(message)

    def _record(self, message: RecordUsage) -> Any:
        # Accounting happens here, synchronously: an abort can never lose a recorded call.
        cost = self.ledger.account(message.model, message.usage, query_usage=message.query_usage)
        if self.parent is None:
            return self._status()
        return self._report_to_parent(cost)

    async def _report_to_parent(self, cost: float) -> BudgetStatus:
        assert self.parent is not None
        self._host_exceeded = bool(await self.parent.ask(HostSpend(cost_usd=cost), block=False))
        return self._status()

    def _status(self) -> BudgetStatus:
        return self.ledger.status(host_exceeded=self._host_exceeded)
