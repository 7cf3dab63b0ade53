"""`python -m bench tricks [--check]`: the hot path's speed and memory tricks, each checked in place.

A trick is how the runtime does less (fewer objects in flight, fewer task switches, fewer passes), not a
behaviour a user sees: the unit suite checks the behaviours, whichever way they are done; this checks that
each trick still holds, so that a change undoing one is seen here rather than only as a drift in the
figures of `bench loops` or `bench instructions`. Each check's docstring says what its trick saves.

Prints `{"benchmark": "tricks", "held": [...], "lost": [...]}`, each lost trick's reason on stderr;
`--check` exits with status 1 if any was lost (for CI).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import pickle
import sys
import weakref
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing, contextmanager
from types import ModuleType
from typing import Any

import trio
import trio.testing

from bench import workload
from queryloop import Runtime
from queryloop.actors.budget_guard import BudgetLedger
from queryloop.actors.compactor import context_config
from queryloop.actors.query_loop.run import Turn, add_tool_results, note_assistant
from queryloop.runtime import _records
from queryloop.runtime._frozen import EMPTY_DICT, EMPTY_LIST, EMPTY_SET
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop import context, transcript
from queryloop.runtime.loop.events import (
    NO_USAGE,
    AssistantMessage,
    AttachmentMessage,
    Block,
    StreamEvent,
    TranscriptMessage,
    Usage,
    UserMessage,
    stream_event,
)
from queryloop.runtime.loop.hooks import HookDecision, StopHookInput
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import initial_state, next_turn
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.providers.scripted import ScriptedModel, ScriptedReply, ScriptedUsage, iter_reply_events


class TrickLost(Exception):
    """A trick no longer holds: the message says what was found instead."""


def _hold(condition: bool, lost: str) -> None:
    if not condition:
        raise TrickLost(lost)


# -- builders --------------------------------------------------------------------------------------


def _text(value: str) -> Block:
    return {"type": "text", "text": value}


def _use(tool_id: str, name: str = "read") -> Block:
    return {"type": "tool_use", "id": tool_id, "name": name, "input": {}}


def _result(tool_id: str) -> Block:
    return {"type": "tool_result", "tool_use_id": tool_id, "content": "ok", "is_error": False}


def _text_reply(text: str = "Done.") -> dict[str, Any]:
    return {"content": [_text(text)], "stop_reason": "end_turn"}


def _tools_reply(*uses: Block) -> dict[str, Any]:
    return {"content": list(uses), "stop_reason": "tool_use"}


def _read_tool(result: str = "ok") -> Tool:
    async def read(_: Any, ctx: ToolContext) -> ToolOutput:
        await trio.lowlevel.checkpoint()
        return result

    return Tool(name="read", call=read, concurrency_safe=True, runs_on="trio")


def _assistant(block: Block, message_id: str = "msg_1") -> AssistantMessage:
    return AssistantMessage(message_id=message_id, model="claude-sonnet-5-5", content=[block])


@contextmanager
def _counting(module: ModuleType, name: str, note: Callable[[Any], None]) -> Iterator[None]:
    """`module.name` calls `note` with its argument, then does what it did, until the block ends."""
    real = getattr(module, name)

    def counted(argument: Any) -> Any:
        note(argument)
        return real(argument)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, real)


class _TaskRecording:
    """A provider that records which trio task streams each request, yielding to the scheduler before each
    event when `paced` (as a network read does)."""

    def __init__(self, inner: ScriptedModel, *, paced: bool = False) -> None:
        self.inner = inner
        self.paced = paced
        self.tasks: list[trio.lowlevel.Task] = []

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        self.tasks.append(trio.lowlevel.current_task())
        async with aclosing(self.inner.stream(request)) as events:
            async for event in events:
                if self.paced:
                    await trio.lowlevel.checkpoint()
                yield event


# -- fewer objects in flight -------------------------------------------------------------------------


def a_turn_without_tools_holds_the_shared_empties() -> None:
    """A turn's tool containers start as the shared empties and get their own at the first tool use or result:
    one list, one set and one list less per turn without tools (part of the census's 224 → 217 objects a
    loop in flight at C=1000)."""
    turn = Turn(EventChannel(4))
    note_assistant(turn, _assistant(_text("no tools")))
    _hold(turn.tool_ids is EMPTY_LIST, "a turn without tool uses made its own tool_ids")
    _hold(turn.pending is EMPTY_SET, "a turn without tool uses made its own pending set")
    _hold(turn.tool_results is EMPTY_LIST, "a turn without tool uses made its own tool_results")
    note_assistant(turn, _assistant(_use("toolu_1")))
    add_tool_results(turn, [UserMessage(content=[_result("toolu_1")])])
    other = Turn(EventChannel(4))
    note_assistant(other, _assistant(_use("toolu_2")))
    _hold(other.tool_results is EMPTY_LIST, "a turn's results list was made before its first result")


def the_shared_empties_stay_shared_through_copies_and_pickling() -> None:
    """A copy or an unpickled shared empty is the shared empty itself, not a new frozen container: a copied
    state or default holds no object of its own for an empty field."""
    for empty in (EMPTY_LIST, EMPTY_DICT, EMPTY_SET):
        name = type(empty).__name__
        _hold(copy.copy(empty) is empty, f"copy.copy of the shared empty {name} made a new one")
        _hold(copy.deepcopy(empty) is empty, f"copy.deepcopy of the shared empty {name} made a new one")
        _hold(pickle.loads(pickle.dumps(empty)) is empty, f"unpickling the shared empty {name} made a new one")


def a_state_is_one_object() -> None:
    """The loop's `State`, remade at every continue site, is a record of one object: no `__dict__`, no
    fields-set (a pydantic model is three objects)."""
    state = next_turn(initial_state([UserMessage(content="hi")]), [])
    _hold(not hasattr(state, "__dict__"), "a State has a __dict__")


def scripted_entries_are_slotted() -> None:
    """The scripted provider's entries are slotted pydantic dataclasses, one object each where a model is three
    (instance, `__dict__`, fields-set): part of the census's 251 → 236 objects a loop in flight."""
    model = ScriptedModel([{"content": [_text("hi")], "usage": {"input_tokens": 3}}])
    reply = model.entries[0]
    if not isinstance(reply, ScriptedReply):
        raise TrickLost(f"a reply's entry is a {type(reply).__name__}")
    _hold(not hasattr(reply, "__dict__"), "a scripted reply has a __dict__")
    _hold(not hasattr(reply.usage, "__dict__"), "a scripted usage has a __dict__")


