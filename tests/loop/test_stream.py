"""`queryloop.runtime.loop.stream`: `ResponseAssembler` fed the recorded Messages API streams (tests/fixtures/sse)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from queryloop.runtime.loop.events import Usage
from queryloop.runtime.loop.stream import CompletedBlock, ResponseAssembler
from tests.helpers import FIXTURES

SSE = FIXTURES / "sse"


def parse_sse(text: str) -> list[dict[str, Any]]:
    """The `data:` objects of an SSE body, in order (blank-line separated; the last may lack its newline)."""
    events: list[dict[str, Any]] = []
    for chunk in text.replace("\r\n", "\n").split("\n\n"):
        name = None
        data: list[str] = []
        for line in chunk.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].strip())
        if not data:
            continue
        event = json.loads("\n".join(data))
        assert name is None or name == event["type"], (name, event["type"])
        events.append(event)
    return events


def load(name: str) -> list[dict[str, Any]]:
    return parse_sse((SSE / f"{name}.sse").read_text(encoding="utf-8"))


def started() -> ResponseAssembler:
    """An assembler past its stream's `message_start`."""
    assembler = ResponseAssembler()
    assembler.feed({"type": "message_start", "message": {"id": "msg_t", "model": "m", "usage": {}}})
    return assembler


def run(events: list[dict[str, Any]]) -> tuple[ResponseAssembler, list[CompletedBlock]]:
    """`events` through an assembler (a made-up stream of blocks alone is given a `message_start` first)."""
    assembler = ResponseAssembler() if events and events[0]["type"] == "message_start" else started()
    completed: list[CompletedBlock] = []
    for event in events:
        block = assembler.feed(event)
        if block is not None:
            assert event["type"] == "content_block_stop", "only content_block_stop completes a block"
            assert block.index == event["index"]
            completed.append(block)
    return assembler, completed


def deltas(events: list[dict[str, Any]], index: int, kind: str, field: str) -> str:
    return "".join(
        e["delta"][field]
        for e in events
        if e["type"] == "content_block_delta" and e["index"] == index and e["delta"]["type"] == kind
    )


def test_the_sse_helper_reads_every_fixture_including_one_without_a_trailing_newline() -> None:
    raw = (SSE / "stop_max_tokens_mid_tool_use.sse").read_bytes()
    assert not raw.endswith(b"\n")
    events = load("stop_max_tokens_mid_tool_use")
    assert events[0]["type"] == "message_start"
    assert events[-1] == {"type": "message_stop"}
    assert len(list(SSE.glob("*.sse"))) >= 20
    for path in SSE.glob("*.sse"):
        assert parse_sse(path.read_text(encoding="utf-8")), path.name


def test_tool_input_is_reassembled_from_fine_input_json_delta_chunks() -> None:
    events = load("tool_use_single_fine_chunks")
    fragments = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert len(fragments) == 10
    assert fragments[0] == ""
    assembler, completed = run(events)
    assert len(completed) == 1
    done = completed[0]
    assert done.index == 0
    assert done.input_error is None
    assert done.block["type"] == "tool_use"
    assert done.block["id"] == "toolu_018acGYLtfR52q9yDbWaEdQZ"
    assert done.block["name"] == "get_weather"
    assert done.block["input"] == {"location": "San Francisco, CA", "units": "f"}
    assert done.block["caller"] == {"type": "direct"}  # fields the runtime does not know pass unharmed
    assert assembler.stop_reason == "tool_use"
    assert assembler.stopped is True
    assert assembler.close_truncated() == []


def test_parallel_tool_uses_after_text_complete_separately_with_their_own_inputs() -> None:
    assembler, completed = run(load("tool_use_parallel_text_then_two_tools"))
    assert [c.index for c in completed] == [0, 1, 2]
    assert [c.block["type"] for c in completed] == ["text", "tool_use", "tool_use"]
    assert completed[0].block["text"] == "I'll retrieve the secrets for both passwords you provided."
    assert [c.block["id"] for c in completed[1:]] == [
        "toolu_015cUijgET79LXjgeYQerN2h",
        "toolu_01XZTimPexA7h3EVKesnKt5T",
    ]
    assert [c.block["input"] for c in completed[1:]] == [{"password": "mellon"}, {"password": "radiance"}]
    assert all(c.input_error is None for c in completed)
    assert assembler.message_id == "msg_013zKrzHmx2EAPhcF2gQKQ4k"
    assert assembler.model == "claude-sonnet-4-20250514"
    assert assembler.stop_reason == "tool_use"


