"""A provider for subagent tests: each request is answered from the script of its conversation's first
prompt, so that concurrent children (whose requests interleave in any order) each play their own."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.providers.scripted import ScriptedModel


def first_prompt(request: ModelRequest) -> str:
    content = request.messages[0]["content"]
    return "".join(b.get("text", "") for b in content if b.get("type") == "text")


class ByPrompt:
    """Plays `scripts[prompt]` for the conversation that started with `prompt` (an unknown one is an error)."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]]) -> None:
        self.models = {
            prompt: ScriptedModel(entries, name=f"m{i}") for i, (prompt, entries) in enumerate(scripts.items())
        }
        self.requests: list[ModelRequest] = []

    def requests_of(self, prompt: str) -> list[ModelRequest]:
        return self.models[prompt].requests

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        self.requests.append(request)
        model = self.models[first_prompt(request)]
        async with aclosing(model.stream(request)) as events:
            async for event in events:
                yield event


def agent_call(tool_id: str, subagent_type: str, prompt: str, description: str = "a task") -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": tool_id,
        "name": "Agent",
        "input": {"description": description, "prompt": prompt, "subagent_type": subagent_type},
    }
