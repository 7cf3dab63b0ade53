"""`ScriptedModel`: the offline provider every test, scenario and the demo use.

Each request takes the next scripted entry (a retried request is a new request).
A reply is streamed as the real Messages API event sequence: `message_start`,
per block `content_block_start` / deltas / `content_block_stop` (text in
`text_delta` chunks, tool input as `input_json_delta` fragments starting with
`""`, as the wire does), `message_delta` with the stop reason and cumulative
usage, `message_stop`. An error entry raises the classified `ModelError` the
real provider would raise. Latency is spent half before the first event and
half before `message_delta`, so tools whose blocks complete earlier can run
while the stream is still open.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, Iterator, Sequence
from typing import Annotated, Any, Literal, Self

import trio
from pydantic import ConfigDict, Field, PlainValidator, TypeAdapter, model_validator
from pydantic.dataclasses import dataclass

from queryloop.runtime.loop.events import Model
from queryloop.runtime.loop.json_text import dumps
from queryloop.runtime.loop.model import FallbackTriggered, ModelError, ModelRequest

TEXT_CHUNK = 48
JSON_CHUNK = 24


_BLOCKS: TypeAdapter[list[dict[str, Any]]] = TypeAdapter(list[dict[str, Any]])


def _blocks(value: Any) -> list[dict[str, Any]]:
    """A reply's content blocks: a list of dicts is taken as it is, without the copy pydantic's own
    validation makes of every block (a provider that scripts its replies may build one per request);
    anything else is validated as `list[dict[str, Any]]` (same errors, same coercions)."""
    if value.__class__ is list:
        for block in value:  # a loop, not all(...): no generator per reply
            if block.__class__ is not dict:
                break
        else:
            return value
    return _BLOCKS.validate_python(value)


Blocks = Annotated[list[dict[str, Any]], PlainValidator(_blocks, json_schema_input_type=list[dict[str, Any]])]
"""A reply's content: a list of Messages API content blocks (dicts)."""


_STRICT = ConfigDict(extra="forbid")

# Slotted pydantic dataclasses, not models: validated as models are (their `__init__` too, and
# `model_validate` through `Model`), but each one GC-tracked object where a model is three (the instance,
# its `__dict__`, its fields-set). A host builds a script per loop, and its entries live as long as the loop.


@dataclass(frozen=True, slots=True, kw_only=True, config=_STRICT)
class ScriptedUsage(Model):
    """The `usage` a scripted reply reports (estimated from the request when a reply gives none)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_1h_input_tokens: int = 0
    """Of `cache_creation_input_tokens`, those written to the one-hour cache (streamed in the API's
    `cache_creation` breakdown)."""

    @model_validator(mode="after")
    def _one_hour_writes_are_cache_writes(self) -> Self:
        if self.cache_creation_1h_input_tokens > self.cache_creation_input_tokens:
            msg = (
                f"cache_creation_1h_input_tokens ({self.cache_creation_1h_input_tokens}) is part of "
                f"cache_creation_input_tokens ({self.cache_creation_input_tokens}) and cannot exceed it"
            )
            raise ValueError(msg)
        return self


@dataclass(frozen=True, slots=True, kw_only=True, config=_STRICT)
class ScriptedReply(Model):
    """One scripted response: its content blocks, streamed as the Messages API streams them."""

    content: Blocks
    stop_reason: Literal[
        "end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal", "model_context_window_exceeded"
    ] = "end_turn"
    stop_details: dict[str, Any] | None = None
    """Sent in `message_delta` as the API sends a refusal's (`{"type": "refusal", "category": ..., ...}`)."""
    usage: ScriptedUsage | None = None
    latency_ms: float = 0
    truncate_last_block: bool = False