def reply_events_are_made_one_by_one_as_they_are_taken() -> None:
    """The scripted provider makes a reply's events as the stream takes them, not a list of them all up front:
    part of the census's 224 → 217 objects a loop in flight."""
    reply = ScriptedReply(content=[_text("word " * 30), _use("t")], usage=ScriptedUsage(input_tokens=5))
    events = iter_reply_events(reply, model="m", message_id="msg", input_tokens=1)
    _hold(isinstance(events, Iterator) and not isinstance(events, list), "a reply's events are made up front")


def ledgers_share_one_zero_usage_until_they_count_a_call() -> None:
    """Every `BudgetLedger` starts on one shared zero `Usage`, and goes back to it at a query's start, until it
    counts a call: two objects less per session (part of the census's 224 → 217 objects a loop in flight)."""
    one, other = BudgetLedger(), BudgetLedger()
    _hold(one.session_usage is other.query_usage is NO_USAGE, "a new ledger made its own zero usage")
    one.account("claude-sonnet-5-5", Usage(input_tokens=10, output_tokens=2))
    _hold(other.session_usage is NO_USAGE, "counting a call in one ledger reached another's zero usage")
    one.begin_query()
    _hold(one.query_usage is NO_USAGE, "a query's start made a new zero usage")


async def a_parked_consumer_waits_in_trios_public_wait_with_no_wrapper_between() -> None:
    """A consumer parked on an `EventChannel` waits in `EventChannel.wait`, which delegates to trio's
    `wait_task_rescheduled` coroutine itself (no `__await__()` wrapper between): the fewest objects a parked
    task holds through trio's public API."""
    channel = EventChannel[int](4)

    async def consumer() -> None:
        while channel.items or await channel.wait():
            channel.take()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        task = next(iter(nursery.child_tasks))
        parked = task.coro.cr_await
        _hold(parked is not None and parked.gi_code is EventChannel.wait.__code__, "a consumer parks elsewhere")
        below = parked.gi_yieldfrom if parked is not None else None
        wait_code = trio.lowlevel.wait_task_rescheduled.__code__
        _hold(below is not None and below.cr_code is wait_code, "a wrapper sits between the channel and trio's wait")
        channel.close()


