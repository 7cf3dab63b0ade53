"""The lifecycle events' hooks (`QueryOptions.hooks`), in the Agent SDK's shape, run where Claude Code runs
them: SubagentStart, PreCompact, PostCompact, SessionStart, SessionEnd and StopFailure. `runtime.loop.event_hooks`
runs them (every matching callback at once, each under its timeout); this module says what each event is given
(`input_data`), what its matcher is tested against, and what its answers mean (`read_event`).

* SubagentStart (matched against the agent's type; `agent_id`, `agent_type`), PostCompact (`trigger`,
  `compact_summary`) and SessionStart (matched against and given its `source`: `startup`, `resume`,
  `compact`): `additionalContext` reaches the model, `systemMessage` the user (`effect_messages`).
* PreCompact (matched against and given its `trigger`, `custom_instructions`): `decision: "block"` (a command
  hook's exit 2 is one) blocks the compaction; any other `decision` is a hook error.
* SessionEnd (`reason`) and StopFailure (matched against and given its `error`; `error_details`,
  `last_assistant_message`) run detached from the query (`run_detached`): nothing waits for them, what they
  answer is ignored and a failure is logged. SessionEnd's hooks share one budget, Claude Code's
  (`session_end_budget_s`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio
from loguru import logger

from queryloop.runtime.loop.event_hooks import (
    QueryHooks,
    ReadAnswers,
    block_reason,
    read_answers,
    run_hooks,
    specific_output,
)
from queryloop.runtime.loop.hooks import failure_text

if TYPE_CHECKING:
    from queryloop.runtime.loop.sdk_hooks import HookMatcher

SESSION_END_BUDGET_S = 1.5
"""Claude Code's budget for a session's SessionEnd hooks, all of them together."""
SESSION_END_MAX_S = 60.0
"""The most a matcher's own `timeout` raises that budget to."""


def session_end_budget_s(matchers: tuple[HookMatcher, ...]) -> float:
    """How long the SessionEnd hooks may run, together: 1.5 s, raised by a matcher's explicit `timeout` (the
    largest), to at most 60 s, as Claude Code bounds them (a matcher without one keeps the shared budget)."""
    explicit = [matcher.timeout for matcher in matchers if matcher.timeout is not None]
    return min(SESSION_END_MAX_S, max([SESSION_END_BUDGET_S, *explicit]))


def _read_pre_compact(value: dict[str, Any]) -> str | None:
    """A PreCompact answer's block: its reason (Claude Code's wording without one), or None (`block_reason`)."""
    reason = block_reason(value, "Compaction blocked by PreCompact hook")
    specific_output(value, "PreCompact")
    return reason


async def read_event(
    hooks: QueryHooks, event: str, match_value: str | None, fields: dict[str, Any]
) -> ReadAnswers[Any]:
    """Run `event`'s callbacks that select `match_value` and read their answers: the common fields, and for
    PreCompact each answer's block reason (None: no block); an event with no fields of its own reads none."""
    answers = await run_hooks(hooks, event, match_value, fields)
    if event == "PreCompact":
        return read_answers(answers, event, _read_pre_compact)
    return read_answers(answers, event, lambda value: specific_output(value, event))


def blocked(read: ReadAnswers[Any]) -> str | None:
    """The first PreCompact block's reason (configuration order), or None."""
    return next((reason for reason in read.specific if reason is not None), None)


async def run_detached(
    hooks: QueryHooks, event: str, match_value: str, fields: dict[str, Any], *, budget_s: float | None = None
) -> None:
    """`event`'s hooks, run where nothing waits for them (SessionEnd, StopFailure): within `budget_s` if given
    (each callback within its own timeout as well), their answers ignored, each failure logged."""
    log = logger.bind(session=hooks.session_id)
    read: ReadAnswers[Any] | None = None
    with trio.move_on_after(budget_s if budget_s is not None else float("inf")):
        read = await read_event(hooks, event, match_value, fields)
    if read is None:
        log.warning("{} hooks cut after {} s", event, budget_s)
        return
    for hook, error in read.failures:
        name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
        log.warning("{} hook {} failed: {}", event, name, failure_text(error))
