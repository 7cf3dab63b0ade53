"""`queryloop.runtime.providers.scripted`: it streams what the Messages API streams and fails as it fails."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
import trio
import trio.testing
from hypothesis import assume, given
from hypothesis import strategies as st

from queryloop.runtime.loop.model import FallbackTriggered, ModelError, ModelProvider, ModelRequest, is_prompt_too_long
from queryloop.runtime.loop.stream import ResponseAssembler
from queryloop.runtime.providers import scripted
from queryloop.runtime.providers.scripted import (
    JSON_CHUNK,
    TEXT_CHUNK,
    ScriptedError,
    ScriptedModel,
    ScriptedReply,
    ScriptedUsage,
    ScriptExhausted,
    parse_entry,
    reply_events,
)


def request(text: str = "hello") -> ModelRequest:
    return ModelRequest(
        model="claude-sonnet-5-5",
        messages=[{"role": "user", "content": [{"type": "text", "text": text}]}],
        max_tokens=8000,
    )


def tool(tool_id: str, value: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": "edit", "input": value}


def events_of(reply: ScriptedReply) -> list[dict[str, Any]]:
    return reply_events(reply, model="claude-sonnet-5-5", message_id="msg_x", input_tokens=321)


def json_fragments(events: list[dict[str, Any]], index: int) -> list[str]:
    return [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == index and e["delta"]["type"] == "input_json_delta"
    ]


def assemble(events: list[dict[str, Any]]) -> tuple[ResponseAssembler, list[dict[str, Any]]]:
    assembler = ResponseAssembler()
    blocks = []
    for event in events:
        done = assembler.feed(event)
        if done is not None:
            assert done.input_error is None
            blocks.append(done.block)
    return assembler, blocks


async def collect(model: ScriptedModel, req: ModelRequest) -> list[dict[str, Any]]:
    return [event async for event in model.stream(req)]


# -- reply_events ----------------------------------------------------------------------------------


def test_reply_events_follow_the_messages_api_sequence() -> None:
    long_text = "x" * (2 * TEXT_CHUNK + 5)
    reply = ScriptedReply(
        content=[{"type": "text", "text": long_text}, tool("toolu_1", {"path": "a.py"})],
        stop_reason="tool_use",
        usage=ScriptedUsage(input_tokens=1200, output_tokens=345, cache_read_input_tokens=800),
    )
    events = events_of(reply)
    kinds = [(e["type"], e.get("index"), e.get("delta", {}).get("type")) for e in events]
    assert kinds[0] == ("message_start", None, None)
    assert kinds[1:6] == [
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_stop", 0, None),
    ]
    assert kinds[6] == ("content_block_start", 1, None)
    assert all(k == ("content_block_delta", 1, "input_json_delta") for k in kinds[7:-3])
    assert kinds[-3:] == [("content_block_stop", 1, None), ("message_delta", None, None), ("message_stop", None, None)]

    start = events[0]["message"]
    assert start["id"] == "msg_x"
    assert start["model"] == "claude-sonnet-5-5"
    assert start["role"] == "assistant"
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 1200
    assert start["usage"]["cache_read_input_tokens"] == 800
    assert start["usage"]["output_tokens"] == 1  # the real API reports a token or so at the start
    assert events[1]["content_block"] == {"type": "text", "text": ""}
    assert [len(e["delta"]["text"]) for e in events[2:5]] == [TEXT_CHUNK, TEXT_CHUNK, 5]
    assert events[6]["content_block"] == {"type": "tool_use", "id": "toolu_1", "name": "edit", "input": {}}
    delta = events[-2]
    assert delta["delta"]["stop_reason"] == "tool_use"
    assert delta["usage"] == {"output_tokens": 345}


def test_reply_events_estimate_usage_when_none_is_scripted() -> None:
    small = events_of(ScriptedReply(content=[{"type": "text", "text": "hi"}]))
    large = events_of(ScriptedReply(content=[{"type": "text", "text": "word " * 400}]))
    assert small[0]["message"]["usage"]["input_tokens"] == 321
    assert small[-2]["usage"]["output_tokens"] >= 1
    assert large[-2]["usage"]["output_tokens"] > small[-2]["usage"]["output_tokens"]
    assert small[-2]["delta"]["stop_reason"] == "end_turn"


def test_input_json_fragments_join_back_to_the_dumped_input_and_start_empty() -> None:
    value = {"path": "src/some/long/module/path.py", "lines": list(range(30)), "note": "ünïcode ✓"}
    events = events_of(ScriptedReply(content=[tool("toolu_1", value)], stop_reason="tool_use"))
    fragments = json_fragments(events, 0)
    assert fragments[0] == ""
    assert len(fragments) > 2
    assert all(len(f) <= JSON_CHUNK for f in fragments)
    assert "".join(fragments) == json.dumps(value)
    empty = json_fragments(events_of(ScriptedReply(content=[tool("toolu_2", {})])), 0)
    assert empty == ["", "{}"]


@pytest.mark.parametrize(
    "value",
    [{}, {"a": 1}, {"path": "x" * 23}, {"path": "x" * 200, "flags": ["-v", "-x"]}],
)
def test_truncate_last_block_cuts_the_last_tools_json_and_omits_its_stop(value: dict[str, Any]) -> None:
    reply = ScriptedReply(
        content=[{"type": "text", "text": "writing"}, tool("toolu_1", {"ok": True}), tool("toolu_2", value)],
        stop_reason="max_tokens",
        truncate_last_block=True,
    )
    events = events_of(reply)
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]  # every block but the cut one is closed
    raw = json.dumps(value)
    joined = "".join(json_fragments(events, 2))
    assert json_fragments(events, 2)[0] == ""
    assert raw.startswith(joined)
    assert joined != raw
    with pytest.raises(json.JSONDecodeError):
        json.loads(joined)
    assert "".join(json_fragments(events, 1)) == json.dumps({"ok": True})  # earlier tools are whole
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-1] == {"type": "message_stop"}

    assembler, blocks = assemble(events)
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    (cut,) = assembler.close_truncated()
    assert cut.block["id"] == "toolu_2"
    assert cut.block["input"] == {}
    assert cut.input_error is not None
    assert "max_tokens" in cut.input_error


def test_thinking_streams_thinking_then_signature_and_unknown_blocks_arrive_whole() -> None:
    thinking = {"type": "thinking", "thinking": "let me think", "signature": "EqQBCkgIARABGAIiQL"}
    redacted = {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"}
    server = {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "trio"}}
    events = events_of(ScriptedReply(content=[thinking, redacted, server]))
    body = events[1:-2]
    assert [(e["type"], e.get("delta", {}).get("type")) for e in body[:4]] == [
        ("content_block_start", None),
        ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
    ]
    assert body[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert body[1]["delta"]["thinking"] == "let me think"
    assert body[2]["delta"]["signature"] == "EqQBCkgIARABGAIiQL"
    assert [e["type"] for e in body[4:6]] == ["content_block_start", "content_block_stop"]
    assert body[4]["content_block"] == redacted  # no deltas: it arrives whole
    # A server tool's input streams as input_json_delta, as on the wire (tool_use_server_then_client.sse).
    assert body[6]["content_block"] == {**server, "input": {}}
    fragments = [e["delta"]["partial_json"] for e in body[7:-1]]
    assert fragments[0] == "" and json.loads("".join(fragments)) == server["input"]
    _, blocks = assemble(events)
    assert blocks == [thinking, redacted, server]


# -- round trip through ResponseAssembler ------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=150)),
    st.builds(
        lambda i, n, v: {"type": "tool_use", "id": f"toolu_{i}", "name": n, "input": v},
        st.integers(0, 10**6),
        st.text(min_size=1, max_size=10),
        st.dictionaries(st.text(max_size=10), json_values, max_size=5),
    ),
    st.builds(
        lambda t, s: {"type": "thinking", "thinking": t, "signature": s},
        st.text(max_size=60),
        st.text(max_size=20),
    ),
    st.builds(lambda d: {"type": "redacted_thinking", "data": d}, st.text(max_size=20)),
)


@given(
    st.lists(blocks, max_size=5),
    st.sampled_from(["end_turn", "tool_use", "max_tokens", "stop_sequence", "pause_turn", "refusal"]),
    st.integers(1, 10**6),
)
def test_reply_events_through_the_assembler_reproduce_the_scripted_content(
    content: list[dict[str, Any]], stop_reason: Any, output_tokens: int
) -> None:
    ids = [b["id"] for b in content if b["type"] == "tool_use"]
    assume(len(ids) == len(set(ids)))  # a repeated tool_use id is dropped (test_hostile_stream)
    reply = ScriptedReply(
        content=content, stop_reason=stop_reason, usage=ScriptedUsage(input_tokens=7, output_tokens=output_tokens)
    )
    assembler, assembled = assemble(events_of(reply))
    assert assembled == content
    assert assembler.close_truncated() == []
    assert assembler.stop_reason == stop_reason
    assert assembler.stopped is True
    assert assembler.message_id == "msg_x"
    assert assembler.usage.input_tokens == 7
    assert assembler.usage.output_tokens == output_tokens


# -- ScriptedModel ---------------------------------------------------------------------------------


async def test_scripted_model_consumes_one_entry_per_request_and_records_requests() -> None:
    model = ScriptedModel(
        [
            {"content": [tool("toolu_1", {"path": "a"})], "stop_reason": "tool_use"},
            {"content": [{"type": "text", "text": "done"}]},
        ],
        name="main",
    )
    assert isinstance(model, ModelProvider)
    first, second = request("read a"), request("thanks")
    events_1 = await collect(model, first)
    events_2 = await collect(model, second)
    assert model.requests == [first, second]
    assert model.requests[0] is first
    assert model.exhausted is False
    assert events_1[0]["message"]["id"] == "msg_main_1"
    assert events_2[0]["message"]["id"] == "msg_main_2"
    assert events_1[0]["message"]["model"] == "claude-sonnet-5-5"
    assert events_1[-2]["delta"]["stop_reason"] == "tool_use"
    assert events_2[-2]["delta"]["stop_reason"] == "end_turn"
    _, blocks_1 = assemble(events_1)
    _, blocks_2 = assemble(events_2)
    assert blocks_1 == [tool("toolu_1", {"path": "a"})]
    assert blocks_2 == [{"type": "text", "text": "done"}]
    assert repr(model) == "<ScriptedModel main: 2/2 used>"


async def test_scripted_model_estimates_input_tokens_from_the_request() -> None:
    model = ScriptedModel([{"content": [{"type": "text", "text": "a"}]}] * 2)
    short = await collect(model, request("hi"))
    long = await collect(model, request("hi " * 1000))
    assert 1 <= short[0]["message"]["usage"]["input_tokens"] < long[0]["message"]["usage"]["input_tokens"]


async def test_scripted_usage_never_estimates_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate dumps the whole request (half the provider's cost): a scripted usage makes it useless."""

    def refuse(payload: Any) -> int:
        raise AssertionError(f"estimated tokens of {payload!r}")

    monkeypatch.setattr(scripted, "_estimate_tokens", refuse)
    usage = {"input_tokens": 1200, "output_tokens": 30, "cache_read_input_tokens": 7}
    partial = {"output_tokens": 5}  # a usage with some counts scripted is scripted: the rest are 0
    model = ScriptedModel(
        [{"content": [{"type": "text", "text": "a"}], "usage": usage}, {"content": [], "usage": partial}]
    )
    first = await collect(model, request("hi " * 1000))
    second = await collect(model, request("again"))
    assert first[0]["message"]["usage"]["input_tokens"] == 1200
    assert first[0]["message"]["usage"]["cache_read_input_tokens"] == 7
    assert first[-2]["usage"] == {"output_tokens": 30}
    assert second[0]["message"]["usage"]["input_tokens"] == 0
    assert second[-2]["usage"] == {"output_tokens": 5}


