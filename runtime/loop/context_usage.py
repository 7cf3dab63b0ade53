"""`session.context_usage()`'s answer as a pure function: the Agent SDK's `ContextUsageResponse` (Claude Code's
`/context`), filled in with what the runtime can count without a model call.

What it counts, and how (every count is a whole number of tokens):

* `System prompt`: the query's system prompt, estimated at 4 characters a token (Claude Code's rough
  estimation between API counts, `context.estimate_tokens`'s rule).
* `System tools` and `MCP tools`: the tools' schemas as sent (name, description, input schema), estimated the
  same way; an `mcp__server__tool` is an MCP tool (`mcpTools` lists each), every other tool a system one.
* `Messages`: what the next request would send of the conversation (what follows its last compact boundary,
  the user context's message first). Where that part holds a response, the total is the API's own count of
  that response (its input, cache and output tokens: the system prompt and tools included) plus an estimate
  of every message since, as the loop counts it against its thresholds (`token_count_with_estimation`), and
  `Messages` is that total less the two estimates above; without one (a new session, or just after a
  compaction) every figure is an estimate and the total their sum.
* `Free space`: what is left below `maxTokens`.

`maxTokens` is the window the loop works in: the autocompact threshold when autocompact is on (Claude Code's
effective limit, the window less the summary's reserve and the autocompact buffer), else the window less the
summary's reserve; `rawMaxTokens` the model's context window (`QueryOptions.context_window`, else the
model's); `percentage` is `totalTokens` of `rawMaxTokens`, from 0 to 100.

What the runtime does not have is given empty, never made up: `memoryFiles` (the runtime reads no CLAUDE.md:
a host's memory comes in through `system_context`, `user_context` or `memory_prefetch`, counted where it
lands), `agents` (subagent definitions are counted with the Agent tool's schema, not one by one) and
`gridRows` (the CLI's drawing of the grid). A category's `color` is a display hint of the runtime's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from queryloop.runtime.loop.context import token_count_with_estimation
from queryloop.runtime.loop.events import AssistantMessage
from queryloop.runtime.loop.json_text import dumps

if TYPE_CHECKING:
    from queryloop.runtime.loop.context import ContextLimits
    from queryloop.runtime.loop.events import TranscriptMessage

MCP_PREFIX = "mcp__"


class ContextUsageCategory(TypedDict):
    """One category of the context (the Agent SDK's `ContextUsageCategory`)."""

    name: str
    tokens: int
    color: str
    isDeferred: NotRequired[bool]


class ContextUsageResponse(TypedDict):
    """`session.context_usage()`: the Agent SDK's `ContextUsageResponse`, keyed as it is (module docstring)."""

    categories: list[ContextUsageCategory]
    totalTokens: int
    maxTokens: int
    rawMaxTokens: int
    percentage: float
    model: str
    isAutoCompactEnabled: bool
    memoryFiles: list[dict[str, Any]]
    mcpTools: list[dict[str, Any]]
    agents: list[dict[str, Any]]
    gridRows: list[list[dict[str, Any]]]
    autoCompactThreshold: NotRequired[int]


def text_tokens(text: str) -> int:
    """A text's tokens at 4 characters a token."""
    return len(text) // 4


def system_tokens(system: list[dict[str, Any]]) -> int:
    """The system prompt's blocks, estimated."""
    return sum(text_tokens(str(block.get("text", ""))) for block in system)


def schema_tokens(schema: dict[str, Any]) -> int:
    """A tool's schema as sent, estimated."""
    return text_tokens(dumps(schema))


def _server_of(name: str) -> str:
    """The MCP server of an `mcp__server__tool` name."""
    return name.removeprefix(MCP_PREFIX).partition("__")[0]


def context_usage(
    *,
    model: str,
    system: list[dict[str, Any]],
    tool_schemas: list[dict[str, Any]],
    messages: list[TranscriptMessage],
    limits: ContextLimits,
    auto_compact: bool,
) -> ContextUsageResponse:
    """The usage of a context made of `system`, `tool_schemas` and `messages` (what the next request sends of
    the conversation, the user context's message included) in `model`'s window (`limits`)."""
    system_count = system_tokens(system)
    mcp_tools = [
        {"name": s["name"], "serverName": _server_of(s["name"]), "tokens": schema_tokens(s), "isLoaded": True}
        for s in tool_schemas
        if str(s.get("name", "")).startswith(MCP_PREFIX)
    ]
    mcp_count = sum(tool["tokens"] for tool in mcp_tools)
    tools_count = sum(schema_tokens(s) for s in tool_schemas) - mcp_count
    counted = token_count_with_estimation(messages)
    if any(type(m) is AssistantMessage and m.usage is not None for m in messages):
        total = counted  # the API's count of the last response (system and tools in it), and estimates since
        messages_count = max(0, total - system_count - tools_count - mcp_count)
    else:
        messages_count = counted
        total = system_count + tools_count + mcp_count + messages_count
    max_tokens = limits.autocompact_threshold if auto_compact else limits.effective_window
    categories: list[ContextUsageCategory] = [
        {"name": "System prompt", "tokens": system_count, "color": "gray"},
        {"name": "System tools", "tokens": tools_count, "color": "blue"},
    ]
    if mcp_tools:
        categories.append({"name": "MCP tools", "tokens": mcp_count, "color": "cyan"})
    categories += [
        {"name": "Messages", "tokens": messages_count, "color": "purple"},
        {"name": "Free space", "tokens": max(0, max_tokens - total), "color": "white"},
    ]
    usage: ContextUsageResponse = {
        "categories": categories,
        "totalTokens": total,
        "maxTokens": max_tokens,
        "rawMaxTokens": limits.context_window,
        "percentage": min(100.0, round(100 * total / max(1, limits.context_window), 2)),
        "model": model,
        "isAutoCompactEnabled": auto_compact,
        "memoryFiles": [],
        "mcpTools": mcp_tools,
        "agents": [],
        "gridRows": [],
    }
    if auto_compact:
        usage["autoCompactThreshold"] = limits.autocompact_threshold
    return usage
