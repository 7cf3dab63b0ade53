"""A server's bytes are checked, not trusted: a usage count that is not a non-negative integer, or a
stream without `message_start`, is a malformed response (retried while nothing was shown, else the
query's `api_error`), never a crash, a negative cost or a made-up success; a repeated tool_use id
runs once and is sent back once; `usage.iterations[]` is what is counted and priced."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest

from queryloop import QueryOptions, Runtime
from queryloop.runtime.loop.model import ModelError, ModelRequest, reported_usage
from queryloop.runtime.loop.stream import ResponseAssembler, complete_text
from queryloop.runtime.providers.scripted import ScriptedModel, ScriptedReply, reply_events
from tests.helpers import Ran, ToolLog, assert_settled, consume, scripted_tool, text_reply, tool_use, tools_reply

Events = list[dict[str, Any]]


class RawModel:
    """Plays raw event lists, one per request (the last one again once they run out)."""

    def __init__(self, responses: Sequence[Events]) -> None:
        self.responses = list(responses)
        self.requests: list[ModelRequest] = []

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        self.requests.append(request)
        for event in self.responses[min(len(self.requests), len(self.responses)) - 1]:
            yield event


def events_of(entry: dict[str, Any], **usage: Any) -> Events:
    events = reply_events(ScriptedReply(**entry), model="claude-sonnet-5-5", message_id="msg_1", input_tokens=10)
    if usage:
        events[0]["message"]["usage"].update(usage)
    return events


def good() -> Events:
    return events_of(text_reply("Fine."))


async def run(responses: Sequence[Events], **options: Any) -> Ran:
    model = RawModel(responses)
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, **options))
        ran = await consume(session, session.query("Go"), model)  # type: ignore[arg-type]
        await assert_settled(ran)
    return ran


BAD_COUNTS: list[Any] = [-9_999_999_999, "100", 1.5, True, [1]]


@pytest.mark.parametrize("count", BAD_COUNTS)
def test_a_usage_count_that_is_not_a_non_negative_integer_is_malformed(count: Any) -> None:
    with pytest.raises(ValueError, match="not a non-negative integer"):
        reported_usage({"input_tokens": count})
    with pytest.raises(ValueError, match="not a non-negative integer"):
        reported_usage({"output_tokens": 1, "iterations": [{"output_tokens": count}]})
    assert reported_usage({"input_tokens": 0, "output_tokens": 5}) == (0, 5, None, None, None)


@pytest.mark.parametrize("count", [-9_999_999_999, "100"])
async def test_a_negative_or_string_usage_is_retried_and_never_billed(count: Any) -> None:
    ran = await run([events_of(text_reply("Bad."), input_tokens=count), good()], max_retries=2)
    result = ran.handle.result
    assert result is not None and result.subtype == "success" and result.total_cost_usd >= 0
    assert result.usage.input_tokens == 10  # the good response's, nothing of the bad one
    assert "system:api_retry" in ran.labels
    assert len(ran.model.requests) == 2


async def test_a_malformed_usage_that_stays_ends_the_query_with_api_error_and_no_cost() -> None:
    ran = await run([events_of(text_reply("Bad."), output_tokens=-5)], max_retries=1)
    result = ran.handle.result
    assert ran.reason == "api_error" and result is not None and result.is_error
    assert result.total_cost_usd == 0 and "non-negative integer" in " ".join(result.errors)


async def test_a_negative_usage_mid_stream_after_text_was_shown_is_an_error_not_a_negative_cost() -> None:
    events = events_of(text_reply("Shown first."))
    delta = next(e for e in events if e["type"] == "message_delta")
    delta["usage"] = {"output_tokens": -1_000_000}
    ran = await run([events], max_retries=2, max_budget_usd=0.01)
    result = ran.handle.result
    assert ran.reason == "api_error" and result is not None
    assert result.total_cost_usd >= 0


@pytest.mark.parametrize(
    "response",
    [
        [{"type": "message_stop"}],
        [{"type": "ping"}, {"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, {"type": "message_stop"}],
        [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "hi"}}],
    ],
    ids=["lone message_stop", "no message_start", "a block before message_start"],
)
async def test_a_stream_without_message_start_is_malformed_never_a_success(response: Events) -> None:
    ran = await run([response], max_retries=1)
    result = ran.handle.result
    assert result is not None and result.is_error  # an API error's result, as Claude Code's: `is_error` is set
    assert ran.reason == "api_error"
    assert "before message_start" in " ".join(result.errors)
    assert len(ran.model.requests) == 2  # retried once, as other malformed streams are


async def test_a_repeated_tool_use_id_in_one_response_runs_once_and_is_sent_back_once() -> None:
    log = ToolLog()
    twice = tools_reply(tool_use("toolu_same", "act", {"n": 1}), tool_use("toolu_same", "act", {"n": 2}))
    model = ScriptedModel([twice, text_reply()])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, tools=[scripted_tool("act", log=log)]))
        ran = await consume(session, session.query("Go"), model)
        await assert_settled(ran)
    assert ran.reason == "completed"
    assert log.order == ["toolu_same"]
    sent = model.requests[1].messages
    uses = [b for m in sent if m["role"] == "assistant" for b in m["content"] if b.get("type") == "tool_use"]
    results = [b for m in sent if m["role"] == "user" for b in m["content"] if b.get("type") == "tool_result"]
    assert [b["id"] for b in uses] == ["toolu_same"] and uses[0]["input"] == {"n": 1}
    assert [b["tool_use_id"] for b in results] == ["toolu_same"]


def test_the_assembler_drops_a_repeated_tool_use_id_and_says_so() -> None:
    assembler = ResponseAssembler()
    completed = []
    for event in events_of(tools_reply(tool_use("a", "x"), tool_use("a", "y"), tool_use("b", "z"))):
        done = assembler.feed(event)
        if done is not None:
            completed.append(done.block)
    assert [(b["id"], b["name"]) for b in completed] == [("a", "x"), ("b", "z")]
    assert assembler.duplicate_tool_use_ids == ["a"]


async def test_a_malformed_compaction_or_summary_stream_is_a_model_error_not_a_crash() -> None:
    request = ModelRequest(
        model="claude-haiku-5-5", system=[], messages=[], tools=[], max_tokens=100, purpose="summary"
    )
    for response in ([{"type": "message_stop"}], events_of(text_reply("x"), input_tokens="many")):
        with pytest.raises(ModelError, match="malformed summary stream event"):
            await complete_text(RawModel([response]), request)
