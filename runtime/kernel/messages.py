"""Messages every actor understands, whatever its role.

Messages between actors are frozen records (`queryloop.runtime._records.record`: slotted dataclasses
whose `__init__` only stores): actors build them from data already checked, so nothing is validated or
copied on the way. Declare one as a dataclass: `@record class Ping(Message): n: int`. Where one is built per
call, per block or per tool, `ping = keyword_maker(Ping)` builds it without the dict of keywords a class
call makes (`ping(n=1)`, the same keywords and types).

A `SupervisorMessage` travels in the priority lane of an actor's inbox, ahead of every ordinary
message already queued. It is the one kind that comes from outside the actors (a host's
`session.abort(reason)`), so it stays a frozen pydantic model, validated when it is built.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from queryloop.runtime._records import keyword_maker, record

__all__ = [
    "Abort",
    "AbortAck",
    "AbortReason",
    "CarrierMessage",
    "Message",
    "Shutdown",
    "SupervisorMessage",
    "keyword_maker",
    "record",
]

AbortReason = Literal["user", "interrupt", "crash", "shutdown"]
"""Why a session is aborted.

`user` is Ctrl+C / ESC or a consumer that stopped listening; `interrupt` is a new
user message submitted while tools ran (Claude Code's submit-interrupt: no interruption message);
`crash` is a sibling actor that failed; `shutdown` is the runtime closing.
"""


class Message:
    """Base of every message exchanged between actors: its subclasses are `@record`s (frozen, not validated)."""

    __slots__ = ()


class CarrierMessage(Message):
    """A message that carries runtime objects (channels, callables, actor refs, exceptions, other messages).

    Like every record it is not validated: the name only says what the message holds."""

    __slots__ = ()


class SupervisorMessage(Message, BaseModel):
    """A message of the supervision protocol: delivered before ordinary mail. A frozen pydantic model,
    validated when built: a host's abort reason enters here."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class Abort(SupervisorMessage):
    """Cancel all in-flight work of the receiving actor; answered by `AbortAck`."""

    reason: AbortReason


class Shutdown(SupervisorMessage):
    """Stop now: cancel all work; once it has unwound the actor stops (`on_stop` runs). Sent by `Supervisor.close()`."""


@record
class AbortAck(Message):
    """An actor's answer to `Abort`, sent once its cancelled work has unwound."""

    actor: str
    cancelled_work: int
    """How many work tasks the abort cancelled (0 when the actor was idle)."""
