"""Stop hooks and PostToolUse hooks: async callables returning a `HookDecision` (or None to pass)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from queryloop.runtime.loop.events import TranscriptMessage


class HookDecision(BaseModel):
    """`blocking_error`: feed this back to the model and let it answer again (stop hooks).
    `prevent`: stop the query (stop hooks: `stop_hook_prevented`; PostToolUse: `hook_stopped`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocking_error: str | None = None
    prevent: str | None = None


class StopHookInput(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    messages: list[TranscriptMessage]
    stop_hook_active: bool
    """True when a stop hook already blocked in this query: check it to avoid re-blocking forever."""


class PostToolUseInput(BaseModel):
    model_config = ConfigDict(frozen=True)

    tool_name: str
    tool_use_id: str
    tool_input: dict[str, Any]
    result: Any
    is_error: bool


StopHook = Callable[[StopHookInput], Awaitable[HookDecision | None]]
PostToolUseHook = Callable[[PostToolUseInput], Awaitable[HookDecision | None]]

STOP_HOOK_FEEDBACK = "Stop hook feedback:\n{error}"
