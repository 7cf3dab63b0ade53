"""Stop hooks and PostToolUse hooks: async callables returning a `HookDecision` (or None to pass).

A hook that raises is a non-blocking hook error, reported as Claude Code reports one and never to the
model: the loop goes on as if the hook had returned None (the other hooks' decisions still count),
a `system` event of subtype `hook_error` is emitted (`hook_error_message`: it joins the conversation,
whose system messages are never sent to the API) and its text is added to the query's
`result.errors`. The result's `subtype` and `is_error` stay what the query's ending makes them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from queryloop.runtime.loop.events import SystemMessage, TranscriptMessage


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
    agent_id: str | None = None
    """The subagent whose stop this is (a `subagent_stop_hooks` hook); None for the session's own query."""
    agent_type: str | None = None
    """That subagent's type (its name in `QueryOptions.agents`)."""
    consecutive_blocks: int = 0
    """How many times in a row the stop hooks have blocked (0 on a first stop, or after a turn that ran
    tools). Once it reaches `QueryOptions.stop_hook_block_cap`, a block is overridden."""


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

STOP_HOOK_BLOCK_CAP = "stop_hook_block_cap"
"""The `subtype` of the `system` event that reports a block overridden by `QueryOptions.stop_hook_block_cap`."""


def stop_hook_block_cap_message(cap: int, errors: list[str]) -> SystemMessage:
    """The `system` event for a block overridden at the cap; its `content` is the text for `result.errors`.

    `data`: `cap` and `blocking_errors` (the overridden hooks' texts, which the model does not see).
    """
    times = "time" if cap == 1 else "times"
    text = (
        f"Stop hooks blocked the turn from ending {cap} consecutive {times}; the next block was overridden. "
        "A stop hook should let the turn end while `stop_hook_active` is True; "
        "QueryOptions.stop_hook_block_cap raises this limit (0: no limit)."
    )
    return SystemMessage(subtype=STOP_HOOK_BLOCK_CAP, content=text, data={"cap": cap, "blocking_errors": errors})


HookEvent = Literal["Stop", "SubagentStop", "PostToolUse"]

HOOK_ERROR = "hook_error"
"""The `subtype` of the `system` event that reports a hook that raised."""


def hook_error_message(
    event: HookEvent,
    hook: Callable[..., Any],
    error: Exception,
    *,
    tool_name: str | None = None,
    tool_use_id: str | None = None,
) -> SystemMessage:
    """The `system` event for `hook` having raised `error`; its `content` is the text for `result.errors`.

    `data`: `hook_event` (`Stop`, `SubagentStop`, `PostToolUse`), `hook_name` (the function's `__qualname__`, or its
    class's for a callable object), `error` (`TypeName: message`) and, for PostToolUse, `tool_name`
    and `tool_use_id`.
    """
    hook_name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    detail = str(error)
    text = f"{type(error).__name__}: {detail}" if detail else type(error).__name__
    data: dict[str, Any] = {"hook_event": event, "hook_name": hook_name, "error": text}
    where = ""
    if event == "PostToolUse":
        data["tool_name"], data["tool_use_id"] = tool_name, tool_use_id
        where = f" for {tool_name} ({tool_use_id})"
    return SystemMessage(subtype=HOOK_ERROR, content=f"{event} hook {hook_name} failed{where}: {text}", data=data)
