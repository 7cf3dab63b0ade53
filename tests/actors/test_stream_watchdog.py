"""The stream watchdog (`runtime/providers/watchdog.py`): a response that does not start, or goes quiet but for
pings, fails as a retryable connection error after `stream_idle_timeout_s`, not after the SDK's ten minutes a
read (or never, for pings).

The provider-level tests serve bodies through `httpx2.MockTransport` on trio's `MockClock` (autojumping: a
silence costs no real time); the end-to-end ones run a real `LocalMessagesAPI` socket on the same clock.
Times are the mock clock's.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any

import anthropic
import httpx2
import pydantic
import pytest
import trio
import trio.lowlevel
import trio.testing

from queryloop import QueryOptions, Runtime
from queryloop.runtime.loop.events import StreamEvent, SystemMessage
from queryloop.runtime.loop.model import DEFAULT_STREAM_IDLE_TIMEOUT_S, ModelError, ModelRequest
from queryloop.runtime.providers.anthropic_model import AnthropicModel
from queryloop.runtime.providers.local_api import LocalMessagesAPI
from queryloop.runtime.providers.scripted import ScriptedModel
from queryloop.runtime.providers.watchdog import NO_RESPONSE, PARTIAL_RESPONSE
from tests.helpers import scripted_tool, text_reply, tool_use, tools_reply

TIMEOUT_S = 30.0


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Jumps to the next deadline as soon as every task waits: on the socket tests too, since loopback data is
    in the peer's buffer by the time `send` returns."""
    return trio.testing.MockClock(autojump_threshold=0)


def frames(*events: dict[str, Any]) -> list[bytes]:
    return [f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events]


MESSAGE_START = {
    "type": "message_start",
    "message": {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-5-5",
        "content": [],
        "stop_reason": None,
        "usage": {"input_tokens": 3, "output_tokens": 1},
    },
}
PING = {"type": "ping"}
BLOCK_START = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}


def delta(text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}


ENDING: list[dict[str, Any]] = [
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}},
    {"type": "message_stop"},
]

Step = bytes | float
"""A body's step: bytes to send, or seconds of silence."""


class TimedBody(httpx2.AsyncByteStream):
    """A response body played step by step on trio's clock; `then` runs after the steps (e.g. a silence)."""

    def __init__(self, steps: Sequence[Step], then: Callable[[], AsyncIterator[bytes]] | None = None) -> None:
        self.steps = steps
        self.then = then
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for step in self.steps:
            if isinstance(step, bytes):
                yield step
            else:
                await trio.sleep(step)
        if self.then is not None:
            async for chunk in self.then():
                yield chunk

    async def aclose(self) -> None:
        self.closed = True


async def silence() -> AsyncIterator[bytes]:
    await trio.sleep_forever()
    yield b""  # pragma: no cover - never reached


async def pings_every_second() -> AsyncIterator[bytes]:
    while True:
        await trio.sleep(1)
        yield frames(PING)[0]


WARM_UP = b"".join(frames(MESSAGE_START, BLOCK_START, delta("warm"), *ENDING))


async def warmed_up(model: AnthropicModel) -> AnthropicModel:
    """`model` after one call made with the clock's jumps off: an SDK client's first request resolves the
    platform in a worker thread, which an autojumping clock takes for a silence and jumps over, to the next
    deadline (the watchdog's, the SDK's own, the test's)."""
    clock = trio.lowlevel.current_clock()
    assert isinstance(clock, trio.testing.MockClock)
    threshold, clock.autojump_threshold = clock.autojump_threshold, math.inf
    try:
        async with aclosing(model.stream(request(None))) as stream:
            async for _ in stream:
                pass
    finally:
        clock.autojump_threshold = threshold
    return model


async def model_of(
    body: TimedBody | None = None, *, before: Callable[[], Awaitable[None]] | None = None
) -> AnthropicModel:
    """A warmed-up model whose next request is answered by `before()`, then `body`."""
    served = 0

    async def handler(request: httpx2.Request) -> httpx2.Response:
        nonlocal served
        served += 1
        if served == 1:
            return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=WARM_UP)
        if before is not None:
            await before()
        assert body is not None
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    client = anthropic.AsyncAnthropic(
        api_key="sk-test-not-real",
        base_url="http://testserver",
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
        max_retries=0,
    )
    return await warmed_up(AnthropicModel(client=client))


def request(timeout_s: float | None = TIMEOUT_S) -> ModelRequest:
    return ModelRequest(
        model="claude-sonnet-5-5",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=64,
        stream_idle_timeout_s=timeout_s,
    )


async def stream_until_error(
    model: AnthropicModel, req: ModelRequest, *, hold_s: float = 0.0
) -> tuple[list[dict[str, Any]], ModelError, float]:
    """The events before the error, the error, and when it came (the mock clock, from the call's start)."""
    began = trio.current_time()
    events: list[dict[str, Any]] = []
    with pytest.raises(ModelError) as caught:
        async with aclosing(model.stream(req)) as stream:
            async for event in stream:
                events.append(event)
                await trio.sleep(hold_s)
    return events, caught.value, trio.current_time() - began


