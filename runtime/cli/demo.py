"""The offline demo: a scripted model driving real, safe tools confined to a root directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from pydantic import BaseModel, Field

from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError, tool
from queryloop.runtime.providers.scripted import ScriptedModel


class PathArgs(BaseModel):
    path: str = Field(default=".", description="A path relative to the working directory")


def confined(root: Path, relative: str) -> Path:
    """`relative` resolved inside `root` (symlinks followed); anything outside is refused."""
    base = root.resolve()
    target = (base / relative).resolve()
    if not target.is_relative_to(base):
        msg = f"{relative!r} is outside the working directory"
        raise ToolError(msg)
    return target


def demo_tools(root: Path, delay_s: float = 0.0) -> list[Tool]:
    """`list_files`, `read_file` and `count_lines`, each refusing paths outside `root`.

    `delay_s` makes each tool take that long (with progress), to watch them run and to try Ctrl+C.
    """

    async def pace(ctx: ToolContext, what: str) -> None:
        steps = 4
        for step in range(steps):
            await ctx.progress(f"{what} {100 * step // steps}%")
            await trio.sleep(delay_s / steps)

    @tool(concurrency_safe=True, description="List the entries of a directory")
    async def list_files(args: PathArgs, ctx: ToolContext) -> str:
        target = confined(root, args.path)
        await pace(ctx, f"listing {args.path}")
        entries = await trio.to_thread.run_sync(lambda: sorted(p.name for p in target.iterdir()))
        return "\n".join(entries)

    @tool(concurrency_safe=True, description="Read a text file (first 2,000 characters)")
    async def read_file(args: PathArgs, ctx: ToolContext) -> str:
        target = confined(root, args.path)
        await pace(ctx, f"reading {args.path}")
        text = await trio.to_thread.run_sync(lambda: target.read_text(errors="replace"))
        return text[:2000]

    @tool(concurrency_safe=False, description="Count the lines of a text file")
    async def count_lines(args: PathArgs, ctx: ToolContext) -> str:
        target = confined(root, args.path)
        await pace(ctx, f"counting {args.path}")
        text = await trio.to_thread.run_sync(lambda: target.read_text(errors="replace"))
        return str(text.count("\n"))

    return [list_files, read_file, count_lines]


def demo_model() -> ScriptedModel:
    """Three calls: look around (two parallel reads), count, answer."""
    entries: list[dict[str, Any]] = [
        {
            "content": [
                {"type": "text", "text": "I'll look at the project first."},
                {"type": "tool_use", "id": "toolu_list", "name": "list_files", "input": {"path": "."}},
                {"type": "tool_use", "id": "toolu_read", "name": "read_file", "input": {"path": "README.md"}},
            ],
            "stop_reason": "tool_use",
            "latency_ms": 300,
        },
        {
            "content": [
                {"type": "text", "text": "Now the size of the README."},
                {
                    "type": "tool_use",
                    "id": "toolu_count",
                    "name": "count_lines",
                    "input": {"path": "README.md"},
                },
            ],
            "stop_reason": "tool_use",
            "latency_ms": 300,
        },
        {
            "content": [{"type": "text", "text": "Done: I listed the project, read its README and counted its lines."}],
            "stop_reason": "end_turn",
            "latency_ms": 300,
        },
    ]
    return ScriptedModel(entries, name="demo")
