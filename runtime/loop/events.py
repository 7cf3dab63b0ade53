"""What a query produces: transcript messages and the events a consumer sees.

Every item of a query's event stream is one of these frozen records (`queryloop.runtime._records`:
slotted dataclasses, built without validation), told apart by `type` (and `subtype` for system and
result events). Transcript messages (`user`, `assistant`, `system`, `attachment`) are also what the
session keeps as its conversation; the others (`stream_request_start`, `stream_event`, `progress`,
`tombstone`, `tool_use_summary`, `result`) are for the consumer.

The runtime builds them from data already checked, so nothing is validated or copied on the way (a
`StreamEvent` holds the provider's own event dict). Where they enter or leave, pydantic has their schema:
`model_dump()` / `model_dump(mode="json")` give the JSON a pydantic model gave, `model_validate(dict)`
validates one (`TranscriptMessage` / `QueryEvent` are discriminated unions for a `TypeAdapter`; a
transcript is loaded that way), `model_json_schema()` describes one.

Content blocks stay as the Messages API's own JSON objects (`dict`): unknown
block types pass through unharmed, and nothing is converted on the way to the
wire.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Self

from pydantic import ConfigDict, Field, TypeAdapter
from typing_extensions import TypedDict

from queryloop.runtime._records import maker, record

Block = dict[str, Any]
"""A content block exactly as the Messages API has it (`{"type": "text", "text": ...}`, ...)."""

_uuids = itertools.count(1)
_process = secrets.token_hex(6)
"""A per-process prefix: a resumed transcript mixes messages made by several processes (`loop.persistence`)."""


def _new_process() -> None:
    global _process  # noqa: PLW0603 - a forked child must not repeat its parent's ids
    _process = secrets.token_hex(6)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_process)


def new_uuid() -> str:
    """A unique id for a message (cheap; the transcript needs uniqueness, not secrecy)."""
    return f"m{_process}-{next(_uuids)}"


_adapters: dict[type[Any], TypeAdapter[Any]] = {}


def _adapter(cls: type[Any]) -> TypeAdapter[Any]:
    """The pydantic adapter of one record class, made on first use."""
    adapter = _adapters.get(cls)
    if adapter is None:
        adapter = _adapters[cls] = TypeAdapter(cls)
    return adapter


class Model:
    """pydantic's model API over a record, for where data enters or leaves: dumps, validation, schema, copies."""

    __slots__ = ()

    def model_dump(self, *, mode: Literal["json", "python"] = "python", **options: Any) -> dict[str, Any]:
        """A new dict of the fields, nested records and containers included: what pydantic's `model_dump` gave."""
        dumped: dict[str, Any] = _adapter(type(self)).serializer.to_python(self, mode=mode, **options)
        return dumped

    def model_dump_json(self, **options: Any) -> str:
        return _adapter(type(self)).serializer.to_json(self, **options).decode()

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> Self:
        """Validate `obj` (a dict, or an instance, returned as it is) into this class; raises `ValidationError`."""
        validated: Self = _adapter(cls).validate_python(obj, **options)
        return validated

    @classmethod
    def model_validate_json(cls, data: str | bytes, **options: Any) -> Self:
        validated: Self = _adapter(cls).validate_json(data, **options)
        return validated

    @classmethod
    def model_construct(cls, **values: Any) -> Self:
        """The class itself: a record's `__init__` never validates (kept for code written against pydantic)."""
        return cls(**values)

    @classmethod
    def model_json_schema(cls, **options: Any) -> dict[str, Any]:
        return _adapter(cls).json_schema(**options)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy with the fields in `update` replaced, not validated (as pydantic's `model_copy`)."""
        source = copy.deepcopy(self) if deep else self
        return dataclasses.replace(source, **(update or {}))  # type: ignore[type-var]


class Event(Model):
    """Base of every event: frozen, unknown fields refused (when validated)."""

    __slots__ = ()
    __pydantic_config__ = ConfigDict(extra="forbid")

    @property
    def label(self) -> str:
        """The scenario verdict's spelling: `system:<subtype>` for system messages, `type` otherwise.

        docs/scenarios.md's example spells the final event plain `result`, so a result's
        subtype is not part of its label.
        """
        kind: str = getattr(self, "type")  # noqa: B009 - every concrete event declares it
        return f"system:{getattr(self, 'subtype', '')}" if kind == "system" else kind


@record
class Usage(Model):
    """The token counts the API reports; accumulated per call and per query."""

    __pydantic_config__ = ConfigDict(extra="ignore")  # its own, or an event's "forbid" would apply inside one

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    """Every token written to the cache, whatever its lifetime (the API's own total)."""
    cache_read_input_tokens: int = 0
    cache_creation_1h_input_tokens: int = 0
    """Of `cache_creation_input_tokens`, those written to the one-hour cache, priced higher than the
    five-minute one's (the API's `cache_creation.ephemeral_1h_input_tokens`)."""

    def __add__(self, other: Usage) -> Usage:
        one_hour = self.cache_creation_1h_input_tokens + other.cache_creation_1h_input_tokens
        total = usage_of(
            self.input_tokens + other.input_tokens,
            self.output_tokens + other.output_tokens,
            self.cache_creation_input_tokens + other.cache_creation_input_tokens,
            self.cache_read_input_tokens + other.cache_read_input_tokens,
        )
        return dataclasses.replace(total, cache_creation_1h_input_tokens=one_hour) if one_hour else total


NO_USAGE = Usage()
"""Zero usage: one frozen record, shared by every total that has counted nothing yet."""

usage_of: Callable[[int, int, int, int], Usage] = maker(
    Usage, "input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"
)
"""`Usage` from its first four counts, in the order of its fields (no one-hour cache writes), made a third
cheaper (several per model call)."""


# -- transcript messages ------------------------------------------------------------


@record
class UserMessage(Event):
    """A user turn: the prompt, tool results, or the runtime's meta messages for the model."""

    type: Literal["user"] = "user"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    content: str | list[Block]
    is_meta: bool = False
    """Written by the runtime for the model (recovery prompts, hook feedback), not typed by a person."""
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


@record
class AssistantMessage(Event):
    """One completed content block of a model response (a response spans several, sharing `message_id`)."""

    type: Literal["assistant"] = "assistant"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    message_id: str
    model: str
    content: list[Block]
    stop_reason: str | None = None
    usage: Usage | None = None
    """The response's usage as known when this block completed (input side final, output partial)."""
    is_api_error: bool = False
    """A synthetic message that reports an API error to the user; never sent back to the model."""
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


assistant_message: Callable[[str, str, str, list[Block], Usage | None], AssistantMessage] = maker(
    AssistantMessage, "uuid", "message_id", "model", "content", "usage"
)
"""`AssistantMessage(uuid=, message_id=, model=, content=, usage=)`, made a third cheaper (a `maker`): the
ModelCaller makes one for every content block, its `uuid` given (`new_uuid()`)."""


def api_error_message(model: str, text: str) -> AssistantMessage:
    """The synthetic assistant message that reports an API error to the user (never sent to the model)."""
    return AssistantMessage(
        message_id="api_error", model=model, content=[{"type": "text", "text": text}], is_api_error=True
    )


@record
class SystemMessage(Event):
    """A notice for the user (model fallback, compaction boundary, retries, `hook_error`); never sent to the model.

    It joins the conversation as it is emitted (a transcript message), where `normalize_messages_for_api`
    drops it from every request."""

    type: Literal["system"] = "system"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    subtype: str
    content: str = ""
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


@record
class AttachmentMessage(Event):
    """Context injected between turns (`attachment.type`: file change, queued message, max_turns_reached...)."""

    type: Literal["attachment"] = "attachment"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    attachment: dict[str, Any]
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


TranscriptMessage = Annotated[
    UserMessage | AssistantMessage | SystemMessage | AttachmentMessage, Field(discriminator="type")
]

# -- consumer-only events ---------------------------------------------------------------


@record
class StreamRequestStart(Event):
    """A model call starts (one per request, retries and fallbacks included)."""

    type: Literal["stream_request_start"] = "stream_request_start"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


@record
class StreamEvent(Event):
    """A raw Messages API stream event, passed through as received (the provider's own dict, not a copy)."""

    type: Literal["stream_event"] = "stream_event"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    event: dict[str, Any]
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


_stream_event: Callable[[dict[str, Any], str, str], StreamEvent] = maker(StreamEvent, "event", "uuid", "session_id")


def stream_event(raw: dict[str, Any], session_id: str = "") -> StreamEvent:
    """`StreamEvent(event=raw, session_id=session_id)` with a new `uuid`, made a third cheaper (a `maker`): the
    consumer's handle makes one for every streamed event as it hands it out."""
    return _stream_event(raw, f"m{_process}-{next(_uuids)}", session_id)


@record
class ProgressEvent(Event):
    """What a tool reported through `ctx.progress(...)` while it ran."""

    type: Literal["progress"] = "progress"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    tool_use_id: str
    data: Any
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


@record
class TombstoneEvent(Event):
    """Retracts an assistant message already emitted (its response was abandoned on fallback)."""

    type: Literal["tombstone"] = "tombstone"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    message_uuid: str
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


@record
class ToolUseSummaryEvent(Event):
    """A one-line summary of a tool batch (with `tool_use_summaries=True`)."""

    type: Literal["tool_use_summary"] = "tool_use_summary"
    uuid: str = dataclasses.field(default_factory=new_uuid)
    summary: str
    preceding_tool_use_ids: list[str]
    parent_tool_use_id: str | None = None
    """Set on a subagent's events: the id of the parent's agent-tool call that runs it (claude-agent-sdk's field)."""
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (a subagent's events carry its session's too), set as the consumer takes the event."""


@record
class AgentUsage(Model):
    """What one subagent (its own subagents included) spent, in its parent's `result.usage_by_agent`."""

    agent_type: str
    parent_tool_use_id: str
    usage: Usage
    total_cost_usd: float


@record
class DeferredToolUse(Model):
    """The tool call a PreToolUse hook deferred (`permissionDecision: "defer"`): the result's `deferred_tool_use`,
    with the Agent SDK's `DeferredToolUse` fields. The call waits, unanswered, in the conversation; the session's
    next query (or a session resumed from its transcript) replays it (docs/hooks.md, "Deferred tool use")."""

    id: str
    name: str
    input: dict[str, Any]


ClaudeCodeTerminalReason = Literal[
    "completed",
    "max_turns",
    "background_requested",
    "aborted_streaming",
    "aborted_tools",
    "hook_stopped",
    "stop_hook_prevented",
    "tool_deferred",
    "tool_deferred_unavailable",
    "blocking_limit",
    "rapid_refill_breaker",
    "prompt_too_long",
    "image_error",
    "model_error",
    "api_error",
    "malformed_tool_use_exhausted",
    "budget_exhausted",
    "structured_output_retry_exhausted",
    "turn_setup_failed",
]
"""Why a query ended, in Claude Code's words (its SDK's `TerminalReason`, all nineteen values): the result's
`terminal_reason`. The runtime's own `Terminal.reason` maps onto it (`decisions.claude_code_terminal_reason`;
docs/design.md has the table, and the values this runtime never produces)."""


class ModelUsage(TypedDict):
    """What one model's calls in a query used and cost: a value of the result's `model_usage`, keyed as the
    Agent SDK's `ModelUsage` is (camelCase, as the CLI's `modelUsage` passes it through)."""

    inputTokens: int
    outputTokens: int
    cacheReadInputTokens: int
    cacheCreationInputTokens: int
    webSearchRequests: int
    costUSD: float
    contextWindow: int
    maxOutputTokens: int


ResultSubtype = Literal[
    "success",
    "error_max_turns",
    "error_max_budget_usd",
    "error_during_execution",
    "error_max_structured_output_retries",
]


@record
class ResultMessage(Event):
    """The last event of every query, whatever its end."""

    type: Literal["result"] = "result"
    subtype: ResultSubtype
    is_error: bool
    duration_ms: int
    result: str = ""
    stop_reason: str | None = None
    total_cost_usd: float
    usage: Usage
    num_turns: int
    stop_details: dict[str, Any] | None = None
    """The API's `stop_details` of a query that ended on a `refusal` (`category`, `explanation`, ...)."""
    errors: list[str] = dataclasses.field(default_factory=list)
    """Why the query ended, for an ending that says (max turns, budget, a model error, a stop hook's
    `prevent`), then the text of each non-blocking hook error (`hook_error` system events), in order.
    Hook errors change neither `subtype` nor `is_error`: a `success` may carry them."""
    usage_by_agent: dict[str, AgentUsage] = dataclasses.field(default_factory=dict)
    """Per subagent (by agent id) of this query: what it spent. `total_cost_usd` includes it; `usage`, the main
    loop's own calls only (Claude Code's count), does not."""
    structured_output: dict[str, Any] | None = None
    """The query's answer as `QueryOptions.output_type` data (its JSON form), when one was given."""
    user_message_uuid: str | None = None
    """The `uuid` of the user message that started the query (claude-agent-sdk's field)."""
    user_message_uuids: list[str] = dataclasses.field(default_factory=list)
    """The `uuid` of every user message the query took in, in order: the one that started it, then each one
    sent while it ran and taken in at a turn boundary (`Session.query`; claude-agent-sdk's field). A message's
    answer is the result that lists its uuid."""
    permission_denials: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Each tool call whose permission was denied (by a PreToolUse hook, a rule, the mode or `can_use_tool`), in
    order: `tool_name`, `tool_use_id`, `tool_input` (claude-agent-sdk's field)."""
    terminal_reason: ClaudeCodeTerminalReason | None = None
    """Why the query ended, in Claude Code's vocabulary (`ClaudeCodeTerminalReason`; claude-agent-sdk's field)."""
    model_usage: dict[str, ModelUsage] = dataclasses.field(default_factory=dict)
    """Per model, every call the query paid for: the main loop's, its subagents', its tool-use summaries' and
    compactions' (claude-agent-sdk's field, keyed as its `ModelUsage`). Their costs sum to `total_cost_usd`."""
    duration_api_ms: int = 0
    """Time spent in API calls: the main loop's requests (every attempt, retries and fallbacks included) and its
    subagents' (claude-agent-sdk's field)."""
    api_error_status: int | None = None
    """The HTTP status of the API error the query ended on (429, 500, 529, ...); None otherwise, and for an
    error that had none (a cut connection; claude-agent-sdk's field)."""
    deferred_tool_use: DeferredToolUse | None = None
    """The call a PreToolUse hook deferred, for a query that ended `tool_deferred` or `tool_deferred_unavailable`
    (claude-agent-sdk's field); None otherwise."""
    uuid: str = dataclasses.field(default_factory=new_uuid)
    session_id: str = dataclasses.field(default="", compare=False)
    """The session's id (claude-agent-sdk's field), as on every event."""


QueryEvent = Annotated[
    UserMessage
    | AssistantMessage
    | SystemMessage
    | AttachmentMessage
    | StreamRequestStart
    | StreamEvent
    | ProgressEvent
    | TombstoneEvent
    | ToolUseSummaryEvent
    | ResultMessage,
    Field(discriminator="type"),
]
