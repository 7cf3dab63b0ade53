"""The lifecycle events' hooks as steps of the `QueryLoop` (`runtime.loop.lifecycle_hooks` runs and reads them):
where Claude Code fires them, the query's hooks (`run.setup.hooks`) fire them here. Nothing of this runs for a
query without hooks: the callers check `run.setup.hooks is None` first.

* SessionStart: at a session's first query, before its prompt (`startup`; `resume` for a session restored from
  a transcript), and after each compaction (`compact`), after the summary. Not in a subagent's loop.
* SubagentStart: in the parent's agent call, before the child's query starts (`subagent_start`); what its
  hooks add follows the child's prompt in the child's conversation (`open_with_hooks`).
* PreCompact: before an autocompaction (the Compactor defers it, `hooked_compaction`), before the
  prompt-too-long cascade's compaction (`pre_compact_allows`) and before `session.compact()`'s (trigger
  `manual`, `controls.compact_now`); a block skips it. PostCompact: once the compaction's messages are in the
  conversation (`after_compaction`).
* SessionEnd: when the session's QueryLoop stops, detached, with the hooks of its last query (`session_end`).

A hook that fails is a non-blocking `hook_error`: its event joins the conversation where the hooks' other
messages do, its text the result's `errors`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

from loguru import logger

from queryloop.actors.compactor import Compact, Compacted, Prepared
from queryloop.actors.query_loop.run import PhaseScope, Run
from queryloop.runtime.errors import WorkCancelled
from queryloop.runtime.loop.context import COMPACT_SUMMARY_PREFIX
from queryloop.runtime.loop.event_hooks import NO_READ, QueryHooks, ReadAnswers, effect_messages
from queryloop.runtime.loop.events import TranscriptMessage, UserMessage
from queryloop.runtime.loop.hooks import HookErrorSource, hook_error_message
from queryloop.runtime.loop.lifecycle_hooks import blocked, read_event, run_detached, session_end_budget_s
from queryloop.runtime.loop.tools import ToolError

if TYPE_CHECKING:
    from queryloop.actors.query_loop.loop import QueryLoop

TRIGGER = "auto"
"""The trigger of every compaction a query asks for (the pipeline's, the prompt-too-long cascade's); `manual` is
`session.compact()`'s, Claude Code's `/compact` (`controls.compact_now`)."""


async def fire(
    run: Run, hooks: QueryHooks, event: HookErrorSource, match_value: str, fields: dict[str, Any], *, scoped: bool
) -> tuple[ReadAnswers[Any], list[TranscriptMessage]]:
    """`event`'s hooks, read (an abort of the query cuts them when `scoped`: none answered), and the messages they
    add, in order: each failure's `hook_error` event (its text joins `run`'s errors), then `effect_messages`."""
    read: ReadAnswers[Any] = NO_READ
    if scoped:
        with PhaseScope(run):
            read = await read_event(hooks, event, match_value, fields)
    else:
        read = await read_event(hooks, event, match_value, fields)
    failures: list[TranscriptMessage] = []
    for hook, error in read.failures:
        failure = hook_error_message(event, hook, error)
        logger.bind(session=hooks.session_id).opt(exception=error).warning(failure.content)
        run.add_hook_errors((failure.content,))
        failures.append(failure)
    effects, _ = effect_messages(event, read)
    return read, [*failures, *effects]


async def session_start(loop: QueryLoop, run: Run, hooks: QueryHooks) -> None:
    """At a session's first query (none has run while the conversation holds only what was restored), the
    SessionStart hooks: their context joins the conversation before the prompt, where Claude Code puts it."""
    restored = loop.caches.restored
    if loop.agent is None and len(loop.conversation) == restored and hooks.has("SessionStart"):
        source = "resume" if restored else "startup"
        _, added = await fire(run, hooks, "SessionStart", source, {"source": source}, scoped=True)
        for message in added:
            await loop.emit(run, message)


async def subagent_start(run: Run, hooks: QueryHooks, agent_id: str, agent_type: str) -> tuple[TranscriptMessage, ...]:
    """The parent query's SubagentStart hooks for a subagent about to start (matched against its type): what they
    add for the child's conversation. A `continue: false` stops the agent before it starts (`ToolError`: the
    call's error result)."""
    as_agent = dataclasses.replace(hooks, agent=(agent_id, agent_type))
    read, added = await fire(run, as_agent, "SubagentStart", agent_type, {}, scoped=False)
    stop = read.stop
    if stop is not None:
        raise ToolError(stop.stop_reason or "Execution stopped by SubagentStart hook")
    return tuple(added)


