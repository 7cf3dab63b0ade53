"""The runtime end to end through the real `anthropic` SDK, real sockets and a local Messages API.

Every session here uses `AnthropicModel` against `queryloop.runtime.providers.local_api.LocalMessagesAPI` on
127.0.0.1: requests are built and sent by the SDK, streams are parsed from real SSE bytes, and
faults are real HTTP statuses, in-stream error events and closed connections. These tests run on
the real clock: latencies are tiny, and conditions are awaited (bounded by `trio.fail_after`),
never slept for.
"""

from __future__ import annotations

import gc
import json
import re
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from loguru import logger

from queryloop import QueryOptions, Runtime
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.loop.context import COMPACT_SUMMARY_PREFIX
from queryloop.runtime.loop.events import AssistantMessage, QueryEvent, StreamEvent, SystemMessage
from queryloop.runtime.loop.pricing import pricing_for
from queryloop.runtime.loop.transcript import transcript_problems
from queryloop.runtime.providers.anthropic_model import AnthropicModel
from queryloop.runtime.providers.local_api import LocalMessagesAPI
from tests.helpers import ToolLog, scripted_tool, text_reply, tool_use, tools_reply

API_KEY = "sk-local-test"
DEADLINE_S = 15.0
"""Bound of every test body: a hang fails the test instead of the run."""
ABORT_BOUND_S = 5.0
"""Bound of a query's end after its abort, in a 30 s stall: far under the stall, far over the milliseconds an
abort takes; it tells an abort that ends the stream from one that waits for it, and measures no speed."""

UNEXHAUSTED_BODY_ITERATOR = (
    "Async generator 'httpcore2._async.connection_pool.PoolByteStream.__aiter__' was garbage collected"
)
# The SDK's body iterator, left to the collector when a stream ends on an in-stream error unless the provider closes
# it (it does: test_an_in_stream_error_closes_the_sdk_body_iterators_instead_of_leaving_them_to_gc). Tests whose
# stream ends so still tolerate this one warning, and only it: the test named checks the closing itself.
TOLERATE_UNEXHAUSTED_BODY_ITERATOR = pytest.mark.filterwarnings(f"ignore:{UNEXHAUSTED_BODY_ITERATOR}:ResourceWarning")


@asynccontextmanager
async def served(
    script: list[dict[str, Any]], *, name: str = "main"
) -> AsyncIterator[tuple[LocalMessagesAPI, AnthropicModel]]:
    """A local server playing `script`, and an `AnthropicModel` (its own SDK client) pointed at it."""
    async with LocalMessagesAPI(script, name=name) as api:
        model = AnthropicModel(api_key=API_KEY, base_url=api.base_url)
        try:
            yield api, model
        finally:
            # Even on a failure: an SDK client left open leaks sockets (a ResourceWarning, an error here).
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await model.aclose()
            # Garbage of this test is collected now, so a leak is reported by the test that made it.
            gc.collect()


async def run_query(session: Session, prompt: str = "Fix the bug") -> tuple[QueryHandle, list[QueryEvent]]:
    handle = session.query(prompt)
    events = [event async for event in handle]
    return handle, events


async def assert_settled(session: Session, handle: QueryHandle, events: list[QueryEvent]) -> None:
    """What every query guarantees at its end: one result last, nothing running, a valid transcript."""
    labels = [e.label for e in events]
    assert labels.count("result") == 1 and labels[-1] == "result"
    assert handle.result is not None and handle.terminal is not None
    assert session.live_tasks() == 0
    assert transcript_problems(await session.transcript()) == []


def tool_pairs(messages: list[dict[str, Any]]) -> list[tuple[list[str], list[str]]]:
    """(tool_use ids of an assistant message, tool_result ids of the user message right after it)."""
    pairs = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or isinstance(message["content"], str):
            continue
        uses = [b["id"] for b in message["content"] if b["type"] == "tool_use"]
        if not uses:
            continue
        following = messages[index + 1] if index + 1 < len(messages) else {"content": []}
        results = [b["tool_use_id"] for b in following["content"] if b["type"] == "tool_result"]
        pairs.append((uses, results))
    return pairs


# ---------------------------------------------------------------- the loop over the wire


