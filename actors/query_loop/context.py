"""The steps around the model call, as functions of the `QueryLoop`: the context pipeline
(`pipeline_due`, `through_pipeline`) and the prompt-too-long cascade, the max-output-tokens recovery (and
a full window's compaction), a paused turn's continuation, tool-use summaries, the token budget's nudge,
stop hooks and the structured answer, attachments and the memory prefetch. Each takes the loop (the
actor: its helpers and emission) and the query's `Run` explicitly, asks a helper actor or a hook, and
applies a transition of `loop.state`; an abort met on the way ends the query through `ending.end_early`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from queryloop.actors.compactor import Compact, Compacted, DrainCollapses, Drained, Prepare, Prepared, StageCollapse
from queryloop.actors.model_caller import PROMPT_TOO_LONG_ERROR_MESSAGE, CallEnded
from queryloop.actors.query_loop.ending import end_early, model_error, surface_failure
from queryloop.actors.query_loop.lifecycle import after_compaction, hooked_compaction, pre_compact_allows
from queryloop.actors.query_loop.run import PendingSummary, PhaseScope, Run, Turn
from queryloop.actors.query_loop.stopping import hook_error, stop_hooks
from queryloop.actors.summarizer import Summarize
from queryloop.runtime.errors import WorkCancelled
from queryloop.runtime.loop.context import collapse_may_stage, pipeline_needed
from queryloop.runtime.loop.decisions import (
    abort_terminal,
    context_is_full,
    max_output_tokens_action,
    pause_turn_may_continue,
    stop_hook_block_capped,
)
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    SystemMessage,
    ToolUseSummaryEvent,
    TranscriptMessage,
    UserMessage,
    api_error_message,
)
from queryloop.runtime.loop.hooks import (
    STOP_HOOK_FEEDBACK,
    hook_error_message,
    stop_hook_block_cap_message,
)
from queryloop.runtime.loop.host_code import checked_attachments, checked_memory
from queryloop.runtime.loop.model import ModelError
from queryloop.runtime.loop.state import (
    COMPLETED,
    MAX_OUTPUT_TOKENS_RECOVERY_TEXT,
    RAPID_REFILL_BREAKER,
    State,
    Terminal,
    collapse_drain_retry,
    max_output_tokens_escalate,
    max_output_tokens_recovery,
    pause_turn_continuation,
    reactive_compact_retry,
    stop_hook_blocking,
    token_budget_continuation,
)
from queryloop.runtime.loop.structured_output import (
    ENFORCEMENT_TEXT,
    StructuredAnswer,
    answer_json,
    attempts_exhausted,
    exhausted_text,
)
from queryloop.runtime.loop.transcript import messages_after_compact_boundary

if TYPE_CHECKING:
    from queryloop.actors.query_loop.loop import QueryLoop


async def recover_max_output_tokens(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
) -> State | None:
    """Escalate once, silently; then up to three recovery messages; None: surface the error."""
    options = run.setup.options
    action = max_output_tokens_action(
        state, max_output_tokens=options.max_output_tokens, escalated=options.escalated_max_output_tokens
    )
    if action == "escalate":
        run.transitions.append("max_output_tokens_escalate")
        return max_output_tokens_escalate(state, messages_for_query, options.escalated_max_output_tokens)
    if action == "recover":
        recovery = UserMessage(content=MAX_OUTPUT_TOKENS_RECOVERY_TEXT, is_meta=True)
        await loop.emit(run, recovery)
        run.transitions.append("max_output_tokens_recovery")
        return max_output_tokens_recovery(state, messages_for_query, turn.assistant_messages, recovery)
    return None


async def continue_paused(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
) -> State | Terminal:
    """A `pause_turn`: the paused response goes back as is (the next State), or the cap ends the query."""
    cap = run.setup.options.max_pause_turn_continuations
    if not pause_turn_may_continue(state.pause_turn_continuations, cap):
        why = f"the model paused its turn (pause_turn) {cap + 1} times; max_pause_turn_continuations is {cap}"
        return await model_error(loop, run, turn, ModelError("api_error", why))
    run.transitions.append("pause_turn_continuation")
    return pause_turn_continuation(state, messages_for_query, turn.assistant_messages)


async def after_final_response(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
) -> State | Terminal:
    """A response without tools: the stop hooks, then the token budget; the next State, or the end."""
    prevent, errors = await stop_hooks(loop, run, state, messages_for_query, turn)
    cap = run.setup.options.stop_hook_block_cap
    capped = bool(errors) and stop_hook_block_capped(state.stop_hook_blocks, cap)
    # An overridden block's feedback is not emitted: it would join the conversation, unanswered.
    blocking = [] if capped else [UserMessage(content=STOP_HOOK_FEEDBACK.format(error=e), is_meta=True) for e in errors]
    if prevent is None:
        for message in blocking:
            await loop.emit(run, message)
    if run.setup.control.abort_reason is not None:
        return end_early(loop, run, turn, abort_terminal(True, False))
    if prevent is not None:
        return Terminal(reason="stop_hook_prevented", error=prevent)
    if capped:
        notice = stop_hook_block_cap_message(cap, errors)
        loop.log.warning("stop hooks blocked {} times in a row: block overridden", cap)
        await loop.emit(run, notice)
        if run.structured is None:
            return Terminal(reason="completed", error=notice.content)
        run.add_hook_errors((notice.content,))  # the hooks are overridden, not the demand for an answer
    if blocking:
        run.transitions.append("stop_hook_blocking")
        return stop_hook_blocking(state, messages_for_query, turn.assistant_messages, blocking)
    if run.structured is not None:  # a final response without the answer (a valid one ends the query)
        return await demand_answer(loop, run, state, messages_for_query, turn, structured=run.structured)
    nudge = await token_budget_nudge(loop, run)
    if nudge is not None:
        run.transitions.append("token_budget_continuation")
        return token_budget_continuation(state, messages_for_query, turn.assistant_messages, nudge)
    return COMPLETED


async def retry_too_long(
    loop: QueryLoop,
    run: Run,
    state: State,
    messages_for_query: list[TranscriptMessage],
    turn: Turn,
    *,
    withheld: AssistantMessage,
) -> State | Terminal:
    """A prompt-too-long: the cascade's next State, or the query's end (aborted meanwhile, or nothing helped)."""
    recovered = await recover_prompt_too_long(loop, run, state, messages_for_query)
    if run.setup.control.abort_reason is not None:  # aborted while compacting: the abort comes first
        return end_early(loop, run, turn, abort_terminal(True, bool(turn.tool_ids)))
    if recovered is None:
        await surface_failure(loop, run, withheld, "invalid_request")
        return Terminal(reason="prompt_too_long")
    return recovered


async def recover_cut_off(
    loop: QueryLoop,
    run: Run,
    state: State,
    messages_for_query: list[TranscriptMessage],
    turn: Turn,
    *,
    ended: CallEnded,
) -> State | Terminal | None:
    """A cut-off response (`max_tokens`, `model_context_window_exceeded`): the next State, a Terminal
    (aborted meanwhile), or None (nothing left to try: surface the withheld error).

    A `model_context_window_exceeded` whose input filled the window (`context_is_full`) goes through
    the 413 cascade's compaction first (a recovery message would have no room); otherwise, and when
    compaction cannot help, through the max-output-tokens recovery, as any cut-off does.
    """
    limits = run.setup.context_config.limits
    if ended.stop_reason == "model_context_window_exceeded" and context_is_full(ended.usage, limits):
        compacted = await recover_prompt_too_long(loop, run, state, messages_for_query)
        if run.setup.control.abort_reason is not None:
            return end_early(loop, run, turn, abort_terminal(True, False))
        if compacted is not None:
            return compacted
    return await recover_max_output_tokens(loop, run, state, messages_for_query, turn)


async def consume_summary(loop: QueryLoop, run: Run, pending: PendingSummary) -> None:
    """The previous batch's summary (`state.pending_tool_use_summary`), made while this iteration's model
    call ran; its failure costs only it.

    Claude Code awaits it "at the top of the next iteration"; it is awaited once that
    iteration's stream has ended, so that it overlaps the model call, as Claude Code's own
    rationale ("resolved during model streaming") intends.
    """
    summary: str | None = None
    with PhaseScope(run):
        try:
            summary = await pending.future
        except Exception:  # noqa: BLE001 - cancelled or failed: the summary is lost, the loop goes on
            summary = None
    if summary:
        await loop.emit(run, ToolUseSummaryEvent(summary=summary, preceding_tool_use_ids=pending.tool_use_ids))


def start_summary(loop: QueryLoop, run: Run, turn: Turn) -> PendingSummary | None:
    if not run.setup.options.tool_use_summaries or not turn.tool_ids:
        return None
    uses = [b for m in turn.assistant_messages for b in m.content if b.get("type") == "tool_use"]
    results = [
        b
        for m in turn.tool_results
        if isinstance(m, UserMessage) and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]
    future = loop.summarizer.ask(
        Summarize(
            model=run.setup.options.small_model,
            tool_uses=uses,
            results=results,
            stream_idle_timeout_s=run.setup.options.stream_idle_timeout_s,
        ),
        block=False,
    )
    return PendingSummary(future=future, tool_use_ids=list(turn.tool_ids))


def stage_collapse(loop: QueryLoop, run: Run, state: State) -> None:
    """With `context_collapse`, at the `next_turn` site: the Compactor stages a collapse of the messages
    when they may need one (it runs beside the next model call)."""
    setup = run.setup
    if collapse_may_stage(state.messages, setup.context_config.limits, run.caches.token_count):
        loop.compactor.tell(StageCollapse(messages=state.messages, config=setup.context_config))


def pipeline_due(run: Run, messages: list[TranscriptMessage]) -> bool:
    """Whether a compaction stage has work on `messages` (not on most iterations): `pipeline_needed`."""
    context = run.setup.context_config
    return pipeline_needed(
        messages,
        context.limits,
        max_tool_result_chars=context.max_tool_result_chars,
        snip_max_rounds=context.snip_max_rounds,
        scan=run.caches.oversized_scan,
        count=run.caches.token_count,
    )


async def through_pipeline(
    loop: QueryLoop, run: Run, messages: list[TranscriptMessage]
) -> list[TranscriptMessage] | Terminal:
    """`messages` through the Compactor's pipeline (`pipeline_due`): the messages to send, or how the
    query ends (aborted while compacting; the blocking limit; the rapid-refill breaker)."""
    prepared = await prepare_context(loop, run, messages)
    if prepared is not None and prepared.compact_due:  # deferred: the rapid-refill breaker, then the PreCompact hooks
        if run.refill_breaker_armed:  # the third refill in a row: no compaction, the query ends
            return RAPID_REFILL_BREAKER
        prepared = await hooked_compaction(loop, run, prepared)
    if prepared is None:
        return end_early(loop, run, None, "aborted_streaming")
    if prepared.compacted is not None:
        run.autocompact_failures = 0
        run.note_autocompaction()
        compacted = await install_compaction(loop, run, prepared.compacted, prepared.pre_compact_tokens)
        messages = messages_after_compact_boundary(compacted)
    else:
        run.autocompact_failures += prepared.autocompact_failed
        messages = prepared.messages
    if prepared.blocking:
        await loop.surface(run, api_error_message(run.model, PROMPT_TOO_LONG_ERROR_MESSAGE))
        return Terminal(reason="blocking_limit")
    return messages


async def prepare_context(loop: QueryLoop, run: Run, messages: list[TranscriptMessage]) -> Prepared | None:
    """The Compactor's pipeline over `messages`; None if aborted."""
    answer: Prepared | None = None
    with PhaseScope(run):
        try:
            hooks = run.setup.hooks
            prepare = Prepare(
                messages=messages,
                config=run.setup.context_config,
                autocompact_failures=run.autocompact_failures,
                defer_compact=run.refill_breaker_armed or (hooks is not None and hooks.has("PreCompact")),
            )
            answer = await loop.compactor.ask(prepare, block=False)
        except WorkCancelled:
            answer = None
    return None if run.setup.control.abort_reason is not None else answer


