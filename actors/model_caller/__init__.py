"""The ModelCaller actor (`caller`) and its messages (`messages`).

May import the kernel (`queryloop.runtime.kernel`), the loop's pure modules (`queryloop.runtime.loop`), telemetry
and the StreamingToolExecutor's messages (each completed `tool_use` goes to it); nothing of the hosts."""

from queryloop.actors.model_caller.caller import PROMPT_TOO_LONG_ERROR_MESSAGE, ModelCaller
from queryloop.actors.model_caller.messages import (
    CallEnded,
    CallFeed,
    CallProgress,
    ConsumerGone,
    RetryAnnounced,
    StartCall,
    call_ended,
    start_call,
)

__all__ = [
    "PROMPT_TOO_LONG_ERROR_MESSAGE",
    "CallEnded",
    "CallFeed",
    "CallProgress",
    "ConsumerGone",
    "ModelCaller",
    "RetryAnnounced",
    "StartCall",
    "call_ended",
    "start_call",
]