async def test_tool_loop_through_the_sdk_pairs_every_tool_use_with_its_result_and_prices_the_usage() -> None:
    usage = {"input_tokens": 1_000, "output_tokens": 100}
    script = [
        tools_reply(
            tool_use("t1", "read", {"path": "a.py"}), tool_use("t2", "read", {"path": "b.py"}), text="Reading both."
        )
        | {"usage": usage, "latency_ms": 10},
        tools_reply(tool_use("t3", "read", {"path": "c.py"})) | {"usage": usage},
        text_reply("All read.") | {"usage": usage},
    ]
    log = ToolLog()
    read = scripted_tool("read", result="contents", safe=True, log=log)
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, tools=[read]))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert handle.transitions == ["next_turn", "next_turn"]
            assert log.order == ["t1", "t2", "t3"]
            bodies = [r.body for r in api.requests]
            assert len(bodies) == 3
            assert all(r.path == "/v1/messages" and r.method == "POST" for r in api.requests)
            assert all(b["stream"] is True and b["model"] == "claude-sonnet-5-5" for b in bodies)
            assert bodies[0]["tools"][0]["name"] == "read"
            assert tool_pairs(bodies[0]["messages"]) == []
            assert tool_pairs(bodies[1]["messages"]) == [(["t1", "t2"], ["t1", "t2"])]
            assert tool_pairs(bodies[2]["messages"]) == [(["t1", "t2"], ["t1", "t2"]), (["t3"], ["t3"])]
            results = [b for b in bodies[1]["messages"][-1]["content"] if b["type"] == "tool_result"]
            assert [r["content"] for r in results] == ["contents", "contents"]
            # The raw wire passes through: the server's pings arrive as stream events.
            pings = [e for e in events if isinstance(e, StreamEvent) and e.event["type"] == "ping"]
            assert len(pings) == 3

            result = handle.result
            assert result is not None and not result.is_error and result.result == "All read."
            assert result.num_turns == 3
            assert (result.usage.input_tokens, result.usage.output_tokens) == (3_000, 300)
            price = pricing_for("claude-sonnet-5-5")
            expected = (3_000 * price.input + 300 * price.output) / 1_000_000
            assert result.total_cost_usd == pytest.approx(expected)
            await assert_settled(session, handle, events)


async def test_prompt_caching_marks_every_request_and_cache_reads_and_writes_are_priced_so() -> None:
    written = {"input_tokens": 10, "cache_creation_input_tokens": 2_000, "output_tokens": 50}
    read_back = {
        "input_tokens": 10,
        "cache_read_input_tokens": 2_000,
        "cache_creation_input_tokens": 60,
        "output_tokens": 5,
    }
    script = [
        tools_reply(tool_use("t1", "read", {"path": "a.py"})) | {"usage": written},
        text_reply("All read.") | {"usage": read_back},
    ]
    read = scripted_tool("read", result="contents")
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, tools=[read]))
            handle, events = await run_query(session)
            await assert_settled(session, handle, events)
        assert [r.body.get("cache_control") for r in api.requests] == [{"type": "ephemeral"}] * 2
        # The second request's prefix is the first one's, byte for byte: what the cache can serve.
        first, second = (r.body["messages"] for r in api.requests)
        assert second[: len(first)] == first
        result = handle.result
        assert result is not None and result.usage.cache_read_input_tokens == 2_000
        price = pricing_for("claude-sonnet-5-5")
        spent = 20 * price.input + 55 * price.output + 2_060 * price.cache_write + 2_000 * price.cache_read
        assert result.total_cost_usd == pytest.approx(spent / 1_000_000)

        async with LocalMessagesAPI([text_reply("No marker.")]) as api:
            plain = AnthropicModel(api_key=API_KEY, base_url=api.base_url, prompt_caching=False)
            try:
                async with Runtime.open() as rt:
                    session = await rt.open_session(QueryOptions(provider=plain))
                    assert (await session.query("hi").wait()).result == "No marker."
            finally:
                await plain.aclose()
            assert "cache_control" not in api.requests[0].body