def test_each_tool_completes_at_its_own_content_block_stop_before_the_stream_ends() -> None:
    events = load("tool_use_parallel_text_then_two_tools")
    assembler = ResponseAssembler()
    first_tool_done_at = None
    for position, event in enumerate(events):
        block = assembler.feed(event)
        if block is not None and block.index == 1:
            first_tool_done_at = position
    assert first_tool_done_at is not None
    # the first tool is usable while the second one's input is still streaming
    later = events[first_tool_done_at + 1 :]
    assert any(e["type"] == "content_block_delta" and e["index"] == 2 for e in later)


def test_empty_input_json_becomes_an_empty_object() -> None:
    assembler, completed = run(load("tool_use_parallel_empty_input"))
    assert [c.block["type"] for c in completed] == ["tool_use", "tool_use"]
    assert [c.block["input"] for c in completed] == [{}, {}]
    assert all(c.input_error is None for c in completed)
    assert assembler.stop_reason == "tool_use"
    # thinking_then_tool_use ends with a tool whose only fragment is "" as well
    _, completed = run(load("thinking_then_tool_use"))
    assert [c.block["type"] for c in completed] == ["thinking", "tool_use"]
    assert completed[1].block["input"] == {}
    assert completed[1].input_error is None


def test_thinking_is_joined_and_carries_its_signature() -> None:
    events = load("thinking_signature_then_text")
    signature = next(e["delta"]["signature"] for e in events if e.get("delta", {}).get("type") == "signature_delta")
    assembler, completed = run(events)
    assert [c.block["type"] for c in completed] == ["thinking", "text"]
    thinking = completed[0].block
    assert thinking["thinking"] == deltas(events, 0, "thinking_delta", "thinking")
    assert thinking["thinking"].startswith("This is a straightforward question about pedestrian safety.")
    assert thinking["thinking"].endswith("help prevent accidents.")
    assert thinking["signature"] == signature
    assert signature.startswith("EvMCCkYICxgCKkCHP2cSuEdcJK")
    assert set(thinking) == {"type", "thinking", "signature"}
    text = completed[1].block["text"]
    assert text == deltas(events, 1, "text_delta", "text")
    assert text.endswith("prioritize safety over speed when crossing streets.")
    assert assembler.stop_reason == "end_turn"


def test_thinking_need_not_be_the_first_block() -> None:
    _, completed = run(load("thinking_adaptive_interleaved_text"))
    assert [(c.index, c.block["type"]) for c in completed] == [(0, "text"), (1, "thinking"), (2, "text")]
    assert completed[1].block["signature"]


def test_redacted_thinking_arrives_whole_and_is_kept_byte_for_byte() -> None:
    events = load("thinking_redacted")
    started = {e["index"]: e["content_block"] for e in events if e["type"] == "content_block_start"}
    _, completed = run(events)
    assert [c.block["type"] for c in completed] == ["redacted_thinking", "redacted_thinking", "text"]
    for done in completed[:2]:
        assert done.block == started[done.index]
        assert done.block["data"].startswith("E")
    assert (
        completed[2].block["text"].startswith("I notice that you've sent what appears to be some kind of test string")
    )


