"""`QueryOptions`: everything a session's queries are configured with, validated once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, model_validator

from queryloop.runtime.loop.agents import (
    AGENT_TOOL_NAME,
    DEFAULT_MAX_AGENT_DEPTH,
    DEFAULT_MAX_CONCURRENT_AGENTS,
    AgentDefinition,
)
from queryloop.runtime.loop.events import TranscriptMessage
from queryloop.runtime.loop.hooks import PostToolUseHook, StopFailureHook, StopHook
from queryloop.runtime.loop.model import (
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    Effort,
    ModelProvider,
    check_provider,
    runs_on_asyncio,
)
from queryloop.runtime.loop.permissions import PermissionMode, parse_rule
from queryloop.runtime.loop.pricing import Pricing, pricing_for
from queryloop.runtime.loop.sdk_hooks import HookEvent, HookMatcher
from queryloop.runtime.loop.settings import SettingSource
from queryloop.runtime.loop.structured_output import DEFAULT_MAX_RETRIES, STRUCTURED_OUTPUT_TOOL
from queryloop.runtime.loop.tools import CanUseTool, Tool

DEFAULT_SYSTEM_PROMPT = [
    "You are an agent that completes the user's task using the tools provided.",
    "Prefer small, verifiable steps. Report what you did and what remains.",
]


@runtime_checkable
class AttachmentSource(Protocol):
    """Something that injects context between turns (file-change notices, queued user messages).

    One that raises is skipped for that turn and logged (as a `memory_prefetch` that raises is).
    """

    async def collect(self) -> list[dict[str, Any]]:
        """Attachments (`{"type": ..., "content": ...}`) that arose since the last call."""
        ...


MemoryPrefetch = Callable[[list[TranscriptMessage]], Awaitable[str | None]]


Provider = Annotated[ModelProvider | None, PlainValidator(check_provider)]


class QueryOptions(BaseModel):
    """Options of a session; `Session.query(..., **overrides)` may change them for one query."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    model: str = "claude-sonnet-5-5"
    fallback_model: str | None = None
    system_prompt: str | None = None
    """Replaces the default system prompt when given."""
    append_system_prompt: str | None = None
    user_context: dict[str, str] = Field(default_factory=dict)
    system_context: dict[str, str] = Field(default_factory=dict)
    max_turns: int | None = Field(default=None, ge=1)
    max_budget_usd: float | None = Field(default=None, gt=0)
    token_budget: int | None = Field(default=None, ge=1)
    auto_compact: bool = True
    context_window: int | None = Field(default=None, ge=1000)
    max_output_tokens: int = Field(default=8000, ge=1)
    escalated_max_output_tokens: int = Field(default=64000, ge=1)
    max_retries: int = Field(default=2, ge=0)
    stream_idle_timeout_s: float | None = Field(default=DEFAULT_STREAM_IDLE_TIMEOUT_S, gt=0)
    """Claude Code's stream watchdog: a model call whose response takes longer than this to start, or then goes
    this long without an event (`ping`s do not count), fails as a connection error, retried as one (within
    `max_retries`, while nothing of it has been shown). None: no limit (the SDK's own timeout, ten minutes per
    read, still applies). It bounds the runtime's own summary and compaction calls too. Honoured by
    `AnthropicModel`."""
    max_pause_turn_continuations: int = Field(default=5, ge=0)
    """`pause_turn` responses sent back per turn before the query ends with an error. Each continuation
    re-sends the whole context (billed again), and the server already runs up to ten server-tool
    iterations in one request before it pauses: five allow some fifty searches in one turn, enough for
    a deep research turn, and stop a turn that would page on forever."""
    thinking: dict[str, Any] | None = None
    effort: Effort | None = None
    """The API's `output_config.effort` for the query's calls ("low" … "max"; None: the model's default).
    The runtime's own small calls (summaries) and compaction calls are sent without it."""
    pricing: Pricing | None = None
    tools: list[Tool] = Field(default_factory=list)
    mcp_servers: list[str] = Field(default_factory=list)
    """MCP servers of the runtime, by their `open_mcp` name, whose tools join each query as the server
    lists them when the query starts (a server that says its tools changed is listed again)."""
    can_use_tool: CanUseTool | None = None
    """Asked about each call the permission rules and the mode leave undecided, as the Agent SDK asks it:
    `await can_use_tool(tool_name, input, context)` (a `ToolPermissionContext`), or with two arguments, the
    older form. `Allow(updated_input=..., updated_permissions=...)` runs it; `Deny(message, interrupt=...)`
    answers the model with `message` (and with `interrupt`, ends the query as an interrupt does)."""
    permission_mode: PermissionMode | None = None
    """Claude Code's permission mode (docs/permissions.md); None: the settings' `defaultMode`, else `default`."""
    allowed_tools: list[str] = Field(default_factory=list)
    """Allow rules (`Tool`, `Tool(specifier)`, `mcp__server__tool`): calls they match run without asking."""
    disallowed_tools: list[str] = Field(default_factory=list)
    """Deny rules: calls they match never run, in every mode."""
    settings: str | Path | None = None
    """A settings file (a path, relative to `cwd`) or inline JSON, in Claude Code's `settings.json` format: its
    hooks (command hooks included) and permissions apply, above the `setting_sources` files."""
    setting_sources: list[SettingSource] | None = None
    """Which settings files to read: `"user"` (`~/.claude/settings.json`), `"project"` (`cwd/.claude/settings.json`),
    `"local"` (`cwd/.claude/settings.local.json`). None reads none (the Agent SDK's None reads all of them: a
    divergence, as project files may run commands and a host's working folders are not trusted by default)."""
    cwd: Path | None = None
    """The query's working folder: hooks' `cwd`, relative rule paths, project settings. None: the process's."""
    add_dirs: list[Path] = Field(default_factory=list)
    """Folders besides `cwd` that count as inside for the permission modes (the SDK's `add_dirs`)."""
    stop_hooks: list[StopHook] = Field(default_factory=list)
    subagent_stop_hooks: list[StopHook] = Field(default_factory=list)
    """Claude Code's SubagentStop hooks: the stop hooks of every subagent's query (`StopHookInput.agent_id`
    and `agent_type` say which); a block sends the subagent back to work, a `prevent` ends it."""
    stop_hook_block_cap: int = Field(default=8, ge=0)
    """Stop-hook blocks in a row that are honoured; the next block is overridden and the query ends
    `completed`, with a `system` event `stop_hook_block_cap` and the warning in `result.errors`.
    0: no cap. Claude Code's `CLAUDE_CODE_STOP_HOOK_BLOCK_CAP`, whose default this is."""
    post_tool_use_hooks: list[PostToolUseHook] = Field(default_factory=list)
    hooks: dict[HookEvent, list[HookMatcher]] = Field(default_factory=dict)
    """Hooks in the Claude Agent SDK's shape, by event (`HookMatcher`s, the SDK's `hooks=`): a callback
    written for the SDK runs unchanged. PreToolUse runs before each tool call's `can_use_tool` (a subagent's
    calls too): deny skips the tool, allow skips `can_use_tool`. An unknown event name is refused; the
    events not run yet are listed in docs/hooks.md."""
    stop_failure_hooks: list[StopFailureHook] = Field(default_factory=list)
    """Told when a query (a subagent's too) ends on an API error instead of stop hooks running: a model error,
    a refusal, a cut-off or a prompt too long surfaced. Not awaited by the loop: they run in the runtime,
    whose close waits for them (up to its grace period)."""
    attachment_sources: list[AttachmentSource] = Field(default_factory=list)
    memory_prefetch: MemoryPrefetch | None = None
    provider: Provider = None
    """The model provider (dependency injection); `Runtime.open_session` requires one."""
    small_model: str = "claude-haiku-5-5"
    """The model of the runtime's own small calls (tool-use summaries)."""
    tool_use_summaries: bool = False
    """Summarize each tool batch with `small_model` while the next call runs (`tool_use_summary` events)."""
    summary_provider: Provider = None
    """Provider of the summaries; the main provider when None."""
    compact_provider: Provider = None
    """Provider of the compaction calls (made with `model`); the main provider when None."""
    compact_instructions: str | None = None
    """Added to every compaction request of the query, after the runtime's instructions, under "Additional
    Instructions:" (Claude Code's `/compact <instructions>`): what the summary must keep, say."""

    # -- context management (defaults after Claude Code's; see runtime/loop/context.py) --
    reactive_compact: bool = True
    """On a prompt-too-long error, compact once and retry."""
    context_collapse: bool = True
    """Stage collapses of older rounds in the background; commit them on a prompt-too-long error."""
    max_tool_result_chars: int = Field(default=50_000, ge=100)
    """A larger tool result is written to the session directory and replaced by a preview and its path."""
    tool_result_preview_chars: int = Field(default=2_000, ge=0)
    microcompact_keep_recent: int = Field(default=8, ge=0)
    """Past the warning threshold, all but this many newest tool results have their content cleared."""
    collapse_keep_recent_rounds: int = Field(default=4, ge=1)
    snip_max_rounds: int | None = Field(default=None, ge=1)
    """Drop the oldest rounds beyond this many (off by default)."""
    summary_output_reserve: int = Field(default=20_000, ge=1)
    autocompact_buffer_tokens: int = Field(default=13_000, ge=0)
    warning_buffer_tokens: int = Field(default=20_000, ge=0)
    blocking_buffer_tokens: int = Field(default=3_000, ge=0)
    task_budget: int | None = Field(default=None, ge=1)
    """A server-side token budget for the task, sent as `task_budget` with what remains of it."""
    session_dir: Path | None = None
    """The folder whose `tool-results/` takes the tool results over `max_tool_result_chars`; the host's, so
    never removed. When None: a durable session (`transcript=` or `resume=`) keeps them beside its
    transcript, in the transcript's path without its suffix (`chat.jsonl` → `chat/tool-results/`, as
    Claude Code keeps `<session-id>/tool-results/`), which outlives the session and a resume writes to
    again; any other session spills to a temporary folder, made at its first spill and removed when the
    session closes (by `close()`, the runtime's exit or a crash). A subagent spills in its session's."""
    event_buffer: int = Field(default=64, ge=1)
    """Events buffered between the loop and a slow consumer before the loop waits (backpressure)."""

    # -- structured output (runtime/loop/structured_output.py) --
    output_type: type[BaseModel] | None = None
    """The final answer's pydantic model: the model answers through a `StructuredOutput` tool with its
    schema, and `result.structured_output` holds the answer (its JSON form)."""
    max_structured_output_retries: int = Field(default=DEFAULT_MAX_RETRIES, ge=1)
    """Failed attempts at an answer (an invalid call, or a response that ends without one) before the
    query ends `max_structured_output_retries`."""

    # -- subagents (runtime/loop/agents.py, docs/agents.md) --
    agents: dict[str, AgentDefinition] = Field(default_factory=dict)
    """Subagents the model may start with the `Agent` tool (added to the tools when this is not empty)."""
    max_agent_depth: int = Field(default=DEFAULT_MAX_AGENT_DEPTH, ge=1, le=8)
    """How deep subagents nest: at 1 (the default, as Claude Code) a subagent has no agent tool itself."""
    max_concurrent_agents: int = Field(default=DEFAULT_MAX_CONCURRENT_AGENTS, ge=1)
    """Subagents of one query running at once; further calls wait for a slot."""

    @model_validator(mode="after")
    def _check(self) -> QueryOptions:
        names = [t.name for t in self.tools]
        _check_tool_names(names, structured_output=self.output_type is not None, agents=bool(self.agents))
        for agent_name, agent in self.agents.items():
            _check_agent(agent_name, agent, names, self)
        _check_prices(self)
        for name in ("allowed_tools", "disallowed_tools"):
            for text in getattr(self, name):  # refused when made, not at the first call
                try:
                    parse_rule(text, cwd=Path("/"))
                except (TypeError, ValueError) as error:
                    msg = f"{name}: {error}"
                    raise ValueError(msg) from None
        return self

    def asyncio_provider(self) -> ModelProvider | None:
        """The first of the providers (main, summary, compaction, the agents') written for asyncio, if any:
        the trio `Runtime` refuses it, `AsyncioRuntime` streams it on the host's loop."""
        for provider in (self.provider, self.summary_provider, self.compact_provider):
            if provider is not None and getattr(provider, "runs_on", None) == "asyncio":  # `runs_on_asyncio`, inline
                return provider
        for agent in self.agents.values():
            if agent.provider is not None and runs_on_asyncio(agent.provider):
                return agent.provider
        return None