async def test_persistent_overload_switches_to_the_fallback_model_over_the_wire() -> None:
    # Both primary attempts get the recorded 529 (no retry-after, so one real backoff of ≤ 0.5 s).
    script = [{"error": "fallback"}, {"error": "overloaded"}, text_reply("Answered by the fallback model.")]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            options = QueryOptions(
                provider=model, model="claude-sonnet-5-5", fallback_model="claude-haiku-5-5", max_retries=1
            )
            session = await rt.open_session(options)
            handle, events = await run_query(session)

            labels = [e.label for e in events]
            assert labels.count("system:api_retry") == 1
            assert labels.count("system:model_fallback") == 1
            assert labels.index("system:api_retry") < labels.index("system:model_fallback")
            assert [r.body["model"] for r in api.requests] == [
                "claude-sonnet-5-5",
                "claude-sonnet-5-5",
                "claude-haiku-5-5",
            ]
            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert handle.result is not None and handle.result.result == "Answered by the fallback model."
            await assert_settled(session, handle, events)


@pytest.mark.parametrize(
    "too_long",
    [{"error": "prompt_too_long"}, {"error": "request_too_large"}],
    ids=["400_prompt_is_too_long", "413_request_too_large_without_top_level_type"],
)
async def test_prompt_too_long_over_the_wire_compacts_reactively_and_retries(too_long: dict[str, Any]) -> None:
    read = scripted_tool("read", result="contents")
    main_script = [tools_reply(tool_use("t1", "read")), too_long, text_reply("Fixed.")]
    compact_script = [text_reply("The user asked for a fix; a file was read.")]
    with trio.fail_after(DEADLINE_S):
        async with (
            served(main_script) as (api, model),
            served(compact_script, name="compact") as (compact_api, compact_model),
            Runtime.open() as rt,
        ):
            options = QueryOptions(provider=model, compact_provider=compact_model, tools=[read])
            session = await rt.open_session(options)
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert handle.transitions == ["next_turn", "reactive_compact_retry"]
            assert len(api.requests) == 3
            assert len(compact_api.requests) == 1
            # The compaction request went to the compaction server, with the whole history to summarize.
            assert tool_pairs(compact_api.requests[0].body["messages"]) == [(["t1"], ["t1"])]
            retry = api.requests[-1].body["messages"]
            assert len(retry) == 1 and retry[0]["content"][0]["text"].startswith(COMPACT_SUMMARY_PREFIX)
            boundaries = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "compact_boundary"]
            assert len(boundaries) == 1 and boundaries[0].data["trigger"] == "reactive"
            await assert_settled(session, handle, events)


async def test_max_tokens_over_the_wire_escalates_the_next_request_to_64000() -> None:
    script = [text_reply("Half an ans", stop_reason="max_tokens"), text_reply("A whole answer.")]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model))
            handle, events = await run_query(session)

            assert handle.transitions == ["max_output_tokens_escalate"]
            assert [r.body["max_tokens"] for r in api.requests] == [8_000, 64_000]
            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert handle.result is not None and handle.result.result == "A whole answer."
            await assert_settled(session, handle, events)


async def test_tool_use_cut_by_max_tokens_over_the_wire_never_runs_and_is_answered_with_an_error() -> None:
    cut = tools_reply(tool_use("t1", "write", {"path": "a.py", "text": "x" * 200}), stop_reason="max_tokens")
    script = [cut | {"truncate_last_block": True}, text_reply("Done in smaller steps.")]
    log = ToolLog()
    write = scripted_tool("write", log=log)
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, tools=[write]))
            handle, events = await run_query(session)

            assert log.order == []  # the partial input never ran
            # A tool_use in the answer makes it a tool turn (Claude Code's needsFollowUp), not a recovery.
            assert handle.transitions == ["next_turn"]
            second = api.requests[1].body
            assert tool_pairs(second["messages"]) == [(["t1"], ["t1"])]
            answer = next(b for b in second["messages"][-1]["content"] if b["type"] == "tool_result")
            assert answer["is_error"] is True and "cut off" in answer["content"]
            assert handle.terminal is not None and handle.terminal.reason == "completed"
            await assert_settled(session, handle, events)


# ---------------------------------------------------------------- faults


