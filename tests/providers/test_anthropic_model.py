"""`AnthropicModel` driven through the real `anthropic` SDK, under trio, against recorded responses.

The SDK talks to `httpx2.MockTransport`, which serves the files of `tests/fixtures`
(see its SOURCES.md): the streams byte for byte, the error responses with their recorded
status, headers and body. Bodies marked "synthetic" below are built here, for cases no
recording covers (image size, in-stream error types other than overload, retry-after-ms).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anthropic
import httpx2
import pytest
import trio
import trio.lowlevel

from queryloop.runtime.loop.model import ModelError, ModelProvider, ModelRequest
from queryloop.runtime.providers.anthropic_model import AnthropicModel, classify_status, model_error_from_sdk
from tests.helpers import FIXTURES

SSE = FIXTURES / "sse"
ERRORS = FIXTURES / "errors"
API_KEY = "sk-test-not-real"

Handler = Callable[[httpx2.Request], httpx2.Response]


# ---------------------------------------------------------------- helpers


def wire_events(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, parsed data) pairs of a fixture, read independently of the code under test."""
    events = []
    for block in path.read_text(encoding="utf-8").split("\n\n"):
        lines = [line for line in block.splitlines() if line]
        if not lines:
            continue
        name = next(line[len("event: ") :] for line in lines if line.startswith("event: "))
        data = "\n".join(line[len("data: ") :] for line in lines if line.startswith("data: "))
        events.append((name, json.loads(data)))
    return events


def wire_bytes_of_first(path: Path, count: int) -> bytes:
    blocks = path.read_bytes().split(b"\n\n")
    return b"\n\n".join(blocks[:count]) + b"\n\n"


def complete_streams() -> list[Path]:
    return sorted(p for p in SSE.glob("*.sse") if wire_events(p)[-1][0] == "message_stop")


def sse_response(body: bytes) -> httpx2.Response:
    return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)


def serving(body: bytes) -> Handler:
    return lambda request: sse_response(body)


def serving_file(path: Path) -> Handler:
    return serving(path.read_bytes())


def make_client(handler: Handler) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        api_key=API_KEY,
        base_url="http://testserver",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )


def make_model(handler: Handler, **options: Any) -> AnthropicModel:
    return AnthropicModel(client=make_client(handler), **options)


def make_request(**overrides: Any) -> ModelRequest:
    fields: dict[str, Any] = {
        "model": "claude-haiku-4-5-20251001",
        "messages": [{"role": "user", "content": "What's the weather in San Francisco?"}],
        "max_tokens": 1024,
    }
    fields.update(overrides)
    return ModelRequest(**fields)


async def collect(model: AnthropicModel, request: ModelRequest | None = None) -> list[dict[str, Any]]:
    events = []
    async with aclosing(model.stream(request or make_request())) as stream:
        async for event in stream:
            events.append(event)
    return events


async def collect_until_error(
    model: AnthropicModel, request: ModelRequest | None = None
) -> tuple[list[dict[str, Any]], ModelError]:
    events: list[dict[str, Any]] = []
    with pytest.raises(ModelError) as caught:
        async with aclosing(model.stream(request or make_request())) as stream:
            async for event in stream:
                events.append(event)
    return events, caught.value


class ObservableBody(httpx2.AsyncByteStream):
    """A response body served chunk by chunk whose closing (and how far it was read) is recorded.

    `aclose` passes a checkpoint between `close_started` and `closed`, as a real transport may:
    a close run inside an already-cancelled scope without a shield stops there, never `closed`.
    """

    def __init__(self, chunks: list[bytes], *, then_hang: bool = False, then_raise: Exception | None = None):
        self.chunks = chunks
        self.then_hang = then_hang
        self.then_raise = then_raise
        self.served = 0
        self.close_started = False
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.served += 1
            yield chunk
        if self.then_raise is not None:
            raise self.then_raise
        if self.then_hang:
            await trio.sleep_forever()

    async def aclose(self) -> None:
        self.close_started = True
        await trio.lowlevel.checkpoint()
        self.closed = True


