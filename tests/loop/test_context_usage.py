"""`context_usage`, the pure function behind `session.context_usage()` (Claude Code's `/context`): what it counts,
from what, and what it leaves empty rather than make up."""

from __future__ import annotations

from queryloop.runtime.loop.context import ContextLimits
from queryloop.runtime.loop.context_usage import context_usage, schema_tokens
from queryloop.runtime.loop.events import AssistantMessage, Usage, UserMessage

LIMITS = ContextLimits(context_window=100_000, max_output_tokens=8_000)
SYSTEM = [{"type": "text", "text": "s" * 400}]
TOOL = {"name": "Read", "description": "Reads a file", "input_schema": {"type": "object"}}
MCP_TOOL = {"name": "mcp__docs__search", "description": "Searches the docs", "input_schema": {"type": "object"}}


def _usage(**fields: object) -> dict[str, object]:
    options: dict[str, object] = {
        "model": "claude-sonnet-4-5",
        "system": SYSTEM,
        "tool_schemas": [TOOL],
        "messages": [],
        "limits": LIMITS,
        "auto_compact": True,
    }
    return dict(context_usage(**{**options, **fields}))  # type: ignore[arg-type]


def _tokens(usage: dict[str, object]) -> dict[str, int]:
    categories = usage["categories"]
    assert isinstance(categories, list)
    return {category["name"]: category["tokens"] for category in categories}


def test_without_a_response_every_category_is_an_estimate_and_the_total_their_sum() -> None:
    usage = _usage(messages=[UserMessage(content="u" * 396)])
    tokens = _tokens(usage)
    assert tokens["System prompt"] == 100 and tokens["System tools"] == schema_tokens(TOOL)
    assert tokens["Messages"] == 396 // 4 + 4  # `estimate_tokens`: 4 characters a token, 4 more a message
    assert usage["totalTokens"] == tokens["System prompt"] + tokens["System tools"] + tokens["Messages"]
    assert tokens["Free space"] == LIMITS.autocompact_threshold - usage["totalTokens"]


def test_with_a_response_the_total_is_the_apis_count_plus_an_estimate_since() -> None:
    answer = AssistantMessage(
        content=[{"type": "text", "text": "ok"}],
        message_id="msg_1",
        model="claude-sonnet-4-5",
        usage=Usage(input_tokens=5_000, output_tokens=100),
    )
    usage = _usage(messages=[UserMessage(content="question"), answer, UserMessage(content="n" * 36)])
    tokens = _tokens(usage)
    assert usage["totalTokens"] == 5_100 + 36 // 4 + 4
    assert tokens["Messages"] == usage["totalTokens"] - tokens["System prompt"] - tokens["System tools"]


def test_an_mcp_tool_is_counted_apart_and_listed_with_its_server() -> None:
    usage = _usage(tool_schemas=[TOOL, MCP_TOOL])
    tokens = _tokens(usage)
    assert tokens["System tools"] == schema_tokens(TOOL) and tokens["MCP tools"] == schema_tokens(MCP_TOOL)
    assert usage["mcpTools"] == [
        {"name": "mcp__docs__search", "serverName": "docs", "tokens": schema_tokens(MCP_TOOL), "isLoaded": True}
    ]


def test_the_window_figures_follow_the_limits_and_autocompact() -> None:
    on, off = _usage(), _usage(auto_compact=False)
    assert on["rawMaxTokens"] == off["rawMaxTokens"] == 100_000
    assert on["maxTokens"] == on["autoCompactThreshold"] == LIMITS.autocompact_threshold
    assert off["maxTokens"] == LIMITS.effective_window and "autoCompactThreshold" not in off
    assert on["percentage"] == round(100 * int(str(on["totalTokens"])) / 100_000, 2)
    assert on["model"] == "claude-sonnet-4-5" and on["isAutoCompactEnabled"] and not off["isAutoCompactEnabled"]


def test_what_the_runtime_cannot_count_is_left_empty() -> None:
    usage = _usage()
    assert usage["memoryFiles"] == [] and usage["agents"] == [] and usage["gridRows"] == []