@TOLERATE_UNEXHAUSTED_BODY_ITERATOR
async def test_midstream_error_event_after_output_ends_the_query_as_api_error_without_retry() -> None:
    # message_start, text block (start, delta, stop), tool_use block (start, "", input, stop): the
    # tool_use is whole when the server sends `event: error` (overloaded_error) on the 200 stream.
    content = [{"type": "text", "text": "Let me look."}, tool_use("t1", "read", {"path": "a.py"})]
    script = [{"error": "midstream_overloaded", "after_events": 8, "content": content}]
    read = scripted_tool("read", result="contents")
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, tools=[read], max_retries=2))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "api_error"
            assert len(api.requests) == 1  # output was emitted: a retry would repeat it
            labels = [e.label for e in events]
            assert "system:api_retry" not in labels
            streamed = [e.event["type"] for e in events if isinstance(e, StreamEvent)]
            assert streamed[:3] == ["message_start", "content_block_start", "ping"]
            assert streamed.count("content_block_stop") == 2 and "message_stop" not in streamed
            assert handle.result is not None and handle.result.is_error
            assert "Overloaded" in handle.result.result and handle.result.stop_reason is None
            # The tool_use was whole before the error: it ran, and its result answers it in the transcript.
            results = [e for e in events if e.label == "user" and "tool_result" in str(e)]
            assert len(results) == 1 and "t1" in str(results[0])
            await assert_settled(session, handle, events)


async def test_rate_limit_retry_after_from_the_header_is_honoured_then_the_query_completes() -> None:
    script = [{"error": "rate_limit", "retry_after_s": 0.05}, text_reply("Answered.")]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model))
            started = trio.current_time()
            handle, events = await run_query(session)
            elapsed = trio.current_time() - started

            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert len(api.requests) == 2
            assert api.requests[0].body == api.requests[1].body  # the same request, sent again
            retries = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "api_retry"]
            assert len(retries) == 1
            assert retries[0].data["kind"] == "rate_limit" and retries[0].data["delay_s"] == pytest.approx(0.05)
            assert elapsed >= 0.05
            await assert_settled(session, handle, events)


async def test_abort_mid_stream_ends_at_once_and_the_client_drops_its_connection() -> None:
    # Two events at once, then 30 s of silence: the abort lands in the middle of a live stream.
    script = [text_reply("A long answer that never comes.") | {"latency_ms": 30_000, "stall_after_events": 2}]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model))
            handle = session.query("Write at length")
            events: list[QueryEvent] = []
            aborted = False
            with trio.CancelScope() as unwinding:  # bounded from the abort on
                async for event in handle:
                    events.append(event)
                    if not aborted and isinstance(event, StreamEvent):
                        aborted = True
                        unwinding.deadline = trio.current_time() + ABORT_BOUND_S
                        await session.abort("user")
            assert aborted
            assert not unwinding.cancelled_caught, (
                f"the query outlived its abort by {ABORT_BOUND_S:g} s: it waited for the stall"
            )

            assert handle.terminal is not None and handle.terminal.reason == "aborted_streaming"
            assert len(api.requests) == 1
            streamed = [e.event["type"] for e in events if isinstance(e, StreamEvent)]
            # Cut inside the stall: what the client had read when the abort landed, nothing after it.
            assert streamed[0] == "message_start"
            assert streamed == ["message_start", "content_block_start", "ping"][: len(streamed)]
            # The server notices the client's close while it is silent, not when it next sends.
            with trio.fail_after(5):
                await api.wait_until(lambda: api.disconnects == 1 and api.open_connections == 0)
            assert api.disconnects == 1 and api.open_connections == 0
            await assert_settled(session, handle, events)