def per_event_chunks(path: Path) -> list[bytes]:
    return [block + b"\n\n" for block in path.read_bytes().split(b"\n\n") if block.strip()]


def body_handler(body: ObservableBody) -> Handler:
    return lambda request: httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=body)


# ---------------------------------------------------------------- happy-path replay


@pytest.mark.parametrize("path", complete_streams(), ids=lambda p: p.stem)
async def test_complete_fixture_replays_every_wire_event_unchanged(path: Path) -> None:
    events = await collect(make_model(serving_file(path)))

    expected = wire_events(path)
    assert [event["type"] for event in events] == [name for name, _ in expected]
    assert events == [data for _, data in expected]


def test_every_complete_stream_fixture_is_covered() -> None:
    # The replay test above must not silently lose fixtures (a misread file would drop out).
    assert len(complete_streams()) == 18


async def test_ping_events_are_yielded_although_the_sdk_iterator_drops_them() -> None:
    events = await collect(make_model(serving_file(SSE / "thinking_redacted.sse")))

    assert [event["type"] for event in events].count("ping") == 3


async def test_tool_input_json_fragments_are_yielded_unjoined() -> None:
    path = SSE / "tool_use_single_fine_chunks.sse"

    events = await collect(make_model(serving_file(path)))

    fragments = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert len(fragments) == 10
    assert fragments[:4] == ["", '{"', "loca", "tio"]
    assert json.loads("".join(fragments)) == {"location": "San Francisco, CA", "units": "f"}
    tool_start = next(e for e in events if e["type"] == "content_block_start")
    assert tool_start["content_block"]["caller"] == {"type": "direct"}


async def test_unknown_compaction_block_and_delta_pass_through_with_their_own_fields() -> None:
    events = await collect(make_model(serving_file(SSE / "server_compaction_block.sse")))

    start = events[1]
    assert start == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "compaction", "content": None},
    }
    delta = next(e for e in events if e["type"] == "content_block_delta")
    assert set(delta["delta"]) == {"type", "content"}  # no `text: null` grafted on by an SDK model
    assert delta["delta"]["type"] == "compaction_delta"
    assert delta["delta"]["content"].startswith("The user provided a very long context")


async def test_last_event_without_its_blank_line_is_still_delivered() -> None:
    path = SSE / "stop_max_tokens_mid_tool_use.sse"
    assert not path.read_bytes().endswith(b"\n")

    events = await collect(make_model(serving_file(path)))

    assert events[-1] == {"type": "message_stop"}
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


async def test_chunk_boundaries_anywhere_do_not_change_the_events() -> None:
    path = SSE / "thinking_then_tool_use.sse"
    raw = path.read_bytes().replace(b"\n", b"\r\n")  # CRLF, so a chunk can split a line ending
    chunks = [raw[i : i + 7] for i in range(0, len(raw), 7)]

    events = await collect(make_model(body_handler(ObservableBody(chunks))))

    assert events == [data for _, data in wire_events(path)]


# ---------------------------------------------------------------- the request on the wire


async def test_request_carries_model_max_tokens_messages_system_and_tools() -> None:
    seen: list[httpx2.Request] = []
    body = (SSE / "tool_use_single_fine_chunks.sse").read_bytes()

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return sse_response(body)

    sent = json.loads((SSE / "tool_use_single_fine_chunks.request.json").read_text())
    request = make_request(
        model=sent["model"],
        max_tokens=sent["max_tokens"],
        messages=sent["messages"],
        tools=sent["tools"],
        system=[{"type": "text", "text": "Be brief."}],
    )

    await collect(make_model(handler), request)

    assert len(seen) == 1
    assert seen[0].method == "POST"
    assert seen[0].url.path == "/v1/messages"
    wire = json.loads(seen[0].content)
    assert wire["stream"] is True
    assert wire["model"] == sent["model"]
    assert wire["max_tokens"] == sent["max_tokens"]
    assert wire["messages"] == sent["messages"]
    assert wire["tools"] == sent["tools"]
    assert wire["system"] == [{"type": "text", "text": "Be brief."}]
    assert "thinking" not in wire


