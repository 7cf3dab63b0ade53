"""The script a `LocalMessagesAPI` plays: its entries (`ScriptedModel`'s, plus the faults only a real
wire shows, HTTP errors given verbatim or read from a recorded file, and recorded bodies replayed
byte for byte) and the plan of what one response sends (events, silences, how the body ends).

Pure data and functions: the server (`local_api`) turns a plan into HTTP. Imports `scripted`.
"""

from __future__ import annotations

import gzip
import itertools
import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from queryloop.runtime.providers.scripted import ScriptedReply, ScriptEntry, parse_entry

# The messages of the recorded error bodies (tests/fixtures/errors/*.json).
PROMPT_TOO_LONG_MESSAGE = "prompt is too long: 219898 tokens > 200000 maximum"
IMAGE_SIZE_MESSAGE = (
    "messages.0.content.0.image.source.base64: image exceeds 5 MB maximum: 6291456 bytes > 5242880 bytes"
)
RATE_LIMIT_MESSAGE = (
    "This request would exceed your organization's rate limit of 20,000,000 prompt bytes per hour. "
    "For details, refer to: https://docs.claude.com/en/api/rate-limits."
)


class WireFault(BaseModel):
    """A script entry for a fault only a real wire shows (`ScriptedModel` has no equivalent)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: Literal["midstream_overloaded", "request_too_large", "malformed_event", "pings_forever"]
    after_events: int = Field(default=0, ge=0)
    """For `midstream_overloaded`, `malformed_event` and `pings_forever`: how many events of `content` stream
    before the bad one (or the pings)."""
    content: list[dict[str, Any]] = Field(default_factory=lambda: [{"type": "text", "text": "An answer cut"}])
    event: dict[str, Any] = Field(default_factory=lambda: {"index": 0, "delta": {"type": "text_delta", "text": "?"}})
    """For `malformed_event`: the data of the event sent in place of the rest (by default one without a `type`)."""
    latency_ms: float = Field(default=0, ge=0)
    ping_every_ms: float = Field(default=1000, gt=0)
    """For `pings_forever`: the silence before each `ping`."""


WIRE_FAULTS = frozenset({"midstream_overloaded", "request_too_large", "malformed_event", "pings_forever"})

# Set by the server itself from the body it sends.
COMPUTED_HEADERS = frozenset({"content-length", "content-type", "transfer-encoding"})


class HttpError(BaseModel):
    """`{"error": "http", "status": S, "body": {...}, "headers": {...}}`: answer with exactly that.

    Or `{"error": "http", "fixture": PATH}`: the status, headers and body of a recorded error file
    (`{"status", "headers", "body"}`, as in `tests/fixtures/errors`), read when the entry is parsed;
    `status` and `body` given beside it replace the recorded ones and `headers` are added over the
    recorded headers (e.g. `{"x-should-retry": "false"}`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    error: Literal["http"]
    status: int = Field(ge=400, le=599)
    body: dict[str, Any] | None = None
    """None: an empty body."""
    headers: dict[str, str] = Field(default_factory=dict)
    """Sent as given (lower-cased), except the framing headers, which the server computes."""
    latency_ms: float = Field(default=0, ge=0)

    def header_list(self) -> list[tuple[str, str]]:
        return [(k.lower(), v) for k, v in self.headers.items() if k.lower() not in COMPUTED_HEADERS]


def http_error_entry(raw: dict[str, Any]) -> HttpError:
    """An `HttpError` of a script entry, its `fixture` file (if any) read and merged under the entry's own keys."""
    fields = dict(raw)
    fixture = fields.pop("fixture", None)
    if fixture is not None:
        recorded = json.loads(Path(fixture).read_text(encoding="utf-8"))
        headers = {str(k).lower(): str(v) for k, v in (recorded.get("headers") or {}).items()}
        headers.update({k.lower(): v for k, v in (fields.pop("headers", None) or {}).items()})
        fields = {"status": recorded["status"], "body": recorded.get("body"), **fields, "headers": headers}
    return HttpError.model_validate(fields)


@dataclass(frozen=True)
class StalledReply:
    """A reply whose latency is spent in one silence after its first `after_events` events."""

    reply: ScriptedReply
    after_events: int


@dataclass(frozen=True)
class RecordedStream:
    """A recorded response body (a `.sse` file of `tests/fixtures/sse`), sent byte for byte as a 200 stream.

    With a `content_encoding`, the body is sent under that `Content-Encoding`: compressed if it is `gzip` or
    `deflate` (zlib-wrapped), as recorded under any other name (a header no client can honour)."""

    body: bytes
    content_encoding: str | None = None


WireEntry = ScriptEntry | WireFault | HttpError | StalledReply | RecordedStream


def parse_wire_entry(raw: WireEntry | dict[str, Any]) -> WireEntry:
    """A `ScriptedModel` entry, or one of the wire-only ones above (unknown keys are errors)."""
    if not isinstance(raw, dict):
        return raw
    if "sse" in raw:
        body, encoding = raw["sse"], raw.get("content_encoding")
        if set(raw) - {"sse", "content_encoding"} or not isinstance(body, str | bytes):
            shape = "{'sse': <the body's text>[, 'content_encoding': NAME]}"
            msg = f"a recorded stream is {shape}, got keys {sorted(raw)}"
            raise ValueError(msg)
        if encoding is not None and not isinstance(encoding, str):
            msg = f"a recorded stream's content_encoding is a name, not {encoding!r}"
            raise ValueError(msg)
        return RecordedStream(body=body.encode() if isinstance(body, str) else body, content_encoding=encoding)
    if raw.get("error") in WIRE_FAULTS:
        return WireFault.model_validate(raw)
    if raw.get("error") == "http":
        return http_error_entry(raw)
    if "stall_after_events" in raw:
        fields = dict(raw)
        after = fields.pop("stall_after_events")
        entry = parse_entry(fields)
        if not isinstance(entry, ScriptedReply) or not isinstance(after, int) or after < 0:
            msg = f"stall_after_events needs a reply and a count >= 0, got {raw!r}"
            raise ValueError(msg)
        return StalledReply(reply=entry, after_events=after)
    return parse_entry(raw)


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class SseEvent:
    data: dict[str, Any]


@dataclass(frozen=True)
class RawBytes:
    """Bytes of the body sent as they are (a recording: its padding, its framing, its pings)."""

    data: bytes


@dataclass(frozen=True)
class StreamPlan:
    """What one 200 response sends: sleeps and events (perhaps without end), then how the body ends."""

    steps: Iterable[Sleep | SseEvent | RawBytes]
    ending: Literal["complete", "error_event", "cut"]
    headers: Sequence[tuple[str, str]] = ()
    """Sent beside the event stream's own."""


def recorded_plan(entry: RecordedStream) -> StreamPlan:
    """A recording sent whole; one with an `error` event ends as the server ends those (connection closed)."""
    error = b"event: error" in entry.body
    ending: Literal["error_event", "complete"] = "error_event" if error else "complete"
    if entry.content_encoding is None:
        return StreamPlan(steps=[RawBytes(entry.body)], ending=ending)
    body = _compressed(entry.body, entry.content_encoding)
    # In three parts, so that a client's decoder sees a coding's state carried from one read to the next.
    third = max(1, len(body) // 3)
    parts = [RawBytes(body[i : i + third]) for i in range(0, len(body), third)]
    return StreamPlan(steps=parts, ending=ending, headers=[("content-encoding", entry.content_encoding)])


def _compressed(body: bytes, coding: str) -> bytes:
    if coding == "gzip":
        return gzip.compress(body)
    if coding == "deflate":
        return zlib.compress(body)
    return body


def pings_forever_plan(head: Sequence[Sleep | SseEvent], every_s: float) -> StreamPlan:
    """The head's steps, then a `ping` after every `every_s` of silence, until the client leaves."""
    pings: itertools.cycle[Sleep | SseEvent | RawBytes] = itertools.cycle([Sleep(every_s), SseEvent({"type": "ping"})])
    return StreamPlan(steps=itertools.chain(head, pings), ending="complete")


def with_ping(events: list[SseEvent]) -> list[SseEvent]:
    """The events with one `ping` after the first `content_block_start`, where the recordings have it."""
    out: list[SseEvent] = []
    pinged = False
    for event in events:
        out.append(event)
        if not pinged and event.data.get("type") == "content_block_start":
            out.append(SseEvent({"type": "ping"}))
            pinged = True
    return out


def reply_plan(events: list[dict[str, Any]], latency_ms: float) -> StreamPlan:
    half = latency_ms / 2000
    steps: list[Sleep | SseEvent | RawBytes] = [Sleep(half)]
    for event in with_ping([SseEvent(e) for e in events]):
        if event.data.get("type") == "message_delta":
            steps.append(Sleep(half))
        steps.append(event)
    return StreamPlan(steps=steps, ending="complete")


def stalled_plan(events: list[dict[str, Any]], after_events: int, latency_ms: float) -> StreamPlan:
    steps: list[Sleep | SseEvent | RawBytes] = []
    sent = 0
    for event in with_ping([SseEvent(e) for e in events]):
        is_ping = event.data.get("type") == "ping"
        if sent == after_events and not is_ping:
            steps.append(Sleep(latency_ms / 1000))  # a ping right after the head still goes before the silence
        steps.append(event)
        sent += 0 if is_ping else 1
    return StreamPlan(steps=steps, ending="complete")


def error_body(error_type: str, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def estimate_tokens(payload: Any) -> int:
    # ScriptedModel's estimate (its `_estimate_tokens`), so usage matches the scripted provider's.
    return max(1, len(json.dumps(payload, separators=(",", ":"))) // 4)