@TOLERATE_UNEXHAUSTED_BODY_ITERATOR
async def test_api_key_never_appears_in_the_logs_or_the_transcript() -> None:
    captured: list[str] = []
    logger.enable("queryloop")
    # Serialized records carry message, extra and any exception; `diagnose` renders local variables
    # in tracebacks, the likeliest way for a key to slip into a log.
    sink_id = logger.add(captured.append, level="DEBUG", serialize=True, backtrace=True, diagnose=True)
    try:
        main_script: list[dict[str, Any]] = [
            # query 1: a dropped connection, a 429 and a 500, each retried, then a tool round.
            {"error": "connection"},
            {"error": "rate_limit", "retry_after_s": 0.01},
            {"error": "api_error", "retry_after_s": 0.01},
            tools_reply(tool_use("t1", "read")),
            text_reply("Read it."),
            # query 2: prompt too long, and the compaction fails (a logged warning).
            {"error": "prompt_too_long"},
            # query 3: an in-stream error after output.
            {"error": "midstream_overloaded", "after_events": 3},
        ]
        read = scripted_tool("read", result="contents")
        all_events: list[QueryEvent] = []
        with trio.fail_after(DEADLINE_S):
            async with (
                served(main_script) as (api, model),
                served([{"error": "api_error"}], name="compact") as (_, compact_model),
                Runtime.open() as rt,
            ):
                options = QueryOptions(provider=model, compact_provider=compact_model, tools=[read], max_retries=3)
                session = await rt.open_session(options)
                reasons = []
                for prompt in ("Read the file", "Go on", "And again"):
                    handle, events = await run_query(session, prompt)
                    all_events.extend(events)
                    assert handle.terminal is not None
                    reasons.append(handle.terminal.reason)
                    await assert_settled(session, handle, events)
                assert reasons == ["completed", "prompt_too_long", "api_error"]
                assert [e.label for e in all_events].count("system:api_retry") == 3
                transcript_text = str(await session.transcript())
                # The key did travel: the SDK sent it to the server on every request.
                assert all(API_KEY in r.headers.get("authorization", "") for r in api.requests)
                assert API_KEY not in repr(model)
    finally:
        logger.remove(sink_id)
        logger.disable("queryloop")

    log_text = "\n".join(captured)
    assert any("compaction failed" in json.loads(line)["record"]["message"] for line in captured)
    assert API_KEY not in log_text
    assert API_KEY not in transcript_text
    assert all(API_KEY not in repr(event) for event in all_events)


async def test_an_in_stream_error_closes_the_sdk_body_iterators_instead_of_leaving_them_to_gc() -> None:
    script = [{"error": "midstream_overloaded", "after_events": 3}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with trio.fail_after(DEADLINE_S):
            async with served(script) as (_, model), Runtime.open() as rt:
                session = await rt.open_session(QueryOptions(provider=model))
                handle, _ = await run_query(session)
                assert handle.terminal is not None and handle.terminal.reason == "api_error"
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leaks == []


async def test_local_api_answers_past_the_end_of_its_script_with_a_500_naming_it() -> None:
    with trio.fail_after(DEADLINE_S):
        async with served([]) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_retries=0))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "api_error"
            errors = [e for e in events if isinstance(e, AssistantMessage) and e.is_api_error]
            assert "script exhausted, no entry for request 1" in errors[-1].content[0]["text"]
            assert len(api.requests) == 1
            await assert_settled(session, handle, events)


@TOLERATE_UNEXHAUSTED_BODY_ITERATOR
async def test_midstream_overload_right_after_message_start_is_retried_and_the_consumer_sees_one_response() -> None:
    # The usual overload mid-stream: `message_start`, then `event: error` (overloaded_error) on the 200 stream.
    # Nothing of the response has been shown yet (its message_start is held back until the next event), so
    # the request is retried and the consumer sees one response, not two starts.
    script = [{"error": "midstream_overloaded", "after_events": 1}, text_reply("Recovered.")]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_retries=2))
            handle, events = await run_query(session)
            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert len(api.requests) == 2
            retries = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "api_retry"]
            assert len(retries) == 1 and retries[0].data["kind"] == "overloaded"
            streamed = [e.event["type"] for e in events if isinstance(e, StreamEvent)]
            assert streamed.count("message_start") == 1 and streamed[0] == "message_start"
            assert streamed[-1] == "message_stop"
            assert handle.result is not None and handle.result.result == "Recovered."
            await assert_settled(session, handle, events)


async def test_a_failed_requests_request_id_is_kept_with_the_surfaced_error() -> None:
    # The API's `request-id` (what Anthropic's support asks for) travels with the error to the consumer.
    with trio.fail_after(DEADLINE_S):
        async with served([{"error": "overloaded"}]) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_retries=0))
            handle, events = await run_query(session)
            assert handle.terminal is not None and handle.terminal.reason == "api_error"
            assert len(api.requests) == 1
            error = handle.terminal.error or ""
            assert re.search(r"^API Error: .+ \(request_id req_\w+_1\)$", error), error
            surfaced = [e for e in events if isinstance(e, AssistantMessage) and e.is_api_error]
            assert surfaced[-1].content[0]["text"] == error
            await assert_settled(session, handle, events)
