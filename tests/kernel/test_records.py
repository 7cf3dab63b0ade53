"""Records: events and actor messages are frozen slotted dataclasses built without validation, and
pydantic still has their schema where data enters or leaves."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Literal

import pydantic
import pytest
import trio

import queryloop.actors  # noqa: F401 - every actor module declares its messages on import
from queryloop import Runtime, ScriptedModel
from queryloop.runtime._records import maker, record
from queryloop.runtime.kernel.messages import Abort, AbortAck, CarrierMessage, Message, Shutdown, SupervisorMessage
from queryloop.runtime.loop.events import (
    AssistantMessage,
    Event,
    QueryEvent,
    ResultMessage,
    StreamEvent,
    SystemMessage,
    TranscriptMessage,
    Usage,
    UserMessage,
    stream_event,
    usage_of,
)
from queryloop.runtime.loop.options import QueryOptions


@record
class Sample:
    kind: Literal["sample"] = "sample"
    name: str
    tags: list[str] = dataclasses.field(default_factory=list)
    count: int = 0


def test_a_record_stores_its_arguments_and_applies_defaults_as_a_dataclass_does() -> None:
    sample = Sample(name="a")
    assert (sample.kind, sample.name, sample.tags, sample.count) == ("sample", "a", [], 0)
    assert Sample(name="b").tags is not Sample(name="b").tags  # a factory per instance, never a shared default
    tags = ["x"]
    assert Sample(name="c", tags=tags, count=2).tags is tags  # stored as given: no copy, no validation
    assert Sample(name="a") == Sample(name="a")
    assert Sample(name="a") != Sample(name="a", count=1)
    assert repr(Sample(name="a")) == "Sample(kind='sample', name='a', tags=[], count=0)"
    make: Any = Sample
    with pytest.raises(TypeError):
        make()
    with pytest.raises(TypeError):
        make(name="a", nmae="b")
    with pytest.raises(TypeError):
        make("a")  # keyword-only


def test_a_record_is_frozen() -> None:
    sample = Sample(name="a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.name = "b"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del sample.name
    assert dataclasses.replace(sample, count=3) == Sample(name="a", count=3)


def test_a_makers_record_equals_the_class_calls_and_is_frozen_as_well() -> None:
    raw = {"type": "ping"}
    made = stream_event(raw, "s1")
    assert made == StreamEvent(event=raw, uuid=made.uuid, session_id="s1")
    assert type(made) is StreamEvent
    assert made.event is raw  # the provider's dict, shared
    assert made.uuid != stream_event(raw).uuid  # each its own, as the SDK's
    assert made.model_dump() == StreamEvent(event=raw, uuid=made.uuid, session_id="s1").model_dump()
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.parent_tool_use_id = "t1"  # type: ignore[misc]
    assert usage_of(1, 2, 3, 4) == Usage(
        input_tokens=1, output_tokens=2, cache_creation_input_tokens=3, cache_read_input_tokens=4
    )
    assert Usage(input_tokens=1, output_tokens=2) + Usage(input_tokens=5, cache_read_input_tokens=7) == usage_of(
        6, 2, 0, 7
    )
    assert maker(Sample, "name", "tags")("a", ["x"]) == Sample(name="a", tags=["x"])


def test_a_record_ends_as_its_own_frozen_class_whichever_way_it_is_built_and_a_plain_subclass_as_itself() -> None:
    # However a record is stored (`__init__`, a `maker`; through its builder or not, which `bench tricks`
    # checks), nothing of the way may show: its class is its own and it is frozen.
    made: list[Any] = [Sample(name="a"), maker(Sample, "name", "tags")("a", []), stream_event({}), usage_of(1, 2, 3, 4)]
    assert [type(m) for m in made] == [Sample, Sample, StreamEvent, Usage]
    for record_made in made:
        name = dataclasses.fields(record_made)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record_made, name, None)
    assert made[0] == made[1] == Sample(name="a", tags=[])

    class Tagged(Sample):  # not a record itself: it has a `__dict__`, which the builder's layout lacks
        pass

    tagged = Tagged(name="t", count=2)
    assert type(tagged) is Tagged
    assert (tagged.name, tagged.tags, tagged.count) == ("t", [], 2)


def test_a_maker_refuses_a_field_without_a_plain_default_or_one_the_record_lacks() -> None:
    with pytest.raises(TypeError, match="tags has no plain default"):
        maker(Sample, "name")  # a field made by a factory must be given
    with pytest.raises(TypeError, match="no field"):
        maker(Sample, "name", "tags", "colour")


def test_events_keep_their_type_defaults_and_uuids() -> None:
    first, second = UserMessage(content="hi"), UserMessage(content="hi")
    assert first.type == "user" and not first.is_meta
    assert first.uuid != second.uuid
    assert isinstance(first, Event)
    assert SystemMessage(subtype="hook_error").label == "system:hook_error"
    raw: dict[str, Any] = {"type": "ping"}
    assert StreamEvent(event=raw).event is raw  # the provider's own dict, not a copy
    assert Usage(input_tokens=1, output_tokens=2) + Usage(output_tokens=3) == Usage(input_tokens=1, output_tokens=5)


def test_model_dump_is_a_new_tree_and_model_validate_reads_it_back() -> None:
    usage = Usage(input_tokens=4)
    message = AssistantMessage(message_id="m", model="x", content=[{"type": "text", "text": "hi"}], usage=usage)
    dumped = message.model_dump()
    assert dumped == {
        "type": "assistant",
        "uuid": message.uuid,
        "message_id": "m",
        "model": "x",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": None,
        "usage": {
            "input_tokens": 4,
            "output_tokens": 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_1h_input_tokens": 0,
        },
        "is_api_error": False,
        "parent_tool_use_id": None,
        "session_id": "",
    }
    assert dumped["content"][0] is not message.content[0]
    assert json.loads(message.model_dump_json()) == message.model_dump(mode="json") == dumped
    assert AssistantMessage.model_validate(dumped) == message
    assert pydantic.TypeAdapter(TranscriptMessage).validate_python(dumped) == message
    result = ResultMessage(
        subtype="success", is_error=False, duration_ms=1, total_cost_usd=0.5, usage=usage, num_turns=1
    )
    assert pydantic.TypeAdapter(QueryEvent).validate_json(result.model_dump_json()) == result
    assert message.model_copy(update={"content": []}).content == []
    assert message.model_copy(update={"content": []}).uuid == message.uuid
    assert Usage.model_construct(input_tokens=2) == Usage(input_tokens=2)


def test_validation_refuses_what_the_models_refused() -> None:
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(TranscriptMessage)
    with pytest.raises(pydantic.ValidationError):
        adapter.validate_python({"type": "user", "content": "x", "bogus": 1})
    with pytest.raises(pydantic.ValidationError):
        adapter.validate_python({"type": "user", "content": 3})
    with pytest.raises(pydantic.ValidationError):
        UserMessage.model_validate({"type": "assistant", "content": "x"})
    # A usage object tolerates unknown counts, as the model did (its own config, not the event's).
    loaded = AssistantMessage.model_validate(
        {"message_id": "m", "model": "x", "content": [], "usage": {"input_tokens": 1, "server_tool_use": {}}}
    )
    assert loaded.usage == Usage(input_tokens=1)
    schema = UserMessage.model_json_schema()
    assert schema["required"] == ["content"] and schema["additionalProperties"] is False


def _subclasses(cls: type[Any]) -> list[type[Any]]:
    """Declared subclasses (a slotted dataclass replaces the class it was made from: that one is left out)."""
    found: list[type[Any]] = []
    for sub in cls.__subclasses__():
        if getattr(sys.modules[sub.__module__], sub.__qualname__, None) is sub:
            found += [sub, *_subclasses(sub)]
    return found


def test_every_actor_message_is_a_record_and_only_supervisor_messages_are_validated() -> None:
    messages = [cls for cls in _subclasses(Message) if cls.__module__.startswith("queryloop.")]
    assert AbortAck in messages and Abort in messages
    for cls in messages:
        if cls is CarrierMessage or cls is SupervisorMessage:
            continue  # bases
        if issubclass(cls, SupervisorMessage):
            assert issubclass(cls, pydantic.BaseModel), cls
        else:
            assert dataclasses.is_dataclass(cls) and "__slots__" in vars(cls), cls
            assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
    assert isinstance(Abort(reason="user"), Message) and isinstance(Shutdown(), SupervisorMessage)


async def test_a_hosts_prompt_is_validated_where_it_enters() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=ScriptedModel([])))
        with pytest.raises(pydantic.ValidationError):
            session.query(42)  # type: ignore[arg-type]
        with trio.fail_after(5):  # refused before anything changed: no query is left to wait for
            await session.close()