@pytest.mark.parametrize("name", ["thinking_redacted", "tool_use_single_fine_chunks", "thinking_signature_then_text"])
def test_pings_anywhere_change_nothing(name: str) -> None:
    events = load(name)
    assert any(e["type"] == "ping" for e in events)
    with_pings, completed = run(events)
    without_pings, completed_clean = run([e for e in events if e["type"] != "ping"])
    assert [(c.index, c.block, c.input_error) for c in completed] == [
        (c.index, c.block, c.input_error) for c in completed_clean
    ]
    assert (with_pings.stop_reason, with_pings.stopped, with_pings.usage) == (
        without_pings.stop_reason,
        without_pings.stopped,
        without_pings.usage,
    )
    assembler = ResponseAssembler()
    assert assembler.feed({"type": "ping"}) is None
    assert assembler == ResponseAssembler()


def test_unknown_block_and_delta_types_pass_without_effect() -> None:
    events = load("server_compaction_block")
    assert any(e.get("delta", {}).get("type") == "compaction_delta" for e in events)
    assembler, completed = run(events)
    assert [c.block["type"] for c in completed] == ["compaction", "text"]
    assert all(c.input_error is None for c in completed)
    assert completed[1].block == {"type": "text", "text": "Hello! 👋"}
    assert assembler.stop_reason == "end_turn"
    assert assembler.stopped is True


def test_server_compaction_summary_is_kept_whole_to_be_sent_back() -> None:
    events = load("server_compaction_block")
    summary = "".join(e["delta"]["content"] for e in events if e.get("delta", {}).get("type") == "compaction_delta")
    _, completed = run(events)
    assert summary and completed[0].block == {"type": "compaction", "content": summary}


def test_unknown_event_types_and_deltas_for_unopened_blocks_are_ignored() -> None:
    events = load("tool_use_parallel_text_then_two_tools")
    noise: list[dict[str, Any]] = [
        {"type": "brand_new_event", "payload": {"x": 1}},
        {"type": "content_block_delta", "index": 7, "delta": {"type": "text_delta", "text": "ghost"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "telepathy_delta", "thought": "?"}},
        {"type": "content_block_stop", "index": 42},
    ]
    noisy = [events[0], events[1], *noise, *events[2:]]
    _, expected = run(events)
    _, got = run(noisy)
    assert [(c.index, c.block) for c in got] == [(c.index, c.block) for c in expected]


def test_max_tokens_inside_tool_use_is_closed_as_truncated_and_never_complete() -> None:
    events = load("stop_max_tokens_mid_tool_use")
    assert not any(e["type"] == "content_block_stop" and e["index"] == 1 for e in events)
    assembler, completed = run(events)
    assert [(c.index, c.block["type"]) for c in completed] == [(0, "text")]  # the cut tool never completed
    assert completed[0].block["text"].endswith("Let me do that for you now.")
    assert assembler.stop_reason == "max_tokens"
    assert assembler.stopped is True
    cut = assembler.close_truncated()
    assert len(cut) == 1
    (truncated,) = cut
    assert truncated.index == 1
    assert truncated.block["type"] == "tool_use"
    assert truncated.block["id"] == "toolu_01EKqbqmZrGRXy18eN7m9kvY"
    assert truncated.block["name"] == "make_file"
    assert truncated.block["input"] == {}  # the partial JSON is never handed to the tool
    assert truncated.input_error is not None
    assert "max_tokens" in truncated.input_error
    assert "did not run" in truncated.input_error
    assert assembler.close_truncated() == []  # closed once


def test_max_tokens_in_text_closes_the_text_block_and_leaves_nothing_open() -> None:
    assembler, completed = run(load("stop_max_tokens_text"))
    assert [c.block["type"] for c in completed] == ["text"]
    assert assembler.stop_reason == "max_tokens"
    assert assembler.close_truncated() == []


def test_a_stream_cut_before_message_stop_is_recognisably_incomplete() -> None:
    events = load("text_basic_ping")
    delta_at = next(i for i, e in enumerate(events) if e["type"] == "message_delta")
    assembler, completed = run(events[:delta_at])
    assert [c.block["type"] for c in completed] == ["text"]
    assert assembler.stopped is False
    assert assembler.stop_reason is None
    # cut between message_delta and message_stop: the reason is known but the stream did not stop
    assembler, _ = run(events[:-1])
    assert assembler.stop_reason == "end_turn"
    assert assembler.stopped is False
    assembler, _ = run(events)
    assert assembler.stopped is True


