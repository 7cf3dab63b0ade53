"""The factory the Ray tests' shards build their sessions with (`tests.ray_factory:options`): a spec
names a scripted conversation; the tools and the model are made inside the shard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import text_reply, tool_use, tools_reply


async def _block(args: Any, ctx: ToolContext) -> ToolOutput:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def _trace_id(args: Any, ctx: ToolContext) -> ToolOutput:
    """The trace the tool call runs in, as its output (hex), or "none"."""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else "none"


def _traced() -> None:
    """Telemetry on in this shard's process (an SDK tracer provider of its own, nothing exported)."""
    from opentelemetry.sdk.trace import TracerProvider

    from queryloop.runtime import telemetry

    if telemetry.active is None:
        telemetry.use(tracer_provider=TracerProvider())


async def _add(args: Any, ctx: ToolContext) -> ToolOutput:
    await ctx.progress("adding")
    return "5"


def options(spec: Mapping[str, Any]) -> QueryOptions:
    kind = spec.get("kind", "chat")
    tools = [
        Tool(name="block", call=_block, runs_on="trio"),
        Tool(name="add", call=_add, runs_on="trio"),
        Tool(name="trace_id", call=_trace_id, runs_on="trio"),
    ]
    if kind == "raise":
        msg = "no such agent"
        raise ValueError(msg)
    if kind == "block":  # a tool call that waits until aborted; the next query answers "next"
        replies = [tools_reply(tool_use("t1", "block")), text_reply("next")]
        if spec.get("greet"):  # a completed turn first
            replies.insert(0, text_reply("hi"))
    elif kind == "traced":  # telemetry on in the shard; the tool answers the trace it runs in
        _traced()
        replies = [tools_reply(tool_use("t1", "trace_id")), text_reply("traced")]
    elif kind == "add":
        replies = [tools_reply(tool_use("t1", "add"), text="Adding."), text_reply("2 + 3 = 5")]
    else:
        replies = [text_reply(text) for text in spec.get("replies", ["hello"])]
    return QueryOptions(provider=ScriptedModel(replies), tools=tools)