class _Echo(TrioActor):
    def double(self, value: int) -> int:
        return value * 2


async def an_actors_ref_reaches_it_through_its_inbox() -> None:
    """An actor's stopped flag is its inbox's, and its ref reaches the actor through the inbox: no flag object
    and no weakref per actor (part of the census's 236 → 224 objects a loop in flight)."""
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(_Echo)
        actor = ref._actor_weakref()  # noqa: SLF001 - how a ref reaches its actor is the trick
        _hold(isinstance(actor, _Echo), "a ref does not reach its actor")
        inbox: object = getattr(actor, "actor_inbox", None)
        _hold(ref.actor_stopped is inbox, "an actor's stopped flag is an object of its own")
        await ref.stop(block=False)
        _hold(ref._actor_weakref() is None, "a ref still reaches its stopped actor")  # noqa: SLF001


async def a_closed_runtime_is_freed_without_the_collector() -> None:
    """A `Runtime` keeps no bound method of itself and lets go of each session at its close: once closed it is
    freed by its reference count, with no cycle for the collector to find."""
    gc.disable()
    try:
        async with Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=workload.model(0), tools=workload.tools(0)))
            await session.query(workload.PROMPT).wait()
        gone = weakref.ref(runtime)
        del runtime, session
        _hold(gone() is None, "a closed runtime is kept alive by a cycle")
    finally:
        gc.enable()


# -- records ---------------------------------------------------------------------------------------


@_records.record
class _Sample:
    name: str
    tags: list[str]
    count: int = 0
    note: str = ""


@_records.record
class _Pair:
    name: str
    count: int = 0


def a_record_is_built_as_its_builder() -> None:
    """A record is one object (slots, no `__dict__`), stored as its builder (a subclass with object's
    `__setattr__`, given the record's class once its fields are stored) by `__init__` from four fields and by
    a maker from three: a 10-field record in 194 ns by a `maker` against 586 through the slot descriptors,
    658 by the class against 924. Fewer fields store through the descriptors, where the swap costs more."""
    _hold(not hasattr(_Sample(name="a", tags=[]), "__dict__"), "a record has a __dict__")
    builder = _Sample.__dict__.get("_record_builder")
    _hold(builder is not None and builder.__setattr__ is object.__setattr__, "a record has no builder")
    paths: list[tuple[str, Callable[..., Any], bool]] = [
        ("__init__ (four fields)", _Sample.__init__, True),
        ("a maker (three fields)", _records.maker(_Sample, "name", "tags"), True),
        ("a keyword_maker", _records.keyword_maker(_Sample), True),
        ("a replacer", _records.replacer(_Sample), True),
        ("__init__ (two fields)", _Pair.__init__, False),
        ("a maker (two fields)", _records.maker(_Pair, "name"), False),
    ]
    for path, function, built in paths:
        through = function.__globals__.get("_builder")
        if built:
            _hold(through is not None and through is builder, f"{path} does not build through the builder")
        else:
            _hold(through is None or through is _Pair, f"{path} builds through a builder: the swap costs more")
    _hold(type(stream_event({})) is StreamEvent, "a maker's record is not its own class")


