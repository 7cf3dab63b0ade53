"""Fewer objects in flight per loop (what every young collection walks): the shared empty defaults
(`runtime._frozen`), shared fields-sets and zero usage, slotted scripts made event by event, consumers parked
in one generator, actors without a stopped-flag object or a weakref."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
import trio.testing

from queryloop import Runtime
from queryloop.actors.budget_guard import BudgetLedger
from queryloop.actors.query_loop.run import Turn, add_tool_results, note_assistant
from queryloop.runtime._frozen import EMPTY_DICT, EMPTY_LIST, EMPTY_SET
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop.events import NO_USAGE, AssistantMessage, Usage, UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import initial_state, next_turn
from queryloop.runtime.providers.scripted import (
    ScriptedModel,
    ScriptedReply,
    ScriptedUsage,
    iter_reply_events,
    reply_events,
)


def test_a_shared_empty_reads_as_the_empty_container_it_is() -> None:
    assert EMPTY_LIST == [] and EMPTY_DICT == {} and set() == EMPTY_SET
    assert isinstance(EMPTY_LIST, list) and isinstance(EMPTY_DICT, dict) and isinstance(EMPTY_SET, set)
    assert not EMPTY_LIST and not EMPTY_DICT and not EMPTY_SET


def test_a_shared_empty_refuses_every_change() -> None:
    shared_list: list[object] = EMPTY_LIST
    shared_dict: dict[str, object] = EMPTY_DICT
    changes: list[Callable[[], object]] = [
        lambda: shared_list.append(object()),
        lambda: shared_list.extend([]),
        lambda: shared_list.insert(0, "x"),
        lambda: shared_dict.update(a="b"),
        lambda: shared_dict.setdefault("x", None),
    ]
    for change in changes:
        with pytest.raises(TypeError, match="shared empty default"):
            change()
    with pytest.raises(TypeError):
        shared_dict["a"] = "b"
    with pytest.raises(TypeError):
        shared_list += ["x"]
    assert EMPTY_LIST == [] and EMPTY_DICT == {}


def test_shared_empties_stay_shared_through_copies_and_pickling() -> None:
    assert copy.copy(EMPTY_LIST) is EMPTY_LIST and copy.deepcopy(EMPTY_DICT) is EMPTY_DICT
    assert pickle.loads(pickle.dumps(EMPTY_LIST)) is EMPTY_LIST
    assert pickle.loads(pickle.dumps(EMPTY_DICT)) is EMPTY_DICT


def test_a_continue_site_builds_its_state_as_dataclasses_replace_would() -> None:
    first = initial_state([UserMessage(content="hi")])
    second = next_turn(first, [])
    assert second == dataclasses.replace(
        first, messages=[], turn_count=2, transition=second.transition, pending_tool_use_summary=None
    )
    assert not hasattr(second, "__dict__")  # a record: one object a State
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.turn_count = 3  # type: ignore[misc]


def test_scripted_entries_are_slotted_and_still_validated() -> None:
    model = ScriptedModel([{"content": [{"type": "text", "text": "hi"}], "usage": {"input_tokens": 3}}])
    reply = model.entries[0]
    assert isinstance(reply, ScriptedReply) and isinstance(reply.usage, ScriptedUsage)
    assert not hasattr(reply, "__dict__") and not hasattr(reply.usage, "__dict__")
    with pytest.raises(ValueError, match="bogus"):
        ScriptedModel([{"content": [], "bogus": 1}])
    with pytest.raises(ValueError, match="stop_reason"):
        ScriptedReply(content=[], stop_reason="nope")  # type: ignore[arg-type]
    assert reply.model_dump()["usage"]["input_tokens"] == 3


def test_the_shared_empty_set_refuses_every_change() -> None:
    changes: list[Callable[[], object]] = [lambda: EMPTY_SET.add("x"), lambda: EMPTY_SET.discard("x")]
    for change in changes:
        with pytest.raises(TypeError, match="shared empty default"):
            change()
    with pytest.raises(TypeError, match="shared empty default"):
        EMPTY_SET.clear()
    assert set() == EMPTY_SET and copy.deepcopy(EMPTY_SET) is EMPTY_SET
    assert pickle.loads(pickle.dumps(EMPTY_SET)) is EMPTY_SET


def test_a_turn_gets_containers_of_its_own_only_for_its_tool_uses_and_results() -> None:
    turn = Turn(EventChannel(4))
    note_assistant(turn, _assistant({"type": "text", "text": "no tools"}))
    assert turn.tool_ids is EMPTY_LIST and turn.pending is EMPTY_SET and turn.tool_results is EMPTY_LIST
    note_assistant(turn, _assistant({"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}))
    assert turn.tool_ids == ["toolu_1"] and turn.pending == {"toolu_1"}
    other = Turn(EventChannel(4))
    note_assistant(other, _assistant({"type": "tool_use", "id": "toolu_2", "name": "read", "input": {}}))
    assert other.tool_ids == ["toolu_2"] and turn.tool_ids == ["toolu_1"]  # each its own
    result = UserMessage(content=[{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}])
    add_tool_results(turn, [result])
    assert turn.tool_results == [result] and other.tool_results is EMPTY_LIST


def _assistant(block: dict[str, Any]) -> AssistantMessage:
    return AssistantMessage(message_id="msg_1", model="claude-sonnet-5-5", content=[block])


def test_reply_events_are_made_one_by_one_as_they_are_taken() -> None:
    reply = ScriptedReply(
        content=[
            {"type": "text", "text": "word " * 30},
            {"type": "tool_use", "id": "t", "name": "x", "input": {"a": 1}},
        ],
        usage=ScriptedUsage(
            input_tokens=5, output_tokens=7, cache_creation_input_tokens=4, cache_creation_1h_input_tokens=3
        ),
    )
    lazily = iter_reply_events(reply, model="m", message_id="msg", input_tokens=1)
    assert isinstance(lazily, Iterator) and not isinstance(lazily, list)
    assert next(lazily)["type"] == "message_start"
    assert [*lazily] == reply_events(reply, model="m", message_id="msg", input_tokens=1)[1:]


def test_ledgers_share_one_zero_usage_until_they_count_a_call() -> None:
    one, other = BudgetLedger(), BudgetLedger()
    assert one.session_usage is other.query_usage is NO_USAGE
    one.account("claude-sonnet-5-5", Usage(input_tokens=10, output_tokens=2))
    assert one.query_usage.input_tokens == 10 and Usage() == NO_USAGE and other.session_usage is NO_USAGE
    one.begin_query()
    assert one.query_usage is NO_USAGE and one.session_usage.input_tokens == 10


async def test_a_consumer_parked_on_a_channel_waits_in_trios_public_wait_with_no_wrapper_between() -> None:
    channel = EventChannel[int](4)
    got: list[int] = []

    async def consumer() -> None:
        while channel.items or await channel.wait():
            got.append(channel.take())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        task = next(t for t in nursery.child_tasks)
        parked = task.coro.cr_await
        assert parked is not None and parked.gi_code is EventChannel.wait.__code__
        # `wait` delegates to trio's `wait_task_rescheduled` coroutine itself, not to its `__await__()` wrapper.
        below = parked.gi_yieldfrom
        assert below is not None and below.cr_code is trio.lowlevel.wait_task_rescheduled.__code__
        channel.send_nowait(1)
        channel.close()
    assert got == [1]


async def test_an_actors_ref_reaches_it_through_its_inbox_until_it_stops() -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(_Echo)
        actor = ref._actor_weakref()
        assert isinstance(actor, _Echo) and ref.actor_stopped is actor.actor_inbox  # type: ignore[comparison-overlap]
        assert await ref.proxy().double(4) == 8  # pykka's proxy finds the actor the same way
        await ref.stop(block=False)
        assert ref._actor_weakref() is None and not ref.is_alive() and actor.actor_stopped.is_set()


class _Echo(TrioActor):
    def double(self, value: int) -> int:
        return value * 2


async def test_a_closed_runtime_refuses_new_sessions_and_is_freed_without_the_collector() -> None:
    import gc
    import weakref

    from bench import workload
    from queryloop.runtime.errors import RuntimeClosed

    gc.disable()
    try:
        async with Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=workload.model(0), tools=workload.tools(0)))
            await session.query(workload.PROMPT).wait()
        # It holds no bound method of itself, and its sessions are gone: no cycle keeps it.
        with pytest.raises(RuntimeClosed, match="runtime is closed"):
            await runtime.open_session(QueryOptions(provider=workload.model(0)))
        with pytest.raises(RuntimeClosed):
            await runtime.open_host_budget(1.0)
        gone = weakref.ref(runtime)
        del runtime, session
        assert gone() is None
    finally:
        gc.enable()
