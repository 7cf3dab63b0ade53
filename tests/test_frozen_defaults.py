"""Objects in flight per loop: the shared empty defaults (`runtime._frozen`), shared fields-sets, slotted scripts."""

from __future__ import annotations

import copy
import pickle

import pytest

from queryloop.runtime._frozen import EMPTY_DICT, EMPTY_LIST
from queryloop.runtime.loop.events import UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import initial_state, next_turn
from queryloop.runtime.providers.scripted import ScriptedModel, ScriptedReply, ScriptedUsage


def test_default_lists_and_dicts_of_options_are_shared_and_read_as_empty() -> None:
    one, other = QueryOptions(), QueryOptions()
    assert one.tools is other.tools is EMPTY_LIST
    assert one.agents is other.agents is EMPTY_DICT
    assert one.tools == [] and one.stop_hooks == [] and one.user_context == {} and one.agents == {}
    assert isinstance(one.tools, list) and isinstance(one.user_context, dict)
    assert one.model_dump()["stop_hooks"] == [] and '"user_context":{}' in one.model_dump_json()


def test_a_shared_empty_default_refuses_every_change() -> None:
    options = QueryOptions()
    for change in (
        lambda: options.tools.append(object()),  # type: ignore[arg-type]
        lambda: options.stop_hooks.extend([]),
        lambda: options.mcp_servers.insert(0, "x"),
        lambda: options.user_context.update(a="b"),
        lambda: options.agents.setdefault("x", None),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match="shared empty default"):
            change()
    with pytest.raises(TypeError):
        options.system_context["a"] = "b"
    with pytest.raises(TypeError):
        options.mcp_servers += ["x"]  # type: ignore[misc]
    assert EMPTY_LIST == [] and EMPTY_DICT == {}


def test_shared_empty_defaults_stay_shared_through_copies_and_pickling() -> None:
    options = QueryOptions()
    assert copy.copy(EMPTY_LIST) is EMPTY_LIST and copy.deepcopy(EMPTY_DICT) is EMPTY_DICT
    assert pickle.loads(pickle.dumps(EMPTY_LIST)) is EMPTY_LIST
    assert pickle.loads(pickle.dumps(EMPTY_DICT)) is EMPTY_DICT
    assert copy.deepcopy(options).tools is EMPTY_LIST
    # Options made again from their fields (a query's overrides) get lists of their own, as given ones do.
    remade = QueryOptions.model_validate({**dict(options), "max_turns": 3})
    assert remade.tools == [] and remade.tools is not EMPTY_LIST
    assert type(remade.tools) is list


def test_states_built_by_the_continue_sites_share_their_fields_sets() -> None:
    first = initial_state([UserMessage(content="hi")])
    second = next_turn(first, [])
    third = next_turn(second, [])
    assert second.__pydantic_fields_set__ is third.__pydantic_fields_set__
    assert second.model_fields_set >= {"messages", "turn_count", "transition"}
    # pydantic's own copy copies the set before it adds to it: the shared one never changes.
    copied = third.model_copy(update={"stop_hook_active": True})
    assert "stop_hook_active" in copied.model_fields_set
    assert copied.__pydantic_fields_set__ is not second.__pydantic_fields_set__


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
