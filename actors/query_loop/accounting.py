"""A query's accounting behind one interface, whoever keeps the books.

Where no host budget is set, the session's `BudgetLedger` is kept by the QueryLoop itself and read
inline (`LedgerAccounts`): no message, no wait, for a loop that makes a dozen calls. Under a host
budget, the session's BudgetGuard keeps it, and every call's cost goes to it by message
(`GuardAccounts`), so the host's total is one actor's. The loop calls the same methods either way;
each answer is a `TrioFuture`, which the ledger resolves before returning it. So the ending written
in an abort's own call (which may not wait) sends the `result` at once when the answer is there
(`done()`), and the loop's task simply awaits it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from queryloop.actors.budget_guard import (
    BeginQuery,
    BudgetLedger,
    BudgetStatus,
    CheckTokenBudget,
    RecordSpend,
    RecordUsage,
    SettleQuery,
)
from queryloop.runtime.kernel._future import TrioFuture

if TYPE_CHECKING:
    from pykka import ActorRef

    from queryloop.actors.budget_guard import BudgetGuard
    from queryloop.runtime.loop.events import Usage
    from queryloop.runtime.loop.options import QueryOptions
    from queryloop.runtime.loop.token_budget import TokenBudgetDecision

T = TypeVar("T")


def _answered(value: T) -> TrioFuture[T]:
    future: TrioFuture[T] = TrioFuture()
    future.set(value)
    return future


class QueryAccounts:
    """The books of a session's queries: what the loop asks of them (`LedgerAccounts`, `GuardAccounts`)."""

    __slots__ = ()

    def begin_query(self, options: QueryOptions) -> None:
        """A new query: its own totals from zero, its caps (`max_budget_usd`, `token_budget`) and pricing."""
        raise NotImplementedError

    def defers(self, options: QueryOptions) -> bool:
        """True when no cap needs a call's cost at once: the loop keeps the calls and settles them at the end."""
        raise NotImplementedError

    def charge(self, model: str, usage: Usage) -> TrioFuture[BudgetStatus]:
        """One main-loop call's usage, priced at `model`'s rates: the query's totals after it."""
        raise NotImplementedError

    def charge_spend(self, model: str, usage: Usage, cost_usd: float, agent_usage: bool) -> TrioFuture[BudgetStatus]:
        """Spend priced already (a subagent's, call by call, at `model`), counted as the query's: the totals after
        it. Its tokens join the query's `model_usage`, not its `usage` (`BudgetLedger.add`)."""
        raise NotImplementedError

    def settle(self, calls: list[tuple[str, Usage]]) -> TrioFuture[BudgetStatus]:
        """The deferred `calls` (model, usage) accounted, then the query's totals."""
        raise NotImplementedError

    def check_token_budget(self, global_turn_tokens: int) -> TrioFuture[TokenBudgetDecision]:
        """The token-budget gate for the query, given its output tokens so far."""
        raise NotImplementedError


class LedgerAccounts(QueryAccounts):
    """No host budget: the session's ledger, kept by the QueryLoop and read inline (every answer is ready)."""

    __slots__ = ("ledger",)

    def __init__(self, ledger: BudgetLedger) -> None:
        self.ledger = ledger

    def begin_query(self, options: QueryOptions) -> None:
        self.ledger.begin_query(
            max_budget_usd=options.max_budget_usd,
            token_budget=options.token_budget,
            model=options.model,
            pricing=options.pricing,
        )

    def defers(self, options: QueryOptions) -> bool:
        # A subagent's ledger (`above`) reports every call to its parent at once, whose cap may stop it.
        return options.max_budget_usd is None and self.ledger.above is None

    def charge(self, model: str, usage: Usage) -> TrioFuture[BudgetStatus]:
        self.ledger.account(model, usage)
        return _answered(self.ledger.status())

    def charge_spend(self, model: str, usage: Usage, cost_usd: float, agent_usage: bool) -> TrioFuture[BudgetStatus]:
        self.ledger.add(model, usage, cost_usd, agent_usage=agent_usage)  # a subagent's ledger reports it further up
        return _answered(self.ledger.status())

    def settle(self, calls: list[tuple[str, Usage]]) -> TrioFuture[BudgetStatus]:
        for model, usage in calls:
            self.ledger.account(model, usage)
        return _answered(self.ledger.status(models=True))

    def check_token_budget(self, global_turn_tokens: int) -> TrioFuture[TokenBudgetDecision]:
        return _answered(self.ledger.check_token_budget(global_turn_tokens))


class GuardAccounts(QueryAccounts):
    """A host budget sits above the session: its BudgetGuard keeps the books and is asked by message."""

    __slots__ = ("guard",)

    def __init__(self, guard: ActorRef[BudgetGuard]) -> None:
        self.guard = guard

    def begin_query(self, options: QueryOptions) -> None:
        self.guard.tell(
            BeginQuery(
                max_budget_usd=options.max_budget_usd,
                token_budget=options.token_budget,
                model=options.model,
                pricing=options.pricing,
            )
        )

    def defers(self, options: QueryOptions) -> bool:
        return False  # every call's cost counts towards the host's cap at once

    def charge(self, model: str, usage: Usage) -> TrioFuture[BudgetStatus]:
        return self._ask(RecordUsage(model=model, usage=usage, query_usage=True))

    def charge_spend(self, model: str, usage: Usage, cost_usd: float, agent_usage: bool) -> TrioFuture[BudgetStatus]:
        return self._ask(RecordSpend(model=model, usage=usage, cost_usd=cost_usd, agent_usage=agent_usage))

    def settle(self, calls: list[tuple[str, Usage]]) -> TrioFuture[BudgetStatus]:
        records = [RecordUsage(model=model, usage=usage, query_usage=True) for model, usage in calls]
        return self._ask(SettleQuery(calls=records))

    def check_token_budget(self, global_turn_tokens: int) -> TrioFuture[TokenBudgetDecision]:
        return self._ask(CheckTokenBudget(global_turn_tokens=global_turn_tokens))

    def _ask(self, message: object) -> TrioFuture[Any]:
        answer: TrioFuture[Any] = self.guard.ask(message, block=False)  # type: ignore[assignment]  # a TrioActor's
        return answer