async def install_compaction(
    loop: QueryLoop, run: Run, compacted: list[TranscriptMessage], pre_tokens: int, trigger: str = "auto"
) -> list[TranscriptMessage]:
    """The compaction's messages join the conversation, then what its SessionStart and PostCompact hooks add:
    all of them, the boundary first."""
    for message in compacted:
        await loop.emit(run, message)
    if run.setup.hooks is not None:
        compacted = await after_compaction(loop, run, run.setup.hooks, compacted, trigger)
    total = run.setup.options.task_budget
    if total is not None:  # loop-local, updated on compaction only
        remaining = run.task_budget_remaining if run.task_budget_remaining is not None else total
        run.task_budget_remaining = max(0, remaining - pre_tokens)
    return compacted


async def recover_prompt_too_long(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage]
) -> State | None:
    """The prompt-too-long cascade: collapse drain (never twice in a row), then one reactive compact."""
    options = run.setup.options
    transition = state.transition
    if options.context_collapse and (transition is None or transition.reason != "collapse_drain_retry"):
        drained: Drained = await loop.compactor.ask(DrainCollapses(messages=messages_for_query), block=False)
        if drained.committed > 0:
            run.transitions.append("collapse_drain_retry")
            return collapse_drain_retry(state, drained.messages, drained.committed)
    if (
        options.reactive_compact
        and not state.has_attempted_reactive_compact
        and (run.setup.hooks is None or await pre_compact_allows(loop, run))  # a PreCompact block fails the recovery
    ):
        compacted: Compacted | None = None
        with PhaseScope(run):
            try:
                compacted = await loop.compactor.ask(
                    Compact(messages=messages_for_query, config=run.setup.context_config, trigger="reactive"),
                    block=False,
                )
            except WorkCancelled:
                compacted = None
        if compacted is not None and run.setup.control.abort_reason is None:
            run.autocompact_failures = 0  # the seed resets `autoCompactTracking` here
            installed = await install_compaction(loop, run, compacted.messages, compacted.pre_tokens)
            run.transitions.append("reactive_compact_retry")
            return reactive_compact_retry(state, installed)
    return None


