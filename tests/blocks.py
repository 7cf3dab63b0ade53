"""Content blocks as the Messages API spells them, for tests that build conversations by hand."""

from __future__ import annotations

from typing import Any

from queryloop.runtime.loop.events import Block


def text(value: str) -> Block:
    return {"type": "text", "text": value}


def tool_use(tool_id: str, name: str = "read", tool_input: dict[str, Any] | None = None) -> Block:
    return {"type": "tool_use", "id": tool_id, "name": name, "input": tool_input or {"path": tool_id}}


def tool_result(tool_id: str, content: str | list[Block] = "ok", *, is_error: bool = False) -> Block:
    return {"type": "tool_result", "tool_use_id": tool_id, "content": content, "is_error": is_error}
