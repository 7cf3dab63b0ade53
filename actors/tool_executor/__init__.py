"""The StreamingToolExecutor actor (`executor`), its messages (`messages`) and one call's steps around its tool
(`calls`: hooks and permissions before, hooks after).

May import the kernel (`queryloop.runtime.kernel`), the loop's pure modules (`queryloop.runtime.loop`) and
telemetry; nothing of the other actors or the hosts."""

from queryloop.actors.tool_executor.executor import StreamingToolExecutor
from queryloop.actors.tool_executor.messages import (
    AddTool,
    BeginTurn,
    Discard,
    QueryAbortFlag,
    ResponseGate,
    ToolResult,
    add_tool,
    begin_turn,
    tool_result,
)

__all__ = [
    "AddTool",
    "BeginTurn",
    "Discard",
    "QueryAbortFlag",
    "ResponseGate",
    "StreamingToolExecutor",
    "ToolResult",
    "add_tool",
    "begin_turn",
    "tool_result",
]