# -- hops ------------------------------------------------------------------------------------------


async def a_querys_calls_run_in_one_model_caller_task() -> None:
    """A query's model calls run in one ModelCaller task, which waits in its feed for the next call: no message,
    task or cancel scope per call; each query has its own."""
    async with Runtime.open() as runtime:
        provider = _TaskRecording(workload.model(0))
        session = await runtime.open_session(QueryOptions(provider=provider, tools=workload.tools(0)))
        await session.query(workload.PROMPT).wait()
        _hold(len(provider.tasks) == 3, f"workload W made {len(provider.tasks)} calls, not 3")
        _hold(len(set(provider.tasks)) == 1, f"a query's three calls ran in {len(set(provider.tasks))} tasks")
        provider.inner = workload.model(0)
        await session.query(workload.PROMPT).wait()
        _hold(provider.tasks[3] is not provider.tasks[0], "a second query's calls ran in the first query's task")
        _hold(len(set(provider.tasks[3:])) == 1, "a second query's calls ran in several tasks")
        await session.close()


async def a_call_after_a_turn_ending_response_starts_a_new_task() -> None:
    """The ModelCaller's task waits for a next call only after a response that asks for one (tool uses, a
    withheld error, a fallback), so a query's last call leaves no task to wake; a call after a response that
    ended the turn (here a stop hook's feedback) starts a new one."""
    blocked: list[bool] = []

    async def stop_hook(_: StopHookInput) -> HookDecision | None:
        if blocked:
            return None
        blocked.append(True)
        return HookDecision(blocking_error="not yet")

    async with Runtime.open() as runtime:
        provider = _TaskRecording(ScriptedModel([_text_reply("first"), _text_reply("second")]))
        session = await runtime.open_session(QueryOptions(provider=provider, stop_hooks=[stop_hook]))
        await session.query("go").wait()
        await session.close()
    _hold(len(provider.tasks) == 2, f"the stop hook's turn made {len(provider.tasks)} calls, not 2")
    _hold(provider.tasks[0] is not provider.tasks[1], "a call after a turn-ending response reused a waiting task")


def _live_actors(session: Any) -> list[str]:
    return sorted(actor.name for actor in session.supervisor.actors if not actor.actor_stopped.is_set())


async def helpers_are_spawned_on_first_need() -> None:
    """A session runs on the QueryLoop, the ModelCaller and the StreamingToolExecutor alone until the context
    first needs the Compactor or a summary is asked for; the BudgetGuard's accounting is kept inline until a
    helper reports spend to it: two actors (and their inboxes and tasks) less per session of workload W."""
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=workload.model(0), tools=workload.tools(0), max_budget_usd=5.0)
        session = await runtime.open_session(options)
        await session.query(workload.PROMPT).wait()
        live = _live_actors(session)
        await session.close()
    _hold(live == ["ModelCaller", "QueryLoop", "StreamingToolExecutor"], f"a W session spawned {live}")


class _StepCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps: dict[trio.lowlevel.Task, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task] = self.steps.get(task, 0) + 1


async def a_streamed_event_costs_one_task_switch() -> None:
    """Paced, a streamed event costs the ModelCaller one step and the consumer at most one (0.67 on average:
    two events are often ready); the QueryLoop is woken per content block, never per event."""
    async with Runtime.open() as runtime:
        provider = _TaskRecording(ScriptedModel([_text_reply("x" * 48 * 200)]), paced=True)  # 200 text deltas
        session = await runtime.open_session(QueryOptions(provider=provider))
        counter = _StepCounter()
        trio.lowlevel.add_instrument(counter)
        try:
            events = 0
            async for event in session.query("go"):
                events += isinstance(event, StreamEvent)
        finally:
            trio.lowlevel.remove_instrument(counter)
        await session.close()
    _hold(events > 200, f"the reply streamed {events} events, not over 200")
    model_caller, consumer = provider.tasks[0], trio.lowlevel.current_task()
    others = sum(n for task, n in counter.steps.items() if task not in (model_caller, consumer))
    _hold(counter.steps[model_caller] <= events + 3, f"the ModelCaller took {counter.steps[model_caller]} steps")
    _hold(counter.steps[consumer] <= events, f"the consumer took {counter.steps[consumer]} steps for {events} events")
    _hold(others <= 5, f"other tasks took {others} steps: woken per event")


