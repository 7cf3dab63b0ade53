"""HTTP errors end to end through the real `anthropic` SDK against `LocalMessagesAPI`, with the recorded
error bodies of `tests/fixtures/errors`: the server's `x-should-retry` verdict, the two "max_tokens
too large" 400s (fitted and sent again), and the errors no provider classifies for the host (a tool
output that cannot be sent, a stream event without a type), which must never log a traceback.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

import pytest
import trio

from queryloop import QueryOptions, Runtime
from queryloop.runtime.loop.events import AssistantMessage, StreamEvent, SystemMessage
from queryloop.runtime.loop.max_tokens import CONTEXT_MARGIN
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.tools import Tool, ToolContext
from queryloop.runtime.providers.scripted import ScriptedReply, ScriptedUsage, reply_events
from tests.e2e.test_wire_e2e import DEADLINE_S, TOLERATE_UNEXHAUSTED_BODY_ITERATOR, assert_settled, run_query, served
from tests.helpers import FIXTURES, log_records, text_reply, tool_use, tools_reply

ERRORS = FIXTURES / "errors"

# A 400 carries no retry-after, so a retry would wait a real backoff (~0.5 s): these tests ask for 10 ms.
QUICK_RETRY = {"retry-after": "0.01"}


def recorded(name: str, **overrides: Any) -> dict[str, Any]:
    """A script entry answering with the recorded error `name` (status, headers, body), `overrides` laid over it."""
    fixture = json.loads((ERRORS / f"{name}.json").read_text())
    headers = {**fixture["headers"], **overrides.pop("headers", {})}
    return {"error": "http", "status": fixture["status"], "body": fixture["body"], "headers": headers, **overrides}


def recorded_message(name: str) -> str:
    message: str = json.loads((ERRORS / f"{name}.json").read_text())["body"]["error"]["message"]
    return message


def assert_no_traceback(records: list[dict[str, Any]]) -> None:
    assert [r for r in records if r["level"] in ("ERROR", "CRITICAL") or r["exception"] is not None] == []


def api_retries(events: list[Any]) -> list[SystemMessage]:
    return [e for e in events if isinstance(e, SystemMessage) and e.subtype == "api_retry"]


# ---------------------------------------------------------------- x-should-retry


@pytest.mark.parametrize(
    "refusal",
    [
        # No 500 was recorded: the body is the documented api_error shape.
        {
            "error": "http",
            "status": 500,
            "body": {"type": "error", "error": {"type": "api_error", "message": "Internal server error"}},
            "headers": {"x-should-retry": "false"},
        },
        # The recorded 529 (which says `true`) read by the server from its file, the header turned to `false`.
        {"error": "http", "fixture": str(ERRORS / "529_overloaded_error.json"), "headers": {"x-should-retry": "false"}},
    ],
    ids=["500", "recorded_529_named_as_a_fixture"],
)
async def test_x_should_retry_false_ends_a_500_after_one_request(refusal: dict[str, Any]) -> None:
    script = [refusal, text_reply("A retry would have answered.")]
    with trio.fail_after(DEADLINE_S), log_records() as records:
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_retries=2))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "api_error"
            assert len(api.requests) == 1
            assert api_retries(events) == []
            assert handle.result is not None and handle.result.is_error
            await assert_settled(session, handle, events)
    assert_no_traceback(records)


@pytest.mark.parametrize("name", ["400_tool_use_without_tool_result", "404_not_found_model"])
async def test_x_should_retry_true_retries_a_status_that_alone_would_not_be(name: str) -> None:
    script = [recorded(name, headers={"x-should-retry": "true", **QUICK_RETRY}), text_reply("Answered on retry.")]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_retries=2))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert len(api.requests) == 2
            assert api.requests[0].body == api.requests[1].body
            assert [r.data["attempt"] for r in api_retries(events)] == [1]
            assert handle.result is not None and handle.result.result == "Answered on retry."
            await assert_settled(session, handle, events)


async def test_x_should_retry_true_is_retried_no_more_than_max_retries() -> None:
    refusal = recorded("400_tool_use_without_tool_result", headers={"x-should-retry": "true", **QUICK_RETRY})
    script = [refusal, refusal, text_reply("Never reached.")]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_retries=1))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "api_error"
            assert len(api.requests) == 2
            assert len(api_retries(events)) == 1
            assert handle.result is not None
            assert recorded_message("400_tool_use_without_tool_result") in handle.result.result
            await assert_settled(session, handle, events)


# ---------------------------------------------------------------- max_tokens too large


async def test_context_overflow_is_retried_once_with_max_tokens_lowered_to_fit() -> None:
    # 178959 + 64000 > 200000: the prompt fits, 64000 tokens of answer do not.
    script = [recorded("400_input_plus_max_tokens_exceed_context"), text_reply("A shorter answer.")]
    with trio.fail_after(DEADLINE_S):
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_output_tokens=64_000, max_retries=0))
            handle, events = await run_query(session)

            assert [r.body["max_tokens"] for r in api.requests] == [64_000, 200_000 - 178_959 - CONTEXT_MARGIN]
            first, second = (r.body for r in api.requests)
            assert first["messages"] == second["messages"]
            assert handle.transitions == []  # no compaction: the prompt was never the problem
            assert api_retries(events) == []
            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert handle.result is not None and handle.result.result == "A shorter answer."
            await assert_settled(session, handle, events)


def _overflow_beyond_the_floor() -> dict[str, Any]:
    # The recorded body with an input that leaves 500 tokens: below the floor, whatever max_tokens is.
    entry = recorded("400_input_plus_max_tokens_exceed_context")
    error = entry["body"]["error"]
    entry["body"] = {**entry["body"], "error": {**error, "message": error["message"].replace("178959", "198500")}}
    return entry


@pytest.mark.parametrize(
    "overflows",
    [
        [recorded("400_input_plus_max_tokens_exceed_context")] * 2,
        [_overflow_beyond_the_floor()],
    ],
    ids=["the_lowered_retry_overflows_again", "not_even_the_floor_fits"],
)
async def test_context_overflow_that_no_max_tokens_fits_goes_to_reactive_compaction(
    overflows: list[dict[str, Any]],
) -> None:
    main_script = [*overflows, text_reply("Fixed after compaction.")]
    compact_script = [text_reply("The user asked for a fix.")]
    with trio.fail_after(DEADLINE_S):
        async with (
            served(main_script) as (api, model),
            served(compact_script, name="compact") as (compact_api, compact_model),
            Runtime.open() as rt,
        ):
            options = QueryOptions(provider=model, compact_provider=compact_model, max_output_tokens=64_000)
            session = await rt.open_session(options)
            handle, events = await run_query(session)

            assert handle.transitions == ["reactive_compact_retry"]
            assert len(compact_api.requests) == 1
            assert len(api.requests) == len(overflows) + 1
            assert api_retries(events) == []
            assert handle.terminal is not None and handle.terminal.reason == "completed"
            await assert_settled(session, handle, events)


async def test_max_tokens_above_the_model_cap_is_clamped_and_the_cap_kept_for_the_session() -> None:
    main_script = [
        recorded("400_max_tokens_above_model_limit"),  # 128001 > 64000
        tools_reply(tool_use("t1", "read")),
        text_reply("First answer."),
        text_reply("Second answer."),
    ]

    async def read(_: Any, ctx: ToolContext) -> str:
        return "contents"

    with trio.fail_after(DEADLINE_S):
        async with served(main_script) as (api, model), Runtime.open() as rt:
            options = QueryOptions(
                provider=model, tools=[Tool(name="read", call=read)], max_output_tokens=128_001, max_retries=0
            )
            session = await rt.open_session(options)
            first, first_events = await run_query(session)
            second, second_events = await run_query(session, "Again")

            # The refused request, its clamped retry, the tool turn and the next query: never above the cap again.
            assert [r.body["max_tokens"] for r in api.requests] == [128_001, 64_000, 64_000, 64_000]
            assert api_retries(first_events) == []
            for handle, events in ((first, first_events), (second, second_events)):
                assert handle.terminal is not None and handle.terminal.reason == "completed"
                await assert_settled(session, handle, events)


# ---------------------------------------------------------------- errors no provider classifies


async def test_a_tool_output_that_is_not_json_serializable_is_an_error_result_naming_the_tool() -> None:
    class Opaque:
        pass

    async def inspect_handle(_: Any, ctx: ToolContext) -> Any:
        return [{"type": "text", "text": "a handle", "handle": Opaque()}]

    script = [tools_reply(tool_use("t1", "inspect_handle")), text_reply("The tool failed; going on.")]
    with trio.fail_after(DEADLINE_S), log_records() as records:
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(
                QueryOptions(provider=model, tools=[Tool(name="inspect_handle", call=inspect_handle)])
            )
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "completed"
            assert len(api.requests) == 2
            answer = next(b for b in api.requests[1].body["messages"][-1]["content"] if b["type"] == "tool_result")
            assert answer["tool_use_id"] == "t1" and answer["is_error"] is True
            assert "inspect_handle" in answer["content"] and "not JSON-serializable" in answer["content"]
            await assert_settled(session, handle, events)
    assert_no_traceback(records)
    assert any(r["level"] == "WARNING" and "inspect_handle" in r["message"] for r in records)


@TOLERATE_UNEXHAUSTED_BODY_ITERATOR
@pytest.mark.parametrize(
    ("after_events", "reason", "requests"),
    [(2, "api_error", 1), (1, "completed", 2), (0, "completed", 2)],
    ids=["after_content_began_ends_the_query", "right_after_message_start_is_retried", "before_any_event_is_retried"],
)
async def test_a_stream_event_without_a_type_is_an_api_error_never_a_traceback(
    after_events: int, reason: str, requests: int
) -> None:
    script = [{"error": "malformed_event", "after_events": after_events}, text_reply("Answered on retry.")]
    with trio.fail_after(DEADLINE_S), log_records() as records:
        async with served(script) as (api, model), Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=model, max_retries=1))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == reason
            assert len(api.requests) == requests
            if reason == "api_error":
                errors = [e for e in events if isinstance(e, AssistantMessage) and e.is_api_error]
                assert "malformed stream event" in errors[-1].content[0]["text"]
                assert "no type" in errors[-1].content[0]["text"]
            else:
                assert [r.data["kind"] for r in api_retries(events)] == ["api_error"]
            await assert_settled(session, handle, events)
    assert_no_traceback(records)


class MalformedEventModel:
    """A provider (not the SDK's) whose second event is `bad`."""

    def __init__(self, bad: object) -> None:
        self.bad = bad

    async def stream(self, request: ModelRequest) -> AsyncGenerator[Any, None]:
        yield {"type": "message_start", "message": {"id": "m1", "usage": {"input_tokens": 1, "output_tokens": 0}}}
        yield self.bad  # not always a dict: a provider's bug


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"index": 0, "delta": {"type": "text_delta", "text": "?"}}, "malformed stream event: no type"),
        ({"type": "content_block_start"}, "malformed stream event 'content_block_start'"),
        ("event: ping", "malformed stream event: no type"),
        (["type", "ping"], "malformed stream event: no type"),
    ],
    ids=["without_a_type", "without_its_fields", "a_string", "a_list"],
)
async def test_a_malformed_provider_event_ends_the_query_api_error_without_a_traceback(bad: object, said: str) -> None:
    with trio.fail_after(DEADLINE_S), log_records() as records:
        async with Runtime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=MalformedEventModel(bad), max_retries=2))
            handle, events = await run_query(session)

            assert handle.terminal is not None and handle.terminal.reason == "api_error"
            assert handle.result is not None and said in handle.result.result
            await assert_settled(session, handle, events)
    assert_no_traceback(records)


class OrderedEventsModel:
    """A provider (not the SDK's) that streams each event of a text reply as an `OrderedDict`."""

    def __init__(self) -> None:
        reply = ScriptedReply(
            content=[{"type": "text", "text": "Hello."}], usage=ScriptedUsage(input_tokens=3, output_tokens=2)
        )
        self.sent = reply_events(reply, model="claude-sonnet-5-5", message_id="m1", input_tokens=3)

    async def stream(self, request: ModelRequest) -> AsyncGenerator[Any, None]:
        for event in self.sent:
            yield OrderedDict(event)


async def test_a_provider_streaming_dict_subclasses_gives_the_consumer_stream_events() -> None:
    model = OrderedEventsModel()
    async with Runtime.open() as rt:
        session = await rt.open_session(QueryOptions(provider=model))
        handle, events = await run_query(session)

        assert not any(isinstance(e, dict) for e in events)  # nothing reached the consumer unwrapped
        streamed = [e.event for e in events if isinstance(e, StreamEvent)]
        assert streamed == model.sent  # every event, in order, each as its StreamEvent
        assert handle.terminal is not None and handle.terminal.reason == "completed"
        await assert_settled(session, handle, events)
