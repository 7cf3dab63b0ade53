"""The public surface: `queryloop`, `queryloop.aio`, `queryloop.ray` and `queryloop.lowlevel` show what
their `__all__` names and nothing else, each public class and function says it is the public module's
(as trio's and httpx's do), and saying so costs nothing: what pickled, validated or subclassed before
still does. The kernel is `queryloop.lowlevel`'s, not the top level's."""

from __future__ import annotations

import dataclasses
import importlib
import pickle
import sys
import types
import typing
from typing import Any

import pydantic
import pytest

import queryloop
import queryloop.aio
import queryloop.lowlevel
from queryloop.runtime.errors import ShardLost

PUBLIC: list[types.ModuleType] = [queryloop, queryloop.aio, queryloop.lowlevel]
try:
    import queryloop.ray
except ImportError:  # the `ray` extra is not installed: its module says so (tests/e2e/test_fresh_clone.py)
    pass
else:
    PUBLIC.append(queryloop.ray)

KERNEL = {"Abort", "AbortAck", "Message", "Supervisor", "SupervisorMessage", "TrioActor", "TrioFuture"}


def _exported(module: types.ModuleType) -> list[tuple[str, str, Any]]:
    return [(module.__name__, name, getattr(module, name)) for name in module.__all__]


def _is_public_code(value: object) -> bool:
    """A class or a function: what has a `__module__` of its own to set (typing aliases and constants do not)."""
    return isinstance(value, types.FunctionType) or (
        isinstance(value, type) and not isinstance(value, types.GenericAlias)
    )


EXPORTED = [entry for module in PUBLIC for entry in _exported(module)]
CODE = [entry for entry in EXPORTED if _is_public_code(entry[2])]
ERRORS = [entry for entry in CODE if isinstance(entry[2], type) and issubclass(entry[2], BaseException)]


def _ids(entries: list[tuple[str, str, Any]]) -> list[str]:
    return [f"{module}.{name}" for module, name, _ in entries]


@pytest.mark.parametrize(("module", "name", "value"), EXPORTED, ids=_ids(EXPORTED))
def test_every_name_in_all_is_importable_from_its_module(module: str, name: str, value: object) -> None:
    namespace: dict[str, Any] = {}
    exec(f"from {module} import {name}", namespace)  # as a host spells it
    assert namespace[name] is value


@pytest.mark.parametrize("module", PUBLIC, ids=[m.__name__ for m in PUBLIC])
def test_a_public_module_shows_its_all_and_its_subpackages_only(module: types.ModuleType) -> None:
    shown = {name for name in dir(module) if not name.startswith("_")}
    subpackages = {name for name in shown if isinstance(getattr(module, name), types.ModuleType)}
    assert all(getattr(module, name).__name__ == f"{module.__name__}.{name}" for name in subpackages)
    assert shown - subpackages == set(module.__all__) - {"__version__"}
    assert len(module.__all__) == len(set(module.__all__))


@pytest.mark.parametrize(("module", "name", "value"), CODE, ids=_ids(CODE))
def test_public_classes_and_functions_say_they_are_the_public_modules(module: str, name: str, value: Any) -> None:
    # A name exported twice (`RuntimeClosed`: `queryloop` and `queryloop.aio`) says the top level's.
    home = "queryloop" if name in queryloop.__all__ else module
    assert value.__module__ == home
    assert value.__qualname__ == name
    assert getattr(sys.modules[home], name) is value  # what pickle looks up: `module.qualname`


def test_the_kernel_is_lowlevels_not_the_top_levels() -> None:
    assert KERNEL.isdisjoint(queryloop.__all__)
    assert not [name for name in KERNEL if hasattr(queryloop, name)]
    assert set(queryloop.lowlevel.__all__) >= KERNEL
    assert queryloop.lowlevel.TrioActor.__module__ == "queryloop.lowlevel"
    assert "AbortReason" in queryloop.__all__  # what a host passes to `abort()` stays at the top


def test_names_a_host_rarely_needs_live_where_they_are_defined() -> None:
    moved = {
        "AGENT_TOOL_NAME": "queryloop.runtime.loop.agents",
        "AgentInput": "queryloop.runtime.loop.agents",
        "Event": "queryloop.runtime.loop.events",
        "Sidechain": "queryloop.runtime.loop.restore",
        "reply_events": "queryloop.runtime.providers.scripted",
        "transcript_problems": "queryloop.runtime.loop.transcript",
    }
    doc = queryloop.__doc__ or ""
    for name, home in moved.items():
        assert name not in queryloop.__all__
        assert hasattr(importlib.import_module(home), name)
        assert f"`{name}`" in doc and f"`{home}`" in doc  # the docstring says where it went


