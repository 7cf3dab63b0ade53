"""Claude Code 2.1's newer recoveries through a session's real actors: a thinking-only answer asked once more
for visible output, a stream cut after visible output resumed, a malformed tool call retried once then
`malformed_tool_use_exhausted`, exhausted API retries `api_error` against a model unavailable `model_error`,
and the rapid-refill breaker. The decisions alone: `tests/loop/test_newer_recovery_decisions.py`."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from queryloop import Runtime
from queryloop.runtime.loop.events import AssistantMessage, SystemMessage
from queryloop.runtime.loop.model import ModelError, ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import (
    MALFORMED_TOOL_USE_EXHAUSTED_TEXT,
    MALFORMED_TOOL_USE_RETRY_TEXT,
    RAPID_REFILL_BREAKER_TEXT,
    THINKING_ONLY_RETRY_TEXT,
    TRUNCATED_RESPONSE_RECOVERY_TEXT,
)
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.actors.test_context_loop import SMALL_WINDOW as CONTEXT_TESTS_WINDOW
from tests.helpers import Ran, assert_settled, consume, run_query, scripted_tool, text_reply, tool_use, tools_reply

THINKING = {"type": "thinking", "thinking": "Let me think.", "signature": "sig"}
THOUGHT_ONLY = {"content": [THINKING], "stop_reason": "end_turn"}
MALFORMED = {"content": [{"type": "text", "text": '<invoke name="read">a.py</invoke>'}], "stop_reason": "tool_use"}


def cut_after(events: int, *blocks: dict[str, Any]) -> dict[str, Any]:
    """A connection cut after `events` stream events (message_start is 1; a text block is 3: start, delta, stop)."""
    content = list(blocks) or [{"type": "text", "text": "The bug is in the parser"}]
    return {"error": "connection", "after_events": events, "content": content}


def last_user_text(request: ModelRequest) -> Any:
    message = request.messages[-1]
    assert message["role"] == "user"
    content = message["content"]
    return content if isinstance(content, str) else content[-1]["text"]


def api_errors(ran: Ran) -> list[str]:
    return [e.content[0]["text"] for e in ran.events if isinstance(e, AssistantMessage) and e.is_api_error]


# -- thinking_only_retry ----------------------------------------------------------------------------


async def test_a_thinking_only_answer_is_asked_once_for_visible_output() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [THOUGHT_ONLY, text_reply("4")])
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["thinking_only_retry"]
        second = ran.model.requests[1]
        assert last_user_text(second) == THINKING_ONLY_RETRY_TEXT
        assert second.messages[-2]["role"] == "assistant"  # the thinking stays, signed, before the ask
        assert ran.handle.result is not None and ran.handle.result.result == "4"
        assert not ran.handle.result.is_error
        await assert_settled(ran)


async def test_an_empty_answer_or_a_stop_sequence_one_is_retried_too() -> None:
    async with Runtime.open() as runtime:
        empty = {"content": [], "stop_reason": "end_turn"}
        ran = await run_query(runtime, [empty, {"content": [THINKING], "stop_reason": "stop_sequence"}, text_reply()])
        # The second is in the same turn: the one retry is spent, it ends as a final response does.
        assert ran.reason == "completed" and ran.handle.transitions == ["thinking_only_retry"]
        assert len(ran.model.requests) == 2
        await assert_settled(ran)


async def test_a_second_thinking_only_answer_in_the_turn_ends_as_today_through_the_stop_hooks() -> None:
    calls: list[object] = []

    async def stop_hook(hook_input: object) -> None:
        calls.append(hook_input)

    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [THOUGHT_ONLY, THOUGHT_ONLY, text_reply("unused")], stop_hooks=[stop_hook])
        assert ran.reason == "completed" and ran.handle.transitions == ["thinking_only_retry"]
        assert len(ran.model.requests) == 2
        assert len(calls) == 1  # the retried answer reached no stop hook; the second did
        assert ran.handle.result is not None and ran.handle.result.result == "" and not ran.handle.result.is_error
        await assert_settled(ran)


async def test_thinking_only_retry_is_once_per_turn_not_once_per_query() -> None:
    async with Runtime.open() as runtime:
        script = [THOUGHT_ONLY, tools_reply(tool_use("t1", "read")), THOUGHT_ONLY, text_reply("Read it.")]
        ran = await run_query(runtime, script, tools=[scripted_tool("read")])
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["thinking_only_retry", "next_turn", "thinking_only_retry"]
        await assert_settled(ran)


# -- truncated_response_recovery --------------------------------------------------------------------


async def test_a_stream_cut_after_visible_text_is_resumed_and_its_partial_spend_billed() -> None:
    async with Runtime.open() as runtime:
        rest = text_reply("drops the last token.", usage={"input_tokens": 100, "output_tokens": 10})
        ran = await run_query(runtime, [cut_after(4), rest], max_retries=2)
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["truncated_response_recovery"]
        assert len(ran.model.requests) == 2  # resumed, never retried as is: its text was shown
        second = ran.model.requests[1]
        assert last_user_text(second) == TRUNCATED_RESPONSE_RECOVERY_TEXT
        assert second.messages[-2] == {
            "role": "assistant",
            "content": [{"type": "text", "text": "The bug is in the parser"}],
        }
        result = ran.handle.result
        assert result is not None and not result.is_error
        # The cut stream's message_start reported 1 in, 1 out: billed with the answer's.
        assert (result.usage.input_tokens, result.usage.output_tokens) == (101, 11)
        assert api_errors(ran) == []
        await assert_settled(ran)


async def test_cuts_share_the_max_output_tokens_recovery_cap_of_three() -> None:
    async with Runtime.open() as runtime:
        half = text_reply("Half an ans", stop_reason="max_tokens")
        script = [half, half, cut_after(4), cut_after(4), cut_after(4), text_reply("unused")]
        ran = await run_query(runtime, script)
        assert ran.handle.transitions == [
            "max_output_tokens_escalate",
            "max_output_tokens_recovery",
            "truncated_response_recovery",
            "truncated_response_recovery",
        ]
        assert ran.reason == "api_error"  # the fourth recovery would pass the cap: the cut ends the query
        assert len(ran.model.requests) == 5
        assert ran.handle.result is not None and ran.handle.result.is_error
        await assert_settled(ran)


async def test_a_cut_before_any_visible_block_ends_the_query_api_error() -> None:
    async with Runtime.open() as runtime:
        inside_first_text = await run_query(runtime, [cut_after(3), text_reply("unused")], max_retries=2)
        thinking_only = await run_query(runtime, [cut_after(4, THINKING, {"type": "text", "text": "x"})])
        for ran in (inside_first_text, thinking_only):
            assert ran.reason == "api_error" and ran.handle.transitions == []
            assert len(ran.model.requests) == 1
            assert api_errors(ran) == ["API Error: stream ended before message_stop"]
            await assert_settled(ran)


async def test_a_cut_after_a_tool_use_is_not_resumed() -> None:
    async with Runtime.open() as runtime:
        cut = cut_after(8, {"type": "text", "text": "Reading."}, tool_use("t1", "read"), {"type": "text", "text": "x"})
        ran = await run_query(runtime, [cut, text_reply("unused")], tools=[scripted_tool("read")])
        assert ran.reason == "api_error" and ran.handle.transitions == []
        assert ran.tool_results()["t1"]["is_error"] is True  # the started tool's call is answered
        await assert_settled(ran)


# -- malformed_tool_use_retry -----------------------------------------------------------------------


async def test_a_tool_use_stop_without_a_tool_use_block_is_retried_once_keeping_what_the_model_wrote() -> None:
    async with Runtime.open() as runtime:
        script = [MALFORMED, tools_reply(tool_use("t1", "read")), text_reply("Read it.")]
        ran = await run_query(runtime, script, tools=[scripted_tool("read")])
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["malformed_tool_use_retry", "next_turn"]
        second = ran.model.requests[1]
        assert last_user_text(second) == MALFORMED_TOOL_USE_RETRY_TEXT
        assert second.messages[-2] == {"role": "assistant", "content": MALFORMED["content"]}
        assert ran.tool_results()["t1"]["is_error"] is False
        await assert_settled(ran)


async def test_a_second_malformed_tool_stop_ends_the_query_malformed_tool_use_exhausted() -> None:
    calls: list[object] = []

    async def stop_hook(hook_input: object) -> None:
        calls.append(hook_input)

    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [MALFORMED, MALFORMED, text_reply("unused")], stop_hooks=[stop_hook])
        assert ran.reason == "malformed_tool_use_exhausted"
        assert ran.handle.transitions == ["malformed_tool_use_retry"]
        assert calls == []  # the turn never finished: no stop hook
        result = ran.handle.result
        assert result is not None and result.subtype == "success" and result.is_error
        assert result.errors == [MALFORMED_TOOL_USE_EXHAUSTED_TEXT]
        assert api_errors(ran) == [MALFORMED_TOOL_USE_EXHAUSTED_TEXT]
        await assert_settled(ran)


async def test_the_malformed_retry_is_once_per_turn() -> None:
    async with Runtime.open() as runtime:
        script = [MALFORMED, tools_reply(tool_use("t1", "read")), MALFORMED, text_reply("Done.")]
        ran = await run_query(runtime, script, tools=[scripted_tool("read")])
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["malformed_tool_use_retry", "next_turn", "malformed_tool_use_retry"]
        await assert_settled(ran)


# -- api_error and model_error ----------------------------------------------------------------------


class NotFound:
    """A provider whose model does not exist (the API's 404)."""

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        raise ModelError("not_found", f"model: {request.model}", status=404)
        yield {}  # pragma: no cover - an async generator


async def test_exhausted_api_retries_end_api_error_and_a_model_unavailable_model_error() -> None:
    async with Runtime.open() as runtime:
        retried = await run_query(runtime, [{"error": "overloaded"}] * 2, max_retries=1)
        unavailable = await run_query(runtime, [{"error": "fallback"}])  # no fallback model to switch to
        session = await runtime.open_session(QueryOptions(provider=NotFound(), max_retries=2))
        not_found = await consume(session, session.query("hi"), ScriptedModel([]))
        assert [r.reason for r in (retried, unavailable, not_found)] == ["api_error", "model_error", "model_error"]
        for ran in (retried, unavailable, not_found):
            result = ran.handle.result
            assert result is not None and result.subtype == "success" and result.is_error
        assert "is currently unavailable" in api_errors(unavailable)[0]
        await assert_settled(retried)
        await assert_settled(unavailable)


# -- rapid_refill_breaker ---------------------------------------------------------------------------

# Autocompaction at 8,000 tokens; one "big" result (36,000 characters, about 9,000 tokens) is past it alone.
SMALL_WINDOW: dict[str, Any] = {**CONTEXT_TESTS_WINDOW, "microcompact_keep_recent": 100, "context_collapse": False}
TOOLS = [scripted_tool("big", result="y" * 36_000), scripted_tool("small", result="ok")]


async def compacting_run(runtime: Runtime, uses: list[str]) -> tuple[Ran, ScriptedModel]:
    script = [tools_reply(tool_use(f"t{i}", name)) for i, name in enumerate(uses)]
    model = ScriptedModel([*script, text_reply("Done.")])
    compactor = ScriptedModel([text_reply("Files were read.")], name="compactor", repeat=True)
    options = QueryOptions(provider=model, compact_provider=compactor, tools=TOOLS, **SMALL_WINDOW)
    session = await runtime.open_session(options)
    return await consume(session, session.query("Read everything"), model), compactor


def compactions(ran: Ran) -> int:
    return sum(1 for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "compact_boundary")


async def test_the_context_refilling_right_after_each_compaction_ends_the_query_at_the_third_refill() -> None:
    async with Runtime.open() as runtime:
        ran, compactor = await compacting_run(runtime, ["big"] * 6)
        assert ran.reason == "rapid_refill_breaker"
        # Compacted before calls 2, 3 and 4 (refills 1 and 2); the third refill, before call 5, ends it.
        assert compactions(ran) == len(compactor.requests) == 3
        assert len(ran.model.requests) == 4
        result = ran.handle.result
        assert result is not None and result.subtype == "success" and result.is_error
        assert result.errors == [RAPID_REFILL_BREAKER_TEXT]
        await assert_settled(ran)


async def test_a_turn_that_needs_no_compaction_starts_the_count_again() -> None:
    async with Runtime.open() as runtime:
        # Compactions before calls 2 and 3 (refill 1); call 3's small result needs none; 5, 6, 7 compact
        # again (a fresh compaction, then refills 1 and 2); the refill before call 8 would be the third.
        ran, _ = await compacting_run(runtime, ["big", "big", "small", "big", "big", "big", "big", "big"])
        assert ran.reason == "rapid_refill_breaker"
        assert compactions(ran) == 5 and len(ran.model.requests) == 7
        await assert_settled(ran)
