"""Workload W: per loop three model calls (two tool calls, then one, then a final answer),
model latency L ms, tool latency T ms. Both the runtime and the baseline run exactly this."""

from __future__ import annotations

import asyncio
from typing import Any

import trio

from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.providers.scripted import ScriptedModel

PROMPT = "Read the two files, then write the summary."


def script(model_ms: float) -> list[dict[str, Any]]:
    return [
        {
            "content": [
                {"type": "text", "text": "I'll read both files."},
                {"type": "tool_use", "id": "toolu_a", "name": "read", "input": {"path": "a.txt"}},
                {"type": "tool_use", "id": "toolu_b", "name": "read", "input": {"path": "b.txt"}},
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 400, "output_tokens": 60},
            "latency_ms": model_ms,
        },
        {
            "content": [
                {"type": "text", "text": "Now the summary."},
                {"type": "tool_use", "id": "toolu_c", "name": "write", "input": {"path": "summary.txt", "text": "ok"}},
            ],
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 600, "output_tokens": 40},
            "latency_ms": model_ms,
        },
        {
            "content": [{"type": "text", "text": "Done: both files read and the summary written."}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 700, "output_tokens": 20},
            "latency_ms": model_ms,
        },
    ]


def model(model_ms: float) -> ScriptedModel:
    return ScriptedModel(script(model_ms), name="bench")


def tools(tool_ms: float) -> list[Tool]:
    async def read(args: Any, ctx: ToolContext) -> ToolOutput:
        await trio.sleep(tool_ms / 1000)
        return "file contents"

    async def write(args: Any, ctx: ToolContext) -> ToolOutput:
        await trio.sleep(tool_ms / 1000)
        return "written"

    # trio tools, named so: under the asyncio facade an unmarked async tool runs on asyncio.
    return [
        Tool(name="read", call=read, concurrency_safe=True, runs_on="trio"),
        Tool(name="write", call=write, runs_on="trio"),
    ]


def asyncio_tools(tool_ms: float) -> list[Tool]:
    """W's tools as an asyncio host writes them (`bench loops --host asyncio --tools asyncio`)."""

    async def read(args: Any, ctx: ToolContext) -> ToolOutput:
        await asyncio.sleep(tool_ms / 1000)
        return "file contents"

    async def write(args: Any, ctx: ToolContext) -> ToolOutput:
        await asyncio.sleep(tool_ms / 1000)
        return "written"

    return [
        Tool(name="read", call=read, concurrency_safe=True, runs_on="asyncio"),
        Tool(name="write", call=write, runs_on="asyncio"),
    ]
