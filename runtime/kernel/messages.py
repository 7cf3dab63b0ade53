"""Messages every actor understands, whatever its role.

Messages between actors are frozen pydantic models: validated once when they
are built (at the boundary), never copied on the way. A `SupervisorMessage`
travels in the priority lane of an actor's inbox, ahead of every ordinary
message already queued.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

AbortReason = Literal["user", "interrupt", "crash", "shutdown"]
"""Why a session is aborted.

`user` is Ctrl+C / ESC or a consumer that stopped listening; `interrupt` is a new
user message submitted while tools ran (seed 000: no interruption message);
`crash` is a sibling actor that failed; `shutdown` is the runtime closing.
"""


class Message(BaseModel):
    """Base of every message exchanged between actors: frozen, strict fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class CarrierMessage(Message):
    """A message that carries runtime objects (channels, callables, actor refs, exceptions, other messages):
    such fields are checked with `isinstance`, not validated."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)


class SupervisorMessage(Message):
    """A message of the supervision protocol: delivered before ordinary mail."""


class Abort(SupervisorMessage):
    """Cancel all in-flight work of the receiving actor; answered by `AbortAck`."""

    reason: AbortReason


class Shutdown(SupervisorMessage):
    """Stop now: cancel all work; once it has unwound the actor stops (`on_stop` runs). Sent by `Supervisor.close()`."""


class AbortAck(Message):
    """An actor's answer to `Abort`, sent once its cancelled work has unwound."""

    actor: str
    cancelled_work: int
    """How many work tasks the abort cancelled (0 when the actor was idle)."""
