"""The StreamingToolExecutor's messages (a turn's setting, each tool to run, a discard, a tool's result) and
what one call carries through it (`CallEntry`), with the error results every refusing path gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import trio

from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import CarrierMessage, Message, keyword_maker, record
from queryloop.runtime.loop.control import PermissionAsker, Permissions
from queryloop.runtime.loop.deferred import deferred_attachment, deferred_tool_use
from queryloop.runtime.loop.event_hooks import QueryHooks
from queryloop.runtime.loop.events import (
    AttachmentMessage,
    Block,
    DeferredToolUse,
    ProgressEvent,
    SystemMessage,
    UserMessage,
)
from queryloop.runtime.loop.tools import Tool
from queryloop.runtime.loop.transcript import tool_error, tool_result_message


class QueryAbortFlag(Protocol):
    """What the executor reads of its query's control: whether an abort has reached the query."""

    @property
    def abort_reason(self) -> str | None: ...


@record
class BeginTurn(CarrierMessage):
    """One model call's tool setting: results go to `sink`. It travels with each `AddTool`: a call
    without tools never wakes the executor, and the first tool of a new call discards the old call's."""

    sink: EventChannel[Any]
    tools: dict[str, Tool]
    can_use_tool: PermissionAsker | None = None
    """`can_use_tool`, called with the SDK's context (`permission_asker`)."""
    permissions: Permissions | None = None
    """The session's permission rules and mode (None: no rule, no mode and no `can_use_tool` decides anything)."""
    agent_id: str | None = None
    """The subagent whose calls these are (its `can_use_tool` context says so); None for the session's own."""
    hooks: QueryHooks | None = None
    """The query's hooks (PreToolUse before `can_use_tool`, PostToolUse after a call; None: it has none)."""
    control: QueryAbortFlag | None = None
    """The query's control: once an abort has reached the query, none of its tools starts any more."""

    async def report(self, tool_use_id: str, data: Any) -> None:
        """A running tool's progress, to the turn channel (each tool's `ToolContext` reports here)."""
        await self.sink.send(ProgressEvent(tool_use_id=tool_use_id, data=data))


@record
class AddTool(CarrierMessage):
    """A `tool_use` block completed in the stream (or was cut off: `input_error` says why)."""

    block: Block
    turn: BeginTurn
    input_error: str | None = None


@record
class Discard(Message):
    """Fallback: the response is retracted; cancel its tools and drop their results."""


@record
class ToolResult(Message):
    """A tool's answer, sent to the turn channel."""

    tool_use_id: str
    message: UserMessage | AttachmentMessage
    """Its `tool_result`; for a call a PreToolUse hook deferred (`deferred`), the `hook_deferred_tool` attachment
    (also the last of its `hook_messages`, which are emitted instead)."""
    hook_messages: list[AttachmentMessage | SystemMessage] = field(default_factory=list)
    """What its PreToolUse and PostToolUse hooks produced, in order (module docstring); emitted after `message`."""
    prevent_continuation: bool = False
    host_errors: tuple[str, ...] = ()
    """What host code failed while answering it (`can_use_tool`, an input validator): for the result's `errors`."""
    denial: dict[str, Any] | None = None
    """A denied permission (by a hook, a rule, the mode or `can_use_tool`): the result's `permission_denials` entry
    (`tool_name`, `tool_use_id`, `tool_input`)."""
    interrupt: bool = False
    """`can_use_tool` denied it with `interrupt`: the query ends as a user's interrupt ends it."""
    deferred: DeferredToolUse | None = None
    """A PreToolUse hook deferred the call (the turn's only one): it has no result, the query ends `tool_deferred`
    with this as the result's `deferred_tool_use`."""


class ResponseGate:
    """A call whose PreToolUse hooks deferred it waits here for its response's end, which alone says how many tool
    calls the turn has (a call starts as its block completes in the stream). Sent to the turn channel, where the
    loop opens it once the response is whole (`open`); made only for a defer, so no other call pays for it."""

    __slots__ = ("closed", "tool_calls")

    def __init__(self) -> None:
        self.closed = trio.Event()
        self.tool_calls = 0

    def open(self, tool_calls: int) -> None:
        """The response is whole, with `tool_calls` tool calls."""
        self.tool_calls = tool_calls
        self.closed.set()


begin_turn = keyword_maker(BeginTurn)
add_tool = keyword_maker(AddTool)
tool_result = keyword_maker(ToolResult)
"""`BeginTurn(...)`, `AddTool(...)` and `ToolResult(...)` for every call and tool (`keyword_maker`)."""


Status = Literal["queued", "executing", "delivered", "discarded"]


@dataclass(slots=True)
class CallEntry:
    """One `tool_use` of the turn, through the executor: its block, status, and what its hooks produced."""

    block: Block
    input_error: str | None
    safe: bool
    status: Status = "queued"
    scope: trio.CancelScope | None = None
    """The scope its work runs under, once started (`Discard` cancels it alone)."""
    hook_messages: list[AttachmentMessage | SystemMessage] | None = None
    """What its PreToolUse hooks produced (None: nothing, or none ran)."""
    stop: str | None = None
    """A hook's `continue: false`: the text the query stops with after this turn."""
    host_error: str | None = None
    """Host code that failed without deciding the call (an `updated_permissions` not applied)."""

    @property
    def id(self) -> str:
        tool_id: str = self.block["id"]
        return tool_id


def with_stop(entry: CallEntry) -> list[AttachmentMessage | SystemMessage]:
    """The call's hook messages, then the `hook_stopped_continuation` attachment of a hook that stopped the query."""
    messages = list(entry.hook_messages or ())
    if entry.stop is not None:
        name = entry.block.get("name", "")
        messages.append(
            AttachmentMessage(
                attachment={
                    "type": "hook_stopped_continuation",
                    "message": entry.stop,
                    "tool_use_id": entry.id,
                    "tool_name": name,
                }
            )
        )
    return messages


def failed(
    entry: CallEntry,
    message: str,
    *,
    host_error: str | None = None,
    denial: dict[str, Any] | None = None,
    interrupt: bool = False,
) -> ToolResult:
    result = tool_result_message(entry.id, tool_error(message), is_error=True)
    return ToolResult(
        tool_use_id=entry.id,
        message=result,
        hook_messages=with_stop(entry),
        prevent_continuation=entry.stop is not None,
        host_errors=(host_error,) if host_error else (),
        denial=denial,
        interrupt=interrupt,
    )


def deferred(entry: CallEntry) -> ToolResult:
    """The answer of a call a PreToolUse hook deferred: no result, its hooks' messages then its `hook_deferred_tool`
    attachment, and the query stops after it (`tool_deferred`)."""
    call = deferred_tool_use(entry.block)
    attachment = deferred_attachment(call)
    return ToolResult(
        tool_use_id=entry.id,
        message=attachment,
        hook_messages=[*(entry.hook_messages or ()), attachment],  # never empty: the loop's slow path takes it
        prevent_continuation=True,
        deferred=call,
    )


def denied(entry: CallEntry, message: str, tool_input: dict[str, Any], *, interrupt: bool = False) -> ToolResult:
    """The error result of a call whose permission was denied, with its `permission_denials` entry."""
    denial = {"tool_name": entry.block.get("name", ""), "tool_use_id": entry.id, "tool_input": tool_input}
    return failed(entry, message, denial=denial, interrupt=interrupt)