async def test_unscripted_usage_estimates_the_request_and_the_reply(monkeypatch: pytest.MonkeyPatch) -> None:
    estimated: list[Any] = []

    def estimate(payload: Any) -> int:
        estimated.append(payload)
        return 40 + len(estimated)

    monkeypatch.setattr(scripted, "_estimate_tokens", estimate)
    content = [{"type": "text", "text": "a"}]
    req = request("hi")
    events = await collect(ScriptedModel([{"content": content}]), req)
    assert estimated == [req.messages, content]
    assert events[0]["message"]["usage"]["input_tokens"] == 41
    assert events[-2]["usage"] == {"output_tokens": 42}


@pytest.mark.parametrize(
    ("entry", "kind", "status", "retry_after", "retryable"),
    [
        ({"error": "prompt_too_long"}, "prompt_too_long", 400, None, False),
        ({"error": "overloaded"}, "overloaded", 529, None, True),
        ({"error": "rate_limit", "retry_after_s": 12.5}, "rate_limit", 429, 12.5, True),
        ({"error": "rate_limit"}, "rate_limit", 429, None, True),
        ({"error": "api_error"}, "api_error", 500, None, True),
        ({"error": "image_size"}, "image_size", 400, None, False),
    ],
)
async def test_scripted_errors_raise_the_classified_model_error(
    entry: dict[str, Any], kind: str, status: int, retry_after: float | None, retryable: bool
) -> None:
    model = ScriptedModel([entry, {"content": [{"type": "text", "text": "after"}]}])
    seen: list[dict[str, Any]] = []
    with pytest.raises(ModelError) as raised:
        async for event in model.stream(request()):
            seen.append(event)
    error = raised.value
    assert seen == []  # the request failed: nothing streamed
    assert error.kind == kind
    assert error.status == status
    assert error.retry_after == retry_after
    assert error.retryable is retryable
    assert not isinstance(error, ScriptExhausted)
    assert is_prompt_too_long(error.status, error.message) is (kind == "prompt_too_long")
    assert len(model.requests) == 1
    assert (await collect(model, request()))[-1] == {"type": "message_stop"}  # the retry gets the next entry


