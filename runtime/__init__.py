"""queryloop's runtime: pykka actors scheduled by trio, sessions, supervision.

The public surface is re-exported here; modules whose names start with `_` are private.
"""

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
    "QueryloopError",
    "Runtime",
    "SessionClosed",
    "Supervisor",
    "SupervisorMessage",
    "TrioActor",
    "TrioFuture",
    "WorkCancelled",
]