async def token_budget_nudge(loop: QueryLoop, run: Run) -> UserMessage | None:
    """The token-budget gate: a meta nudge to go on, or None to stop (with its completion event)."""
    if run.setup.options.token_budget is None:
        return None
    decision = await loop.accounts.check_token_budget(run.usage.output_tokens)
    if decision.action == "continue" and decision.nudge_message is not None:
        nudge = UserMessage(content=decision.nudge_message, is_meta=True)
        await loop.emit(run, nudge)
        return nudge
    if decision.completion_event is not None:
        await loop.emit(run, SystemMessage(subtype="token_budget", data=decision.completion_event.model_dump()))
    return None


async def demand_answer(
    loop: QueryLoop,
    run: Run,
    state: State,
    messages_for_query: list[TranscriptMessage],
    turn: Turn,
    *,
    structured: StructuredAnswer,
) -> State | Terminal:
    """A failed attempt at the structured answer: sent back with the demand, or the query's end."""
    structured.failures += 1
    ended = _out_of_attempts(run, structured)
    if ended is not None:
        return ended
    demand = UserMessage(content=ENFORCEMENT_TEXT, is_meta=True)
    await loop.emit(run, demand)
    run.transitions.append("stop_hook_blocking")  # Claude Code's built-in stop hook
    return stop_hook_blocking(state, messages_for_query, turn.assistant_messages, [demand])


