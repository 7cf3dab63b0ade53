"""The stop reasons beyond Claude Code's own (api-facts §3): `pause_turn`, `refusal` and
`model_context_window_exceeded`, as pure decisions and through a session's real actors
(the recorded streams of these are replayed through the real SDK in `test_wire_fixtures`)."""

from __future__ import annotations

from typing import Any

import trio

from queryloop import Runtime
from queryloop.runtime.loop.context import ContextLimits
from queryloop.runtime.loop.decisions import context_is_full, pause_turn_may_continue
from queryloop.runtime.loop.events import AssistantMessage, SystemMessage, Usage, UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import (
    NextTurn,
    PauseTurnContinuation,
    State,
    next_turn,
    pause_turn_continuation,
)
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.e2e.test_wire_e2e import DEADLINE_S, served
from tests.helpers import Ran, assert_settled, consume, text_reply

SERVER_TOOL_TURN: list[dict[str, Any]] = [
    {"type": "text", "text": "Searching."},
    {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "weather"}},
]
PAUSED = {"content": SERVER_TOOL_TURN, "stop_reason": "pause_turn"}
REFUSED = {
    "content": [{"type": "text", "text": "Hi"}],
    "stop_reason": "refusal",
    "stop_details": {"type": "refusal", "category": "cyber", "explanation": "not this"},
}
LIMITS = ContextLimits(context_window=50_000, max_output_tokens=8_000)  # autocompact threshold 29,000


async def run(runtime: Runtime, entries: list[dict[str, Any]], **options: Any) -> Ran:
    model = ScriptedModel(entries)
    session = await runtime.open_session(QueryOptions(provider=model, **options))
    return await consume(session, session.query("What is the weather?"), model)


def test_pause_turn_may_continue_until_the_cap() -> None:
    assert [pause_turn_may_continue(n, 2) for n in range(4)] == [True, True, False, False]
    assert not pause_turn_may_continue(0, 0)


def test_pause_turn_continuation_sends_the_paused_response_back_in_the_same_turn() -> None:
    prompt = UserMessage(content="go")
    paused = AssistantMessage(message_id="m", model="x", content=SERVER_TOOL_TURN)
    state = State(messages=[prompt], turn_count=3, max_output_tokens_recovery_count=1)
    first = pause_turn_continuation(state, [prompt], [paused])
    assert first.messages == [prompt, paused]  # nothing added: the request ends with the paused response
    assert first.turn_count == 3 and first.max_output_tokens_recovery_count == 1
    assert first.transition == PauseTurnContinuation(continuation=1)
    second = pause_turn_continuation(first, first.messages, [paused])
    assert second.pause_turn_continuations == 2
    assert next_turn(second, [prompt]).pause_turn_continuations == 0  # a new turn: a new allowance
    assert next_turn(second, [prompt]).transition == NextTurn()


def test_context_is_full_when_the_input_alone_passes_the_autocompact_threshold() -> None:
    assert LIMITS.autocompact_threshold == 29_000
    assert context_is_full(Usage(input_tokens=20_000, cache_read_input_tokens=9_000), LIMITS)
    assert not context_is_full(Usage(input_tokens=20_000, output_tokens=29_000), LIMITS)


async def test_pause_turn_sends_the_paused_response_back_as_is_without_stop_hooks() -> None:
    hook_calls: list[object] = []

    async def stop_hook(hook_input: object) -> None:
        hook_calls.append(hook_input)

    async with Runtime.open() as runtime:
        ran = await run(runtime, [PAUSED, PAUSED, text_reply("Sunny.")], stop_hooks=[stop_hook])
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["pause_turn_continuation", "pause_turn_continuation"]
        continued = ran.model.requests[1].messages
        assert [m["role"] for m in continued] == ["user", "assistant"]
        assert continued[-1]["content"] == SERVER_TOOL_TURN  # as it came, ending on the dangling server tool use
        assert len(hook_calls) == 1  # only once the turn has really ended
        assert ran.handle.result is not None and ran.handle.result.num_turns == 1
        await assert_settled(ran)