@pytest.mark.parametrize(
    ("module", "name", "value"),
    CODE,
    ids=_ids(CODE),
)
def test_public_classes_and_functions_have_docstrings(module: str, name: str, value: Any) -> None:
    doc = value.__doc__ or ""
    generated = dataclasses.is_dataclass(value) and doc.startswith(f"{name}(")  # the dataclass module's own
    assert doc.strip() and not generated, f"{module}.{name} has no docstring"


def _sample(name: str, error: type[BaseException]) -> BaseException:
    """An instance as the runtime raises one: the errors whose `__init__` asks more than a message get it."""
    samples: dict[str, BaseException] = {
        "ActorCrashed": queryloop.ActorCrashed("s1", "QueryLoop", ValueError("boom")),
        "ModelError": queryloop.ModelError("overloaded", "Overloaded"),
        "NotInTrio": queryloop.NotInTrio(),
        "ScriptExhausted": queryloop.ScriptExhausted("script_exhausted", "no reply left"),
        "ShardLost": ShardLost("shard 1 died", 1, "task-1"),
        "TranscriptRefused": queryloop.TranscriptRefused("t.jsonl", "s1"),
        "TranscriptInUse": queryloop.TranscriptInUse("t.jsonl", "s1"),
        "TranscriptHoldsAnotherSession": queryloop.TranscriptHoldsAnotherSession("t.jsonl", None),
        "TranscriptDamaged": queryloop.TranscriptDamaged("t.jsonl", [3], ["line 3: not JSON"], "a tool result"),
    }
    return samples.get(name) or error("why it failed")


@pytest.mark.parametrize(
    ("module", "name", "value"),
    ERRORS,
    ids=_ids(ERRORS),
)
def test_public_errors_pickle_as_themselves(module: str, name: str, value: type[BaseException]) -> None:
    error = _sample(name, value)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is value
    assert str(again) == str(error)


def test_the_results_and_options_that_cross_ray_pickle_as_themselves() -> None:
    usage = queryloop.Usage(input_tokens=3, output_tokens=5)
    crossing = [
        queryloop.ResultMessage(
            subtype="success", is_error=False, duration_ms=1, total_cost_usd=0.5, usage=usage, num_turns=1
        ),
        queryloop.Terminal(reason="completed", turn_count=1),
        queryloop.QueryOptions(model="claude-sonnet-4-5", max_turns=3, system_prompt="Be brief."),
        queryloop.AssistantMessage(message_id="m1", model="x", content=[{"type": "text", "text": "hi"}]),
        queryloop.StreamEvent(event={"type": "ping"}),
        queryloop.UserMessage(content="hello"),
        queryloop.lowlevel.Abort(reason="user"),
        queryloop.lowlevel.AbortAck(actor="QueryLoop", cancelled_work=1),
    ]
    for value in crossing:
        again = pickle.loads(pickle.dumps(value))
        assert type(again) is type(value)
        assert again == value


def test_renamed_classes_still_resolve_their_annotations() -> None:
    # Annotations are strings (`from __future__ import annotations`), evaluated in the module `__module__`
    # names: `queryloop` must not be where `Literal` or `Block` are looked for.
    classes = [value for _, _, value in CODE if isinstance(value, type)]
    assert [cls.__name__ for cls in classes if not _hints_resolve(cls)] == []
    records = [cls for cls in classes if dataclasses.is_dataclass(cls)]
    for cls in records:  # a fresh adapter each: pydantic reads the dataclass's fields again
        pydantic.TypeAdapter(cls).json_schema()
    message = queryloop.UserMessage(content="hello")
    assert queryloop.UserMessage.model_validate(message.model_dump()) == message


def _hints_resolve(cls: type) -> bool:
    try:
        typing.get_type_hints(cls)
    except NameError:
        return False
    return True


def test_a_hosts_models_build_on_the_renamed_ones() -> None:
    class Options(queryloop.QueryOptions):
        ticket: str = "none"

    class Logged(pydantic.BaseModel):
        message: queryloop.UserMessage
        result: queryloop.Terminal

    assert Options(ticket="T-1", max_turns=2).max_turns == 2
    logged = Logged.model_validate({"message": {"content": "hi"}, "result": {"reason": "completed"}})
    assert logged.message.content == "hi"
