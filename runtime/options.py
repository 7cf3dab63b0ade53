"""`QueryOptions`: everything a session's queries are configured with, validated once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.events import TranscriptMessage
from runtime.hooks import PostToolUseHook, StopHook
from runtime.model import ModelProvider
from runtime.pricing import Pricing, pricing_for
from runtime.tools import CanUseTool, Tool

DEFAULT_SYSTEM_PROMPT = [
    "You are an agent that completes the user's task using the tools provided.",
    "Prefer small, verifiable steps. Report what you did and what remains.",
]


@runtime_checkable
class AttachmentSource(Protocol):
    """Something that injects context between turns (file-change notices, queued user messages)."""

    async def collect(self) -> list[dict[str, Any]]:
        """Attachments (`{"type": ..., "content": ...}`) that arose since the last call."""
        ...


MemoryPrefetch = Callable[[list[TranscriptMessage]], Awaitable[str | None]]


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
    thinking: dict[str, Any] | None = None
    pricing: Pricing | None = None
    tools: list[Tool] = Field(default_factory=list)
    can_use_tool: CanUseTool | None = None
    stop_hooks: list[StopHook] = Field(default_factory=list)
    post_tool_use_hooks: list[PostToolUseHook] = Field(default_factory=list)
    attachment_sources: list[AttachmentSource] = Field(default_factory=list)
    memory_prefetch: MemoryPrefetch | None = None
    provider: ModelProvider | None = None
    """The model provider (dependency injection); `Runtime.open_session` requires one."""
    event_buffer: int = Field(default=64, ge=1)
    """Events buffered between the loop and a slow consumer before the loop waits (backpressure)."""

    @model_validator(mode="after")
    def _check(self) -> QueryOptions:
        names = [t.name for t in self.tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            msg = f"tools: duplicate tool names {duplicates}"
            raise ValueError(msg)
        # A model without a known price is refused here, not priced at $0 later.
        for model in (self.model, self.fallback_model):
            if model is not None:
                pricing_for(model, self.pricing)
        return self