# -- passes ----------------------------------------------------------------------------------------


def a_turns_conversation_is_counted_once_for_both_checks() -> None:
    """Whether a collapse may stage and whether the next call needs the pipeline both compare the conversation's
    estimated tokens with a threshold: a session's `TokenCountMemo` counts the turn's conversation once for
    both (about 0.9 % of a W loop's instructions)."""
    counted: list[int] = []
    memo = context.TokenCountMemo()
    limits = context.ContextLimits(context_window=200_000, max_output_tokens=8_000)
    conversation: list[TranscriptMessage] = [UserMessage(content="a" * 400)]
    with _counting(context, "token_count_with_estimation", lambda messages: counted.append(len(messages))):
        context.collapse_may_stage(conversation, limits, memo)
        context.pipeline_needed(conversation, limits, max_tool_result_chars=10_000, snip_max_rounds=None, count=memo)
    _hold(counted == [1], f"one turn's unchanged conversation was counted {len(counted)} times")


def _tool_round(index: int, size: int = 20) -> list[TranscriptMessage]:
    return [
        AssistantMessage(
            message_id=f"msg_{index}", model="m", content=[_use(f"t{index}_r"), _use(f"t{index}_b", "bash")]
        ),
        UserMessage(content=[{**_result(f"t{index}_r"), "content": "r" * size}]),
        UserMessage(content=[{**_result(f"t{index}_b"), "content": "b" * size}]),
    ]


def the_oversized_result_scan_measures_each_message_once() -> None:
    """The scan for a tool result over the size limit looks only at what the conversation gained since the last
    call (a step that rewrote a message makes it look at the whole again): a conversation of N results costs N
    measures, not N²/2."""
    measured: list[str] = []
    scan = context.OversizedResultScan()
    conversation: list[TranscriptMessage] = [UserMessage(content="go")]
    with _counting(context, "_result_text", lambda block: measured.append(block.get("tool_use_id", ""))):
        for index in range(5):
            conversation = [*conversation, *_tool_round(index)]
            scan.found(conversation, 1_000)
        grown = len(measured)
        measured.clear()
        scan.found([UserMessage(content="go"), *conversation[2:]], 1_000)
    _hold(grown == 10, f"five rounds of two results took {grown} measures, not 10")
    _hold(len(measured) == 10, f"a rewritten conversation of ten results took {len(measured)} measures")


def a_querys_context_config_is_one_object_per_setting() -> None:
    """A query's `ContextConfig`, frozen, is made once per setting and shared by the queries of equal options
    (3.6 µs a query before)."""
    _hold(context_config(QueryOptions()) is context_config(QueryOptions()), "equal options made two configs")


def _turn(number: int, uses: int = 2) -> list[TranscriptMessage]:
    """One loop iteration's messages: a response (a text and `uses` tool uses), its results, an attachment."""
    ids = [f"t{number}_{i}" for i in range(uses)]
    return [
        AssistantMessage(message_id=f"msg_{number}", model="m", content=[_text("working")]),
        *(AssistantMessage(message_id=f"msg_{number}", model="m", content=[_use(i)]) for i in ids),
        *(UserMessage(content=[_result(i)]) for i in ids),
        AttachmentMessage(attachment={"type": "file_changed", "content": "x"}),
    ]


def _conversation(turns: int) -> list[TranscriptMessage]:
    return [UserMessage(content="start"), *(m for n in range(turns) for m in _turn(n))]