# ---------------------------------------------------------------- the provider


async def test_a_stream_that_stalls_after_its_first_event_fails_as_a_partial_response(
    clock: trio.testing.MockClock,
) -> None:
    body = TimedBody(frames(MESSAGE_START), then=silence)

    events, error, elapsed = await stream_until_error(await model_of(body), request())

    assert [e["type"] for e in events] == ["message_start"]
    assert error.kind == "connection" and error.retryable
    assert error.message.startswith(PARTIAL_RESPONSE)
    assert "30s" in error.message and "stream_idle_timeout_s" in error.message
    assert elapsed == pytest.approx(TIMEOUT_S)
    assert body.closed


async def test_pings_alone_never_restart_the_watchdog(clock: trio.testing.MockClock) -> None:
    body = TimedBody([], then=pings_every_second)

    events, error, elapsed = await stream_until_error(await model_of(body), request())

    assert {e["type"] for e in events} == {"ping"}
    assert len(events) == TIMEOUT_S - 1  # a ping a second, none of them a sign of progress
    assert error.kind == "connection" and error.message.startswith(NO_RESPONSE)
    assert elapsed == pytest.approx(TIMEOUT_S)


async def test_pings_after_the_first_events_do_not_keep_a_stalled_stream_alive(clock: trio.testing.MockClock) -> None:
    body = TimedBody([*frames(MESSAGE_START, BLOCK_START, delta("Hel")), 10.0], then=pings_every_second)

    events, error, elapsed = await stream_until_error(await model_of(body), request())

    assert [e["type"] for e in events[:3]] == ["message_start", "content_block_start", "content_block_delta"]
    assert error.message.startswith(PARTIAL_RESPONSE)
    assert elapsed == pytest.approx(TIMEOUT_S)


async def test_every_event_but_ping_restarts_the_watchdog(clock: trio.testing.MockClock) -> None:
    # Ten gaps of 0.9 timeouts each, pings inside them: nine timeouts in all, and never one without an event.
    gap = 0.9 * TIMEOUT_S
    steps: list[Step] = [*frames(MESSAGE_START, BLOCK_START)]
    for word in ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]:
        steps += [gap / 2, *frames(PING), gap / 2, *frames(delta(word))]
    body = TimedBody([*steps, *frames(*ENDING)])
    began = trio.current_time()

    async with aclosing((await model_of(body)).stream(request())) as stream:
        events = [event async for event in stream]

    assert events[-1]["type"] == "message_stop"
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "abcdefghij"
    assert trio.current_time() - began == pytest.approx(10 * gap)


async def test_time_the_consumer_holds_an_event_is_not_counted(clock: trio.testing.MockClock) -> None:
    # The consumer holds each event three timeouts long (a slow host); only the server's silence after its
    # last event counts.
    body = TimedBody(frames(MESSAGE_START, BLOCK_START), then=silence)

    events, error, elapsed = await stream_until_error(await model_of(body), request(), hold_s=3 * TIMEOUT_S)

    assert len(events) == 2
    assert error.message.startswith(PARTIAL_RESPONSE)
    assert elapsed == pytest.approx(2 * 3 * TIMEOUT_S + TIMEOUT_S)


async def test_an_event_trickled_a_byte_a_second_does_not_restart_the_watchdog(clock: trio.testing.MockClock) -> None:
    trickled = frames(delta("x" * 100))[0]
    steps: list[Step] = [*frames(MESSAGE_START)]
    for byte in trickled:
        steps += [1.0, bytes([byte])]
    body = TimedBody(steps, then=silence)

    events, error, elapsed = await stream_until_error(await model_of(body), request())

    assert [e["type"] for e in events] == ["message_start"]
    assert error.message.startswith(PARTIAL_RESPONSE)
    assert elapsed == pytest.approx(TIMEOUT_S)


async def test_a_response_that_never_starts_fails_at_the_first_byte_deadline(clock: trio.testing.MockClock) -> None:
    model = await model_of(before=trio.sleep_forever)

    events, error, elapsed = await stream_until_error(model, request())

    assert events == []
    assert error.kind == "connection" and error.message.startswith(NO_RESPONSE)
    assert elapsed == pytest.approx(TIMEOUT_S)


async def test_none_turns_the_watchdog_off(clock: trio.testing.MockClock) -> None:
    body = TimedBody([*frames(MESSAGE_START, BLOCK_START), 100 * TIMEOUT_S, *frames(delta("late"), *ENDING)])

    async with aclosing((await model_of(body)).stream(request(None))) as stream:
        events = [event async for event in stream]

    assert [e["type"] for e in events][-1] == "message_stop"


# ---------------------------------------------------------------- the option


def test_stream_idle_timeout_is_on_by_default_and_must_be_positive_or_none() -> None:
    assert QueryOptions().stream_idle_timeout_s == DEFAULT_STREAM_IDLE_TIMEOUT_S == 300.0
    assert QueryOptions(stream_idle_timeout_s=None).stream_idle_timeout_s is None
    assert QueryOptions(stream_idle_timeout_s=0.5).stream_idle_timeout_s == 0.5
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(pydantic.ValidationError, match="stream_idle_timeout_s"):
            QueryOptions(stream_idle_timeout_s=bad)


