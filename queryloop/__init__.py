"""queryloop: Claude-Code-style agent loops as groups of pykka actors scheduled by trio.

What a host uses is importable from here: runtimes and sessions (`Runtime`, `BlockingRuntime`), the
options, tools, hooks and providers a session is given, the events and results a query yields, and
every error. Each of these says it is `queryloop`'s (`queryloop.Runtime.__module__ == "queryloop"`),
wherever it is defined. Beside it:

- `queryloop.aio`: `AsyncioRuntime`, the same sessions, queries and events, awaited on asyncio;
- `queryloop.ray`: sessions sharded over Ray actors (the `ray` extra);
- `queryloop.lowlevel`: the kernel (`TrioActor`, `Supervisor`, their messages), for hosts that write
  actors of their own, as `trio.lowlevel` is trio's.

Names a host rarely needs live where they are defined: `Event` (the base of every event; type a
query's events as `QueryEvent`) in `queryloop.runtime.loop.events`, `Sidechain` (the values of
`LoadedTranscript.sidechains`) in `queryloop.runtime.loop.restore`, `transcript_problems` in
`queryloop.runtime.loop.transcript`, `reply_events` in `queryloop.runtime.providers.scripted`, and the
Agent tool's `AGENT_TOOL_NAME` and `AgentInput` in `queryloop.runtime.loop.agents`.

The code lives in two subpackages: `queryloop.runtime` (the kernel, the loop's rules, providers, hosts,
the CLI; its docstring maps the layers) and `queryloop.actors` (the six actors of a session).

The library is silent until its host asks: `from loguru import logger; logger.enable("queryloop")`.
"""

import importlib.metadata as _metadata
import inspect as _inspect
import sys as _sys
import types as _types
from typing import Any as _Any

from loguru import logger as _logger

from queryloop.runtime.errors import (
    ActorCrashed,
    BlockingCallOnTrioThread,
    CompactFailed,
    McpRequestFailed,
    McpServerUnavailable,
    NotInSession,
    NotInTrio,
    QueryInProgress,
    QueryloopError,
    RuntimeClosed,
    SessionClosed,
    TranscriptDamaged,
    TranscriptHoldsAnotherSession,
    TranscriptInUse,
    TranscriptRefused,
    WorkCancelled,
)
from queryloop.runtime.host.blocking import BlockingQuery, BlockingRuntime, BlockingSession
from queryloop.runtime.host.protocols import QueryView, SessionView, SyncQueryView, SyncSessionView
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.kernel.messages import AbortReason
from queryloop.runtime.loop.agents import AgentDefinition
from queryloop.runtime.loop.context_usage import ContextUsageCategory, ContextUsageResponse
from queryloop.runtime.loop.control import PermissionRuleValue, PermissionUpdate, ToolPermissionContext
from queryloop.runtime.loop.events import (
    AgentUsage,
    AssistantMessage,
    AttachmentMessage,
    Block,
    DeferredToolUse,
    ProgressEvent,
    QueryEvent,
    ResultMessage,
    ResultSubtype,
    StreamEvent,
    StreamRequestStart,
    SystemMessage,
    TombstoneEvent,
    ToolUseSummaryEvent,
    TranscriptMessage,
    Usage,
    UserMessage,
)
from queryloop.runtime.loop.hooks import (
    HookDecision,
    PostToolUseHook,
    PostToolUseInput,
    StopFailureHook,
    StopFailureInput,
    StopHook,
    StopHookInput,
)
from queryloop.runtime.loop.model import FallbackTriggered, ModelError, ModelProvider, ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.permissions import PermissionMode
from queryloop.runtime.loop.pricing import Pricing
from queryloop.runtime.loop.restore import LoadedTranscript, load_transcript
from queryloop.runtime.loop.sdk_hooks import (
    BaseHookInput,
    HookCallback,
    HookContext,
    HookEvent,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    HookSpecificOutput,
    NotificationHookInput,
    PermissionRequestHookInput,
    PostCompactHookInput,
    PostToolUseFailureHookInput,
    PostToolUseFailureHookSpecificOutput,
    PostToolUseHookInput,
    PostToolUseHookSpecificOutput,
    PreCompactHookInput,
    PreToolUseHookInput,
    PreToolUseHookSpecificOutput,
    SessionEndHookInput,
    SessionStartHookInput,
    StopFailureHookInput,
    SubagentStartHookInput,
    SubagentStopHookInput,
    SyncHookJSONOutput,
    UserPromptSubmitHookInput,
)
from queryloop.runtime.loop.settings import SettingsError, SettingSource
from queryloop.runtime.loop.state import ContinueReason, Terminal, TerminalReason
from queryloop.runtime.loop.tools import (
    Allow,
    CanUseTool,
    Deny,
    PermissionResult,
    Tool,
    ToolContext,
    ToolError,
    tool,
)
from queryloop.runtime.mcp.elicitation import McpElicitation, McpElicitationAnswer
from queryloop.runtime.mcp.servers import McpHttpServer, McpStdioServer
from queryloop.runtime.providers.anthropic_model import AnthropicModel
from queryloop.runtime.providers.local_api import LocalMessagesAPI
from queryloop.runtime.providers.scripted import (
    ScriptedError,
    ScriptedModel,
    ScriptedReply,
    ScriptedUsage,
    ScriptExhausted,
)

try:
    __version__ = _metadata.version("queryloop")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# A library stays quiet until its host asks: `logger.enable("queryloop")`.
_logger.disable("queryloop")