def test_a_mid_tool_stream_error_leaves_the_tool_open_and_the_stream_unstopped() -> None:
    events = load("derived_midstream_overloaded_error")
    assert events[-1]["type"] == "error"
    assembler, completed = run(events)
    assert completed == []
    assert assembler.stopped is False
    assert assembler.stop_reason is None
    (cut,) = assembler.close_truncated()
    assert cut.block["type"] == "tool_use"
    assert cut.block["input"] == {}
    assert cut.input_error is not None
    assert "end of the stream" in cut.input_error


def test_usage_comes_from_message_start_then_the_cumulative_message_delta() -> None:
    events = load("tool_use_single_fine_chunks")
    assembler = ResponseAssembler()
    assembler.feed(events[0])
    assert assembler.usage == Usage(input_tokens=656, output_tokens=26)
    assert assembler.message_id == "msg_01AusY9WEbCaj3N7Tv5J4YjH"
    assert assembler.model == "claude-haiku-4-5-20251001"
    for event in events[1:]:
        assembler.feed(event)
    assert assembler.usage == Usage(input_tokens=656, output_tokens=74)  # replaced, not added

    assembler, _ = run(load("thinking_signature_then_text"))
    assert assembler.usage.output_tokens == 282
    assert assembler.usage.input_tokens == 43


def test_usage_with_iterations_counts_every_sampling_pass_as_billed() -> None:
    # Server-side compaction: two passes (the compaction, then the answer). The top-level counts (181 in,
    # 8 out) are the answer's only; the response is billed for both, 281 in and 91 out.
    assembler, _ = run(load("server_compaction_block"))
    assert assembler.usage == Usage(input_tokens=281, output_tokens=91, cache_read_input_tokens=55_096)


def test_usage_of_a_message_delta_without_input_counts_keeps_message_start_values() -> None:
    assembler, _ = run(load("stop_max_tokens_mid_tool_use"))  # its message_delta has output_tokens only
    assert assembler.usage == Usage(input_tokens=450, output_tokens=124)


def _tool_events(fragments: list[str]) -> list[dict[str, Any]]:
    start = {"type": "tool_use", "id": "toolu_x", "name": "edit", "input": {}}
    return [
        {"type": "content_block_start", "index": 0, "content_block": start},
        *(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": f}}
            for f in fragments
        ),
        {"type": "content_block_stop", "index": 0},
    ]


def test_invalid_json_at_content_block_stop_is_an_input_error() -> None:
    _, (done,) = run(_tool_events(["", '{"path": "a.py", ', '"line": ']))
    assert done.block["input"] == {}
    assert done.input_error is not None
    assert done.input_error.startswith("InputValidationError")
    assert "not valid JSON" in done.input_error


@pytest.mark.parametrize("raw", ["[1, 2]", '"text"', "3", "null"])
def test_json_that_is_not_an_object_is_an_input_error(raw: str) -> None:
    _, (done,) = run(_tool_events(["", raw]))
    assert done.block["input"] == {}
    assert done.input_error is not None
    assert "not a JSON object" in done.input_error


def test_whitespace_only_input_json_is_an_empty_object() -> None:
    _, (done,) = run(_tool_events(["", "  ", "\n"]))
    assert done.block["input"] == {}
    assert done.input_error is None


def test_citations_deltas_are_collected_on_their_text_block() -> None:
    citation = {"type": "web_search_result_location", "url": "https://example.com", "cited_text": "x"}
    events: list[dict[str, Any]] = [
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "citations_delta", "citation": citation}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Sunny."}},
        {"type": "content_block_stop", "index": 0},
    ]
    _, (done,) = run(events)
    assert done.block == {"type": "text", "text": "Sunny.", "citations": [citation]}


