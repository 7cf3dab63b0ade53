"""What a user builds or holds is plain Python: fresh, mutable containers as defaults, no shared frozen
empties (those stay inside the runtime, `runtime._frozen`), and a `Runtime` that holds no bound method of
itself (docs/design.md, "The hot path")."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

import queryloop
from bench import workload
from queryloop import QueryOptions, Runtime, RuntimeClosed, Tool
from queryloop.runtime.providers.scripted import ScriptedModel

_PLAIN = (list, dict, set)


def _read(_input: dict[str, Any], _ctx: object) -> str:
    return "ok"


def _exported_classes() -> list[type]:
    return [obj for name in queryloop.__all__ if isinstance(obj := getattr(queryloop, name), type)]


def _container_defaults(cls: type) -> list[tuple[str, Any, Any]]:
    """Each container default of `cls`'s fields (pydantic's or a dataclass's), made twice: (field, one, other)."""
    made: list[tuple[str, Any, Any]] = []
    fields = getattr(cls, "__pydantic_fields__", None)
    if fields is not None and not dataclasses.is_dataclass(cls):
        for name, info in fields.items():
            one = info.get_default(call_default_factory=True, validated_data={})
            if isinstance(one, _PLAIN):
                made.append((name, one, info.get_default(call_default_factory=True, validated_data={})))
    if dataclasses.is_dataclass(cls):
        for field in dataclasses.fields(cls):
            if field.default_factory is not dataclasses.MISSING:
                one = field.default_factory()
                if isinstance(one, _PLAIN):
                    made.append((field.name, one, field.default_factory()))
            elif isinstance(field.default, _PLAIN):
                made.append((field.name, field.default, field.default))
    return made


def _grow(container: Any) -> None:
    if isinstance(container, list):
        container.append("x")
    elif isinstance(container, dict):
        container["x"] = "x"
    else:
        container.add("x")


def test_a_default_options_tools_list_takes_a_tool_and_keeps_it_to_itself() -> None:
    options, other = QueryOptions(), QueryOptions()
    read = Tool(name="read", call=_read)
    options.tools.append(read)
    options.user_context["cwd"] = "/tmp"
    options.agents.clear()
    assert options.tools == [read] and options.user_context == {"cwd": "/tmp"}
    assert other.tools == [] and other.user_context == {} and QueryOptions().tools == []


def test_every_container_default_of_an_exported_class_is_a_fresh_plain_container() -> None:
    seen = 0
    for cls in _exported_classes():
        for field, one, other in _container_defaults(cls):
            seen += 1
            where = f"{cls.__name__}.{field}"
            assert type(one) in _PLAIN, f"{where} defaults to a {type(one).__name__}, not a plain container"
            assert one is not other, f"{where}: every instance shares one default"
            _grow(one)
            assert not other, f"{where}: a change to one default reached another"
    assert seen >= 10  # QueryOptions' ten, at least: the introspection found the defaults


def test_no_exported_class_takes_a_shared_container_as_a_parameter_default() -> None:
    for cls in _exported_classes():
        try:
            parameters = inspect.signature(cls).parameters.values()
        except (TypeError, ValueError):
            continue
        for parameter in parameters:
            assert not isinstance(parameter.default, _PLAIN), f"{cls.__name__}({parameter.name}=...) is shared"


async def test_a_finished_querys_transitions_are_a_plain_list_of_its_own() -> None:
    async with Runtime.open() as runtime:
        handles = []
        for _ in range(2):
            session = await runtime.open_session(QueryOptions(provider=workload.model(0), tools=workload.tools(0)))
            handles.append(session.query(workload.PROMPT))
            assert type(handles[-1].transitions) is list  # before its end too
            await handles[-1].wait()
        first, second = handles
    assert type(first.transitions) is list and first.transitions == second.transitions
    assert first.transitions is not second.transitions
    kept = list(second.transitions)
    first.transitions.append("next_turn")
    assert second.transitions == kept


async def test_a_runtime_holds_no_bound_method_of_itself() -> None:
    def bound_to(runtime: Runtime) -> list[str]:
        return [name for name, value in vars(runtime).items() if getattr(value, "__self__", None) is runtime]

    async with Runtime.open() as runtime:
        assert bound_to(runtime) == []
        session = await runtime.open_session(QueryOptions(provider=ScriptedModel([{"content": []}])))
        await session.query("hi").wait()
        assert bound_to(runtime) == []
    assert bound_to(runtime) == []


async def test_a_closed_runtime_raises_runtime_closed_not_attribute_error() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=workload.model(0), tools=workload.tools(0)))
        await session.query(workload.PROMPT).wait()
    with pytest.raises(RuntimeClosed):
        await runtime.open_session(QueryOptions(provider=workload.model(0)))
    with pytest.raises(RuntimeClosed):
        await runtime.start_group()
    with pytest.raises(RuntimeClosed):
        await runtime.open_host_budget(1.0)
