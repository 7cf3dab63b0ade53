"""Hooks in the Claude Agent SDK's own shape (`QueryOptions.hooks`): a hook written for `claude-agent-sdk`'s
Python `hooks=` runs here unchanged, imported from `queryloop` instead.

`hooks` maps an event name (`HookEvent`) to `HookMatcher`s; each matcher selects by its `matcher` (a tool
name, a `|` list or a regular expression: `runtime.loop.hook_matching`) and holds callbacks called as the SDK
calls them, `await callback(input_data, tool_use_id, context)`, each returning a dict (`HookJSONOutput`).
The names and shapes mirror the SDK's `types.py`; PreToolUse, PostToolUse and PostToolUseFailure run
(`runtime.loop.pre_tool_use`, `runtime.loop.post_tool_use`), and so do SubagentStart, PreCompact, PostCompact,
SessionStart, SessionEnd and StopFailure (`runtime.loop.lifecycle_hooks`); docs/hooks.md says what else is still to
come.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from pydantic import WithJsonSchema
from typing_extensions import TypeAliasType

HookEvent = Literal[
    "PreToolUse",
    "PostToolUse",
    "PostToolUseFailure",
    "UserPromptSubmit",
    "Stop",
    "SubagentStop",
    "PreCompact",
    "Notification",
    "SubagentStart",
    "PermissionRequest",
    "PostCompact",
    "SessionStart",
    "SessionEnd",
    "StopFailure",
]
"""The events a hook may be registered for: the names the SDK's Python `HookEvent` accepts, and four Claude Code
events it lacks (PostCompact, SessionStart, SessionEnd, StopFailure: a superset, so an SDK hook map is accepted
unchanged). Any other key of `QueryOptions.hooks` is refused. Which run yet: docs/hooks.md."""

HOOK_TIMEOUT_S = 60.0
"""How long a callback may run when its matcher gives no `timeout` (the SDK's and Claude Code's default)."""


class HookContext(TypedDict):
    """The third argument of a callback, as the SDK passes it: `signal` is reserved (always None)."""

    signal: Any | None


class BaseHookInput(TypedDict):
    """What every hook's `input_data` holds.

    `session_id` is the session's id (a subagent's hooks get its session's, as Claude Code's do);
    `transcript_path` the session's transcript file, or `""` for a session that keeps none;
    `cwd` the process's working directory when the hook fires; `permission_mode` is always `"default"`
    (the runtime has no permission modes: `can_use_tool` decides)."""

    session_id: str
    transcript_path: str
    cwd: str
    permission_mode: str


class PreToolUseHookInput(BaseHookInput):
    """A PreToolUse callback's `input_data`: the call about to run, after its input passed the tool's model.

    `agent_id` and `agent_type` are there only for a call made inside a subagent (its id and its name in
    `QueryOptions.agents`), as in the SDK; absent on the session's own calls."""

    hook_event_name: Literal["PreToolUse"]
    tool_name: str
    tool_input: dict[str, Any]
    tool_use_id: str
    agent_id: NotRequired[str]
    agent_type: NotRequired[str]


class PostToolUseHookInput(BaseHookInput):
    """A PostToolUse callback's `input_data`: a call that ran and succeeded, its output (`tool_response`, what
    the model gets: a string or a list of content blocks) and how long it ran (`duration_ms`, hooks and the
    permission check excluded)."""

    hook_event_name: Literal["PostToolUse"]
    tool_name: str
    tool_input: dict[str, Any]
    tool_response: Any
    tool_use_id: str
    duration_ms: NotRequired[int]
    agent_id: NotRequired[str]
    agent_type: NotRequired[str]


class PostToolUseFailureHookInput(BaseHookInput):
    """A PostToolUseFailure callback's `input_data`: a call that ran and failed (`error`: its error text)."""

    hook_event_name: Literal["PostToolUseFailure"]
    tool_name: str
    tool_input: dict[str, Any]
    tool_use_id: str
    error: str
    is_interrupt: NotRequired[bool]
    duration_ms: NotRequired[int]
    agent_id: NotRequired[str]
    agent_type: NotRequired[str]


class SubagentStartHookInput(BaseHookInput):
    """A SubagentStart callback's `input_data`: a subagent about to start (its matcher is tested against
    `agent_type`, the agent's name in `QueryOptions.agents`); `agent_id` names it in its events and hooks."""

    hook_event_name: Literal["SubagentStart"]
    agent_id: str
    agent_type: str


class PreCompactHookInput(BaseHookInput):
    """A PreCompact callback's `input_data`: a compaction about to run (`trigger` `"auto"`: every compaction the
    loop asks for; `custom_instructions`: `QueryOptions.compact_instructions`)."""

    hook_event_name: Literal["PreCompact"]
    trigger: Literal["manual", "auto"]
    custom_instructions: str | None
    agent_id: NotRequired[str]
    agent_type: NotRequired[str]