async def test_a_fallback_entry_raises_fallback_triggered() -> None:
    model = ScriptedModel([{"error": "fallback"}])
    with pytest.raises(FallbackTriggered):
        await collect(model, request())
    assert not issubclass(FallbackTriggered, ModelError)
    assert len(model.requests) == 1


@pytest.mark.parametrize("after_events", [0, 1, 3])
async def test_a_connection_entry_streams_some_events_then_raises_connection(after_events: int) -> None:
    content = [{"type": "text", "text": "An answer that will be cut"}]
    model = ScriptedModel([{"error": "connection", "after_events": after_events, "content": content}])
    seen: list[dict[str, Any]] = []
    with pytest.raises(ModelError) as raised:
        async for event in model.stream(request()):
            seen.append(event)
    assert raised.value.kind == "connection"
    assert raised.value.retryable is True
    full = reply_events(ScriptedReply(content=content), model="claude-sonnet-5-5", message_id="msg_1", input_tokens=1)
    assert seen == full[:after_events]
    assembler, _ = assemble(seen)
    assert assembler.stopped is False  # a cut stream never reaches message_stop
    assert assembler.stop_reason is None


async def test_running_out_of_script_raises_script_exhausted() -> None:
    model = ScriptedModel([{"content": [{"type": "text", "text": "only one"}]}], name="tiny")
    await collect(model, request())
    assert model.exhausted is False
    with pytest.raises(ScriptExhausted) as raised:
        await collect(model, request("one more"))
    assert isinstance(raised.value, ModelError)
    assert raised.value.kind == "script_exhausted"
    assert raised.value.retryable is False
    assert "tiny" in raised.value.message
    assert "request 2" in raised.value.message
    assert model.exhausted is True
    assert len(model.requests) == 2  # the unanswerable request is recorded too
    with pytest.raises(ScriptExhausted):
        await collect(ScriptedModel([]), request())