async def test_the_option_reaches_every_main_request() -> None:
    provider = ScriptedModel([text_reply("one"), text_reply("two")])
    async with Runtime.open() as rt:
        session = await rt.open_session(QueryOptions(provider=provider, stream_idle_timeout_s=42.0))
        [_ async for _ in session.query("first")]
        [_ async for _ in session.query("second", stream_idle_timeout_s=None)]

    assert [r.stream_idle_timeout_s for r in provider.requests] == [42.0, None]


async def test_the_option_reaches_the_summary_and_compaction_requests_too() -> None:
    # The runtime's own calls stream from the same kind of endpoint: a stalled one is bounded alike.
    main = ScriptedModel([tools_reply(tool_use("t1", "read")), {"error": "prompt_too_long"}, text_reply("after")])
    summaries = ScriptedModel([text_reply("Read a file")])
    compaction = ScriptedModel([text_reply("<summary>")])
    options = QueryOptions(
        provider=main,
        tools=[scripted_tool("read")],
        summary_provider=summaries,
        compact_provider=compaction,
        tool_use_summaries=True,
        context_collapse=False,
        stream_idle_timeout_s=17.0,
    )
    async with Runtime.open() as rt:
        session = await rt.open_session(options)
        [_ async for _ in session.query("first")]
    assert [r.stream_idle_timeout_s for r in compaction.requests] == [17.0]
    assert [r.stream_idle_timeout_s for r in summaries.requests] == [17.0]
    assert [r.stream_idle_timeout_s for r in main.requests] == [17.0, 17.0, 17.0]


# ---------------------------------------------------------------- over a real socket


async def run_on(
    script: list[dict[str, Any]], *, options: dict[str, Any], sdk_timeout: float = 600.0
) -> tuple[LocalMessagesAPI, list[Any], Any]:
    """One query against a real socket playing `script`, after a warm-up call (`warmed_up`) not counted in
    `api.requests`."""
    async with LocalMessagesAPI([text_reply("warm"), *script]) as api:
        model = AnthropicModel(api_key="sk-local-test", base_url=api.base_url, timeout=sdk_timeout)
        try:
            await warmed_up(model)
            del api.requests[0]
            async with Runtime.open() as rt:
                session = await rt.open_session(QueryOptions(provider=model, **options))
                handle = session.query("Hi")
                events = [event async for event in handle]
                return api, events, handle.result
        finally:
            with trio.CancelScope(shield=True):
                await model.aclose()


async def test_a_server_that_pings_forever_ends_the_query_although_every_read_succeeds(
    clock: trio.testing.MockClock,
) -> None:
    # The SDK's 3 s read timeout never fires: a ping comes every second. Before the watchdog, this query never ended.
    script = [{"error": "pings_forever", "after_events": 1, "ping_every_ms": 1000}]
    with trio.fail_after(10 * TIMEOUT_S):
        api, events, result = await run_on(
            script, options={"stream_idle_timeout_s": TIMEOUT_S, "max_retries": 2}, sdk_timeout=3.0
        )

    assert result is not None and result.is_error
    assert PARTIAL_RESPONSE in result.result
    pings = [e for e in events if isinstance(e, StreamEvent) and e.event["type"] == "ping"]
    assert TIMEOUT_S - 2 <= len(pings) <= TIMEOUT_S
    assert len(api.requests) == 1  # a ping was shown: a retry would repeat it (docs/design.md)
    assert api.disconnects == 1  # the client left the stream it gave up on


async def test_a_silent_server_is_retried_after_each_idle_timeout_instead_of_ten_minutes_an_attempt(
    clock: trio.testing.MockClock,
) -> None:
    # No headers, ever: the SDK alone waited its 600 s timeout three times over.
    silent = {"error": "overloaded", "latency_ms": 10**9}
    began = trio.current_time()
    with trio.fail_after(10 * TIMEOUT_S):
        api, events, result = await run_on(
            [silent, silent, silent], options={"stream_idle_timeout_s": TIMEOUT_S, "max_retries": 2}
        )

    assert len(api.requests) == 3
    retries = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "api_retry"]
    assert [r.data["kind"] for r in retries] == ["connection", "connection"]
    assert result is not None and result.is_error and NO_RESPONSE in result.result
    # Three timeouts and two backoffs (at most 0.5 s and 1 s).
    assert 3 * TIMEOUT_S <= trio.current_time() - began <= 3 * TIMEOUT_S + 2


async def test_a_stream_silent_after_its_headers_is_cut_and_the_retry_completes(
    clock: trio.testing.MockClock,
) -> None:
    stalled = text_reply("never") | {"stall_after_events": 0, "latency_ms": 10**9}
    with trio.fail_after(10 * TIMEOUT_S):
        api, events, result = await run_on([stalled, text_reply("Hello")], options={"stream_idle_timeout_s": TIMEOUT_S})

    assert len(api.requests) == 2
    retries = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "api_retry"]
    assert [r.data["kind"] for r in retries] == ["connection"]
    assert result is not None and not result.is_error and result.result == "Hello"