class PostCompactHookInput(BaseHookInput):
    """A PostCompact callback's `input_data` (Claude Code's; the SDK's Python types lack it): a compaction
    installed, `compact_summary` the summary that now starts the conversation."""

    hook_event_name: Literal["PostCompact"]
    trigger: Literal["manual", "auto"]
    compact_summary: str
    agent_id: NotRequired[str]
    agent_type: NotRequired[str]


class SessionStartHookInput(BaseHookInput):
    """A SessionStart callback's `input_data` (Claude Code's): `source` `"startup"` (a new session's first query),
    `"resume"` (a session restored from its transcript) or `"compact"` (after a compaction)."""

    hook_event_name: Literal["SessionStart"]
    source: Literal["startup", "resume", "clear", "compact"]


class SessionEndHookInput(BaseHookInput):
    """A SessionEnd callback's `input_data` (Claude Code's): the session closes (`reason` `"other"`)."""

    hook_event_name: Literal["SessionEnd"]
    reason: str


class StopFailureHookInput(BaseHookInput):
    """A StopFailure callback's `input_data` (Claude Code's): the query ends on an API error (`error`, Claude
    Code's category; `error_details`, the error as given; `last_assistant_message`, the error message's text)."""

    hook_event_name: Literal["StopFailure"]
    error: str
    error_details: NotRequired[str]
    last_assistant_message: NotRequired[str]
    agent_id: NotRequired[str]
    agent_type: NotRequired[str]


class UserPromptSubmitHookInput(BaseHookInput):
    """A UserPromptSubmit callback's `input_data`: the prompt (its text) before it joins the conversation."""

    hook_event_name: Literal["UserPromptSubmit"]
    prompt: str


class StopHookInput(BaseHookInput):
    """A Stop callback's `input_data` (the SDK's `StopHookInput`; `queryloop.StopHookInput` is the older
    `stop_hooks`' own input): `stop_hook_active` is true once a stop hook sent the model back in this query."""

    hook_event_name: Literal["Stop"]
    stop_hook_active: bool
    last_assistant_message: NotRequired[str]


class SubagentStopHookInput(BaseHookInput):
    """A SubagentStop callback's `input_data`: a subagent's Stop, with its id, type and transcript."""

    hook_event_name: Literal["SubagentStop"]
    stop_hook_active: bool
    agent_id: str
    agent_transcript_path: str
    agent_type: str
    last_assistant_message: NotRequired[str]


class PermissionRequestHookInput(BaseHookInput):
    """A PermissionRequest callback's `input_data`: a call whose permission is about to be asked of the host."""

    hook_event_name: Literal["PermissionRequest"]
    tool_name: str
    tool_input: dict[str, Any]
    permission_suggestions: NotRequired[list[Any]]
    agent_id: NotRequired[str]
    agent_type: NotRequired[str]


class NotificationHookInput(BaseHookInput):
    """A Notification callback's `input_data`: what Claude Code would tell the user (`permission_prompt`)."""

    hook_event_name: Literal["Notification"]
    message: str
    title: NotRequired[str]
    notification_type: str


# Aliases by name (`TypeAliasType`): the SDK's names, each the public name of its own object.
HookInput = TypeAliasType(
    "HookInput",
    PreToolUseHookInput
    | PostToolUseHookInput
    | PostToolUseFailureHookInput
    | SubagentStartHookInput
    | PreCompactHookInput
    | PostCompactHookInput
    | SessionStartHookInput
    | SessionEndHookInput
    | StopFailureHookInput
    | UserPromptSubmitHookInput
    | StopHookInput
    | SubagentStopHookInput
    | PermissionRequestHookInput
    | NotificationHookInput,
)
"""A callback's `input_data` (the SDK's union of every event's input: the events that run so far)."""


class PreToolUseHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a PreToolUse callback's answer.

    `permissionDecision`: `"deny"` (the tool does not run; `permissionDecisionReason` is the model's error),
    `"allow"` (it runs without asking `can_use_tool`; `updatedInput` replaces its input), `"ask"` (as
    none: `can_use_tool` decides), `"defer"` (the turn's only call waits for the host: the query ends
    `tool_deferred`, docs/hooks.md). `additionalContext` is not used yet."""

    hookEventName: Literal["PreToolUse"]
    permissionDecision: NotRequired[Literal["allow", "deny", "ask", "defer"]]
    permissionDecisionReason: NotRequired[str]
    updatedInput: NotRequired[dict[str, Any]]
    additionalContext: NotRequired[str]


class PostToolUseHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a PostToolUse callback's answer: `additionalContext` for the model,
    `updatedToolOutput` in place of the call's output (a string or a list of content blocks), and
    `updatedMCPToolOutput`, the same for an MCP tool's call only."""

    hookEventName: Literal["PostToolUse"]
    additionalContext: NotRequired[str]
    updatedToolOutput: NotRequired[Any]
    updatedMCPToolOutput: NotRequired[Any]


class PostToolUseFailureHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a PostToolUseFailure callback's answer."""

    hookEventName: Literal["PostToolUseFailure"]
    additionalContext: NotRequired[str]


class UserPromptSubmitHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a UserPromptSubmit callback's answer: `additionalContext` follows the prompt."""

    hookEventName: Literal["UserPromptSubmit"]
    additionalContext: NotRequired[str]


class StopHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a Stop callback's answer: `additionalContext` sends the model back with it."""

    hookEventName: Literal["Stop"]
    additionalContext: NotRequired[str]


class SubagentStopHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a SubagentStop callback's answer: as Stop's, for the subagent."""

    hookEventName: Literal["SubagentStop"]
    additionalContext: NotRequired[str]


class PermissionRequestHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a PermissionRequest callback's answer: `decision`, `{"behavior": "allow",
    "updatedInput": {...}}` or `{"behavior": "deny", "message": "...", "interrupt": False}`."""

    hookEventName: Literal["PermissionRequest"]
    decision: dict[str, Any]


class NotificationHookSpecificOutput(TypedDict):
    """`hookSpecificOutput` of a Notification callback's answer (nothing here decides anything)."""

    hookEventName: Literal["Notification"]
    additionalContext: NotRequired[str]


HookSpecificOutput = TypeAliasType(
    "HookSpecificOutput",
    PreToolUseHookSpecificOutput
    | PostToolUseHookSpecificOutput
    | PostToolUseFailureHookSpecificOutput
    | UserPromptSubmitHookSpecificOutput
    | StopHookSpecificOutput
    | SubagentStopHookSpecificOutput
    | PermissionRequestHookSpecificOutput
    | NotificationHookSpecificOutput,
)
"""`hookSpecificOutput`, by event."""


class SyncHookJSONOutput(TypedDict, total=False):
    """What a callback returns (`{}`: no opinion). The SDK's fields: `continue_` (`continue` is read too)
    `False` stops the query, `stopReason` saying why; `systemMessage` is a warning for the user;
    `suppressOutput` is accepted and changes nothing, as in Claude Code. `decision: "block"` with `reason`
    blocks what the event decides (PostToolUse: the reason goes to the model); for PreToolUse the
    deprecated `decision` counts as `"block"`: deny, `"approve"`: allow, with `reason` as the deny's text
    when `permissionDecisionReason` gives none."""

    continue_: bool
    suppressOutput: bool
    stopReason: str
    decision: Literal["block", "approve"]
    systemMessage: str
    reason: str
    hookSpecificOutput: HookSpecificOutput


HookJSONOutput = TypeAliasType("HookJSONOutput", SyncHookJSONOutput)
"""A callback's answer (the SDK's also allows `{"async_": True}`, which decides nothing here)."""

HookCallback = Callable[[HookInput, str | None, HookContext], Awaitable[HookJSONOutput]]
"""`async def hook(input_data, tool_use_id, context) -> dict`, the SDK's callback signature."""


@dataclass
class HookMatcher:
    """Callbacks for the calls a matcher selects, as the SDK's `HookMatcher` (same fields, same order).

    `matcher`: None, `""` or `"*"` for every tool; a name or a `|` or `,` list of names (`"Write|Edit"`);
    anything else a regular expression searched in the tool's name (`"^mcp__"`). `hooks`: the callbacks, all run in
    parallel with those of every other matching matcher. `timeout`: seconds each of them may run (None:
    60); one that runs longer is cancelled and reported as a hook error, as one that raises is."""

    matcher: str | None = None
    hooks: Annotated[list[HookCallback], WithJsonSchema({"type": "array", "items": {}})] = field(default_factory=list)
    timeout: float | None = None

    def __post_init__(self) -> None:
        # Refused when made, not at the first tool call: trio's deadlines take no negative or NaN seconds.
        if self.timeout is not None and not self.timeout > 0:
            msg = f"HookMatcher.timeout must be > 0 seconds (None: {HOOK_TIMEOUT_S:g}), not {self.timeout!r}"
            raise ValueError(msg)

    @property
    def timeout_s(self) -> float:
        """The seconds each callback may run: `timeout`, or the 60 s default."""
        return HOOK_TIMEOUT_S if self.timeout is None else self.timeout