def _check_tool_names(names: list[str], *, structured_output: bool, agents: bool) -> None:
    """Refuse tools that share a name, or that take the name of a tool the runtime adds: the structured output
    tool's (with an `output_type`) or the subagent tool's (with `agents`)."""
    if len(set(names)) < len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        msg = f"tools: duplicate tool names {duplicates}"
        raise ValueError(msg)
    if structured_output and STRUCTURED_OUTPUT_TOOL in names:
        msg = f"tools: {STRUCTURED_OUTPUT_TOOL!r} is the structured output tool's name; rename your tool"
        raise ValueError(msg)
    if agents and AGENT_TOOL_NAME in names:
        msg = f"tools: {AGENT_TOOL_NAME!r} is the subagent tool's name; rename your tool or drop `agents`"
        raise ValueError(msg)


def _check_agent(agent_name: str, agent: AgentDefinition, names: list[str], options: QueryOptions) -> None:
    """Refuse a subagent that names a tool the session does not have, or runs on a model without a known price."""
    unknown = sorted(set(agent.tools or ()) - set(names))
    if unknown:
        msg = f"agents[{agent_name!r}].tools: no such tools {unknown} among the session's tools"
        raise ValueError(msg)
    if agent.model is not None:
        pricing_for(agent.model, options.pricing if agent.model == options.model else None)


def _check_prices(options: QueryOptions) -> None:
    """Refuse a model of the session (main, small, fallback) without a known price."""
    # A model without a known price is refused here, not priced at $0 later.
    pricing_for(options.model, options.pricing)
    if options.small_model != options.model:
        pricing_for(options.small_model)
    if options.fallback_model is not None and options.fallback_model != options.model:
        pricing_for(options.fallback_model)
