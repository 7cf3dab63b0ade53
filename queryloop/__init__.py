"""queryloop: Claude-Code-style agent loops as groups of pykka actors scheduled by trio.

Everything a host needs is importable from here; an asyncio host imports `AsyncioRuntime` from
`queryloop.aio` (the same sessions, queries and events, awaited on asyncio). The code lives in two subpackages:
`queryloop.runtime` (the kernel, the loop's rules, providers, hosts, the CLI; its docstring maps the
layers) and `queryloop.actors` (the six actors of a session).

The library is silent until its host asks: `from loguru import logger; logger.enable("queryloop")`.
"""

import importlib.metadata as _metadata

from loguru import logger as _logger

from queryloop.runtime.errors import (
    ActorCrashed,
    BlockingCallOnTrioThread,
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
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.kernel._future import TrioFuture
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.messages import Abort, AbortAck, AbortReason, Message, SupervisorMessage
from queryloop.runtime.kernel.supervisor import Supervisor
from queryloop.runtime.loop.agents import AGENT_TOOL_NAME, AgentDefinition, AgentInput
from queryloop.runtime.loop.events import (
    AgentUsage,
    AssistantMessage,
    AttachmentMessage,
    Block,
    Event,
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
from queryloop.runtime.loop.pricing import Pricing
from queryloop.runtime.loop.restore import LoadedTranscript, Sidechain, load_transcript
from queryloop.runtime.loop.state import ContinueReason, Terminal, TerminalReason
from queryloop.runtime.loop.tools import Allow, CanUseTool, Deny, PermissionResult, Tool, ToolContext, ToolError, tool
from queryloop.runtime.loop.transcript import transcript_problems
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
    reply_events,
)

try:
    __version__ = _metadata.version("queryloop")
except _metadata.PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# A library stays quiet until its host asks: `logger.enable("queryloop")`.
_logger.disable("queryloop")

__all__ = [
    "AGENT_TOOL_NAME",
    "Abort",
    "AbortAck",
    "AbortReason",
    "ActorCrashed",
    "AgentDefinition",
    "AgentInput",
    "AgentUsage",
    "Allow",
    "AnthropicModel",
    "AssistantMessage",
    "AttachmentMessage",
    "Block",
    "BlockingCallOnTrioThread",
    "BlockingQuery",
    "BlockingRuntime",
    "BlockingSession",
    "CanUseTool",
    "ContinueReason",
    "Deny",
    "Event",
    "FallbackTriggered",
    "HookDecision",
    "LoadedTranscript",
    "LocalMessagesAPI",
    "McpElicitation",
    "McpElicitationAnswer",
    "McpHttpServer",
    "McpRequestFailed",
    "McpServerUnavailable",
    "McpStdioServer",
    "Message",
    "ModelError",
    "ModelProvider",
    "ModelRequest",
    "NotInSession",
    "NotInTrio",
    "PermissionResult",
    "PostToolUseHook",
    "PostToolUseInput",
    "Pricing",
    "ProgressEvent",
    "QueryEvent",
    "QueryHandle",
    "QueryInProgress",
    "QueryOptions",
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
    "Sidechain",
    "StopFailureHook",
    "StopFailureInput",
    "StopHook",
    "StopHookInput",
    "StreamEvent",
    "StreamRequestStart",
    "Supervisor",
    "SupervisorMessage",
    "SystemMessage",
    "Terminal",
    "TerminalReason",
    "TombstoneEvent",
    "Tool",
    "ToolContext",
    "ToolError",
    "ToolUseSummaryEvent",
    "TranscriptDamaged",
    "TranscriptHoldsAnotherSession",
    "TranscriptInUse",
    "TranscriptMessage",
    "TranscriptRefused",
    "TrioActor",
    "TrioFuture",
    "Usage",
    "UserMessage",
    "WorkCancelled",
    "__version__",
    "load_transcript",
    "reply_events",
    "tool",
    "transcript_problems",
]
