"""Every recorded stream of `tests/fixtures/sse`, replayed byte for byte through the real SDK path.

Each `.sse` file is served by `LocalMessagesAPI` as a recorded body (`{"sse": ...}`) to a session whose
provider is `AnthropicModel`; a follow-up reply answers whatever the recording asks for next (a tool
result, a continuation). Checked for every recording: each raw event reaches the consumer as the wire
sent it; the history sent back repeats each response's blocks as they came (rebuilt here from the
events, independently of the runtime's assembler); the terminal and transitions are those the API's
documentation implies (`docs/api-facts.md` §1-§3); the result's `usage` is what the API billed for the
responses (their `message_start` counts as the last `message_delta` updates them, the passes of `iterations[]`
summed), a stream an error event cut included: what it reported is billed (docs/design.md).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from queryloop import QueryOptions, Runtime
from queryloop.runtime.loop.events import AssistantMessage, QueryEvent, StreamEvent, SystemMessage
from queryloop.runtime.loop.transcript import transcript_problems
from queryloop.runtime.providers.sse import SSEReader
from tests.e2e.test_wire_e2e import DEADLINE_S, TOLERATE_UNEXHAUSTED_BODY_ITERATOR, served
from tests.helpers import FIXTURES, scripted_tool, text_reply

SSE = FIXTURES / "sse"


def recording(name: str) -> str:
    return (SSE / f"{name}.sse").read_text()


def wire_events(body: str) -> list[dict[str, Any]]:
    """The events of a recorded body as the wire has them (pings included), up to an `error` event."""
    parser = SSEReader()
    events = []
    for _, data in parser.feed(body.encode()) + parser.finish():
        if data:
            event = json.loads(data)
            if event.get("type") == "error":
                break
            events.append(event)
    return events


def blocks_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's content blocks rebuilt from its events by the documented rules (api-facts §1)."""
    blocks: dict[int, dict[str, Any]] = {}
    json_parts: dict[int, list[str]] = {}
    for event in events:
        kind = event["type"]
        if kind == "content_block_start":
            blocks[event["index"]] = json.loads(json.dumps(event["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            dtype = delta["type"]
            if dtype == "text_delta":
                block["text"] += delta["text"]
            elif dtype == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif dtype == "signature_delta":
                block["signature"] = delta["signature"]
            elif dtype == "input_json_delta":
                json_parts.setdefault(event["index"], []).append(delta["partial_json"])
            elif dtype == "citations_delta":
                block.setdefault("citations", []).append(delta["citation"])
            elif dtype == "compaction_delta":
                block["content"] = (block.get("content") or "") + delta["content"]
        elif kind == "content_block_stop" and event["index"] in json_parts:
            raw = "".join(json_parts.pop(event["index"]))
            blocks[event["index"]]["input"] = json.loads(raw) if raw.strip() else {}
    return [blocks[index] for index in sorted(blocks)]


FOLLOW_UP = text_reply("All done.", usage={"input_tokens": 211, "output_tokens": 5, "cache_read_input_tokens": 40})
FOLLOW_UP_BILLED = (211, 5, 0, 40)

# name: (what answers the next request, terminal reason, transitions, is_error)
CASES: dict[str, tuple[list[dict[str, Any]], str, list[str], bool]] = {
    "text_basic_ping": ([], "completed", [], False),
    "text_after_two_429_retries": ([], "completed", [], False),
    "stop_sequence": ([], "completed", [], False),
    "server_compaction_block": ([], "completed", [], False),
    "thinking_adaptive_interleaved_text": ([], "completed", [], False),
    "thinking_redacted": ([], "completed", [], False),
    "thinking_signature_then_text": ([], "completed", [], False),
    "tool_use_followup_final_text": ([], "completed", [], False),
    "stop_pause_turn_continuation": ([], "completed", [], False),
    # tool_use: the client tools run, their results go back, the model answers.
    "thinking_then_tool_use": ([FOLLOW_UP], "completed", ["next_turn"], False),
    "tool_use_parallel_empty_input": ([FOLLOW_UP], "completed", ["next_turn"], False),
    "tool_use_parallel_text_then_two_tools": ([FOLLOW_UP], "completed", ["next_turn"], False),
    "tool_use_server_then_client": ([FOLLOW_UP], "completed", ["next_turn"], False),
    "tool_use_single_fine_chunks": ([FOLLOW_UP], "completed", ["next_turn"], False),
    # max_tokens: a cut text is retried with the escalated limit; a cut tool_use never runs (error result).
    "stop_max_tokens_text": ([FOLLOW_UP], "completed", ["max_output_tokens_escalate"], False),
    "stop_max_tokens_mid_tool_use": ([FOLLOW_UP], "completed", ["next_turn"], False),
    # pause_turn: the paused response goes back as is, and the recorded continuation answers it.
    "stop_pause_turn_server_tools": (
        [{"sse": recording("stop_pause_turn_continuation")}],
        "completed",
        ["pause_turn_continuation"],
        False,
    ),
    # refusal: the query ends saying so (an API error: no stop hooks), nothing is sent back.
    "stop_refusal_after_partial_output": ([], "completed", [], True),
    # error events: overloaded in a 200 stream, never retried once events were shown (and not here at all).
    "error_event_docs_example": ([], "api_error", [], True),
    "error_event_only_real_padded": ([], "api_error", [], True),
    "derived_midstream_overloaded_error": ([], "api_error", [], True),
}

TOOL_NAMES = [
    "fixed_version",
    "pelican_name_generator",
    "secret_retrieval_tool",
    "get_exchange_rate",
    "get_weather",
    "make_file",
]


def billed(events: list[dict[str, Any]]) -> tuple[int, int, int, int]:
    """What a recorded response bills, read from its wire events by the documented rules (api-facts §1): the
    `message_start` usage, each count a later `message_delta` reports replacing it (they are cumulative); with
    `iterations[]`, the passes' sums. A stream cut by an error event bills what it reported before the cut."""
    usage: dict[str, Any] = {}
    for event in events:
        if event["type"] == "message_start":
            usage.update(event["message"]["usage"])
        elif event["type"] == "message_delta" and event.get("usage"):
            usage.update(event["usage"])
    passes = usage.get("iterations") or [usage]
    keys = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    return tuple(sum(p.get(key) or 0 for p in passes) for key in keys)  # type: ignore[return-value]


def follow_up_billed(entry: dict[str, Any]) -> tuple[int, int, int, int]:
    return billed(wire_events(entry["sse"])) if "sse" in entry else FOLLOW_UP_BILLED


def test_every_recorded_stream_has_a_case() -> None:
    assert sorted(CASES) == sorted(p.stem for p in SSE.glob("*.sse"))


@TOLERATE_UNEXHAUSTED_BODY_ITERATOR
@pytest.mark.parametrize("name", sorted(CASES))
async def test_recorded_stream_reaches_the_consumer_unchanged_and_goes_back_as_it_came(name: str) -> None:
    follow_ups, reason, transitions, is_error = CASES[name]
    body = recording(name)
    tools = [scripted_tool(tool, safe=True) for tool in TOOL_NAMES]
    with trio.fail_after(DEADLINE_S):
        async with served([{"sse": body}, *follow_ups]) as (api, model), Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=model, tools=tools, max_retries=0))
            handle = session.query("Go")
            events: list[QueryEvent] = [event async for event in handle]
            conversation = await session.transcript()
            await session.close()

    assert handle.terminal is not None and handle.result is not None
    assert (handle.terminal.reason, handle.transitions, handle.result.is_error) == (reason, transitions, is_error)
    assert len(api.requests) == 1 + len(follow_ups)
    # The result bills what the API billed: the recorded response's usage and its follow-ups', no more.
    bills = [billed(wire_events(body)), *(follow_up_billed(entry) for entry in follow_ups)]
    usage = handle.result.usage
    counted = (
        usage.input_tokens,
        usage.output_tokens,
        usage.cache_creation_input_tokens,
        usage.cache_read_input_tokens,
    )
    assert counted == tuple(map(sum, zip(*bills, strict=True)))
    # Every raw event of the recording reached the consumer as the wire sent it, in order.
    sent = wire_events(body)
    streamed = [e.event for e in events if isinstance(e, StreamEvent)]
    assert streamed[: len(sent)] == sent
    assert transcript_problems(conversation) == []
    if transitions in (["next_turn"], ["pause_turn_continuation"]):
        # The history sent back repeats the recorded response's blocks exactly (a cut tool_use is sent
        # with the input it could be given, `{}`, and answered with an error result). An escalation
        # retries the same input: the cut response is not sent back.
        sent_back = api.requests[1].body["messages"]
        assistant = [m for m in sent_back if m["role"] == "assistant"][-1]
        expected = blocks_of(sent)
        if name == "stop_max_tokens_mid_tool_use":
            expected[-1]["input"] = {}
        assert assistant["content"] == expected


@TOLERATE_UNEXHAUSTED_BODY_ITERATOR
async def test_refusal_keeps_stop_details_and_retracts_the_refused_turn() -> None:
    body = recording("stop_refusal_after_partial_output")
    stop_hook_calls: list[object] = []

    async def stop_hook(hook_input: object) -> None:
        stop_hook_calls.append(hook_input)

    with trio.fail_after(DEADLINE_S):
        async with served([{"sse": body}]) as (_, model), Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=model, stop_hooks=[stop_hook]))
            handle = session.query("Go")
            events = [event async for event in handle]
            conversation = await session.transcript()
            await session.close()

    result = handle.result
    assert result is not None and result.stop_reason == "refusal" and result.is_error
    assert result.stop_details is not None and result.stop_details["type"] == "refusal"
    assert handle.terminal is not None and handle.terminal.stop_details == result.stop_details
    assert "refusal" in result.errors[0]
    assert stop_hook_calls == []  # an API error ends the query: no stop hooks
    refused = [e for e in events if isinstance(e, AssistantMessage) and not e.is_api_error]
    tombstoned = {e.message_uuid for e in events if e.type == "tombstone"}
    assert refused and {m.uuid for m in refused} <= tombstoned
    # The session keeps none of the refused output: only the prompt and the surfaced error.
    assert [type(m).__name__ for m in conversation] == ["UserMessage", "AssistantMessage"]
    assert isinstance(conversation[1], AssistantMessage) and conversation[1].is_api_error


@TOLERATE_UNEXHAUSTED_BODY_ITERATOR
async def test_refusal_switches_to_the_fallback_model_when_one_is_set() -> None:
    body = recording("stop_refusal_after_partial_output")
    with trio.fail_after(DEADLINE_S):
        async with served([{"sse": body}, FOLLOW_UP]) as (api, model), Runtime.open() as runtime:
            options = QueryOptions(provider=model, model="claude-sonnet-5-5", fallback_model="claude-opus-5-5")
            session = await runtime.open_session(options)
            handle = session.query("Go")
            events = [event async for event in handle]
            await session.close()

    assert handle.terminal is not None and handle.terminal.reason == "completed"
    assert handle.result is not None and not handle.result.is_error and handle.result.result == "All done."
    switched = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "model_fallback"]
    assert len(switched) == 1 and switched[0].data["reason"] == "refusal"
    assert [r.body["model"] for r in api.requests] == ["claude-sonnet-5-5", "claude-opus-5-5"]
    # The refused response is not in what the fallback model is sent.
    assert [m["role"] for m in api.requests[1].body["messages"]] == ["user"]
