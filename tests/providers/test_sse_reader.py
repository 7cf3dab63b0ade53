"""`SSEReader` (`runtime/providers/sse.py`): the events of any body, however it is split, are those of the SSE
spec, and no event may grow past its cap.

The property tests compare the reader, fed random bodies in random splits, with two references: a plain
reading of the WHATWG rules over the whole body, written here, and httpx2's public `EventSource` (the
maintained reader the SDK's transport ships, derived from httpx-sse). Our reader is kept over `EventSource`
because it is faster (`python -m bench stream` reports both: `sse_events_per_s`) and reads the raw body
(docs/design.md, the wire defences).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anthropic
import httpx2
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queryloop.runtime.loop.model import ModelError, ModelRequest
from queryloop.runtime.providers.anthropic_model import AnthropicModel
from queryloop.runtime.providers.sse import MAX_EVENT_BYTES, SSEReader

Event = tuple[str, str]
"""(name, data): the name "message" where the body gave none, as the spec names it."""


# ---------------------------------------------------------------- references


def spec_events(body: bytes) -> list[Event]:
    """The WHATWG reading of a whole body, with the reader's one extension: an event left without its
    blank line at the end of the body is dispatched (the same as reading the body with two LFs added)."""
    text = (body + b"\n\n").decode("utf-8", "replace")
    lines = re.split("\r\n|\r|\n", text)[:-1]  # what follows the last line end is no line
    events: list[Event] = []
    name, data = "", ""
    for line in lines:
        if line == "":
            if data:
                events.append((name or "message", data.removesuffix("\n")))
            name, data = "", ""
        elif line.startswith(":"):
            continue
        else:
            field, colon, value = line.partition(":")
            value = value.removeprefix(" ") if colon else ""
            if field == "event":
                name = value
            elif field == "data":
                data += value + "\n"
    return events


class Chunks(httpx2.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def event_source_events(chunks: list[bytes]) -> list[Event]:
    """httpx2's `EventSource` over the same chunks (its end-of-body event given its blank lines, as above)."""

    async def read() -> list[Event]:
        response = httpx2.Response(
            200,
            headers={"content-type": "text/event-stream; charset=utf-8"},
            stream=Chunks([*chunks, b"\n\n"]),
            request=httpx2.Request("POST", "http://testserver/v1/messages"),
        )
        return [(sse.event, sse.data) async for sse in httpx2.EventSource(response, max_event_size=None)]

    return trio.run(read)


def read_all(chunks: list[bytes], reader: SSEReader | None = None) -> list[Event]:
    reader = reader or SSEReader()
    events = [event for chunk in chunks for event in reader.feed(chunk)] + reader.finish()
    return [(name or "message", data) for name, data in events]


# ---------------------------------------------------------------- random bodies, random splits

VALUE_PARTS = [b"a", b"{}", b" ", b":", b"data", "é".encode(), "☃".encode(), b"\xff", b"\xe2\x82", b"\x00"]
"""Pieces of a field's value: ASCII, multi-byte UTF-8 (split anywhere by the chunks), invalid UTF-8."""

values = st.lists(st.sampled_from(VALUE_PARTS), max_size=6).map(b"".join)
field_lines = st.tuples(
    st.sampled_from([b"data", b"data", b"data", b"event", b"event", b"id", b"retry", b"dat", b"data ", b"other"]),
    st.sampled_from([b":", b": ", b""]),
    values,
).map(lambda parts: parts[0] + (parts[1] + parts[2] if parts[1] else b""))
lines = st.one_of(field_lines, field_lines, values.map(lambda v: b":" + v), st.just(b""))
line_ends = st.sampled_from([b"\n", b"\r", b"\r\n"])


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    # Events of a few lines each, each closed by a blank line, so that what one event leaves behind meets the next.
    events = draw(st.lists(st.lists(lines, max_size=4).map(lambda e: [*e, b""]), max_size=8))
    body = b"".join(line + draw(line_ends) for event in events for line in event)
    if draw(st.booleans()):  # no final blank line, perhaps not even a final line end
        body = body[: draw(st.integers(0, len(body)))]
    return body


