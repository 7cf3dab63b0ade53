"""Subagents: what a host declares (`AgentDefinition`) and what the model sees (the agent tool).

`QueryOptions(agents={"reviewer": AgentDefinition(...)})` gives the model one more tool, named
`Agent`, in Claude Code's shape: its input is `{description, prompt, subagent_type}` and its
description lists the agents it may start. Calling it runs a child query loop (its own actor group,
under the session's supervisor: `queryloop.actors.query_loop.subagent`) whose final text is the
tool's result.

The name: Claude Code called this tool `Task` until its 2.x versions renamed it `Agent`; its input
and result kept their shape. The current name is taken, so that a model prompted as today's Claude
Code is, and a host's permission rules written for today's SDK, find the tool they expect
(`AGENT_TOOL_NAME`; docs/agents.md).

The caps and their defaults (docs/agents.md says why):

* `QueryOptions.max_agent_depth` (default 1): how deep subagents nest. At 1 a subagent never has
  the agent tool, as in Claude Code; above it, a child at depth d < max has it. A child that calls
  its own type forever is stopped by this cap.
* `QueryOptions.max_concurrent_agents` (default 10): live subagents of one session's query at once;
  more calls wait for a slot (Claude Code runs at most 10 agent calls of one turn in parallel).
* `Runtime.open(max_live_agents=N)` (default 1000): live subagents across the host; a call past it
  is refused at once with an error result (waiting there could deadlock parents on their children).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

from queryloop.runtime.loop.model import ModelProvider, check_provider

AGENT_TOOL_NAME = "Agent"
"""The subagent tool's name (Claude Code's current one; `Task` in its versions before 2.x)."""

DEFAULT_MAX_AGENT_DEPTH = 1
DEFAULT_MAX_CONCURRENT_AGENTS = 10
DEFAULT_MAX_LIVE_AGENTS = 1000


class AgentDefinition(BaseModel):
    """A subagent the model may start through the agent tool (claude-agent-sdk's `AgentDefinition`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    description: str
    """When to use this agent: shown to the model in the agent tool's description."""
    prompt: str
    """The subagent's system prompt (it replaces the default one)."""
    tools: list[str] | None = None
    """Names of the parent's tools the subagent may use; None: all of them."""
    model: str | None = None
    """The subagent's model id; None: the parent's."""
    max_turns: int | None = Field(default=None, ge=1)
    provider: Annotated[ModelProvider | None, PlainValidator(check_provider)] = None
    """The subagent's model provider; None: the parent's."""


class AgentInput(BaseModel):
    """The agent tool's input, as Claude Code's Task/Agent tool has it."""

    model_config = ConfigDict(extra="forbid")

    description: str = Field(description="A short (3-5 word) description of the task")
    prompt: str = Field(description="The task for the agent to perform")
    subagent_type: str = Field(description="The type of specialized agent to use for this task")


def agent_tool_description(agents: Mapping[str, AgentDefinition]) -> str:
    """The agent tool's description: what it does, then each agent with its tools (Claude Code's layout)."""
    lines = [
        "Launch a new agent to handle complex, multi-step tasks autonomously.",
        "",
        "Available agent types and the tools they have access to:",
    ]
    for name, agent in agents.items():
        tools = "*" if agent.tools is None else ", ".join(agent.tools) or "none"
        lines.append(f"- {name}: {agent.description} (Tools: {tools})")
    lines += [
        "",
        "When using the Agent tool, you must specify a subagent_type parameter to select which agent type to use.",
        "",
        "Usage notes:",
        "- Launch multiple agents concurrently whenever possible: use a single message with several tool uses.",
        "- When the agent is done, it returns a single message back to you; the user does not see it. "
        "Summarize what matters for the user.",
        "- Each agent invocation is stateless: your prompt must hold everything the agent needs.",
    ]
    return "\n".join(lines)
