"""Tools: async functions with a pydantic input model, a concurrency flag, progress and a timeout.

    @tool(concurrency_safe=True, description="Read a file")
    async def read(args: ReadArgs, ctx: ToolContext) -> str:
        await ctx.progress("opening")
        return Path(args.path).read_text()

A tool returns a string or a list of content blocks. An exception (or
`ToolError`) becomes an error result wrapped in `<tool_use_error>`; so do an
unknown tool, input that fails validation, a denied permission and a timeout.
The loop goes on in every case.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from queryloop.runtime.errors import QueryloopError

ToolOutput = str | list[dict[str, Any]]


class ToolError(QueryloopError):
    """Raise from a tool to report a failure to the model as an error result."""


class ToolContext:
    """What a running tool may use: its id and a progress channel to the consumer."""

    __slots__ = ("_report", "tool_use_id")

    def __init__(self, tool_use_id: str, report: Callable[[str, Any], Awaitable[None]]) -> None:
        self.tool_use_id = tool_use_id
        self._report = report

    async def progress(self, data: Any) -> None:
        """Emit a `progress` event for this tool now."""
        await self._report(self.tool_use_id, data)


class Tool(BaseModel):
    """A tool the model may call."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    name: str
    call: Callable[[Any, ToolContext], Awaitable[ToolOutput]]
    description: str = ""
    input_model: type[BaseModel] | None = None
    concurrency_safe: bool = False
    timeout_s: float | None = None

    def api_schema(self) -> dict[str, Any]:
        """The definition sent to the Messages API."""
        schema: dict[str, Any] = (
            self.input_model.model_json_schema() if self.input_model else {"type": "object", "properties": {}}
        )
        return {"name": self.name, "description": self.description, "input_schema": schema}

    def parse_input(self, raw: dict[str, Any]) -> Any:
        """Validate the model's input; raises pydantic's `ValidationError` naming the field."""
        return self.input_model.model_validate(raw) if self.input_model else raw


def tool(
    *,
    name: str | None = None,
    description: str | None = None,
    input_model: type[BaseModel] | None = None,
    concurrency_safe: bool = False,
    timeout_s: float | None = None,
) -> Callable[[Callable[[Any, ToolContext], Awaitable[ToolOutput]]], Tool]:
    """Make a `Tool` of an `async def fn(args: SomeModel, ctx: ToolContext)`.

    The input model is `input_model`, or else read from the first parameter's hint.
    """

    def wrap(fn: Callable[[Any, ToolContext], Awaitable[ToolOutput]]) -> Tool:
        model = input_model if input_model is not None else _hinted_model(fn)
        return Tool(
            name=name or fn.__name__,
            call=fn,
            description=description if description is not None else inspect.getdoc(fn) or "",
            input_model=model,
            concurrency_safe=concurrency_safe,
            timeout_s=timeout_s,
        )

    return wrap


def _hinted_model(fn: Callable[..., Any]) -> type[BaseModel] | None:
    first = next(iter(inspect.signature(fn).parameters), None)
    if first is None:
        return None
    hint = inspect.signature(fn).parameters[first].annotation
    try:
        if isinstance(hint, str):  # postponed annotations: resolve this one hint as typing would
            hint = eval(hint, fn.__globals__)
    except NameError as error:
        msg = (
            f"tool {fn.__name__!r}: cannot resolve the type of {first!r} ({error}); "
            "define the model at module level or pass input_model="
        )
        raise TypeError(msg) from error
    return hint if isinstance(hint, type) and issubclass(hint, BaseModel) else None


class Allow(BaseModel):
    model_config = ConfigDict(frozen=True)
    behavior: Literal["allow"] = "allow"
    updated_input: dict[str, Any] | None = None


class Deny(BaseModel):
    model_config = ConfigDict(frozen=True)
    behavior: Literal["deny"] = "deny"
    message: str


PermissionResult = Allow | Deny
CanUseTool = Callable[[str, dict[str, Any]], Awaitable[PermissionResult]]
"""`await can_use_tool(tool_name, tool_input)` before every tool run."""
