"""queryloop's runtime: pykka actors scheduled by trio, sessions, supervision.

The public surface is re-exported here; modules whose names start with `_` are private.
"""

from typing import Any

from loguru import logger

from runtime._future import TrioFuture
from runtime._runtime import Runtime
from runtime.actor import TrioActor
from runtime.errors import (
    ActorCrashed,
    BlockingCallOnTrioThread,
    NotInSession,
    QueryloopError,
    SessionClosed,
    WorkCancelled,
)
from runtime.messages import Abort, AbortAck, AbortReason, Message, SupervisorMessage
from runtime.supervisor import Supervisor

_SESSION_LAYER = {"Session": "runtime.session", "QueryHandle": "runtime.session", "QueryOptions": "runtime.options"}


def __getattr__(name: str) -> Any:
    # The session layer imports the actors, which import this kernel: it is loaded on first use.
    if name in _SESSION_LAYER:
        import importlib

        return getattr(importlib.import_module(_SESSION_LAYER[name]), name)
    raise AttributeError(name)


# A library stays quiet until its host asks: the CLI (or the host) enables these.
logger.disable("runtime")
logger.disable("actors")

__all__ = [
    "Abort",
    "AbortAck",
    "AbortReason",
    "ActorCrashed",
    "BlockingCallOnTrioThread",
    "Message",
    "NotInSession",
    "QueryHandle",
    "QueryOptions",
    "QueryloopError",
    "Runtime",
    "Session",
    "SessionClosed",
    "Supervisor",
    "SupervisorMessage",
    "TrioActor",
    "TrioFuture",
    "WorkCancelled",
]