async def test_pause_turn_cap_ends_the_query_with_an_error_result() -> None:
    async with Runtime.open() as runtime:
        ran = await run(runtime, [PAUSED, PAUSED, text_reply("never asked for")], max_pause_turn_continuations=1)
        assert ran.reason == "api_error"
        assert ran.handle.transitions == ["pause_turn_continuation"]
        assert len(ran.model.requests) == 2
        result = ran.handle.result
        assert result is not None and result.is_error
        assert "max_pause_turn_continuations is 1" in result.errors[0]
        await assert_settled(ran)


async def test_refusal_ends_the_query_completed_with_the_refusal_surfaced() -> None:
    async with Runtime.open() as runtime:
        ran = await run(runtime, [REFUSED])
        conversation = await ran.session.transcript()
        assert ran.reason == "completed" and ran.handle.transitions == []
        result = ran.handle.result
        assert result is not None and result.is_error and result.stop_reason == "refusal"
        assert result.stop_details == REFUSED["stop_details"]
        assert "category: cyber" in result.errors[0] and "explanation: not this" in result.errors[0]
        assert [m.content[0]["text"] for m in conversation if isinstance(m, AssistantMessage)] == [result.errors[0]]
        await assert_settled(ran)


async def test_refusal_with_a_fallback_model_retries_there_without_the_refused_turn() -> None:
    async with Runtime.open() as runtime:
        ran = await run(runtime, [REFUSED, text_reply("Sunny.")], fallback_model="claude-opus-5-5")
        assert ran.reason == "completed" and ran.handle.result is not None and not ran.handle.result.is_error
        assert [r.model for r in ran.model.requests] == ["claude-sonnet-5-5", "claude-opus-5-5"]
        assert [m["role"] for m in ran.model.requests[1].messages] == ["user"]
        fallback = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "model_fallback"]
        assert fallback[0].data == {"from": "claude-sonnet-5-5", "to": "claude-opus-5-5", "reason": "refusal"}
        await assert_settled(ran)


async def test_model_context_window_exceeded_is_recovered_as_a_cut_off() -> None:
    cut = {"content": [{"type": "text", "text": "The answer is"}], "stop_reason": "model_context_window_exceeded"}
    async with Runtime.open() as runtime:
        ran = await run(runtime, [cut, text_reply("The answer is 42.")], context_window=50_000)
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["max_output_tokens_escalate"]
        assert ran.model.requests[1].max_tokens == 64_000
        await assert_settled(ran)


async def test_model_context_window_exceeded_with_a_full_input_compacts_first() -> None:
    cut = {
        "content": [{"type": "text", "text": "The answer is"}],
        "stop_reason": "model_context_window_exceeded",
        "usage": {"input_tokens": 30_000, "output_tokens": 12_000},
    }
    compactor = ScriptedModel([text_reply("The user asked about the weather.")], name="compactor")
    async with Runtime.open() as runtime:
        ran = await run(
            runtime,
            [cut, text_reply("Sunny.")],
            context_window=50_000,
            compact_provider=compactor,
            context_collapse=False,
        )
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["reactive_compact_retry"]
        assert len(compactor.requests) == 1
        await assert_settled(ran)


async def test_model_context_window_exceeded_through_the_real_sdk_is_recovered_or_compacted() -> None:
    """Both branches of the rule, the stop reason arriving over HTTP through the `anthropic` SDK."""
    cut = {"content": [{"type": "text", "text": "The answer is"}], "stop_reason": "model_context_window_exceeded"}
    full = {**cut, "usage": {"input_tokens": 30_000, "output_tokens": 12_000}}
    compactor = ScriptedModel([text_reply("The user asked about the weather.")], name="compactor")
    with trio.fail_after(DEADLINE_S):
        async with (
            served([cut, text_reply("42."), full, text_reply("Sunny.")]) as (api, model),
            Runtime.open() as runtime,
        ):
            options = QueryOptions(
                provider=model, context_window=50_000, compact_provider=compactor, context_collapse=False
            )
            session = await runtime.open_session(options)
            first = session.query("What is the answer?")
            async for _ in first:
                pass
            second = session.query("And the weather?")
            async for _ in second:
                pass
            await session.close()
    assert first.transitions == ["max_output_tokens_escalate"]
    assert api.requests[1].body["max_tokens"] == 64_000  # the same input, the escalated limit
    assert second.transitions == ["reactive_compact_retry"]
    assert len(compactor.requests) == 1
    assert first.result is not None and second.result is not None
    assert (first.result.result, second.result.result) == ("42.", "Sunny.")
