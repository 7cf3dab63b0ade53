"""Claude Code 2.1's newer recoveries, as steps of the query (functions of the `QueryLoop`, as `context`'s are):
a final response with no visible text asked once more for one (`thinking_only_retry`), a stream cut after
visible output resumed (`truncated_response_recovery`), a `tool_use` stop with no `tool_use` block retried
once, then the query's end (`malformed_tool_use_retry`, `malformed_tool_use_exhausted`). Each is decided by a
pure function of `runtime.loop.decisions` and applied by a continue site of `runtime.loop.state`; the loop
reaches them through `after_error` (a call that failed for good) and `after_final` (a response without tool
use, before its stop hooks). The fourth, the rapid-refill breaker, sits with the context pipeline
(`context.through_pipeline`, `Run.note_autocompaction`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from queryloop.actors.query_loop.context import after_final_response
from queryloop.actors.query_loop.ending import model_error
from queryloop.runtime.loop.decisions import (
    malformed_tool_use_action,
    thinking_only_retry_due,
    truncated_response_recoverable,
)
from queryloop.runtime.loop.events import UserMessage, api_error_message
from queryloop.runtime.loop.state import (
    MALFORMED_TOOL_USE_EXHAUSTED_TEXT,
    MALFORMED_TOOL_USE_RETRY_TEXT,
    THINKING_ONLY_RETRY_TEXT,
    TRUNCATED_RESPONSE_RECOVERY_TEXT,
    State,
    Terminal,
    malformed_tool_use_retry,
    thinking_only_retry,
    truncated_response_recovery,
)

if TYPE_CHECKING:
    from queryloop.actors.model_caller import CallEnded
    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.actors.query_loop.run import Run, Turn
    from queryloop.runtime.loop.events import TranscriptMessage
    from queryloop.runtime.loop.model import ModelError


async def after_error(
    loop: QueryLoop,
    run: Run,
    state: State,
    messages_for_query: list[TranscriptMessage],
    turn: Turn,
    *,
    error: ModelError,
) -> State | Terminal:
    """A model call that failed for good (not withheld): a stream cut after visible output is resumed
    (`truncated_response_recoverable`); any other failure ends the query (`ending.model_error`)."""
    if truncated_response_recoverable(state, error.kind, turn.assistant_messages, bool(turn.tool_ids)):
        return await resume_cut(loop, run, state, messages_for_query, turn)
    return await model_error(loop, run, turn, error)


async def resume_cut(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
) -> State:
    """`truncated_response_recovery`: the blocks that completed stay (the conversation has them), the model is
    asked to resume from where they stop. What the cut stream reported it had spent is billed, as for a call
    an abort cuts (`ending.collect_remaining`)."""
    streamed = turn.progress.usage()
    if not turn.usage_recorded and streamed is not None:
        turn.usage_recorded = True
        run.usage = run.usage + streamed
        run.unsettled.append((run.model, streamed))
    recovery = UserMessage(content=TRUNCATED_RESPONSE_RECOVERY_TEXT, is_meta=True)
    await loop.emit(run, recovery)
    run.transitions.append("truncated_response_recovery")
    return truncated_response_recovery(state, messages_for_query, turn.assistant_messages, recovery)


async def after_final(
    loop: QueryLoop,
    run: Run,
    state: State,
    messages_for_query: list[TranscriptMessage],
    turn: Turn,
    *,
    ended: CallEnded,
) -> State | Terminal:
    """A response without tool use and not cut off: a malformed tool call's retry or end, a thinking-only
    answer's retry, else the stop hooks and what follows them (`context.after_final_response`)."""
    malformed = malformed_tool_use_action(state, ended.stop_reason, len(turn.tool_ids))
    if malformed is not None:
        return await malformed_tool_use(loop, run, state, messages_for_query, turn, exhausted=malformed == "exhausted")
    if thinking_only_retry_due(state, ended.stop_reason, turn.assistant_messages):
        retry = UserMessage(content=THINKING_ONLY_RETRY_TEXT, is_meta=True)
        await loop.emit(run, retry)
        run.transitions.append("thinking_only_retry")
        return thinking_only_retry(state, messages_for_query, turn.assistant_messages, retry)
    return await after_final_response(loop, run, state, messages_for_query, turn)


async def malformed_tool_use(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn, *, exhausted: bool
) -> State | Terminal:
    """A `tool_use` stop with no `tool_use` block: retried once in the turn, the malformed response kept (the
    model sees what it wrote; Claude Code 2.1 outside its clean-retry mode); a second one ends the query
    `malformed_tool_use_exhausted`, its error surfaced as the answer (no stop hooks: the turn did not finish)."""
    if exhausted:
        await loop.surface(run, api_error_message(run.model, MALFORMED_TOOL_USE_EXHAUSTED_TEXT))
        return Terminal(reason="malformed_tool_use_exhausted", error=MALFORMED_TOOL_USE_EXHAUSTED_TEXT)
    retry = UserMessage(content=MALFORMED_TOOL_USE_RETRY_TEXT, is_meta=True)
    await loop.emit(run, retry)
    run.transitions.append("malformed_tool_use_retry")
    return malformed_tool_use_retry(state, messages_for_query, turn.assistant_messages, retry)
