"""PostToolUse and PostToolUseFailure hooks (`QueryOptions.hooks`), in the Agent SDK's shape: run once a tool
call has run, PostToolUse when it succeeded and PostToolUseFailure when it failed (an exception, a timeout,
an error result), as Claude Code fires them. A call that never ran (unknown tool, input refused, permission
denied) fires neither.

What their answers do (`runtime.loop.event_hooks` runs them and reads the common fields):

* PostToolUse `decision: "block"` with `reason`: the reason is fed to the model after the call's result (a
  `hook_blocking_error` attachment), as Claude Code prompts Claude with it; the call has run all the same.
* PostToolUse `hookSpecificOutput.updatedToolOutput` replaces the result the model gets (a string or a list
  of content blocks; anything else is a hook error and the output is kept, as Claude Code rejects an output
  of the wrong shape); `updatedMCPToolOutput` does the same for an MCP tool's call only. With several, the
  last in configuration order wins.
* Both events: `additionalContext` reaches the model, `systemMessage` the user, and `continue: false` stops
  the query once this turn's calls are answered (`hook_stopped`).

`QueryOptions.post_tool_use_hooks` (the runtime's older hook form) runs through the same machinery: each hook
is a PostToolUse callback (`legacy_callback`) whose `HookDecision.blocking_error` is a block and `prevent` a
`continue: false`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from queryloop.runtime.loop.event_hooks import (
    QueryHooks,
    ReadAnswers,
    block_reason,
    read_answers,
    run_hooks,
    specific_output,
)
from queryloop.runtime.loop.hooks import PostToolUseHook, PostToolUseInput
from queryloop.runtime.loop.host_code import checked_field, checked_hook_decision
from queryloop.runtime.loop.sdk_hooks import HookMatcher

if TYPE_CHECKING:
    from queryloop.runtime.loop.sdk_hooks import HookCallback, HookContext, HookInput, HookJSONOutput

_KEEP = object()
"""No replacement output (None could be one a hook means)."""


@dataclass(frozen=True, slots=True)
class PostToolUseOutput:
    """What one PostToolUse answer says of the call: a block's reason, a replacement output."""

    block_reason: str | None = None
    output: Any = _KEEP


def read_post_tool_use(value: dict[str, Any], *, mcp: bool) -> PostToolUseOutput:
    """One PostToolUse answer's own fields, or `HostCodeError` (a `decision` other than block, a reason that is
    not a string, a replacement output that is neither a string nor a list of blocks)."""
    reason = block_reason(value, "Blocked by PostToolUse hook")
    output: Any = _KEEP
    specific = specific_output(value, "PostToolUse")
    if specific is not None:
        for key in ("updatedToolOutput", *(("updatedMCPToolOutput",) if mcp else ())):
            if key in specific:
                output = checked_field(specific, key, (str, list), "a string or a list of content blocks")
    return PostToolUseOutput(reason, output)


def _read_failure(value: dict[str, Any]) -> None:
    """A PostToolUseFailure answer has no fields of its own (its `decision: "block"` is accepted, no effect)."""
    specific_output(value, "PostToolUseFailure")


@dataclass(frozen=True, slots=True)
class PostToolUseVerdict:
    """What a call's PostToolUse (or PostToolUseFailure) hooks said."""

    read: ReadAnswers[Any]
    blocks: tuple[str, ...] = ()
    """Block reasons, for the model after the call's result."""
    output: Any = _KEEP
    """The replacement output, or `KEEP`."""

    @property
    def replaces_output(self) -> bool:
        return self.output is not _KEEP


async def run_post_tool_use(
    hooks: QueryHooks,
    tool_name: str,
    tool_use_id: str,
    *,
    tool_input: dict[str, Any],
    tool_response: object,
    duration_ms: int,
) -> PostToolUseVerdict:
    """Run the PostToolUse callbacks that select `tool_name` (a call that succeeded) and read their answers."""
    fields = {
        "tool_name": tool_name,
        "tool_input": tool_input,
        "tool_response": tool_response,
        "tool_use_id": tool_use_id,
        "duration_ms": duration_ms,
    }
    answers = await run_hooks(hooks, "PostToolUse", tool_name, fields, tool_use_id)
    mcp = tool_name.startswith("mcp__")
    read = read_answers(answers, "PostToolUse", lambda value: read_post_tool_use(value, mcp=mcp))
    blocks = tuple(own.block_reason for own in read.specific if own.block_reason is not None)
    output: Any = _KEEP
    for own in read.specific:
        if own.output is not _KEEP:
            output = own.output
    return PostToolUseVerdict(read, blocks, output)


async def run_post_tool_use_failure(
    hooks: QueryHooks,
    tool_name: str,
    tool_use_id: str,
    *,
    tool_input: dict[str, Any],
    error: str,
    duration_ms: int,
) -> PostToolUseVerdict:
    """Run the PostToolUseFailure callbacks that select `tool_name` (a call that failed) and read their answers."""
    fields = {
        "tool_name": tool_name,
        "tool_input": tool_input,
        "tool_use_id": tool_use_id,
        "error": error,
        "is_interrupt": False,
        "duration_ms": duration_ms,
    }
    answers = await run_hooks(hooks, "PostToolUseFailure", tool_name, fields, tool_use_id)
    return PostToolUseVerdict(read_answers(answers, "PostToolUseFailure", _read_failure))


def legacy_callback(hook: PostToolUseHook) -> HookCallback:
    """`hook` (a `QueryOptions.post_tool_use_hooks` entry) as a PostToolUse callback: given the call it was always
    given, its `HookDecision` said as the SDK says it (`blocking_error`: a block, `prevent`: `continue: false`).
    It reports failures under the hook's own name."""

    async def callback(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        data: dict[str, Any] = dict(input_data)
        decision = checked_hook_decision(
            await hook(
                PostToolUseInput(
                    tool_name=data["tool_name"],
                    tool_use_id=data["tool_use_id"],
                    tool_input=data["tool_input"],
                    result=data["tool_response"],
                    is_error=False,
                )
            )
        )
        output: HookJSONOutput = {}
        if decision is not None and decision.blocking_error is not None:
            output["decision"] = "block"
            output["reason"] = decision.blocking_error
        if decision is not None and decision.prevent is not None:
            output["continue_"] = False
            output["stopReason"] = decision.prevent
        return output

    callback.__qualname__ = getattr(hook, "__qualname__", None) or type(hook).__qualname__
    return callback


def legacy_matcher(hooks: list[PostToolUseHook]) -> HookMatcher:
    """`QueryOptions.post_tool_use_hooks` as one PostToolUse matcher for every tool (each hook under the default
    timeout, as every SDK callback is)."""
    return HookMatcher(matcher=None, hooks=[legacy_callback(hook) for hook in hooks])