class _Calls:
    def __init__(self) -> None:
        self.count = 0

    def note(self, _: object) -> None:
        self.count += 1


def appending_to_a_conversation_normalizes_only_what_is_new() -> None:
    """The `IncrementalNormalizer` puts through the per-message normalisation only what was appended and the
    previous turn again (its response opened the last checkpoint): the same count at 61 messages as at 601,
    and a call with nothing new normalises only the last turn."""
    calls = _Calls()
    with _counting(transcript, "_api_blocks", calls.note):
        for turns in (10, 100):
            normalizer = transcript.IncrementalNormalizer()
            history = _conversation(turns)
            normalizer.normalize(history)
            for number in range(turns, turns + 20):
                history = [*history, *_turn(number)]
                calls.count = 0
                normalizer.normalize(history)
                expected = len(_turn(number)) + len(_turn(number - 1))
                _hold(calls.count == expected, f"appending a turn at {turns} turns normalised {calls.count}")
            _hold(normalizer.restarts == 0, "a growing conversation was normalised whole again")
            calls.count = 0
            normalizer.normalize(list(history))
            _hold(calls.count == len(_turn(0)), f"a call with nothing new normalised {calls.count} messages")


def _cleared(message: TranscriptMessage) -> TranscriptMessage:
    """The message with each tool result's content replaced, as microcompact does (a new message if any)."""
    if not isinstance(message, UserMessage) or not isinstance(message.content, list):
        return message
    blocks = [{**b, "content": "cleared"} if b.get("type") == "tool_result" else b for b in message.content]
    return message.model_copy(update={"content": blocks})


def a_rewritten_history_is_normalized_whole_once_then_incrementally() -> None:
    """An older message rewritten (microcompact) or retracted makes the normaliser start again from the whole
    conversation, once; appending after that is incremental again."""
    calls = _Calls()
    with _counting(transcript, "_api_blocks", calls.note):
        normalizer = transcript.IncrementalNormalizer()
        history = _conversation(50)
        normalizer.normalize(history)
        history = [_cleared(m) for m in history]
        calls.count = 0
        normalizer.normalize(history)
        _hold(calls.count == len(history) and normalizer.restarts == 1, "a rewrite was not normalised whole, once")
        history = [*history, *_turn(50)]
        calls.count = 0
        normalizer.normalize(history)
        _hold(calls.count == 2 * len(_turn(50)), f"appending after a rewrite normalised {calls.count}")
        retracted = [m for m in history if m is not history[5]]
        retracted.append(UserMessage(content="and then"))  # a tombstone: the same length as before
        calls.count = 0
        normalizer.normalize(retracted)
        _hold(calls.count == len(retracted) and normalizer.restarts == 2, "a retraction was not normalised whole")


async def a_long_query_normalizes_each_message_a_bounded_number_of_times() -> None:
    """40 tool turns in one query: each request normalises its new messages and the previous turn's, never the
    whole history (the whole at every request would be about turns × messages / 2)."""
    turns = 40
    replies = [{"content": [_text(f"step {n}"), _use(f"t{n}")], "stop_reason": "tool_use"} for n in range(turns)] + [
        _text_reply()
    ]
    calls = _Calls()
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=ScriptedModel(replies), tools=[_read_tool()], user_context={"cwd": "/repo"})
        session = await runtime.open_session(options)
        with _counting(transcript, "_api_blocks", calls.note):
            await session.query("Fix the bug").wait()
        sent = 1 + len(await session.transcript())  # the user context's message, then the conversation
        await session.close()
    _hold(calls.count <= 2 * sent, f"a query of {sent} messages normalised {calls.count}")