def test_unknown_keys_in_an_entry_are_validation_errors_naming_the_key() -> None:
    with pytest.raises(pydantic.ValidationError, match="stop_reasn"):
        ScriptedModel([{"content": [], "stop_reasn": "end_turn"}])
    with pytest.raises(pydantic.ValidationError, match="retry_after"):
        ScriptedModel([{"error": "rate_limit", "retry_after": 3}])
    with pytest.raises(pydantic.ValidationError, match="error"):
        parse_entry({"error": "teapot"})
    with pytest.raises(pydantic.ValidationError, match="stop_reason"):
        parse_entry({"content": [], "stop_reason": "finished"})
    with pytest.raises(pydantic.ValidationError, match="content"):
        parse_entry({"stop_reason": "end_turn"})
    assert isinstance(parse_entry({"error": "overloaded"}), ScriptedError)
    assert isinstance(parse_entry({"content": []}), ScriptedReply)
    parsed = ScriptedReply(content=[{"type": "text", "text": "pre-built"}])
    assert ScriptedModel([parsed]).entries == [parsed]


async def test_latency_is_spent_half_before_the_first_event_and_half_before_message_delta(
    autojump_clock: trio.testing.MockClock,
) -> None:
    model = ScriptedModel(
        [{"content": [{"type": "text", "text": "slow"}, tool("toolu_1", {"a": 1})], "latency_ms": 2000}]
    )
    start = trio.current_time()
    arrivals: list[tuple[str, float]] = []
    async for event in model.stream(request()):
        arrivals.append((event["type"], trio.current_time() - start))
    times = dict(arrivals)
    assert arrivals[0][0] == "message_start"
    assert arrivals[0][1] == pytest.approx(1.0)
    # every block, tool included, completes after the first half: tools can start while the stream is open
    assert all(t == pytest.approx(1.0) for kind, t in arrivals if kind.startswith("content_block"))
    assert times["message_delta"] == pytest.approx(2.0)
    assert times["message_stop"] == pytest.approx(2.0)


async def test_an_error_entry_spends_its_whole_latency_before_raising(autojump_clock: trio.testing.MockClock) -> None:
    model = ScriptedModel([{"error": "overloaded", "latency_ms": 3000}, {"error": "connection", "latency_ms": 3000}])
    start = trio.current_time()
    with pytest.raises(ModelError):
        await collect(model, request())
    assert trio.current_time() - start == pytest.approx(3.0)
    start = trio.current_time()
    with pytest.raises(ModelError) as raised:
        await collect(model, request())
    assert raised.value.kind == "connection"
    assert trio.current_time() - start == pytest.approx(1.5)  # cut after the first half


async def test_no_latency_means_no_time_passes(autojump_clock: trio.testing.MockClock) -> None:
    model = ScriptedModel([{"content": [{"type": "text", "text": "fast"}]}])
    start = trio.current_time()
    await collect(model, request())
    assert trio.current_time() == start