@st.composite
def splits(draw: st.DrawFn) -> list[bytes]:
    body = draw(bodies())
    anywhere = st.integers(0, len(body))
    # Cuts right after a CR are drawn often: a CRLF split there is the case a reader most easily gets wrong.
    after_cr = [i + 1 for i, byte in enumerate(body) if byte == 0x0D]
    cut = st.one_of(anywhere, st.sampled_from(after_cr)) if after_cr else anywhere
    cuts = sorted(set(draw(st.lists(cut, max_size=12))))
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=splits())
def test_any_split_of_any_body_reads_as_the_spec_reads_the_whole(chunks: list[bytes]) -> None:
    assert read_all(chunks) == spec_events(b"".join(chunks))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=splits())
def test_any_split_of_any_body_gives_the_events_httpx2_event_source_gives(chunks: list[bytes]) -> None:
    # EventSource also dispatches an event that has a name or an id but no data line; no data is nothing
    # to the runtime either (the provider forwards no event without data), so those are left out on both sides.
    ours = [event for event in read_all(chunks) if event[1]]
    assert ours == [event for event in event_source_events(chunks) if event[1]]


def test_a_crlf_split_between_two_chunks_is_one_line_end() -> None:
    assert read_all([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == [("message", "a\nb")]
    assert read_all([b"data: a\r", b"\r", b"data: b\r\r"]) == [("message", "a"), ("message", "b")]


def test_an_event_name_does_not_carry_over_to_the_next_event() -> None:
    assert read_all([b"event: error\ndata: a\n\ndata: b\n\nevent: x\n\ndata: c\n\n"]) == [
        ("error", "a"),
        ("message", "b"),
        ("message", "c"),
    ]


def test_a_line_split_over_many_chunks_is_read_whole() -> None:
    line = b"data: " + json.dumps({"type": "content_block_delta", "text": "é" * 5000}).encode()
    chunks = [line[i : i + 7] for i in range(0, len(line), 7)]
    assert read_all([*chunks, b"\n\n"]) == [("message", line[6:].decode())]


# ---------------------------------------------------------------- the cap on one event


def test_an_event_past_the_cap_is_refused_naming_the_cap_as_soon_as_a_chunk_crosses_it() -> None:
    reader = SSEReader(max_event_bytes=1000)
    fed = 0
    with pytest.raises(ModelError) as caught:
        reader.feed(b"event: content_block_delta\ndata: ")
        for _ in range(100):
            reader.feed(b"x" * 300)
            fed += 1
    assert fed == 3  # the fourth chunk crossed 1,000 bytes: nothing more was taken
    assert caught.value.kind == "api_error"
    assert "1,000-byte cap" in caught.value.message and "max_event_bytes" in caught.value.message


def test_comments_and_blank_lines_before_an_event_count_toward_its_cap() -> None:
    reader = SSEReader(max_event_bytes=1000)
    with pytest.raises(ModelError, match="1,000-byte cap"):
        for _ in range(100):
            reader.feed(b": keep-alive\n\n\n")


def test_a_whole_event_past_the_cap_is_refused_even_in_one_chunk() -> None:
    reader = SSEReader(max_event_bytes=1000)
    with pytest.raises(ModelError, match="1,000-byte cap"):
        reader.feed(b"data: " + b"x" * 2000 + b"\n\ndata: small\n\n")


def test_events_within_the_cap_pass_however_many_come() -> None:
    reader = SSEReader(max_event_bytes=1000)
    event = b"event: ping\ndata: " + b"x" * 900 + b"\n\n"
    assert len(read_all([event] * 50, reader)) == 50


async def test_a_server_streaming_one_event_past_16_mib_is_refused_before_the_rest_is_read() -> None:
    piece = 1 << 20
    head = b'event: message_start\ndata: {"type": "message_start", "message": {"usage": {}}}\n\n'
    sent: list[int] = []

    class Endless(httpx2.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield head + b"event: content_block_delta\ndata: "
            for _ in range(64):  # 64 MiB of one line, if the client keeps reading
                sent.append(piece)
                yield b"x" * piece

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=Endless())

    client = anthropic.AsyncAnthropic(
        api_key="sk-test-not-real",
        base_url="http://testserver",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )
    request = ModelRequest(model="claude-sonnet-5-5", messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    events: list[dict[str, Any]] = []
    with pytest.raises(ModelError) as caught:
        async with aclosing(AnthropicModel(client=client).stream(request)) as stream:
            async for event in stream:
                events.append(event)

    assert [e["type"] for e in events] == ["message_start"]
    assert caught.value.kind == "api_error" and f"{MAX_EVENT_BYTES:,}-byte cap" in caught.value.message
    assert len(sent) == MAX_EVENT_BYTES // piece  # the piece that crossed the cap was the last one read