async def a_long_session_normalizes_each_message_a_bounded_number_of_times() -> None:
    """30 queries in one session: the session keeps one normaliser (and one context message per context), so
    each query's first request normalises only what the conversation gained since the previous query (made
    per query, about queries² messages)."""
    queries = 30
    calls = _Calls()
    async with Runtime.open() as runtime:
        model = ScriptedModel([_text_reply(f"answer {n}") for n in range(queries)])
        session = await runtime.open_session(QueryOptions(provider=model, user_context={"cwd": "/repo"}))
        with _counting(transcript, "_api_blocks", calls.note):
            for number in range(queries):
                await session.query(f"question {number}").wait()
        conversation = await session.transcript()
        await session.close()
    _hold(calls.count <= 3 * len(conversation), f"{queries} queries normalised {calls.count} messages")


async def a_long_session_scans_each_tool_result_a_bounded_number_of_times() -> None:
    """30 queries of one session, a tool call each: the oversized-result scan is the session's (as its
    normaliser is), so a query's first call measures only the results gained since the query before (per
    query, 1 + 2 + ... + 30 = 465 measures)."""
    queries = 30
    replies: list[dict[str, Any]] = []
    for number in range(queries):
        replies += [_tools_reply(_use(f"t{number}")), _text_reply(f"answer {number}")]
    measured: list[str] = []
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=ScriptedModel(replies), tools=[_read_tool()]))
        with _counting(context, "_result_text", lambda block: measured.append(block.get("tool_use_id", ""))):
            for number in range(queries):
                await session.query(f"question {number}").wait()
        await session.close()
    _hold(len(measured) <= 2 * queries, f"{queries} queries of a tool call each took {len(measured)} measures")


TRICKS: list[Callable[[], Any]] = [
    a_turn_without_tools_holds_the_shared_empties,
    the_shared_empties_stay_shared_through_copies_and_pickling,
    a_state_is_one_object,
    scripted_entries_are_slotted,
    reply_events_are_made_one_by_one_as_they_are_taken,
    ledgers_share_one_zero_usage_until_they_count_a_call,
    a_parked_consumer_waits_in_trios_public_wait_with_no_wrapper_between,
    an_actors_ref_reaches_it_through_its_inbox,
    a_closed_runtime_is_freed_without_the_collector,
    a_record_is_built_as_its_builder,
    a_querys_calls_run_in_one_model_caller_task,
    a_call_after_a_turn_ending_response_starts_a_new_task,
    helpers_are_spawned_on_first_need,
    a_streamed_event_costs_one_task_switch,
    a_turns_conversation_is_counted_once_for_both_checks,
    the_oversized_result_scan_measures_each_message_once,
    a_querys_context_config_is_one_object_per_setting,
    appending_to_a_conversation_normalizes_only_what_is_new,
    a_rewritten_history_is_normalized_whole_once_then_incrementally,
    a_long_query_normalizes_each_message_a_bounded_number_of_times,
    a_long_session_normalizes_each_message_a_bounded_number_of_times,
    a_long_session_scans_each_tool_result_a_bounded_number_of_times,
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true", help="exit with status 1 if any trick was lost (for CI)")


def hold(check: Callable[[], Any]) -> str | None:
    """Run one check (an async one under `trio.run`): None if its trick holds, else why not."""
    try:
        if inspect.iscoroutinefunction(check):
            trio.run(check)
        else:
            check()
    except Exception as error:  # noqa: BLE001 - any failure, a renamed internal included, is a lost trick
        return f"{type(error).__name__}: {error}"
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    held: list[str] = []
    lost: list[str] = []
    for check in TRICKS:
        reason = hold(check)
        if reason is None:
            held.append(check.__name__)
        else:
            lost.append(check.__name__)
            print(f"bench tricks: {check.__name__} lost ({reason})", file=sys.stderr)
    result: dict[str, Any] = {"benchmark": "tricks", "held": held, "lost": lost}
    if args.check and lost:
        print(json.dumps(result, sort_keys=True))
        msg = f"bench tricks: {len(lost)} trick(s) lost: {', '.join(lost)}"
        raise SystemExit(msg)
    return result
