"""A host written against the Claude Agent SDK's messages, reading queryloop's as they are.

    python -m examples.sdk_result      # offline: a scripted model, one subagent

`report` below is the code such a host has for the SDK's `ResultMessage` and `SystemMessage`: it reads
`session_id`, `terminal_reason`, `is_error`, `api_error_status`, `duration_api_ms` and `model_usage`
(camelCase keys, per model), and the `init` message's `data`. queryloop's events carry the same names,
so the same function reads them, with no mapping code in between.
"""

from __future__ import annotations

from typing import Any

import trio

from queryloop import AgentDefinition, QueryOptions, Runtime, ScriptedModel


def report(message: Any) -> list[str]:
    """What an Agent SDK host prints of a message (it would get the same from `claude_agent_sdk.query`)."""
    if getattr(message, "subtype", None) == "init":
        data = message.data
        return [f"init: session {data['session_id']}, model {data['model']}, tools {data['tools']}"]
    if getattr(message, "type", None) != "result":
        return []
    lines = [
        f"session {message.session_id}: {message.terminal_reason} (is_error={message.is_error}, "
        f"api_error_status={message.api_error_status})",
        f"api time {message.duration_api_ms} ms, total ${message.total_cost_usd:.6f}",
    ]
    for model, usage in sorted((message.model_usage or {}).items()):
        lines.append(
            f"  {model}: {usage['inputTokens']} in, {usage['outputTokens']} out, ${usage['costUSD']:.6f}, "
            f"window {usage['contextWindow']}"
        )
    return lines


def scripted() -> ScriptedModel:
    """The main model asks an explorer subagent (on Haiku), then answers; the subagent answers at once."""
    agent_call = {
        "type": "tool_use",
        "id": "call_1",
        "name": "Agent",
        "input": {"description": "look around", "prompt": "List the files", "subagent_type": "explorer"},
    }
    return ScriptedModel(
        [
            {"content": [agent_call], "stop_reason": "tool_use", "usage": {"input_tokens": 1200, "output_tokens": 40}},
            {"content": [{"type": "text", "text": "a.py, b.py"}], "usage": {"input_tokens": 300, "output_tokens": 8}},
            {"content": [{"type": "text", "text": "Two files."}], "usage": {"input_tokens": 1300, "output_tokens": 5}},
        ]
    )


async def main() -> None:
    explorer = AgentDefinition(description="Explores", prompt="You explore.", model="claude-haiku-5-5")
    options = QueryOptions(provider=scripted(), agents={"explorer": explorer}, max_concurrent_agents=1)
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options)
        async for message in session.query("What files are there?"):
            for line in report(message):
                print(line)


if __name__ == "__main__":
    trio.run(main)
