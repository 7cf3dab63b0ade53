"""What crosses between the driver and a shard: submissions, event entries, errors, and Ray's typing.

A shard ships the events of every query a driver runs on it through one Ray streaming generator per
driver: each Ray object is a pickled list of `Entry` (a query's events since the last object, and its
end). Events are the public records (frozen slotted dataclasses): pickled as they are, they cost less
than their JSON dumps rebuilt with a `TypeAdapter` (docs/ray.md). Errors cross pickled when they can
be rebuilt, as `RemoteError` (type and message) when not. Imports `queryloop.runtime.errors` and
`queryloop.runtime.loop`.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import ray

from queryloop.runtime.errors import QueryloopError, RemoteError
from queryloop.runtime.loop.events import StreamEvent, StreamRequestStart

if TYPE_CHECKING:
    from collections.abc import Callable

    from queryloop.runtime.loop.events import Block, QueryEvent
    from queryloop.runtime.loop.state import ContinueReason, Terminal

F = TypeVar("F", bound="Callable[..., Any]")

EventsMode = Literal["all", "messages", "result"]
"""What a query ships back: every event, every event but the raw stream deltas, or only its result."""
EVENTS_MODES: tuple[EventsMode, ...] = ("all", "messages", "result")
DELTAS = (StreamEvent, StreamRequestStart)
"""The raw stream deltas (`stream_request_start`, `stream_event`) that `events="messages"` leaves out."""

KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A session key: also its transcript's file name (`KEY.jsonl` in the transcript directory)."""

CONTROL = "control"
"""The Ray concurrency group of the aborts: a busy data lane does not delay them."""


class SessionNotHere(QueryloopError):
    """The shard holds no session of that key (it was restarted by Ray, empty, or the session closed)."""


@dataclass(frozen=True, slots=True)
class Submission:
    key: str
    qid: int
    stream: str
    prompt: str | list[Block]
    events: EventsMode
    overrides: dict[str, Any]
    trace: dict[str, str] | None = None
    """The driver's trace context (W3C `traceparent`, `tracestate`) where it submitted, while its telemetry is on:
    the shard submits the query under it, so the query's spans join the driver's trace."""


@dataclass(frozen=True, slots=True)
class Ending:
    terminal: Terminal | None
    transitions: list[ContinueReason]


Entry = tuple[int, list["QueryEvent"], Ending | None, BaseException | None]
"""(query id, its events since the last entry, its end if it ended, the error that ended it)."""


def encode(entries: list[Entry]) -> bytes:
    return pickle.dumps(entries, protocol=5)


def decode(data: bytes) -> list[Entry]:
    entries: list[Entry] = pickle.loads(data)
    return entries


def portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling, else a `RemoteError` naming its type and message."""
    try:
        pickle.loads(pickle.dumps(error, protocol=5))
    except Exception:  # noqa: BLE001 - any failure means: send it as text
        return RemoteError(f"{type(error).__name__}: {error}")
    return error


def method(**options: Any) -> Callable[[F], F]:
    """`ray.method` typed (Ray's own decorator is untyped)."""
    decorate = cast("Callable[..., Callable[[F], F]]", ray.method)
    return decorate(**options)