async def pre_compact(
    loop: QueryLoop, run: Run, hooks: QueryHooks, trigger: str = TRIGGER
) -> tuple[str | None, list[TranscriptMessage]]:
    """The PreCompact hooks of a compaction about to run: a block's reason (None: it may run), and the messages
    they added to the conversation (emitted)."""
    fields = {"trigger": trigger, "custom_instructions": run.setup.options.compact_instructions}
    read, added = await fire(run, hooks, "PreCompact", trigger, fields, scoped=True)
    for message in added:
        await loop.emit(run, message)
    reason = blocked(read)
    if reason is not None:
        loop.log.info("compaction blocked by a PreCompact hook: {}", reason)
    return reason, added


async def hooked_compaction(loop: QueryLoop, run: Run, prepared: Prepared) -> Prepared | None:
    """An autocompaction the Compactor deferred (`Prepared.compact_due`): asked for once the PreCompact hooks let
    it, its outcome said as the pipeline says it; a block goes on as if none were due. None: aborted."""
    hooks = run.setup.hooks
    assert hooks is not None  # deferred only for a query with PreCompact hooks
    reason, added = await pre_compact(loop, run, hooks)
    if run.setup.control.abort_reason is not None:
        return None
    if reason is not None:
        return dataclasses.replace(prepared, messages=[*prepared.messages, *added], compact_due=False)
    compacted: Compacted | None = None
    with PhaseScope(run):
        try:
            ask = Compact(messages=prepared.messages, config=run.setup.context_config, trigger="auto")
            compacted = await loop.compactor.ask(ask, block=False)
        except WorkCancelled:
            compacted = None
    if run.setup.control.abort_reason is not None:
        return None
    if compacted is None:
        return dataclasses.replace(prepared, autocompact_failed=True, compact_due=False)
    return dataclasses.replace(
        prepared,
        messages=compacted.messages,
        compacted=compacted.messages,
        pre_compact_tokens=compacted.pre_tokens,
        blocking=False,
        compact_due=False,
    )


async def pre_compact_allows(loop: QueryLoop, run: Run) -> bool:
    """Whether the prompt-too-long cascade's compaction may run: its PreCompact hooks did not block it (a block,
    or an abort meanwhile, fails the recovery as a failed compaction does)."""
    hooks = run.setup.hooks
    if hooks is None or not hooks.has("PreCompact"):
        return True
    reason, _ = await pre_compact(loop, run, hooks)
    return reason is None and run.setup.control.abort_reason is None


def compact_summary(compacted: list[TranscriptMessage]) -> str:
    """The summary text of a compaction's messages (its boundary, then the summary)."""
    for message in compacted:
        if type(message) is UserMessage and isinstance(message.content, str):
            return message.content.removeprefix(COMPACT_SUMMARY_PREFIX)
    return ""


async def after_compaction(
    loop: QueryLoop, run: Run, hooks: QueryHooks, compacted: list[TranscriptMessage], trigger: str = TRIGGER
) -> list[TranscriptMessage]:
    """`compacted` (emitted already), followed by what SessionStart (`compact`) and then PostCompact hooks add,
    as Claude Code adds them after the summary (emitted here)."""
    added: list[TranscriptMessage] = []
    if loop.agent is None and hooks.has("SessionStart"):
        added.extend((await fire(run, hooks, "SessionStart", "compact", {"source": "compact"}, scoped=True))[1])
    if hooks.has("PostCompact"):
        fields = {"trigger": trigger, "compact_summary": compact_summary(compacted)}
        added.extend((await fire(run, hooks, "PostCompact", trigger, fields, scoped=True))[1])
    for message in added:
        await loop.emit(run, message)
    return [*compacted, *added]


def session_end(loop: QueryLoop) -> None:
    """The session closes (its QueryLoop stops): the SessionEnd hooks of its last query, `reason` `"other"`,
    started detached (nothing is left to wait for them: the runtime's close does), within Claude Code's budget."""
    hooks, detach = loop.caches.hooks, loop.detach
    if hooks is None or loop.agent is not None or detach is None or not hooks.has("SessionEnd"):
        return
    budget = session_end_budget_s(hooks.matchers["SessionEnd"])
    try:
        detach(functools.partial(run_detached, hooks, "SessionEnd", "other", {"reason": "other"}, budget_s=budget))
    except RuntimeError as error:  # the runtime has closed under the session: nothing may start any more
        loop.log.warning("SessionEnd hooks not run: {}", error)