__all__ = [
    "AbortReason",
    "ActorCrashed",
    "AgentDefinition",
    "AgentUsage",
    "Allow",
    "AnthropicModel",
    "AssistantMessage",
    "AttachmentMessage",
    "BaseHookInput",
    "Block",
    "BlockingCallOnTrioThread",
    "BlockingQuery",
    "BlockingRuntime",
    "BlockingSession",
    "CanUseTool",
    "CompactFailed",
    "ContextUsageCategory",
    "ContextUsageResponse",
    "ContinueReason",
    "DeferredToolUse",
    "Deny",
    "FallbackTriggered",
    "HookCallback",
    "HookContext",
    "HookDecision",
    "HookEvent",
    "HookInput",
    "HookJSONOutput",
    "HookMatcher",
    "HookSpecificOutput",
    "LoadedTranscript",
    "LocalMessagesAPI",
    "McpElicitation",
    "McpElicitationAnswer",
    "McpHttpServer",
    "McpRequestFailed",
    "McpServerUnavailable",
    "McpStdioServer",
    "ModelError",
    "ModelProvider",
    "ModelRequest",
    "NotInSession",
    "NotInTrio",
    "NotificationHookInput",
    "PermissionMode",
    "PermissionRequestHookInput",
    "PermissionResult",
    "PermissionRuleValue",
    "PermissionUpdate",
    "PostCompactHookInput",
    "PostToolUseFailureHookInput",
    "PostToolUseFailureHookSpecificOutput",
    "PostToolUseHook",
    "PostToolUseHookInput",
    "PostToolUseHookSpecificOutput",
    "PostToolUseInput",
    "PreCompactHookInput",
    "PreToolUseHookInput",
    "PreToolUseHookSpecificOutput",
    "Pricing",
    "ProgressEvent",
    "QueryEvent",
    "QueryHandle",
    "QueryInProgress",
    "QueryOptions",
    "QueryView",
    "QueryloopError",
    "ResultMessage",
    "ResultSubtype",
    "Runtime",
    "RuntimeClosed",
    "ScriptExhausted",
    "ScriptedError",
    "ScriptedModel",
    "ScriptedReply",
    "ScriptedUsage",
    "Session",
    "SessionClosed",
    "SessionEndHookInput",
    "SessionStartHookInput",
    "SessionView",
    "SettingSource",
    "SettingsError",
    "StopFailureHook",
    "StopFailureHookInput",
    "StopFailureInput",
    "StopHook",
    "StopHookInput",
    "StreamEvent",
    "StreamRequestStart",
    "SubagentStartHookInput",
    "SubagentStopHookInput",
    "SyncHookJSONOutput",
    "SyncQueryView",
    "SyncSessionView",
    "SystemMessage",
    "Terminal",
    "TerminalReason",
    "TombstoneEvent",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolPermissionContext",
    "ToolUseSummaryEvent",
    "TranscriptDamaged",
    "TranscriptHoldsAnotherSession",
    "TranscriptInUse",
    "TranscriptMessage",
    "TranscriptRefused",
    "Usage",
    "UserMessage",
    "UserPromptSubmitHookInput",
    "WorkCancelled",
    "__version__",
    "load_transcript",
    "tool",
]


# Names under these are the code's homes, not a host's: a class or function exported from one of them
# takes the public module's name.
_PRIVATE_HOMES = ("queryloop.runtime.", "queryloop.actors.")


def _publish(namespace: dict[str, _Any]) -> None:
    """Give each class and function a public module exports (its `__all__`) that module's name as `__module__`.

    As trio's and httpx's do: reprs, tracebacks and documentation then say `queryloop.Runtime`, the name
    a host imports, not the private module it is defined in. Pickle finds a class by `__module__` and
    `__qualname__`, which still resolve to the same object: the public module holds it under that name
    (a name exported as an alias would not, so it is left as it is). A name exported by a second public
    module too (`RuntimeClosed`) keeps the first; typing aliases (`AbortReason`) have no module to set.
    """
    public = namespace["__name__"]
    for name in namespace["__all__"]:
        found = namespace[name]
        if isinstance(found, _types.GenericAlias) or not isinstance(found, type | _types.FunctionType):
            continue
        if not found.__module__.startswith(_PRIVATE_HOMES) or found.__qualname__ != name:
            continue
        if isinstance(found, type):
            _settle_annotations(found)
        found.__module__ = public


def _settle_annotations(cls: type) -> None:
    """Evaluate the string annotations `cls` declares, where it is defined, before its `__module__` changes.

    `from __future__ import annotations` leaves them strings, which `typing.get_type_hints` and pydantic
    evaluate in the module `__module__` names (a record's `TypeAdapter`, made on first use; a host's model
    subclassing ours): in `queryloop`, `Literal` or `Block` would be found nowhere. A name only type
    checkers see (imported under TYPE_CHECKING) stays a string: it resolved nowhere before either.
    """
    home = vars(_sys.modules[cls.__module__])
    settled = _inspect.get_annotations(cls)
    fields: dict[str, _Any] = getattr(cls, "__dataclass_fields__", {})
    for attr, hint in settled.items():
        if not isinstance(hint, str):
            continue
        try:
            value = eval(hint, home)  # our own annotations, read as typing.get_type_hints reads them
        except (NameError, AttributeError, TypeError):
            continue
        settled[attr] = value
        if attr in fields and fields[attr].type == hint:  # what pydantic reads of a dataclass
            fields[attr].type = value
    cls.__annotations__ = settled


_publish(globals())

# The kernel's names carry `queryloop.lowlevel` whether or not the host imports it (the kernel is loaded
# by `Runtime` anyway), and `queryloop.lowlevel` is there after `import queryloop`, as `trio.lowlevel` is.
from queryloop import lowlevel as lowlevel  # noqa: E402
