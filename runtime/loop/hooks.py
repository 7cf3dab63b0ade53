"""Stop hooks and PostToolUse hooks: async callables returning a `HookDecision` (or None to pass);
StopFailure hooks, told when a query ends on an API error.

A hook that raises is a non-blocking hook error, reported as Claude Code reports one and never to the
model: the loop goes on as if the hook had returned None (the other hooks' decisions still count),
a `system` event of subtype `hook_error` is emitted (`hook_error_message`: it joins the conversation,
whose system messages are never sent to the API) and its text is added to the query's
`result.errors`. The result's `subtype` and `is_error` stay what the query's ending makes them.

A StopFailure hook is not awaited by the loop (Claude Code's `void executeStopFailureHooks`): it runs
detached from the query, in the runtime, what it returns is ignored and an error it raises is logged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal

import trio
from loguru import logger
from pydantic import BaseModel, ConfigDict

from queryloop.runtime.loop.events import SystemMessage, TranscriptMessage


class HookDecision(BaseModel):
    """`blocking_error`: feed this back to the model and let it answer again (stop hooks).
    `prevent`: stop the query (stop hooks: `stop_hook_prevented`; PostToolUse: `hook_stopped`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    blocking_error: str | None = None
    prevent: str | None = None


class StopHookInput(BaseModel):
    """What a stop hook (or a subagent stop hook) is given when its query is about to end."""

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
    """What a PostToolUse hook is given once a tool has run: the call and its result."""

    model_config = ConfigDict(frozen=True)

    tool_name: str
    tool_use_id: str
    tool_input: dict[str, Any]
    result: Any
    is_error: bool


StopFailureError = Literal[
    "rate_limit",
    "overloaded",
    "server_error",
    "authentication_failed",
    "billing_error",
    "model_not_found",
    "invalid_request",
    "max_output_tokens",
    "unknown",
]
"""Claude Code's categories of the API error a turn ended on (its StopFailure hook's `error`)."""


class StopFailureInput(BaseModel):
    """What a StopFailure hook gets: the query ended on an API error, surfaced as the last assistant message
    (the model's reply was cut, refused or never came), so the stop hooks did not run."""

    model_config = ConfigDict(frozen=True)

    session_id: str
    error: StopFailureError
    error_details: str | None = None
    """The error as the API (or the provider) gave it."""
    last_assistant_message: str | None = None
    """The text of the API error message the query surfaced."""
    agent_id: str | None = None
    """The subagent whose query this was; None for the session's own."""
    agent_type: str | None = None


StopHook = Callable[[StopHookInput], Awaitable[HookDecision | None]]
PostToolUseHook = Callable[[PostToolUseInput], Awaitable[HookDecision | None]]
StopFailureHook = Callable[[StopFailureInput], Awaitable[object]]

STOP_FAILURE_HOOK_TIMEOUT_S = 600.0
"""How long a StopFailure hook may run (Claude Code's hook timeout, ten minutes); it is cancelled then."""

_STOP_FAILURE_BY_KIND: dict[str, StopFailureError] = {
    "rate_limit": "rate_limit",
    "overloaded": "overloaded",
    "api_error": "server_error",
    "authentication": "authentication_failed",
    "not_found": "model_not_found",
    "model_unavailable": "overloaded",
    "invalid_request": "invalid_request",
    "prompt_too_long": "invalid_request",
    "context_overflow": "invalid_request",
    "max_tokens_cap": "invalid_request",
}


def stop_failure_error(kind: str, message: str) -> StopFailureError:
    """The StopFailure category of a `ModelError` (its `kind` and message); a cut connection is `unknown`."""
    if "credit balance is too low" in message.lower():  # a 400 the API sends for billing
        return "billing_error"
    return _STOP_FAILURE_BY_KIND.get(kind, "unknown")


async def run_stop_failure_hook(hook: StopFailureHook, hook_input: StopFailureInput) -> None:
    """One StopFailure hook, detached from its query: bounded by `STOP_FAILURE_HOOK_TIMEOUT_S`, its answer
    ignored, an error it raises logged (the query has ended: there is no result left to report it in)."""
    name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    try:
        with trio.move_on_after(STOP_FAILURE_HOOK_TIMEOUT_S) as scope:
            await hook(hook_input)
    except Exception:  # noqa: BLE001 - a hook's failure never reaches the runtime
        log = logger.bind(session=hook_input.session_id)
        log.opt(exception=True).warning("StopFailure hook {} failed", name)
        return
    if scope.cancelled_caught:
        logger.bind(session=hook_input.session_id).warning(
            "StopFailure hook {} was cancelled after {} s", name, STOP_FAILURE_HOOK_TIMEOUT_S
        )


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


def failure_text(error: BaseException) -> str:
    """`TypeName: message` (the type alone when the message is empty), as `hook_error` events spell it."""
    detail = str(error)
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


HookErrorSource = Literal[
    "Stop",
    "SubagentStop",
    "PreToolUse",
    "PostToolUse",
    "PostToolUseFailure",
    "UserPromptSubmit",
    "SubagentStart",
    "PreCompact",
    "PostCompact",
    "Notification",
    "PermissionRequest",
    "SessionStart",
    "SessionEnd",
    "AttachmentSource",
    "MemoryPrefetch",
]
"""Which host code failed: a hook, or one of the options' other callbacks that a failure treats as one."""

HOOK_ERROR = "hook_error"
"""The `subtype` of the `system` event that reports a hook that raised."""


def hook_error_message(
    event: HookErrorSource,
    hook: Callable[..., Any],
    error: Exception,
    *,
    tool_name: str | None = None,
    tool_use_id: str | None = None,
) -> SystemMessage:
    """The `system` event for `hook` having raised `error`; its `content` is the text for `result.errors`.

    `data`: `hook_event` (a `HookErrorSource`), `hook_name` (the function's `__qualname__`, or its
    class's for a callable object), `error` (`TypeName: message`) and, for PreToolUse and PostToolUse,
    `tool_name` and `tool_use_id`.
    """
    hook_name = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    text = failure_text(error)
    data: dict[str, Any] = {"hook_event": event, "hook_name": hook_name, "error": text}
    where = ""
    if tool_name is not None:
        data["tool_name"], data["tool_use_id"] = tool_name, tool_use_id
        where = f" for {tool_name} ({tool_use_id})"
    return SystemMessage(subtype=HOOK_ERROR, content=f"{event} hook {hook_name} failed{where}: {text}", data=data)