def settle_answer(run: Run, turn: Turn) -> Terminal | None:
    """After a tool batch: a valid `StructuredOutput` call ends the query; too many failed ones too."""
    structured = run.structured
    assert structured is not None
    uses = [b for m in turn.assistant_messages for b in m.content if b.get("type") == "tool_use"]
    answer = structured.settle_batch(uses)
    if answer is not None:
        run.structured_output = answer_json(answer)
        return COMPLETED
    return _out_of_attempts(run, structured)


def attachments_due(run: Run) -> bool:
    """Whether context can have arisen while the tools ran (not on most turns of most queries)."""
    memory_due = run.memory is not None and not run.memory_used
    return bool(run.setup.options.attachment_sources) or memory_due or run.memory_failure is not None


async def collect_attachments(loop: QueryLoop, run: Run) -> list[AttachmentMessage]:
    """Context that arose while the tools ran (`attachments_due`), injected before the next model call.

    A source that raises or returns anything but a list of attachments is skipped for this turn, as a
    failed memory prefetch is: a `hook_error` event says so and the result's `errors` names it; its
    context is lost for this turn, never the session.
    """
    if (failure := run.memory_failure) is not None:
        run.memory_failure = None
        await loop.emit(run, failure)
    messages: list[AttachmentMessage] = []
    for source in run.setup.options.attachment_sources:
        try:
            collected = checked_attachments(await source.collect())
            messages.extend(AttachmentMessage(attachment=a) for a in collected)
        except Exception as error:  # noqa: BLE001 - the host's source: a non-blocking error, as a hook's
            loop.log.opt(exception=error).warning("attachment source failed")
            await hook_error(loop, run, hook_error_message("AttachmentSource", source.collect, error))
    if run.memory is not None and not run.memory_used:
        run.memory_used = True
        messages.append(AttachmentMessage(attachment={"type": "memory", "content": run.memory}))
    for message in messages:
        await loop.emit(run, message)
    return messages


async def prefetch_memory(loop: QueryLoop, run: Run, messages: list[TranscriptMessage]) -> None:
    prefetch = run.setup.options.memory_prefetch
    assert prefetch is not None
    try:
        run.memory = checked_memory(await prefetch(messages))
    except Exception as error:  # noqa: BLE001 - the host's prefetch: a non-blocking error, as a hook's
        loop.log.opt(exception=error).warning("memory prefetch failed")
        # The prefetch runs beside the loop: its `hook_error` event waits for the loop's next
        # attachments, so it never lands in the middle of a streamed response; `errors` has it now.
        failure = hook_error_message("MemoryPrefetch", prefetch, error)
        run.add_hook_errors((failure.content,))
        run.memory_failure = failure


def _out_of_attempts(run: Run, structured: StructuredAnswer) -> Terminal | None:
    """The query's end once its failed attempts at a structured answer reach the cap, else None."""
    if attempts_exhausted(structured.failures, run.setup.options.max_structured_output_retries):
        return Terminal(reason="max_structured_output_retries", error=exhausted_text(structured.failures))
    return None
