"""What the tricks for fewer objects in flight must keep as it was: the shared empty defaults (`runtime._frozen`)
read as empty containers and refuse every change, records and scripted entries stay frozen and validated,
replies, ledgers and actors behave as before. That the tricks hold is `bench tricks`'."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from queryloop import Runtime
from queryloop.actors.budget_guard import BudgetLedger
from queryloop.actors.query_loop.run import Turn, add_tool_results, note_assistant
from queryloop.runtime._frozen import EMPTY_DICT, EMPTY_LIST, EMPTY_SET
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop.events import NO_USAGE, AssistantMessage, Usage, UserMessage
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


def test_a_continue_site_builds_its_state_as_dataclasses_replace_would() -> None:
    first = initial_state([UserMessage(content="hi")])
    second = next_turn(first, [])
    assert second == dataclasses.replace(
        first, messages=[], turn_count=2, transition=second.transition, pending_tool_use_summary=None
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        second.turn_count = 3  # type: ignore[misc]


def test_scripted_entries_are_validated() -> None:
    model = ScriptedModel([{"content": [{"type": "text", "text": "hi"}], "usage": {"input_tokens": 3}}])
    reply = model.entries[0]
    assert isinstance(reply, ScriptedReply) and isinstance(reply.usage, ScriptedUsage)
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
    assert set() == EMPTY_SET


def test_a_turn_gets_containers_of_its_own_only_for_its_tool_uses_and_results() -> None:
    turn = Turn(EventChannel(4))
    note_assistant(turn, _assistant({"type": "text", "text": "no tools"}))
    assert turn.tool_ids == [] and turn.pending == set() and turn.tool_results == []
    note_assistant(turn, _assistant({"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}))
    assert turn.tool_ids == ["toolu_1"] and turn.pending == {"toolu_1"}
    other = Turn(EventChannel(4))
    note_assistant(other, _assistant({"type": "tool_use", "id": "toolu_2", "name": "read", "input": {}}))
    assert other.tool_ids == ["toolu_2"] and turn.tool_ids == ["toolu_1"]  # each its own
    result = UserMessage(content=[{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}])
    add_tool_results(turn, [result])
    assert turn.tool_results == [result] and other.tool_results == []


def _assistant(block: dict[str, Any]) -> AssistantMessage:
    return AssistantMessage(message_id="msg_1", model="claude-sonnet-5-5", content=[block])


def test_a_replys_events_taken_one_by_one_are_the_events_of_the_whole_reply() -> None:
    reply = ScriptedReply(
        content=[
            {"type": "text", "text": "word " * 30},
            {"type": "tool_use", "id": "t", "name": "x", "input": {"a": 1}},
        ],
        usage=ScriptedUsage(
            input_tokens=5, output_tokens=7, cache_creation_input_tokens=4, cache_creation_1h_input_tokens=3
        ),
    )
    one_by_one = iter_reply_events(reply, model="m", message_id="msg", input_tokens=1)
    assert next(one_by_one)["type"] == "message_start"
    assert [*one_by_one] == reply_events(reply, model="m", message_id="msg", input_tokens=1)[1:]


def test_a_ledger_counts_its_own_calls_and_starts_each_query_at_zero() -> None:
    one, other = BudgetLedger(), BudgetLedger()
    assert one.session_usage == other.query_usage == Usage()
    one.account("claude-sonnet-5-5", Usage(input_tokens=10, output_tokens=2))
    assert one.query_usage.input_tokens == 10 and one.session_usage.input_tokens == 10
    assert Usage() == NO_USAGE and other.session_usage == other.query_usage == Usage()  # the others' zero untouched
    one.begin_query()
    assert one.query_usage == Usage() and one.session_usage.input_tokens == 10


async def test_an_actors_ref_reaches_it_until_it_stops() -> None:
    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        ref = group.spawn(_Echo)
        assert ref.is_alive() and not ref.actor_stopped.is_set()
        assert await ref.proxy().double(4) == 8
        await ref.stop(block=False)
        assert not ref.is_alive() and ref.actor_stopped.is_set()


class _Echo(TrioActor):
    def double(self, value: int) -> int:
        return value * 2
