"""A response body's `Content-Encoding` (`runtime/providers/content_encoding.py`): a compressed stream reads as
the stream it compresses, a coding the client cannot read is refused by name, and a decompression bomb is
stopped at the SSE reader's cap on one event, never inflated whole.

The request asks for `accept-encoding: identity`; a proxy may compress anyway. The recorded streams are
served compressed over a real socket by `LocalMessagesAPI`, or through `httpx2.MockTransport` as a raw body.
"""

from __future__ import annotations

import gzip
import sys
import tracemalloc
import types
import zlib
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anthropic
import httpx2
import pytest
import trio

from queryloop import QueryOptions, Runtime
from queryloop.runtime.loop.model import ModelError, ModelRequest
from queryloop.runtime.providers.anthropic_model import AnthropicModel
from queryloop.runtime.providers.content_encoding import PIECE_BYTES, body_decoder
from queryloop.runtime.providers.local_api import LocalMessagesAPI
from queryloop.runtime.providers.sse import MAX_EVENT_BYTES
from tests.helpers import FIXTURES
from tests.providers.test_anthropic_model import wire_events

SSE = FIXTURES / "sse"
RECORDINGS = ["text_basic_ping", "tool_use_single_fine_chunks", "thinking_signature_then_text"]
DEADLINE_S = 15.0


def request() -> ModelRequest:
    return ModelRequest(model="claude-sonnet-5-5", messages=[{"role": "user", "content": "Hi"}], max_tokens=64)


async def collect(model: AnthropicModel) -> tuple[list[dict[str, Any]], ModelError | None]:
    events: list[dict[str, Any]] = []
    try:
        async with aclosing(model.stream(request())) as stream:
            async for event in stream:
                events.append(event)
    except ModelError as error:
        return events, error
    return events, None


async def over_a_socket(body: bytes, coding: str) -> tuple[list[dict[str, Any]], ModelError | None]:
    async with LocalMessagesAPI([{"sse": body, "content_encoding": coding}]) as api:
        model = AnthropicModel(api_key="sk-local-test", base_url=api.base_url)
        try:
            return await collect(model)
        finally:
            with trio.CancelScope(shield=True):
                await model.aclose()


