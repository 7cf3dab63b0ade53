"""A tool's definition is checked when the tool is made, naming it: never at the first call, never as a
request the Messages API refuses for the whole query."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from pydantic import BaseModel

from queryloop import Tool, ToolContext, tool
from queryloop.runtime.loop.tools import TOOL_NAME


class Args(BaseModel):
    text: str


async def call(args: Any, ctx: ToolContext) -> str:
    return "ok"


@pytest.mark.parametrize("name", ["has space!", "x" * 129, "", "dotted.name", "ünïcode", "slash/name"])
def test_a_tool_name_the_messages_api_refuses_is_refused_when_the_tool_is_made(name: str) -> None:
    with pytest.raises(ValueError, match="a tool's name must be 1 to 128 ASCII letters, digits, '_' or '-'"):
        Tool(name=name, call=call)
    with pytest.raises(ValueError, match="a tool's name must be"):
        tool(name=name)(call)


def test_the_refusal_names_the_tool_and_a_long_one_by_its_beginning_and_length() -> None:
    with pytest.raises(ValueError, match=r"tool 'has space!'"):
        Tool(name="has space!", call=call)
    with pytest.raises(ValueError, match=r"tool 'yyyyyyyy.*\.\.\. \(200 characters\)"):
        Tool(name="y" * 200, call=call)


@pytest.mark.parametrize("name", ["a", "x" * 128, "read_file", "mcp__srv__a-b", "A1_-z"])
def test_every_name_of_the_api_rule_is_accepted(name: str) -> None:
    assert Tool(name=name, call=call).name == name
    assert TOOL_NAME.fullmatch(name)


def test_a_lambda_must_be_given_a_name() -> None:
    with pytest.raises(ValueError, match=r"tool '<lambda>'.*name="):
        tool(lambda args, ctx: "x")


def test_a_function_that_cannot_take_args_and_ctx_is_refused_when_decorated() -> None:
    with pytest.raises(TypeError, match=r"tool 'no_ctx': its function is called as fn\(args, ctx\)"):

        @tool(description="forgot ctx")  # type: ignore[arg-type]  # mypy sees it too: the overloads say (args, ctx)
        async def no_ctx(args: Args) -> str:
            return args.text

    with pytest.raises(TypeError, match=r"tool 'needs_three'"):

        @tool  # type: ignore[arg-type]
        def needs_three(args: Args, ctx: ToolContext, extra: int) -> str:
            return args.text

    with pytest.raises(TypeError, match=r"tool 'keyword_only'"):

        @tool  # type: ignore[arg-type]
        async def keyword_only(args: Args, *, ctx: ToolContext) -> str:
            return args.text

    async def no_args() -> str:
        return ""

    with pytest.raises(TypeError, match=r"tool 'direct'.*cannot take them"):
        Tool(name="direct", call=no_args)


def test_every_shape_that_takes_args_and_ctx_is_accepted() -> None:
    async def star(*args: Any) -> str:
        return ""

    async def defaults(args: Any, ctx: Any = None, more: int = 1) -> str:
        return ""

    async def three(prefix: str, args: Any, ctx: ToolContext) -> str:
        return prefix

    class Method:
        async def run(self, args: Any, ctx: ToolContext) -> str:
            return ""

    for fn in (star, defaults, functools.partial(three, "p"), Method().run):
        assert Tool(name="shaped", call=fn).name == "shaped"


@pytest.mark.parametrize("timeout_s", [0, -1, -0.5, float("nan")])
def test_a_timeout_not_above_zero_is_refused_naming_the_tool(timeout_s: float) -> None:
    with pytest.raises(ValueError, match=r"tool 'slow': timeout_s must be above 0"):
        Tool(name="slow", call=call, timeout_s=timeout_s)
    with pytest.raises(ValueError, match=r"tool 'slow': timeout_s must be above 0"):
        tool(name="slow", timeout_s=timeout_s)(call)


def test_a_positive_timeout_or_none_is_accepted() -> None:
    assert Tool(name="t", call=call, timeout_s=0.001).timeout_s == 0.001
    assert Tool(name="t", call=call).timeout_s is None


def test_a_bare_tool_decorator_makes_a_tool_with_the_defaults() -> None:
    @tool
    async def shout(args: Args, ctx: ToolContext) -> str:
        """Say it louder."""
        return args.text.upper()

    assert isinstance(shout, Tool)
    assert (shout.name, shout.description, shout.input_model) == ("shout", "Say it louder.", Args)
    assert (shout.concurrency_safe, shout.timeout_s, shout.runs_on) == (False, None, None)
    assert not shout.runs_in_thread

    @tool
    def count(args: Args, ctx: ToolContext) -> str:
        return str(len(args.text))

    assert count.runs_in_thread and count.name == "count"