async def test_empty_optional_fields_are_left_out_of_the_request() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(json.loads(request.content))
        return sse_response((SSE / "text_basic_ping.sse").read_bytes())

    await collect(make_model(handler, prompt_caching=False), make_request())
    await collect(make_model(handler), make_request())

    assert set(seen[0]) == {"model", "max_tokens", "messages", "stream"}
    # Prompt caching (on by default) adds its one top-level marker, and nothing else.
    assert set(seen[1]) - set(seen[0]) == {"cache_control"} and seen[1]["cache_control"] == {"type": "ephemeral"}


async def test_thinking_is_sent_and_task_budget_goes_to_output_config_behind_its_beta() -> None:
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return sse_response((SSE / "thinking_then_tool_use.sse").read_bytes())

    request = make_request(
        thinking={"type": "enabled", "budget_tokens": 1024},
        task_budget={"total": 400_000, "remaining": 120_000},
    )
    await collect(make_model(handler), request)

    wire = json.loads(seen[0].content)
    assert wire["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert wire["output_config"] == {"task_budget": {"type": "tokens", "total": 400_000, "remaining": 120_000}}
    assert "task_budget" not in wire
    assert "task-budgets-2026-03-13" in seen[0].headers["anthropic-beta"]


async def test_effort_goes_to_output_config_beside_the_task_budget() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(json.loads(request.content))
        return sse_response((SSE / "text_basic_ping.sse").read_bytes())

    await collect(make_model(handler), make_request(effort="low"))
    await collect(make_model(handler), make_request(effort="max", task_budget={"total": 9_000, "remaining": 8_000}))

    assert seen[0]["output_config"] == {"effort": "low"}
    assert seen[1]["output_config"] == {
        "task_budget": {"type": "tokens", "total": 9_000, "remaining": 8_000},
        "effort": "max",
    }


async def test_api_key_is_sent_to_the_server_but_never_shown_in_repr() -> None:
    seen: list[httpx2.Request] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        return sse_response((SSE / "text_basic_ping.sse").read_bytes())

    model = make_model(handler)
    await collect(model)

    headers = seen[0].headers
    # anthropic 2.12.0 sends the key as `Authorization: Bearer`; older 2.x sent `x-api-key`.
    assert headers.get("x-api-key") == API_KEY or headers.get("authorization") == f"Bearer {API_KEY}"
    assert API_KEY not in repr(model)
    assert API_KEY not in str(model)


async def test_model_built_from_an_api_key_hides_it_and_honours_its_settings() -> None:
    model = AnthropicModel(api_key="sk-ant-secret-123", base_url="http://testserver", timeout=30.0)
    try:
        text = repr(model)
        assert "sk-ant-secret-123" not in text
        assert "max_retries=0" in text
        assert "timeout=30.0" in text
        assert "http://testserver" in text
    finally:
        await model.aclose()


def test_anthropic_model_satisfies_the_provider_protocol() -> None:
    assert isinstance(make_model(serving(b"")), ModelProvider)


# ---------------------------------------------------------------- HTTP errors (recorded)

EXPECTED_KIND = {
    "400_input_plus_max_tokens_exceed_context": "context_overflow",
    "400_max_tokens_above_model_limit": "max_tokens_cap",
    "400_prompt_too_long": "prompt_too_long",
    "400_tool_result_without_matching_tool_use": "invalid_request",
    "400_tool_use_without_tool_result": "invalid_request",
    "401_authentication_error": "authentication",
    "404_not_found_model": "not_found",
    "413_request_size_exceeds_context_window": "prompt_too_long",
    "413_request_too_large": "prompt_too_long",
    "429_rate_limit_error": "rate_limit",
    "429_rate_limit_headers_with_retry_after": "rate_limit",
    "529_overloaded_error": "overloaded",
}


def recorded_error_handler(path: Path, calls: list[httpx2.Request]) -> Handler:
    recorded = json.loads(path.read_text())
    # The body is re-serialised here, so the recorded length no longer applies.
    headers = {k: v for k, v in recorded["headers"].items() if k.lower() != "content-length"}
    content = b"" if recorded["body"] is None else json.dumps(recorded["body"]).encode()

    def handler(request: httpx2.Request) -> httpx2.Response:
        calls.append(request)
        return httpx2.Response(recorded["status"], headers=headers, content=content)

    return handler


def test_every_error_fixture_has_an_expected_kind() -> None:
    assert {p.stem for p in ERRORS.glob("*.json")} == set(EXPECTED_KIND)


@pytest.mark.parametrize("name", sorted(EXPECTED_KIND))
async def test_recorded_http_error_maps_to_its_kind(name: str) -> None:
    path = ERRORS / f"{name}.json"
    recorded = json.loads(path.read_text())
    calls: list[httpx2.Request] = []

    events, error = await collect_until_error(make_model(recorded_error_handler(path, calls)))

    assert events == []
    assert len(calls) == 1  # the SDK did not retry behind the ModelCaller's back
    assert error.kind == EXPECTED_KIND[name]
    assert error.status == recorded["status"]
    if recorded["body"] is not None:
        assert error.message == recorded["body"]["error"]["message"]


async def test_rate_limit_with_retry_after_header_sets_retry_after() -> None:
    path = ERRORS / "429_rate_limit_headers_with_retry_after.json"

    _, error = await collect_until_error(make_model(recorded_error_handler(path, [])))

    assert error.kind == "rate_limit"
    assert error.retry_after == 16.0
    assert error.retryable


async def test_rate_limit_without_retry_after_header_leaves_it_unset() -> None:
    _, error = await collect_until_error(make_model(recorded_error_handler(ERRORS / "429_rate_limit_error.json", [])))

    assert error.retry_after is None


# ---------------------------------------------------------------- HTTP errors (synthetic)


def json_error(status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> Handler:
    body = {"type": "error", "error": {"type": error_type, "message": message}}
    return lambda request: httpx2.Response(status, headers=headers or {}, json=body)


async def test_retry_after_ms_header_wins_over_retry_after_seconds() -> None:
    handler = json_error(429, "rate_limit_error", "slow down", {"retry-after-ms": "1500", "retry-after": "16"})

    _, error = await collect_until_error(make_model(handler))

    assert error.retry_after == 1.5


@pytest.mark.parametrize(
    ("status", "header", "should_retry", "retryable"),
    [
        (500, "false", False, False),
        (529, "False", False, False),
        (400, "true", True, True),
        (409, "true", True, True),
        (500, None, None, True),
        (400, None, None, False),
        (400, "maybe", None, False),
    ],
)
async def test_x_should_retry_header_wins_over_the_status(
    status: int, header: str | None, should_retry: bool | None, retryable: bool
) -> None:
    headers = {} if header is None else {"x-should-retry": header}
    handler = json_error(status, "api_error", "synthetic", headers)

    _, error = await collect_until_error(make_model(handler))

    assert error.should_retry is should_retry
    assert error.retryable is retryable


async def test_recorded_529_carries_its_x_should_retry_true() -> None:
    path = ERRORS / "529_overloaded_error.json"

    _, error = await collect_until_error(make_model(recorded_error_handler(path, [])))

    assert error.should_retry is True


async def test_an_event_without_a_type_is_a_malformed_stream_event_api_error() -> None:
    body = b'event: message_start\ndata: {"message": {"id": "msg_1"}}\n\n'

    events, error = await collect_until_error(make_model(serving(body)))

    assert events == []
    assert error.kind == "api_error"
    assert "malformed stream event 'message_start': no type" in error.message


async def test_image_too_large_400_maps_to_image_size() -> None:
    # synthetic: wording as reported for oversized base64 images
    message = "messages.0.content.1.image.source.base64: image exceeds 5 MB maximum: 6291456 bytes > 5242880 bytes"

    _, error = await collect_until_error(make_model(json_error(400, "invalid_request_error", message)))

    assert error.kind == "image_size"
    assert not error.retryable


@pytest.mark.parametrize(
    ("status", "error_type", "kind"),
    [
        (402, "billing_error", "invalid_request"),
        (403, "permission_error", "authentication"),
        (408, "timeout_error", "api_error"),
        (409, "conflict_error", "api_error"),
        (500, "api_error", "api_error"),
        (503, "api_error", "api_error"),
        (504, "timeout_error", "api_error"),
    ],
)
async def test_other_http_statuses_map_to_their_kind(status: int, error_type: str, kind: str) -> None:
    _, error = await collect_until_error(make_model(json_error(status, error_type, "synthetic")))

    assert (error.kind, error.status) == (kind, status)


# ---------------------------------------------------------------- errors inside a 200 stream


@pytest.mark.parametrize(
    "name",
    ["error_event_only_real_padded", "derived_midstream_overloaded_error", "error_event_docs_example"],
)
async def test_in_stream_overloaded_error_event_raises_after_the_events_before_it(name: str) -> None:
    path = SSE / f"{name}.sse"
    wire = wire_events(path)
    before_error = [data for event, data in wire if event != "error"]
    assert wire[-1][0] == "error"

    events, error = await collect_until_error(make_model(serving_file(path)))

    assert events == before_error
    assert error.kind == "overloaded"
    assert error.status == 529
    assert error.retry_after is None
    assert error.retryable
    assert "Overloaded" in error.message
    assert "in-stream" in error.message


async def test_midstream_error_after_partial_tool_input_keeps_the_partial_events() -> None:
    events, _ = await collect_until_error(make_model(serving_file(SSE / "derived_midstream_overloaded_error.sse")))

    assert len(events) == 8
    assert events[2] == {"type": "ping"}
    assert events[-1]["delta"] == {"type": "input_json_delta", "partial_json": 'n": '}


@pytest.mark.parametrize(
    ("error_type", "message", "kind", "status"),
    [
        ("rate_limit_error", "Rate limited", "rate_limit", 429),
        ("api_error", "Internal server error", "api_error", 500),
        (
            "invalid_request_error",
            "prompt is too long: 210000 tokens > 200000 maximum",
            "prompt_too_long",
            400,
        ),
        ("invalid_request_error", "messages.1: something else", "invalid_request", 400),
        ("some_future_error", "New", "api_error", 500),
    ],
)
async def test_in_stream_error_events_classify_by_error_type(
    error_type: str, message: str, kind: str, status: int
) -> None:
    # synthetic: the recorded prefix of a stream, then an error event of another type
    payload = {"type": "error", "error": {"type": error_type, "message": message}}
    prefix = wire_bytes_of_first(SSE / "text_basic_ping.sse", 3)
    body = prefix + f"event: error\ndata: {json.dumps(payload)}\n\n".encode()

    events, error = await collect_until_error(make_model(serving(body)))

    assert [e["type"] for e in events] == ["message_start", "content_block_start", "ping"]
    assert (error.kind, error.status) == (kind, status)
    assert error.message.startswith(message)


def test_a_bare_sdk_status_error_on_http_200_is_classified_by_its_body() -> None:
    # What the SDK's own iterator raises for an `event: error` (status_code 200, not OverloadedError).
    response = httpx2.Response(200, request=httpx2.Request("POST", "http://testserver/v1/messages"))
    body = {"type": "error", "error": {"details": None, "type": "overloaded_error", "message": "Overloaded"}}
    sdk_error = anthropic.APIStatusError(str(body), response=response, body=body)

    error = model_error_from_sdk(sdk_error)

    assert (error.kind, error.status) == ("overloaded", 529)


# ---------------------------------------------------------------- broken connections


async def test_stream_cut_before_message_stop_raises_connection_after_the_events_received() -> None:
    path = SSE / "tool_use_single_fine_chunks.sse"
    body = wire_bytes_of_first(path, 8)

    events, error = await collect_until_error(make_model(serving(body)))

    assert events == [data for _, data in wire_events(path)[:8]]
    assert error.kind == "connection"
    assert error.status is None
    assert error.message == "stream ended before message_stop"


async def test_stream_cut_inside_an_event_raises_connection() -> None:
    raw = (SSE / "text_basic_ping.sse").read_bytes()
    cut = raw[: raw.index(b'"text_delta"')]  # the server went away in the middle of a data line

    events, error = await collect_until_error(make_model(serving(cut)))

    assert [e["type"] for e in events] == ["message_start", "content_block_start", "ping"]
    assert error.kind == "connection"


async def test_transport_error_while_reading_the_body_raises_connection() -> None:
    chunks = per_event_chunks(SSE / "text_basic_ping.sse")[:4]
    body = ObservableBody(chunks, then_raise=httpx2.ReadError("connection reset by peer"))

    events, error = await collect_until_error(make_model(body_handler(body)))

    assert len(events) == 4
    assert error.kind == "connection"
    assert isinstance(error.__cause__, httpx2.ReadError)
    assert body.closed


@pytest.mark.parametrize(
    "failure",
    [httpx2.ConnectError("connection refused"), httpx2.ReadTimeout("timed out")],
    ids=["connect_error", "timeout"],
)
async def test_failure_to_get_a_response_raises_connection(failure: Exception) -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        raise failure

    events, error = await collect_until_error(make_model(handler))

    assert events == []
    assert error.kind == "connection"
    assert isinstance(error.__cause__, anthropic.APIConnectionError)


# ---------------------------------------------------------------- closing the response


async def test_breaking_out_early_closes_the_response() -> None:
    body = ObservableBody(per_event_chunks(SSE / "thinking_signature_then_text.sse"))
    received = []

    async with aclosing(make_model(body_handler(body)).stream(make_request())) as stream:
        async for event in stream:
            received.append(event)
            if len(received) == 3:
                break

    assert body.closed
    assert body.served < len(body.chunks)


async def test_cancelling_the_consumer_mid_stream_closes_the_response() -> None:
    body = ObservableBody(per_event_chunks(SSE / "thinking_signature_then_text.sse"))
    received = []

    with trio.CancelScope() as scope:
        async with aclosing(make_model(body_handler(body)).stream(make_request())) as stream:
            async for event in stream:
                received.append(event)
                scope.cancel()
                await trio.sleep_forever()  # cancelled here, then the stream is closed in a cancelled scope

    assert scope.cancelled_caught
    assert len(received) == 1
    assert body.closed


async def test_cancelling_while_waiting_for_the_next_chunk_ends_the_stream() -> None:
    chunks = per_event_chunks(SSE / "text_basic_ping.sse")[:2]
    body = ObservableBody(chunks, then_hang=True)
    received = []

    with trio.move_on_after(0.2) as scope:
        async with aclosing(make_model(body_handler(body)).stream(make_request())) as stream:
            async for event in stream:
                received.append(event)

    assert scope.cancelled_caught
    assert [e["type"] for e in received] == ["message_start", "content_block_start"]
    # httpx2 starts the close itself when a read is cancelled, unshielded; the real transport
    # (httpcore2) shields its own close, which this stand-in does not, so only the start shows.
    assert body.close_started


# ---------------------------------------------------------------- the mapping table itself


@pytest.mark.parametrize(
    ("status", "message", "kind"),
    [
        (400, "prompt is too long: 219898 tokens > 200000 maximum", "prompt_too_long"),
        (413, "anything at all", "prompt_too_long"),
        (400, "image dimensions exceed max allowed size: 8000 pixels", "image_size"),
        (400, "Image too large", "image_size"),
        (400, "max_tokens: 128001 > 64000", "invalid_request"),
        (
            400,
            "max_tokens: 128001 > 64000, which is the maximum allowed number of output tokens for claude-opus-4-5",
            "max_tokens_cap",
        ),
        (400, "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000", "context_overflow"),
        (413, "input length and `max_tokens` exceed context limit: 178959 + 64000 > 200000", "prompt_too_long"),
        (422, "unprocessable", "invalid_request"),
        (529, "Overloaded", "overloaded"),
        (599, "?", "api_error"),
    ],
)
def test_classify_status(status: int, message: str, kind: str) -> None:
    assert classify_status(status, message) == kind