@pytest.mark.parametrize(
    ("name", "stop_reason", "types"),
    [
        ("text_basic_ping", "end_turn", ["text"]),
        ("text_after_two_429_retries", "end_turn", ["text"]),
        ("tool_use_followup_final_text", "end_turn", ["text"]),
        ("stop_sequence", "stop_sequence", ["text"]),
        ("stop_refusal_after_partial_output", "refusal", ["thinking", "text"]),
        ("thinking_then_tool_use", "tool_use", ["thinking", "tool_use"]),
    ],
)
def test_recorded_streams_complete_the_blocks_the_sdk_replay_found(
    name: str, stop_reason: str, types: list[str]
) -> None:
    assembler, completed = run(load(name))
    assert [c.block["type"] for c in completed] == types
    assert assembler.stop_reason == stop_reason
    assert assembler.stopped is True
    assert assembler.close_truncated() == []


def test_server_tool_use_input_is_assembled_alongside_the_client_tool_use() -> None:
    _, completed = run(load("tool_use_server_then_client"))
    assert [c.block["type"] for c in completed] == [
        "text",
        "server_tool_use",
        "tool_search_tool_result",
        "text",
        "tool_use",
    ]
    assert completed[1].block["input"] == {"query": "USD EUR exchange rate currency conversion"}
    assert completed[4].block["input"] == {"from_currency": "USD", "to_currency": "EUR"}
    assert all(c.input_error is None for c in completed)


@pytest.mark.parametrize("name", ["stop_pause_turn_server_tools", "stop_pause_turn_continuation"])
def test_pause_turn_streams_with_server_tools_assemble(name: str) -> None:
    events = load(name)
    recorded = next(e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta")
    assembler, completed = run(events)
    assert assembler.stop_reason == recorded
    assert assembler.stopped is True
    assert any(c.block["type"] == "server_tool_use" for c in completed)


def test_text_thinking_and_compaction_deltas_are_joined_once_at_their_block_stop() -> None:
    assembler = started()
    assembler.feed({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "T"}})
    assembler.feed({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}})
    assembler.feed(
        {"type": "content_block_start", "index": 2, "content_block": {"type": "compaction", "content": None}}
    )
    pieces = [f"w{i} " for i in range(5000)]
    for piece in pieces:
        assembler.feed(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": piece}}
        )
        assembler.feed({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": piece}})
        assembler.feed(
            {"type": "content_block_delta", "index": 2, "delta": {"type": "compaction_delta", "content": piece}}
        )
    # Nothing is joined while the blocks stream: no copy of the text grows with every delta.
    assert assembler._open[1]["text"] == ""
    thinking = assembler.feed({"type": "content_block_stop", "index": 0})
    text = assembler.feed({"type": "content_block_stop", "index": 1})
    compaction = assembler.feed({"type": "content_block_stop", "index": 2})
    assert thinking is not None and thinking.block["thinking"] == "T" + "".join(pieces)
    assert text is not None and text.block == {"type": "text", "text": "".join(pieces)}
    assert compaction is not None and compaction.block["content"] == "".join(pieces)


def test_a_text_block_cut_by_the_end_of_the_stream_is_joined_and_dropped_with_its_pieces() -> None:
    assembler = started()
    assembler.feed({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    assembler.feed({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "cut"}})
    assert assembler.close_truncated() == []  # only a tool_use is answered; a cut text is not kept
    assert assembler._pieces == {} and assembler._piece_field == {} and assembler._open == {}


def test_a_delta_after_its_block_stopped_extends_nothing_even_after_a_run_of_deltas() -> None:
    """A run of deltas of one block takes the assembler's short path; its block's stop ends that path,
    so a stray delta for the stopped block is ignored as any delta for an unopened block is."""
    assembler = started()
    assembler.feed({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    for piece in ("a", "b", "c"):
        assembler.feed({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}})
    done = assembler.feed({"type": "content_block_stop", "index": 0})
    assert done is not None and done.block == {"type": "text", "text": "abc"}
    assert (
        assembler.feed({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "x"}})
        is None
    )
    assert done.block == {"type": "text", "text": "abc"} and assembler._pieces == {}
    assembler.feed({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": "d"}})
    assembler.feed({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "e"}})
    second = assembler.feed({"type": "content_block_stop", "index": 1})
    assert second is not None and second.block == {"type": "text", "text": "de"}