@dataclass(frozen=True, slots=True, kw_only=True, config=_STRICT)
class ScriptedError(Model):
    """One scripted failure of a request: an API error, or a connection cut after `after_events` events."""

    error: Literal["prompt_too_long", "overloaded", "rate_limit", "api_error", "connection", "fallback", "image_size"]
    retry_after_s: float | None = None
    after_events: int = 0
    """For `connection`: how many events of `content` stream before the cut."""
    content: Blocks = Field(default_factory=lambda: [{"type": "text", "text": "An answer cut"}])
    latency_ms: float = 0


ScriptEntry = ScriptedReply | ScriptedError


def parse_entry(raw: dict[str, Any]) -> ScriptEntry:
    """Validate one scripted entry (unknown keys are errors, naming the key)."""
    return ScriptedError.model_validate(raw) if "error" in raw else ScriptedReply.model_validate(raw)


def _estimate_tokens(payload: Any) -> int:
    return max(1, len(json.dumps(payload, separators=(",", ":"))) // 4)


def reply_events(reply: ScriptedReply, *, model: str, message_id: str, input_tokens: int) -> list[dict[str, Any]]:
    """The full event sequence of a reply, as the Messages API streams it (`iter_reply_events`, listed)."""
    return list(iter_reply_events(reply, model=model, message_id=message_id, input_tokens=input_tokens))


def iter_reply_events(
    reply: ScriptedReply, *, model: str, message_id: str, input_tokens: int
) -> Iterator[dict[str, Any]]:
    """The event sequence of a reply, as the Messages API streams it, each event made as it is taken.

    Its usage is the scripted one; without one, `input_tokens` and an estimate of the reply's output.
    Made one by one, as a stream's events arrive: a reply's events are not all alive at once (a loop
    streaming its reply held them all, a dozen objects more in flight).
    """
    usage = reply.usage or ScriptedUsage(input_tokens=input_tokens, output_tokens=_estimate_tokens(reply.content))
    start_usage: dict[str, Any] = {
        "input_tokens": usage.input_tokens,
        "output_tokens": 1,
        "cache_creation_input_tokens": usage.cache_creation_input_tokens,
        "cache_read_input_tokens": usage.cache_read_input_tokens,
    }
    if one_hour := usage.cache_creation_1h_input_tokens:
        five_minutes = usage.cache_creation_input_tokens - one_hour
        split = {"ephemeral_5m_input_tokens": five_minutes, "ephemeral_1h_input_tokens": one_hour}
        start_usage["cache_creation"] = split
    yield {
        "type": "message_start",
        "message": {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": start_usage,
        },
    }
    last = len(reply.content) - 1
    for index, block in enumerate(reply.content):
        yield from _block_events(index, block, cut=reply.truncate_last_block and index == last)
    delta: dict[str, Any] = {"stop_reason": reply.stop_reason, "stop_sequence": None}
    if reply.stop_details is not None:
        delta["stop_details"] = reply.stop_details
    yield {"type": "message_delta", "delta": delta, "usage": {"output_tokens": usage.output_tokens}}
    yield {"type": "message_stop"}


def _chunks(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _block_events(index: int, block: dict[str, Any], *, cut: bool) -> Iterator[dict[str, Any]]:
    """One content block's events (start, deltas, stop)."""
    kind = block.get("type")
    if kind == "text":
        text: str = block.get("text", "")
        yield {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}
        # A text of one chunk (most of them) skips the slicing loop.
        chunks = [text] if len(text) <= TEXT_CHUNK else _chunks(text, TEXT_CHUNK)
        for chunk in chunks:
            yield {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": chunk}}
    elif kind in ("tool_use", "server_tool_use"):
        start = {"type": kind, "id": block["id"], "name": block["name"], "input": {}}
        yield {"type": "content_block_start", "index": index, "content_block": start}
        raw = dumps(block.get("input", {}))  # json.dumps's text, the wire's partial_json
        fragments = ["", raw] if len(raw) <= JSON_CHUNK else ["", *_chunks(raw, JSON_CHUNK)]
        if cut:  # a max_tokens cut: the JSON stops half-way and no content_block_stop follows
            fragments = fragments[: max(2, len(fragments) // 2)]
            if "".join(fragments) == raw:  # too short to halve: drop the closing brace at least
                fragments[-1] = fragments[-1][:-1]
        for fragment in fragments:
            yield {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": fragment},
            }
        if cut:
            return
    elif kind == "thinking":
        yield {
            "type": "content_block_start",
            "index": index,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        }
        yield {
            "type": "content_block_delta",
            "index": index,
            "delta": {"type": "thinking_delta", "thinking": block.get("thinking", "")},
        }
        yield {
            "type": "content_block_delta",
            "index": index,
            "delta": {"type": "signature_delta", "signature": block.get("signature", "sig")},
        }
    else:  # redacted thinking, server tools, anything newer: arrives whole
        yield {"type": "content_block_start", "index": index, "content_block": block}
    yield {"type": "content_block_stop", "index": index}


def scripted_error(entry: ScriptedError) -> ModelError | FallbackTriggered:
    """The error the real provider would raise for a scripted error entry."""
    kind = entry.error
    if kind == "fallback":
        return FallbackTriggered("scripted fallback")
    if kind == "prompt_too_long":
        return ModelError(kind, "prompt is too long: 210000 tokens > 200000 maximum", status=400)
    if kind == "overloaded":
        return ModelError(kind, "Overloaded", status=529)
    if kind == "rate_limit":
        return ModelError(kind, "rate limit exceeded", status=429, retry_after=entry.retry_after_s)
    if kind == "api_error":
        return ModelError(kind, "Internal server error", status=500)
    if kind == "image_size":
        return ModelError(kind, "image exceeds 5 MB maximum: 6291456 bytes > 5242880 bytes", status=400)
    return ModelError("connection", "stream ended before message_stop")


def fixed_reply_model(text: str, *, name: str) -> ScriptedModel:
    """A provider that answers every request with `text` (the scenarios' default summarizer and compactor)."""
    return ScriptedModel([ScriptedReply(content=[{"type": "text", "text": text}])], name=name, repeat=True)


class ScriptExhausted(ModelError):
    """The script has no entry left for a request: an error in the verdict, never a hang."""


class ScriptedModel:
    """A provider that plays back scripted entries, one per request, and records the requests."""

    def __init__(
        self, entries: Sequence[ScriptEntry | dict[str, Any]], *, name: str = "model", repeat: bool = False
    ) -> None:
        self.entries: list[ScriptEntry] = [parse_entry(e) if isinstance(e, dict) else e for e in entries]
        self.name = name
        self.repeat = repeat
        """Play the entries round and round instead of running out."""
        self.requests: list[ModelRequest] = []
        self.exhausted = False

    def __repr__(self) -> str:
        return f"<ScriptedModel {self.name}: {len(self.requests)}/{len(self.entries)} used>"

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        number = len(self.requests)
        self.requests.append(request)
        if self.repeat and self.entries:
            number %= len(self.entries)
        if number >= len(self.entries):
            self.exhausted = True
            msg = f"the scripted {self.name} has no reply left for request {number + 1}"
            raise ScriptExhausted("script_exhausted", msg)
        entry = self.entries[number]
        half = entry.latency_ms / 2000
        if half:
            await trio.sleep(half)
        if isinstance(entry, ScriptedError):
            if entry.error != "connection":
                if half:
                    await trio.sleep(half)
                raise scripted_error(entry)
            reply = ScriptedReply(content=entry.content)
            events = iter_reply_events(reply, model=request.model, message_id=f"msg_{number + 1}", input_tokens=1)
            for event in itertools.islice(events, entry.after_events):
                yield event
            raise scripted_error(entry)
        # The estimate dumps the whole request to JSON: only a reply whose usage is not scripted uses it.
        input_tokens = _estimate_tokens(request.messages) if entry.usage is None else 0
        events = iter_reply_events(
            entry, model=request.model, message_id=f"msg_{self.name}_{number + 1}", input_tokens=input_tokens
        )
        for event in events:
            if half and event["type"] == "message_delta":
                await trio.sleep(half)
            yield event