class RawBody(httpx2.AsyncByteStream):
    """A body served as the network would: raw, in the given chunks, read by the provider's `aiter_raw`."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.served = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.served += 1
            yield chunk


def raw_model(body: RawBody, coding: str) -> AnthropicModel:
    headers = {"content-type": "text/event-stream", "content-encoding": coding}

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers=headers, stream=body)

    client = anthropic.AsyncAnthropic(
        api_key="sk-test-not-real",
        base_url="http://testserver",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )
    return AnthropicModel(client=client)


def in_pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


# ---------------------------------------------------------------- compressed streams read as the recording


@pytest.mark.parametrize("coding", ["gzip", "deflate"])
@pytest.mark.parametrize("name", RECORDINGS)
async def test_a_compressed_recording_over_a_real_socket_reads_as_the_recording(coding: str, name: str) -> None:
    path = SSE / f"{name}.sse"
    with trio.fail_after(DEADLINE_S):
        events, error = await over_a_socket(path.read_bytes(), coding)

    assert error is None
    assert events == [data for _, data in wire_events(path)]


@pytest.mark.parametrize(
    ("coding", "compress"),
    [("deflate", raw_deflate), ("x-gzip", gzip.compress), ("gzip, identity", gzip.compress)],
    ids=["raw_deflate", "x_gzip", "gzip_then_identity"],
)
async def test_every_spelling_of_a_readable_coding_is_read(coding: str, compress: Any) -> None:
    path = SSE / "text_basic_ping.sse"
    body = RawBody(in_pieces(compress(path.read_bytes()), 50))

    events, error = await collect(raw_model(body, coding))

    assert error is None
    assert events == [data for _, data in wire_events(path)]


async def test_two_codings_are_undone_in_the_reverse_of_their_order() -> None:
    path = SSE / "text_basic_ping.sse"
    twice = gzip.compress(zlib.compress(path.read_bytes()))  # deflate applied first, then gzip
    events, error = await collect(raw_model(RawBody(in_pieces(twice, 64)), "deflate, gzip"))

    assert error is None
    assert events == [data for _, data in wire_events(path)]


# ---------------------------------------------------------------- codings refused


async def test_a_coding_no_reader_here_knows_is_refused_by_name_and_not_retried() -> None:
    body = (SSE / "text_basic_ping.sse").read_bytes()
    with trio.fail_after(DEADLINE_S):
        events, error = await over_a_socket(body, "zstd")

    assert events == []
    assert error is not None and error.kind == "api_error" and not error.retryable
    assert "'zstd'" in error.message and "gzip, deflate" in error.message


async def test_a_query_on_an_unreadable_coding_ends_at_once_saying_which() -> None:
    body = (SSE / "text_basic_ping.sse").read_bytes()
    with trio.fail_after(DEADLINE_S):
        async with LocalMessagesAPI([{"sse": body, "content_encoding": "compress"}] * 3) as api:
            model = AnthropicModel(api_key="sk-local-test", base_url=api.base_url)
            try:
                async with Runtime.open() as rt:
                    session = await rt.open_session(QueryOptions(provider=model, max_retries=2))
                    handle = session.query("Hi")
                    [_ async for _ in handle]
            finally:
                with trio.CancelScope(shield=True):
                    await model.aclose()

    assert len(api.requests) == 1
    assert handle.result is not None and handle.result.is_error and "'compress'" in handle.result.result


async def test_br_is_read_when_a_brotli_module_is_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    class Decompressor:  # the `brotli` module's interface, over raw deflate (no brotli module is installed here)
        def __init__(self) -> None:
            self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)

        def process(self, data: bytes) -> bytes:
            return self._inflater.decompress(data)

    monkeypatch.setitem(sys.modules, "brotli", types.SimpleNamespace(Decompressor=Decompressor, error=zlib.error))
    path = SSE / "text_basic_ping.sse"

    events, error = await collect(raw_model(RawBody(in_pieces(raw_deflate(path.read_bytes()), 40)), "br"))

    assert error is None
    assert events == [data for _, data in wire_events(path)]


async def test_br_without_a_brotli_module_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "brotli", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "brotlicffi", None)

    events, error = await collect(raw_model(RawBody([b"\x00" * 10]), "br"))

    assert events == []
    assert error is not None and "'br'" in error.message and not error.retryable


async def test_a_body_that_is_not_valid_in_its_coding_is_a_malformed_stream() -> None:
    events, error = await collect(raw_model(RawBody([b"this is not gzip at all"]), "gzip"))

    assert events == []
    assert error is not None and error.kind == "api_error" and "not valid gzip" in error.message


# ---------------------------------------------------------------- bombs


async def test_a_gzip_bomb_is_stopped_at_the_event_cap_without_being_inflated_whole() -> None:
    inflated = 64 * 1024 * 1024  # 64 MiB of one data line, from about 64 KiB on the wire
    bomb = gzip.compress(b"event: message_start\ndata: " + b"x" * inflated)
    body = RawBody([bomb])
    tracemalloc.start()
    try:
        events, error = await collect(raw_model(body, "gzip"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert events == []
    assert error is not None and error.kind == "api_error" and f"{MAX_EVENT_BYTES:,}-byte cap" in error.message
    # What was held: the pieces of the line up to the cap, and a piece or two more; not the 64 MiB.
    assert peak < MAX_EVENT_BYTES + 8 * PIECE_BYTES


def test_one_chunk_inflates_piece_by_piece_each_only_when_taken() -> None:
    decoder = body_decoder("gzip")
    assert decoder is not None
    pieces = decoder.decode(gzip.compress(b"x" * (5 * PIECE_BYTES + 7)))

    first = next(pieces)
    rest = list(pieces)

    assert len(first) == PIECE_BYTES
    assert [len(p) for p in rest] == [PIECE_BYTES] * 4 + [7]


@pytest.mark.parametrize("header", [None, "", "identity", " Identity "])
def test_no_coding_means_no_decoder(header: str | None) -> None:
    assert body_decoder(header) is None
