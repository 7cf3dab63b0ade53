"""The model phase: one model call and its tools, as steps of the query (functions of the `QueryLoop`).

`model_phase` hands the call to the ModelCaller's task for the query (`CallFeed`, via `call_once`),
waits on the turn's channel, and dispatches each item (assistant messages, tool results, progress, the
call's end, the gate of a call its PreToolUse hooks deferred, opened once the response is whole) as it
arrives; a fallback (or a refusal, with a fallback model) retries it with the same State. That wait has no
cancel scope: an abort wakes it (`Run.abort`) and the loop stops dispatching; the ending takes what is left
(`drain_in_ending`). Every event goes through the loop's emission
(`QueryLoop.emit`, which may wait for a slow consumer, or `QueryLoop.emit_now`, for an ending): a
transcript message joins the conversation as it is emitted, a tool result once its response is whole
(`close_response`).

Each step takes what it works on explicitly: the loop (the actor: its helpers, conversation and
emission), the query's `Run`, and the turn or State at hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.model_caller import CallEnded, ConsumerGone, RetryAnnounced, start_call
from queryloop.actors.query_loop.messages import Forwarded
from queryloop.actors.query_loop.run import (
    BudgetExceeded,
    QueryPhase,
    Run,
    Turn,
    accept_result,
    note_assistant,
    task_budget_of,
    turn_done,
    wait_for_room,
)
from queryloop.actors.tool_executor import Discard, ResponseGate, ToolResult, begin_turn
from queryloop.runtime.errors import WorkCancelled
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop.events import (
    AssistantMessage,
    ProgressEvent,
    StreamRequestStart,
    SystemMessage,
    TombstoneEvent,
    TranscriptMessage,
    Usage,
)
from queryloop.runtime.loop.model import ModelError, ModelRequest, model_request
from queryloop.runtime.loop.state import State
from queryloop.runtime.loop.transcript import strip_signature_blocks

if TYPE_CHECKING:
    from queryloop.actors.query_loop.loop import QueryLoop

TURN_BUFFER = 256
"""Items a model call and its tools may queue before they wait for the loop (backpressure)."""


async def model_phase(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage]
) -> tuple[Turn, list[TranscriptMessage]]:
    """One model call; a fallback retries it here with the same State (a bare continue, as in Claude Code's loop).

    A `refusal` switches to the fallback model too, when one is set (the API's advice: a refused
    conversation sent again as is is refused again); without one, the query ends as a refusal.
    """
    while True:
        turn = await call_once(loop, run, state, messages_for_query)
        ended = turn.ended
        if ended is None or run.setup.control.abort_reason is not None:
            return turn, messages_for_query
        refused = ended.stop_reason == "refusal"
        if not (ended.fallback or refused):
            return turn, messages_for_query
        fallback = run.setup.options.fallback_model
        if fallback is None or fallback == run.model:
            if not refused:
                why = f"{run.model} is currently unavailable. (fallback requested, but no fallback_model is set)"
                turn.ended = CallEnded(error=ModelError("model_unavailable", why))
            return turn, messages_for_query
        if loop.transcript is not None:  # logged as held already: retracted there too
            for message in turn.held_results or ():
                loop.transcript.append(TombstoneEvent(message_uuid=message.uuid))
        turn.held_results = None  # results of the abandoned response go with it
        for message in [*turn.assistant_messages, *turn.tool_results]:
            await loop.emit(run, TombstoneEvent(message_uuid=message.uuid))
        loop.executor.tell(Discard())
        previous, run.model = run.model, fallback
        messages_for_query = strip_signature_blocks(messages_for_query)
        why = "refused the request" if refused else "is unavailable"
        await loop.emit(
            run,
            SystemMessage(
                subtype="model_fallback",
                content=f"Switched to {fallback} because {previous} {why}",
                data={"from": previous, "to": fallback, "reason": "refusal" if refused else "overloaded"},
            ),
        )


async def call_once(loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage]) -> Turn:
    channel: EventChannel[Any] = EventChannel(TURN_BUFFER)
    turn = Turn(channel)
    run.turn, run.turn_count = turn, state.turn_count
    setup = run.setup
    control = setup.control
    if control.abort_reason is not None:
        return turn  # aborted before the request: nothing is started
    await loop.emit(run, StreamRequestStart())
    options = setup.options
    turn_setting = begin_turn(
        sink=channel,
        tools=setup.tools,
        can_use_tool=setup.can_use_tool,
        permissions=setup.permissions,
        agent_id=loop.agent[0] if loop.agent is not None else None,
        hooks=setup.hooks,
        control=control,
    )
    call = start_call(
        request=request(run, state, messages_for_query),
        sink=channel,
        events=setup.sink,
        progress=turn.progress,
        turn=turn_setting,
        max_retries=options.max_retries,
        fallback_available=options.fallback_model is not None and options.fallback_model != run.model,
        feed=run.calls,
        transcript=loop.transcript,
    )
    if loop.transcript is not None:
        try:
            loop.transcript.write()  # what the request carries is in the file before it goes out
        except OSError as error:  # a full disk: wait for room (past the bound, the query ends: it raises)
            await wait_for_room(run, loop.transcript, error)
            if run.disk_error is not None:
                return turn  # an abort cut the wait: no request goes out, the ending is the abort's
    if run.calls.accepting:
        run.calls.feed(call)  # to the ModelCaller's task for this query: no message, no new task
    else:
        loop.model_caller.tell(call)  # the query's first call (or the first since an abort cut its task)
    # No cancel scope: an abort wakes the wait below (`Run.abort`), and the loop stops dispatching at
    # once; what the turn still holds is taken by the ending (`drain_in_ending`). The only other waits
    # here are shielded (a slow consumer, a transcript flush) or a host budget's answer, which the
    # abort cancels too.
    items = channel.items
    while run.terminal is None and control.abort_reason is None:
        if not items:
            run.phase = QueryPhase.AWAITING_TURN
            try:
                await channel.wait()  # one wakeup takes the whole burst that arrived meanwhile
            finally:
                if run.phase is QueryPhase.AWAITING_TURN:  # else an abort has ended the query meanwhile
                    run.phase = QueryPhase.RUNNING
            continue
        item = items.popleft()  # `channel.take()` written out (`EventChannel`'s note)
        if channel.waiting_senders:
            channel.admit_waiting_sender()
        if type(item) is AssistantMessage:  # most items: the consumer has it; recorded here, nothing awaited
            take_block(loop, run, turn, item)
        else:
            await dispatch(loop, run, turn, item)
        if turn_done(turn):  # only an item changes it: a fresh turn is not done, and a wait changes nothing
            break
    return turn


def request(run: Run, state: State, messages_for_query: list[TranscriptMessage]) -> ModelRequest:
    setup = run.setup
    options = setup.options
    context = setup.context_message
    messages = messages_for_query if context is None else [context, *messages_for_query]
    return model_request(  # a record: built from parts already valid, nothing copied
        model=run.model,
        system=setup.system,
        messages=run.caches.normalizer.normalize(messages),  # only what is new since the last call (its docstring)
        tools=setup.tool_schemas,
        max_tokens=state.max_output_tokens_override or options.max_output_tokens,
        thinking=options.thinking,
        task_budget=task_budget_of(run),
        effort=options.effort,
        purpose="main",
        stream_idle_timeout_s=options.stream_idle_timeout_s,
    )


async def dispatch(loop: QueryLoop, run: Run, turn: Turn, item: Any) -> None:
    """An item of the turn channel other than a block's message (`call_once` takes those: `take_block`)."""
    kind = type(item)
    if kind is ProgressEvent or kind is SystemMessage:
        await loop.emit(run, item)
    elif kind is ConsumerGone:
        run.consumer_open = False  # the consumer went away: that is an abort by the user
        run.abort("user")
    elif kind is ToolResult:
        for message in accept_result(run, turn, item):
            await loop.emit(run, message, of_turn=turn)
        if item.interrupt:  # `can_use_tool` denied it with `interrupt`: the query ends as a user's interrupt
            run.abort("user")
    elif kind is CallEnded:
        await charge_call(loop, run, turn, item)
    elif kind is Forwarded:  # a subagent's event, tagged: to the consumer only (its own log has it)
        await loop.emit(run, item.event, record=False)
    elif kind is RetryAnnounced:  # the consumer and the log have it already
        loop.keep(run, item.message, None, True)
    elif kind is ResponseGate:  # a call its PreToolUse hooks deferred asks how many calls the turn has
        if turn.response_closed:
            item.open(len(turn.tool_ids))
        elif turn.gates is None:
            turn.gates = [item]
        else:
            turn.gates.append(item)


async def charge_call(loop: QueryLoop, run: Run, turn: Turn, ended: CallEnded) -> None:
    """The call has ended: its usage to the query's accounts (kept for the end where no cap needs it now);
    a cap reached ends the query (`BudgetExceeded`)."""
    usage = end_call(loop, run, turn, ended)
    if usage is None:
        return
    accounts = loop.accounts
    if accounts.defers(run.setup.options):
        run.unsettled.append((run.model, usage))  # no cap to check: accounted once, when the query ends
        return
    try:
        status = await accounts.charge(run.model, usage)
    except WorkCancelled:  # a BudgetGuard's answer, cut by the abort
        if run.setup.control.abort_reason is None:
            raise
        return  # the call is recorded, the query ends aborted
    run.cost_usd = status.query_cost_usd
    if status.exceeded:
        run.budget_exceeded = True
        if run.phase < QueryPhase.ENDING:
            raise BudgetExceeded


def take_block(loop: QueryLoop, run: Run, turn: Turn, message: AssistantMessage) -> None:
    """A block's message, which the ModelCaller has given to the consumer already: the turn and the
    conversation take it (`QueryLoop.emit` with `sent`, without its coroutine)."""
    note_assistant(turn, message)
    loop.keep(run, message, None, True)
    if run.budget_exceeded and run.phase < QueryPhase.ENDING:  # a subagent's spend reached the cap meanwhile
        raise BudgetExceeded


def drain_in_ending(loop: QueryLoop, run: Run, turn: Turn) -> None:
    """`dispatch` for what a turn cut short has queued: nothing waits (the ending's events are
    few, they go past the consumer's bound), and the call's usage is settled with the query."""
    channel = turn.channel
    while channel.items:
        item = channel.take()
        kind = type(item)
        if kind is AssistantMessage:
            note_assistant(turn, item)
            loop.emit_now(run, item, sent=True)
        elif kind is ToolResult:
            for message in accept_result(run, turn, item):
                loop.emit_now(run, message, of_turn=turn)
        elif kind is CallEnded:
            usage = end_call(loop, run, turn, item)
            if usage is not None:
                run.unsettled.append((run.model, usage))
        elif kind is ConsumerGone:
            run.consumer_open = False
        elif kind is RetryAnnounced:
            loop.keep(run, item.message, None, True)
        elif kind is ResponseGate:
            pass  # never opened: the call's work waits for the helpers' stop, which ends it
        elif kind is Forwarded:
            if run.consumer_open:
                try:
                    run.setup.sink.push(item.event)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    run.consumer_open = False
        else:  # progress and system messages produced before the cut
            loop.emit_now(run, item)


def end_call(loop: QueryLoop, run: Run, turn: Turn, ended: CallEnded) -> Usage | None:
    """The call's last item: its response is whole; the usage to record, if it reached its end."""
    turn.ended = ended
    close_response(loop, turn)
    gates = turn.gates
    if gates is not None and ended.error is None and not ended.fallback:  # a whole response: deferred calls go on
        turn.gates = None
        for gate in gates:
            gate.open(len(turn.tool_ids))
    if ended.stop_reason is None:
        if ended.error is not None:
            run.api_error_status = ended.error.status
        return None
    run.last_stop_reason = ended.stop_reason
    turn.usage_recorded = True
    run.usage = run.usage + ended.usage
    return ended.usage


def close_response(loop: QueryLoop, turn: Turn) -> None:
    """The response has no more blocks: the results held back join the conversation after it."""
    turn.response_closed = True
    held = turn.held_results
    if held is None:
        return
    loop.conversation.extend(held)  # their records are in the log already, held: released there too
    if loop.transcript is not None:
        loop.transcript.release()
    turn.held_results = None
