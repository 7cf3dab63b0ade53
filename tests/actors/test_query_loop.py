"""The query loop end to end on real actors and the ScriptedModel: terminals, continue sites, check order.

Every test ends with `assert_settled`: one `result` last, no task of the session
running once the stream has ended, and an API-valid transcript.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pydantic
import pytest
import trio
import trio.testing

from queryloop import Runtime
from queryloop.actors.query_loop import QueryControl
from queryloop.actors.query_loop.ending import budget_error
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    ProgressEvent,
    ResultMessage,
    StreamEvent,
    SystemMessage,
    TombstoneEvent,
    UserMessage,
)
from queryloop.runtime.loop.hooks import HookDecision, PostToolUseInput, StopHookInput
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.pricing import Pricing
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.loop.state import MAX_OUTPUT_TOKENS_RECOVERY_TEXT
from queryloop.runtime.loop.tools import Allow, Deny, Tool, ToolOutput
from queryloop.runtime.loop.transcript import (
    INTERRUPT_MESSAGE,
    INTERRUPT_MESSAGE_FOR_TOOL_USE,
    INTERRUPTED_BY_USER,
    transcript_problems,
)
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import (
    FallbackMidStream,
    Ran,
    ToolLog,
    assert_settled,
    consume,
    hang_guard,
    open_session,
    run_query,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)

PRICE = Pricing(input=3.0, output=15.0, cache_write=3.75, cache_read=0.3)


async def test_completed_after_a_tool_turn_reports_success_with_usage_cost_and_turns(runtime: Runtime) -> None:
    ran = await run_query(
        runtime,
        [
            tools_reply(
                tool_use("t1", "read", {"path": "a"}),
                text="Let me look.",
                usage={"input_tokens": 1000, "output_tokens": 100},
            ),
            text_reply("Fixed.", usage={"input_tokens": 2000, "output_tokens": 50}),
        ],
        tools=[scripted_tool("read", result="file text", safe=True)],
        pricing=PRICE,
    )
    assert ran.reason == "completed"
    assert ran.handle.transitions == ["next_turn"]
    result = ran.handle.result
    assert result is not None
    assert (result.subtype, result.is_error, result.result, result.stop_reason) == (
        "success",
        False,
        "Fixed.",
        "end_turn",
    )
    assert result.num_turns == 2
    assert (result.usage.input_tokens, result.usage.output_tokens) == (3000, 150)
    assert result.total_cost_usd == pytest.approx((3000 * 3.0 + 150 * 15.0) / 1e6)
    assert ran.tool_results()["t1"]["content"] == "file text"
    assert ran.labels[:2] == ["system:init", "stream_request_start"]
    await assert_settled(ran)


async def test_tool_starts_before_its_model_stream_ends(
    autojump_clock: trio.testing.MockClock, runtime: Runtime
) -> None:
    log = ToolLog()
    model = ScriptedModel([tools_reply(tool_use("t1", "probe"), text="Checking.", latency_ms=2000), text_reply()])
    session = await open_session(runtime, model, tools=[scripted_tool("probe", log=log)])
    seen_message_delta_at: list[float] = []
    handle = session.query("go")
    events = []
    async for event in handle:
        events.append(event)
        if isinstance(event, StreamEvent) and event.event["type"] == "message_delta" and not seen_message_delta_at:
            seen_message_delta_at.append(trio.current_time())
    # Latency is split around the content: the block completes at 1 s, the stream ends at 2 s.
    assert log.starts["t1"] == pytest.approx(1.0)
    assert seen_message_delta_at[0] == pytest.approx(2.0)
    assert log.ends["t1"] < seen_message_delta_at[0]
    ran = await consume(session, handle, model)
    ran.events = events
    await assert_settled(ran)


async def test_concurrency_safe_tools_run_in_parallel_and_unsafe_tools_alone_in_order(
    autojump_clock: trio.testing.MockClock,
    runtime: Runtime,
) -> None:
    log = ToolLog()
    ran = await run_query(
        runtime,
        [
            tools_reply(
                tool_use("r1", "read"),
                tool_use("r2", "read"),
                tool_use("w1", "write"),
                tool_use("r3", "read"),
            ),
            text_reply(),
        ],
        tools=[
            scripted_tool("read", latency=1.0, safe=True, log=log),
            scripted_tool("write", latency=1.0, log=log),
        ],
    )
    assert log.starts["r1"] == log.starts["r2"]  # safe neighbours together
    assert log.starts["w1"] >= max(log.ends["r1"], log.ends["r2"])  # unsafe waits for them
    assert log.starts["r3"] >= log.ends["w1"]  # and nothing behind it jumps the queue
    # r1 and r2 start in the same scheduler tick, in whichever order trio runs that batch.
    assert sorted(log.order[:2]) == ["r1", "r2"] and log.order[2:] == ["w1", "r3"]
    await assert_settled(ran)


async def test_max_turns_emits_the_attachment_and_an_error_max_turns_result(runtime: Runtime) -> None:
    ran = await run_query(
        runtime,
        [tools_reply(tool_use("t1", "read")), tools_reply(tool_use("t2", "read")), text_reply()],
        tools=[scripted_tool("read", safe=True)],
        max_turns=2,
    )
    assert ran.reason == "max_turns"
    assert ran.handle.terminal is not None and ran.handle.terminal.turn_count == 3
    attachment = next(e for e in ran.events if isinstance(e, AttachmentMessage))
    assert attachment.attachment == {"type": "max_turns_reached", "maxTurns": 2, "turnCount": 3}
    assert ran.tool_results().keys() == {"t1", "t2"}  # all tool results of the last turn collected
    result = ran.handle.result
    assert result is not None
    assert (result.subtype, result.is_error) == ("error_max_turns", True)
    assert result.errors == ["Reached maximum number of turns (2)"]
    assert len(ran.model.requests) == 2
    await assert_settled(ran)


async def test_max_output_tokens_escalate_is_silent_and_retries_the_same_input() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [text_reply("Half an ans", stop_reason="max_tokens"), text_reply("A whole answer.")],
            max_output_tokens=8000,
            escalated_max_output_tokens=64000,
        )
        first, second = ran.model.requests
        assert (first.max_tokens, second.max_tokens) == (8000, 64000)
        assert second.messages == first.messages  # same input: the truncated answer is not sent back
        assert ran.handle.transitions == ["max_output_tokens_escalate"]
        assert not [e for e in ran.events if isinstance(e, UserMessage)]  # no meta message: silent
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_max_output_tokens_recovery_three_times_then_the_withheld_error_surfaces() -> None:
    hook_calls: list[bool] = []

    async def stop_hook(hook_input: StopHookInput) -> HookDecision:
        hook_calls.append(hook_input.stop_hook_active)
        return HookDecision(blocking_error="should never run")

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [text_reply(f"part {i}", stop_reason="max_tokens") for i in range(5)],
            stop_hooks=[stop_hook],
        )
        assert ran.handle.transitions == [
            "max_output_tokens_escalate",
            "max_output_tokens_recovery",
            "max_output_tokens_recovery",
            "max_output_tokens_recovery",
        ]
        assert ran.texts_of_user_events() == [MAX_OUTPUT_TOKENS_RECOVERY_TEXT] * 3
        recovery_request = ran.model.requests[2]
        assert recovery_request.max_tokens == 64000  # recovery keeps the escalated limit
        assert recovery_request.messages[-2]["content"][0]["text"] == "part 1"  # the truncated answer is kept
        errors = [e for e in ran.events if isinstance(e, AssistantMessage) and e.is_api_error]
        assert len(errors) == 1 and "output token maximum" in errors[0].content[0]["text"]
        assert hook_calls == []  # an API error message never reaches stop hooks
        assert ran.reason == "completed"
        assert ran.handle.result is not None and ran.handle.result.is_error
        await assert_settled(ran)


async def test_stop_hook_blocking_feeds_the_error_back_with_stop_hook_active() -> None:
    seen: list[bool] = []

    async def stop_hook(hook_input: StopHookInput) -> HookDecision | None:
        seen.append(hook_input.stop_hook_active)
        return None if hook_input.stop_hook_active else HookDecision(blocking_error="tests fail")

    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply("Done."), text_reply("Fixed the tests.")], stop_hooks=[stop_hook])
        assert seen == [False, True]
        assert ran.handle.transitions == ["stop_hook_blocking"]
        feedback = ran.model.requests[1].messages[-1]["content"]
        assert feedback[-1]["text"] == "Stop hook feedback:\ntests fail"
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_stop_hook_blocking_resets_the_max_output_tokens_recovery_count() -> None:
    blocked = False

    async def stop_hook(_: StopHookInput) -> HookDecision | None:
        nonlocal blocked
        if blocked:
            return None
        blocked = True
        return HookDecision(blocking_error="again")

    async with Runtime.open() as runtime:
        truncated = [text_reply("cut", stop_reason="max_tokens") for _ in range(3)]
        ran = await run_query(
            runtime,
            [*truncated, text_reply("ok"), *truncated, text_reply("ok")],
            stop_hooks=[stop_hook],
            max_output_tokens=8000,
            escalated_max_output_tokens=64000,
        )
        # escalate, 2 recoveries, then blocking: the next response escalates afresh and recovers again.
        assert ran.handle.transitions == [
            "max_output_tokens_escalate",
            "max_output_tokens_recovery",
            "max_output_tokens_recovery",
            "stop_hook_blocking",
            "max_output_tokens_escalate",
            "max_output_tokens_recovery",
            "max_output_tokens_recovery",
        ]
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_stop_hook_prevent_ends_with_stop_hook_prevented() -> None:
    async def stop_hook(_: StopHookInput) -> HookDecision:
        return HookDecision(prevent="policy says stop")

    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply()], stop_hooks=[stop_hook])
        assert ran.reason == "stop_hook_prevented"
        assert ran.handle.result is not None and ran.handle.result.subtype == "success"
        await assert_settled(ran)


async def test_check_order_stop_hook_prevent_wins_over_blocking() -> None:
    async def blocks(_: StopHookInput) -> HookDecision:
        return HookDecision(blocking_error="fix it")

    async def prevents(_: StopHookInput) -> HookDecision:
        return HookDecision(prevent="stop")

    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply(), text_reply()], stop_hooks=[blocks, prevents])
        assert ran.reason == "stop_hook_prevented"
        assert ran.handle.transitions == []
        assert len(ran.model.requests) == 1
        await assert_settled(ran)


async def test_post_tool_use_hook_prevent_ends_with_hook_stopped_after_all_tools() -> None:
    async def hook(hook_input: PostToolUseInput) -> HookDecision | None:
        return HookDecision(prevent="policy") if hook_input.tool_name == "write" else None

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("w", "write"), tool_use("r", "read")), text_reply()],
            tools=[scripted_tool("write"), scripted_tool("read")],
            post_tool_use_hooks=[hook],
        )
        assert ran.reason == "hook_stopped"
        assert ran.tool_results().keys() == {"w", "r"}
        stopped = [e for e in ran.events if isinstance(e, AttachmentMessage)]
        assert stopped[0].attachment["type"] == "hook_stopped_continuation"
        assert len(ran.model.requests) == 1
        await assert_settled(ran)


async def test_check_order_hook_stopped_is_checked_before_max_turns() -> None:
    async def hook(_: PostToolUseInput) -> HookDecision:
        return HookDecision(prevent="enough")

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t", "read")), text_reply()],
            tools=[scripted_tool("read")],
            post_tool_use_hooks=[hook],
            max_turns=1,
        )
        assert ran.reason == "hook_stopped"
        await assert_settled(ran)


async def test_aborted_streaming_answers_open_tool_uses_and_emits_the_interruption_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow"), text="Working", latency_ms=10_000)])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        handle = session.query("go")
        events = []
        async for event in handle:
            events.append(event)
            if isinstance(event, AssistantMessage) and event.content[0].get("type") == "tool_use":
                await session.abort("user")
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_streaming"
        assert handle.abort_reason == "user"
        assert ran.tool_results()["t1"] == {
            "type": "tool_result",
            "tool_use_id": "t1",
            "content": INTERRUPTED_BY_USER,
            "is_error": True,
        }
        assert ran.texts_of_user_events()[-1] == INTERRUPT_MESSAGE
        assert ran.handle.result is not None and ran.handle.result.subtype == "error_during_execution"
        assert trio.current_time() < 10  # the stream was cut, not waited for
        await assert_settled(ran)


async def test_abort_with_reason_interrupt_emits_no_interruption_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply()])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        handle = session.query("go")
        events = []
        async for event in handle:
            events.append(event)
            if isinstance(event, StreamEvent) and event.event["type"] == "message_stop":
                await trio.sleep(1)  # the tool is running now
                await session.abort("interrupt")
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_tools"
        assert ran.tool_results()["t1"]["content"] == INTERRUPTED_BY_USER
        assert INTERRUPT_MESSAGE_FOR_TOOL_USE not in ran.texts_of_user_events()
        assert INTERRUPT_MESSAGE not in ran.texts_of_user_events()
        await assert_settled(ran)


async def test_aborted_tools_keeps_finished_results_and_interrupts_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("fast", "quick"), tool_use("slow", "lengthy")), text_reply()])
        session = await open_session(
            runtime,
            model,
            tools=[
                scripted_tool("quick", result="quick result", safe=True),
                scripted_tool("lengthy", latency=60, safe=True),
            ],
        )
        handle = session.query("go")
        events = []
        stream_ended = fast_done = False
        async for event in handle:
            events.append(event)
            stream_ended |= isinstance(event, StreamEvent) and event.event["type"] == "message_stop"
            fast_done |= isinstance(event, UserMessage)
            if stream_ended and fast_done and handle._control.abort_reason is None:
                await session.abort("user")  # the stream is over and the slow tool still runs
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_tools"
        results = ran.tool_results()
        assert results["fast"]["content"] == "quick result" and not results["fast"]["is_error"]
        assert results["slow"]["content"] == INTERRUPTED_BY_USER and results["slow"]["is_error"]
        assert ran.texts_of_user_events()[-1] == INTERRUPT_MESSAGE_FOR_TOOL_USE
        assert len(model.requests) == 1
        await assert_settled(ran)


async def test_check_order_abort_wins_over_max_tokens_truncation(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("cut", stop_reason="max_tokens", latency_ms=1000), text_reply()])
        session = await open_session(runtime, model)
        handle = session.query("go")
        events = []
        async for event in handle:
            events.append(event)
            if isinstance(event, AssistantMessage):  # the text completed; the stream ends later
                await session.abort("user")
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_streaming"
        assert ran.handle.transitions == []  # no escalation after an abort
        assert len(model.requests) == 1
        await assert_settled(ran)


async def test_abort_while_stop_hooks_run_cancels_them_and_ends_aborted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hook_finished: list[bool] = []

    async def slow_hook(_: StopHookInput) -> HookDecision:
        await trio.sleep(60)
        hook_finished.append(True)
        return HookDecision(blocking_error="too late")

    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Done."), text_reply("unused")])
        session = await open_session(runtime, model, stop_hooks=[slow_hook])
        handle = session.query("go")
        events = []
        async for event in handle:
            events.append(event)
            if isinstance(event, StreamEvent) and event.event["type"] == "message_stop":
                await trio.sleep(1)  # the stop hook is running now
                await session.abort("user")
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_streaming"  # no tools ran: the abort is the streaming kind
        assert hook_finished == []
        assert len(model.requests) == 1
        assert ran.texts_of_user_events()[-1] == INTERRUPT_MESSAGE
        await assert_settled(ran)


async def test_abort_before_start_makes_no_model_call() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply()])
        session = await open_session(runtime, model)
        handle = session.query("go")
        await session.abort("user")  # overtakes the query in the mailbox; the query still sees it
        ran = await consume(session, handle, model)
        assert ran.reason == "aborted_streaming"
        assert model.requests == []
        assert ran.labels == ["system:init", "user", "result"]  # the start, the interruption message, the result
        await assert_settled(ran)


async def test_abort_after_end_changes_nothing_and_the_session_stays_usable() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("one"), text_reply("two")])
        session = await open_session(runtime, model)
        ran = await consume(session, session.query("first"), model)
        await session.abort("user")
        await session.abort("user")  # idempotent
        assert ran.reason == "completed"
        assert ran.handle.abort_reason is None  # it came too late to be this query's
        again = await consume(session, session.query("second"), model)
        assert again.reason == "completed" and again.handle.result is not None
        assert again.handle.result.result == "two"
        await assert_settled(again)


def test_an_abort_after_the_loop_decided_its_ending_is_not_recorded() -> None:
    control = QueryControl()
    control.decided = True  # the terminal is known; helpers are stopping, the result is on its way
    assert control.request_abort("user") is False
    assert control.abort_reason is None
    early = QueryControl()
    assert early.request_abort("interrupt") is True
    assert early.request_abort("user") is False  # the first reason stays
    assert early.abort_reason == "interrupt"


async def test_an_abort_landing_while_the_result_waits_in_the_buffer_changes_nothing() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("done")])
        session = await open_session(runtime, model)
        handle = session.query("go")
        await trio.testing.wait_all_tasks_blocked()  # the query ran to its end into the buffer, unread
        await session.abort("user")
        ran = await consume(session, handle, model)
        assert ran.reason == "completed" and handle.abort_reason is None
        await assert_settled(ran)


async def test_an_api_error_answers_tool_uses_already_streamed() -> None:
    async with Runtime.open() as runtime:
        # The cut comes after the first block (a tool_use) completed: emitted, so not retried.
        cut = {
            "error": "connection",
            "after_events": 6,
            "content": [tool_use("t1", "read", {"p": 1}), {"type": "text", "text": "never"}],
        }
        ran = await run_query(runtime, [cut, text_reply()], tools=[scripted_tool("read", latency=0)])
        assert ran.reason == "api_error"  # a cut after a tool_use is not resumed: that tool had started
        assert len(ran.model.requests) == 1
        result = ran.tool_results()["t1"]
        assert result["tool_use_id"] == "t1"
        error = [e for e in ran.events if isinstance(e, AssistantMessage) and e.is_api_error]
        assert error and error[0].content[0]["text"].startswith("API Error:")
        assert ran.handle.result is not None and ran.handle.result.is_error
        await assert_settled(ran)


async def test_overloaded_is_retried_with_backoff_while_nothing_was_emitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [{"error": "overloaded"}, {"error": "overloaded"}, text_reply()], max_retries=2)
        assert ran.reason == "completed"
        assert len(ran.model.requests) == 3
        assert ran.labels.count("system:api_retry") == 2
        assert ran.labels.count("stream_request_start") == 1  # retries belong to one iteration
        assert trio.current_time() > 0  # the backoff waited
        await assert_settled(ran)


async def test_retries_exhausted_end_with_api_error(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [{"error": "api_error"}] * 3, max_retries=2)
        assert ran.reason == "api_error"
        assert ran.handle.result is not None and ran.handle.result.subtype == "success" and ran.handle.result.is_error
        assert len(ran.model.requests) == 3
        await assert_settled(ran)


async def test_rate_limit_retry_honours_retry_after(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        start = trio.current_time()
        ran = await run_query(runtime, [{"error": "rate_limit", "retry_after_s": 7}, text_reply()])
        retry = next(e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "api_retry")
        assert retry.data["delay_s"] == 7
        assert trio.current_time() - start == pytest.approx(7)
        await assert_settled(ran)


async def test_an_api_retry_announcement_comes_before_the_retried_requests_events_even_with_no_backoff(
    tmp_path: Path,
) -> None:
    # With `retry-after: 0` the retry streams at the next scheduler step; trio runs that step's tasks in a random
    # order, so an announcement that went through the loop came after the retry's first events about one time in
    # four. Twenty queries make that order a near certainty to show.
    path = tmp_path / "session.jsonl"
    async with Runtime.open() as runtime:
        scripted = ScriptedModel([{"error": "rate_limit", "retry_after_s": 0}, text_reply()] * 20)
        session = await runtime.open_session(QueryOptions(provider=scripted), transcript=path)
        for _ in range(20):
            ran = await consume(session, session.query("Fix the bug"), scripted)
            assert ran.reason == "completed"
            assert ran.labels.index("system:api_retry") < ran.labels.index("stream_event"), ran.labels
        on_disk = load_transcript(path).messages
        assert on_disk == await session.transcript()  # logged once each, by the ModelCaller
        assert sum(isinstance(m, SystemMessage) and m.subtype == "api_retry" for m in on_disk) == 20
        await assert_settled(ran)


async def test_image_size_error_ends_with_image_error() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [{"error": "image_size"}])
        assert ran.reason == "image_error"
        error = [e for e in ran.events if isinstance(e, AssistantMessage) and e.is_api_error]
        assert "image exceeds" in error[0].content[0]["text"]
        await assert_settled(ran)


async def test_fallback_continue_keeps_state_tombstones_and_switches_model() -> None:
    async with Runtime.open() as runtime:
        inner = ScriptedModel(
            [
                tools_reply({"type": "thinking", "thinking": "hmm", "signature": "sig"}, tool_use("t1", "read")),
                tools_reply(tool_use("t2", "read"), text="About to"),  # abandoned after its text block
                text_reply("Answered by the fallback."),
            ]
        )
        provider = FallbackMidStream(inner, fail_on=2, events=5)
        options = QueryOptions(
            provider=provider,
            model="claude-sonnet-5-5",
            fallback_model="claude-haiku-5-5",
            tools=[scripted_tool("read")],
        )
        session = await runtime.open_session(options)
        handle = session.query("go")
        ran = await consume(session, handle, inner)
        assert ran.reason == "completed"
        tombstones = [e for e in ran.events if isinstance(e, TombstoneEvent)]
        abandoned = [
            e for e in ran.events if isinstance(e, AssistantMessage) and e.content[0].get("text") == "About to"
        ]
        assert [t.message_uuid for t in tombstones] == [m.uuid for m in abandoned]
        fallback_notice = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "model_fallback"]
        assert len(fallback_notice) == 1
        assert ran.handle.transitions == ["next_turn"]  # the fallback retry is a bare continue
        third = inner.requests[2]
        assert third.model == "claude-haiku-5-5"
        assert third.messages == [m for m in third.messages if all(b.get("type") != "thinking" for b in m["content"])]
        assert inner.requests[1].messages[1]["content"][0]["type"] == "thinking"  # stripped only for the fallback
        assert third.max_tokens == inner.requests[1].max_tokens
        transcript = await session.transcript()
        assert all(m.uuid not in {a.uuid for a in abandoned} for m in transcript)
        await assert_settled(ran)


async def test_tool_failures_each_become_an_error_result_and_the_loop_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [
                tools_reply(
                    tool_use("u", "nonexistent"),
                    tool_use("c", "crash"),
                    tool_use("h", "hang"),
                    tool_use("v", "typed", {"count": "not a number"}),
                ),
                text_reply(),
            ],
            tools=[
                scripted_tool("crash", raises="disk full"),
                scripted_tool("hang", latency=100_000, timeout_s=0.05),
                _typed_tool(),
            ],
        )
        results = ran.tool_results()
        assert results["u"]["content"] == "<tool_use_error>Error: No such tool available: nonexistent</tool_use_error>"
        assert results["c"]["content"] == "<tool_use_error>Error: disk full</tool_use_error>"
        assert "timed out" in results["h"]["content"]
        assert results["v"]["content"].startswith("<tool_use_error>InputValidationError")
        assert "count" in results["v"]["content"]
        assert all(r["is_error"] for r in results.values())
        assert ran.reason == "completed" and ran.handle.transitions == ["next_turn"]
        await assert_settled(ran)


class CountArgs(pydantic.BaseModel):
    count: int


def _typed_tool() -> Any:
    from queryloop.runtime.loop.tools import ToolContext, tool

    @tool()
    async def typed(args: CountArgs, ctx: ToolContext) -> str:
        return str(args.count)

    return typed


def test_tool_decorator_refuses_an_unresolvable_input_model_clearly() -> None:
    from queryloop.runtime.loop.tools import ToolContext, tool

    class LocalArgs(pydantic.BaseModel):
        count: int

    with pytest.raises(TypeError, match="input_model="):

        @tool()
        async def typed(args: LocalArgs, ctx: ToolContext) -> str:
            return str(args.count)

    @tool(input_model=LocalArgs)
    async def explicit(args: LocalArgs, ctx: ToolContext) -> str:
        return str(args.count)

    assert explicit.input_model is LocalArgs
    assert explicit.api_schema()["input_schema"]["required"] == ["count"]


async def test_tool_use_cut_off_by_max_tokens_is_answered_with_an_error_and_never_runs() -> None:
    log = ToolLog()
    async with Runtime.open() as runtime:
        cut = {
            "content": [tool_use("t1", "write", {"path": "a/very/long/path/name.txt", "body": "x" * 80})],
            "stop_reason": "max_tokens",
            "truncate_last_block": True,
        }
        ran = await run_query(runtime, [cut, text_reply()], tools=[scripted_tool("write", log=log)])
        assert log.order == []  # the partial input never ran
        result = ran.tool_results()["t1"]
        assert result["is_error"] and "cut off" in result["content"]
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_permission_callback_denies_with_its_message_and_allows_updated_input() -> None:
    seen: list[dict[str, Any]] = []

    async def can_use_tool(name: str, tool_input: dict[str, Any]) -> Allow | Deny:
        if name == "rm":
            return Deny(message="rm is not allowed here")
        return Allow(updated_input={**tool_input, "safe": True})

    async def record(args: Any, ctx: Any) -> str:
        seen.append(args)
        return "ran"

    from queryloop.runtime.loop.tools import Tool

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("a", "rm"), tool_use("b", "ls", {"dir": "."})), text_reply()],
            tools=[Tool(name="rm", call=record), Tool(name="ls", call=record)],
            can_use_tool=can_use_tool,
        )
        results = ran.tool_results()
        assert results["a"] == {
            "type": "tool_result",
            "tool_use_id": "a",
            "content": "<tool_use_error>rm is not allowed here</tool_use_error>",
            "is_error": True,
        }
        assert results["b"]["content"] == "ran"
        assert seen == [{"dir": ".", "safe": True}]
        await assert_settled(ran)


async def test_budget_exceeded_ends_with_error_max_budget_usd_overshooting_by_at_most_one_call() -> None:
    usage = {"input_tokens": 100_000, "output_tokens": 1000}  # $0.315 per call at PRICE
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use(f"t{i}", "read"), usage=usage) for i in range(5)],
            tools=[scripted_tool("read")],
            pricing=PRICE,
            max_budget_usd=0.5,
        )
        assert ran.reason == "max_budget_usd"
        result = ran.handle.result
        assert result is not None
        assert (result.subtype, result.is_error) == ("error_max_budget_usd", True)
        per_call = (100_000 * 3.0 + 1000 * 15.0) / 1e6
        assert len(ran.model.requests) == 2  # the second call crossed the cap; no third was made
        assert 0.5 <= result.total_cost_usd <= 0.5 + per_call
        assert "t1" in ran.tool_results()  # the open tool_use was answered
        assert result.errors == ["Reached maximum budget ($0.5)"]
        await assert_settled(ran)


async def test_budget_exceeded_reports_the_turn_the_capping_call_was_in() -> None:
    # The second call (turn 2) crosses the cap: the result counts two turns, as a stop on any other
    # ending does (it said 1 when the budget stop took the query's first State's count).
    cheap, costly = {"input_tokens": 10, "output_tokens": 1}, {"input_tokens": 200_000, "output_tokens": 1000}
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "read"), usage=cheap), tools_reply(tool_use("t2", "read"), usage=costly)],
            tools=[scripted_tool("read")],
            pricing=PRICE,
            max_budget_usd=0.5,
        )
        assert ran.reason == "max_budget_usd" and len(ran.model.requests) == 2
        assert ran.handle.result is not None and ran.handle.result.num_turns == 2
        await assert_settled(ran)


def test_the_budget_error_prints_the_cap_as_claude_code_does() -> None:
    # Claude Code's text: `Reached maximum budget ($${maxBudgetUsd})`, a JavaScript number: `$1`, never `$1.0`.
    assert budget_error(1.0, 1.2) == "Reached maximum budget ($1)"
    assert budget_error(10, 10.0) == "Reached maximum budget ($10)"
    assert budget_error(0.25, 0.3) == "Reached maximum budget ($0.25)"
    # A stop on a shared cap (the host's, a parent query's) does not name the query's own, unreached one.
    assert (
        budget_error(10.0, 0.6)
        == budget_error(None, 0.6)
        == ("Reached maximum budget (a shared cap: the host's or a parent query's)")
    )


async def test_consumer_that_stops_early_aborts_the_query_and_the_session_stays_usable(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow"), latency_ms=100), text_reply("second query")])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        async with session.query("first") as handle:
            async for event in handle:
                if isinstance(event, ProgressEvent | AssistantMessage):
                    break
        await trio.testing.wait_all_tasks_blocked()
        assert session.live_tasks() == 0
        assert handle.result is None
        again = await consume(session, session.query("second"), model)
        assert again.reason == "completed"
        await assert_settled(again)


async def test_a_consumer_gone_mid_stream_is_the_users_abort_even_before_any_abort_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        # The consumer's channel goes while the stream still runs (the first half of its 10 s comes at once, the
        # rest at 10 s) and the tool takes a minute: the ModelCaller is the first to find it closed, at 10 s.
        model = ScriptedModel([tools_reply(tool_use("t1", "slow"), latency_ms=10_000), text_reply("second")])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        handle = session.query("first")
        async for event in handle:
            if isinstance(event, StreamEvent):
                break
        handle._events.close_receiver()  # closed under the ModelCaller, no abort asked
        await trio.sleep(7)  # virtual time: the stream's last events come at 10 s and find the channel closed
        assert handle.abort_reason == "user"  # the ModelCaller told the loop, the loop aborted
        assert session.live_tasks() == 0  # the minute-long tool was cut
        assert transcript_problems(await session.transcript()) == []
        again = await consume(session, session.query("second"), model)
        assert again.reason == "completed"
        await assert_settled(again)


async def test_a_stream_step_racing_the_abort_never_reaches_the_consumer_after_the_result() -> None:
    class EveryTick:
        """A stream that produces an event in every scheduler batch (a network stream with data waiting)."""

        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            yield {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 5}}}
            while True:
                await trio.lowlevel.cancel_shielded_checkpoint()  # woken next batch, whatever happened
                yield {"type": "ping"}
                await trio.lowlevel.checkpoint_if_cancelled()

    async with Runtime.open() as runtime:
        # After the abort, the loop and the stream's task run in the same batch, in either order (trio
        # shuffles a batch): over twenty sessions both orders come up; the result must stay the last event.
        for _ in range(20):
            session = await runtime.open_session(QueryOptions(provider=EveryTick()))
            handle = session.query("go")
            labels: list[str] = []
            async for event in handle:
                labels.append(event.label)
                if len(labels) == 10:
                    await session.abort("user")
            assert labels[-1] == "result" and labels.count("result") == 1
            assert handle.terminal is not None and handle.terminal.reason == "aborted_streaming"
            await session.close()


async def test_consumer_that_drops_the_handle_without_closing_it_aborts_the_query(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log = ToolLog()
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow"), latency_ms=100), text_reply("second query")])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60, log=log)])
        async for _event in session.query("first"):
            break  # no aclose(): the handle is simply dropped
        await trio.testing.wait_all_tasks_blocked()
        assert session.live_tasks() == 0
        assert "t1" not in log.ends  # the tool was cancelled, not run to its end
        transcript = await session.transcript()
        assert transcript[-1].type == "user"  # the interruption closed the aborted query
        again = await consume(session, session.query("second"), model)
        assert again.reason == "completed"
        await assert_settled(again)


async def test_second_query_continues_the_conversation() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Paris."), text_reply("About 2 million.")])
        session = await open_session(runtime, model)
        await consume(session, session.query("Capital of France?"), model)
        ran = await consume(session, session.query("Population?"), model)
        sent = model.requests[1].messages
        assert [m["role"] for m in sent] == ["user", "assistant", "user"]
        assert sent[1]["content"] == [{"type": "text", "text": "Paris."}]
        assert ran.handle.result is not None and ran.handle.result.num_turns == 1
        await assert_settled(ran)


async def test_system_prompt_is_layered_and_user_context_is_prepended() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [text_reply()],
            system_prompt="You are terse.",
            append_system_prompt="Answer in English.",
            system_context={"cwd": "/project"},
            user_context={"claudeMd": "Use tabs."},
        )
        request = ran.model.requests[0]
        assert [b["text"] for b in request.system] == ["You are terse.", "Answer in English.", "cwd: /project"]
        first = request.messages[0]
        assert first["role"] == "user"
        assert "Use tabs." in first["content"][0]["text"]  # user context: a block before the prompt
        assert first["content"][-1]["text"] == "Fix the bug"
        await assert_settled(ran)


class _Queue:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items = items
        self.calls = 0

    async def collect(self) -> list[dict[str, Any]]:
        self.calls += 1
        found, self.items = self.items, []
        return found


async def test_attachments_from_pluggable_sources_are_injected_between_turns() -> None:
    queue = _Queue([{"type": "queued_message", "content": "also update the docs"}])
    changes = _Queue([{"type": "file_changed", "content": "src/app.py was modified"}])
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t", "read")), text_reply()],
            tools=[scripted_tool("read")],
            attachment_sources=[queue, changes],
        )
        last_user = ran.model.requests[1].messages[-1]["content"]
        texts = [b.get("text") for b in last_user if b["type"] == "text"]
        assert "also update the docs" in texts
        assert any("src/app.py was modified" in t and "<system-reminder>" in t for t in texts if t)
        assert last_user[0]["type"] == "tool_result"
        assert queue.calls == 1  # between turns only: not after the final answer
        await assert_settled(ran)


async def test_memory_prefetch_starts_once_and_is_disposed_on_every_exit() -> None:
    started: list[int] = []
    disposed: list[bool] = []

    async def prefetch(messages: list[Any]) -> str | None:
        started.append(len(messages))
        try:
            await trio.sleep_forever()
        finally:
            disposed.append(True)
        return None  # pragma: no cover

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t", "read")), tools_reply(tool_use("u", "read")), text_reply()],
            tools=[scripted_tool("read")],
            memory_prefetch=prefetch,
        )
        assert started == [1] and disposed == [True]
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_memory_prefetch_result_is_injected_once_when_settled() -> None:
    async def prefetch(_: list[Any]) -> str:
        return "the user prefers tabs"

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t", "read")), tools_reply(tool_use("u", "read")), text_reply()],
            tools=[scripted_tool("read")],
            memory_prefetch=prefetch,
        )
        memories = [e for e in ran.events if isinstance(e, AttachmentMessage) and e.attachment["type"] == "memory"]
        assert len(memories) == 1
        await assert_settled(ran)


async def test_submitting_with_interrupt_while_tools_run_interrupts_the_query_and_continues_with_the_new_message(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply("Doing the new thing.")])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        first = session.query("first")
        await trio.sleep(1)  # the tool runs
        second = session.query("actually, do this instead", interrupt=True)
        interrupted = await consume(session, first, model)
        ran = await consume(session, second, model)
        assert interrupted.reason == "aborted_tools"
        assert interrupted.tool_results()["t1"]["content"] == INTERRUPTED_BY_USER
        assert INTERRUPT_MESSAGE_FOR_TOOL_USE not in interrupted.texts_of_user_events()  # reason `interrupt`
        assert ran.reason == "completed" and ran.handle.result is not None
        assert ran.handle.result.result == "Doing the new thing."
        assert trio.current_time() < 60
        await assert_settled(ran)


async def test_messages_sent_back_to_back_are_all_answered_in_order(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("one", latency_ms=1000), text_reply("two"), text_reply("three")])
        session = await open_session(runtime, model)
        handles = [session.query(prompt) for prompt in ("first", "second", "third")]
        answers = [await consume(session, handle, model) for handle in handles]
        assert [ran.reason for ran in answers] == ["completed"] * 3
        assert [ran.handle.result.result for ran in answers if ran.handle.result] == ["one", "two", "three"]
        # Each answered its own message, in order: the n-th request ends with the n-th prompt.
        last_prompts = [request.messages[-1]["content"][-1]["text"] for request in model.requests]
        assert last_prompts == ["first", "second", "third"]
        assert [m.type for m in await session.transcript()] == ["user", "assistant"] * 3
        await assert_settled(answers[-1])


async def test_a_message_sent_while_tools_run_is_taken_in_at_the_next_turn_boundary(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply("Both done.")])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        first = session.query("first")
        await trio.sleep(1)  # the tool runs
        queued = session.query("and also this")
        ran = await consume(session, first, model)
        taken = await consume(session, queued, model)
        assert ran.reason == "completed" and len(model.requests) == 2  # one query answered both
        second_request = model.requests[1].messages
        assert second_request[-1]["role"] == "user"
        assert second_request[-1]["content"][-1] == {"type": "text", "text": "and also this"}
        taken_in = [e for e in ran.events if isinstance(e, AttachmentMessage)]
        assert [a.attachment for a in taken_in] == [{"type": "queued_message", "content": "and also this"}]
        assert taken.events[0] is taken_in[0]  # its own stream says it was taken in, then gets the answer
        assert taken.handle.result is ran.handle.result and taken.reason == "completed"
        conversation = await session.transcript()
        assert [m.type for m in conversation] == ["user", "assistant", "user", "attachment", "assistant"]
        # The result lists every message it answered, as claude-agent-sdk's `user_message_uuids` does.
        assert ran.handle.result is not None
        assert ran.handle.result.user_message_uuid == conversation[0].uuid
        uuids = ran.handle.result.user_message_uuids
        assert len(uuids) == 2 and uuids[0] == conversation[0].uuid and len(set(uuids)) == 2
        assert transcript_problems(conversation) == []
        await assert_settled(ran)


async def test_a_message_with_overrides_waits_for_a_query_of_its_own(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply("First."), text_reply("Second.")])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        first = session.query("first")
        await trio.sleep(1)
        own = session.query("second", max_turns=5)
        ran = await consume(session, first, model)
        second = await consume(session, own, model)
        assert ran.handle.result is not None and ran.handle.result.result == "First."
        assert second.handle.result is not None and second.handle.result.result == "Second."
        assert not any(isinstance(e, AttachmentMessage) for e in ran.events)


async def test_closing_a_session_with_messages_waiting_ends_every_stream(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("one", latency_ms=10_000), text_reply("two"), text_reply("three")])
        session = await open_session(runtime, model)
        handles = [session.query(prompt) for prompt in ("first", "second", "third")]
        await trio.sleep(1)
        with hang_guard(60, "closing a session with messages waiting"):
            await session.close()
            events = [[event async for event in handle] for handle in handles]
        assert handles[0].terminal is not None and handles[0].terminal.reason == "aborted_streaming"
        assert all(not e or e[-1].type == "result" for e in events)  # each ended, with a result or without
        assert len(model.requests) == 1  # the waiting ones never called the model


async def test_aborting_a_waiting_message_ends_it_without_touching_the_running_query(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("one", latency_ms=1000), text_reply("three")])
        session = await open_session(runtime, model)
        first, second, third = (session.query(prompt) for prompt in ("first", "second", "third"))
        second.abort()
        answers = [await consume(session, handle, model) for handle in (first, second, third)]
        assert answers[0].reason == "completed" and answers[2].reason == "completed"
        assert answers[1].handle.result is not None and answers[1].handle.result.subtype == "error_during_execution"
        assert [request.messages[-1]["content"][-1]["text"] for request in model.requests] == ["first", "third"]


async def test_a_host_wide_limit_caps_concurrent_model_calls(autojump_clock: trio.testing.MockClock) -> None:
    streaming = [0]
    peak = [0]

    class Counting(ScriptedModel):
        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            streaming[0] += 1
            peak[0] = max(peak[0], streaming[0])
            try:
                async with aclosing(super().stream(request)) as events:
                    async for event in events:
                        yield event
            finally:
                streaming[0] -= 1

    async with Runtime.open(max_concurrent_model_calls=2) as runtime:
        sessions = [
            (await open_session(runtime, model), model)
            for model in [Counting([text_reply(f"answer {i}", latency_ms=1000)]) for i in range(6)]
        ]
        results: list[Ran] = []

        async def one(session: Any, model: ScriptedModel) -> None:
            results.append(await consume(session, session.query("go"), model))

        async with trio.open_nursery() as nursery:
            for session, model in sessions:
                nursery.start_soon(one, session, model)
        assert peak[0] == 2
        assert sorted(r.reason for r in results) == ["completed"] * 6
        assert trio.current_time() == pytest.approx(3.0)  # six 1 s calls, two at a time
        for ran in results:
            await assert_settled(ran)


async def test_a_query_submitted_while_an_aborted_one_unwinds_runs_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply("the new request")])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)])
        first = session.query("first")
        await trio.sleep(1)  # the tool is running
        session.abort_nowait("interrupt")
        second = session.query("actually, do this")  # accepted at once: the first is aborting
        aborted = await consume(session, first, model)
        ran = await consume(session, second, model)
        assert aborted.reason == "aborted_tools"
        assert ran.reason == "completed" and ran.handle.result is not None
        assert ran.handle.result.result == "the new request"
        sent = model.requests[1].messages
        assert sent[-1]["content"][-1]["text"] == "actually, do this"
        assert sent[-2]["role"] == "assistant"  # roles alternate across the interrupted query
        await assert_settled(ran)


def test_invalid_options_are_refused_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="max_turns"):
        QueryOptions(max_turns=0)
    with pytest.raises(pydantic.ValidationError, match="no price known for model 'my-own-model'"):
        QueryOptions(model="my-own-model")
    with pytest.raises(pydantic.ValidationError, match="bogus"):
        QueryOptions(bogus=1)  # type: ignore[call-arg]
    assert QueryOptions(model="my-own-model", pricing=PRICE).model == "my-own-model"


async def test_sessions_are_isolated_an_abort_in_one_leaves_the_other_untouched(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        slow = ScriptedModel([tools_reply(tool_use("t", "slow")), text_reply()])
        calm = ScriptedModel([tools_reply(tool_use("t", "slow")), text_reply("calm done")])
        tools = [scripted_tool("slow", latency=5)]
        aborted_session = await open_session(runtime, slow, tools=tools)
        calm_session = await open_session(runtime, calm, tools=tools)
        aborted_handle = aborted_session.query("a")
        calm_handle = calm_session.query("b")
        results: dict[str, Any] = {}

        async def drain(name: str, session: Any, handle: Any, model: ScriptedModel) -> None:
            results[name] = await consume(session, handle, model)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain, "aborted", aborted_session, aborted_handle, slow)
            nursery.start_soon(drain, "calm", calm_session, calm_handle, calm)
            await trio.sleep(1)
            await aborted_session.abort("user")
        assert results["aborted"].reason == "aborted_tools"
        assert results["calm"].reason == "completed"
        assert results["calm"].handle.result.result == "calm done"
        for ran in results.values():
            await assert_settled(ran)


async def test_persistent_overload_switches_to_the_fallback_model(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [{"error": "overloaded"}] * 3 + [text_reply("From the fallback.")],
            max_retries=2,
            model="claude-sonnet-5-5",
            fallback_model="claude-haiku-5-5",
        )
        assert ran.reason == "completed"
        assert [r.model for r in ran.model.requests] == ["claude-sonnet-5-5"] * 3 + ["claude-haiku-5-5"]
        assert "system:model_fallback" in ran.labels
        assert ran.handle.transitions == []
        await assert_settled(ran)


async def test_a_call_cut_short_by_an_abort_keeps_the_usage_already_billed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel(
            [tools_reply(tool_use("t1", "slow"), usage={"input_tokens": 5000, "output_tokens": 100}, latency_ms=10_000)]
        )
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=60)], pricing=PRICE)
        handle = session.query("go")
        events = []
        async for event in handle:
            events.append(event)
            if isinstance(event, AssistantMessage):  # mid-stream: message_start was seen, message_stop not
                await session.abort("user")
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_streaming"
        result = ran.handle.result
        assert result is not None
        assert result.usage.input_tokens == 5000  # the input was billed when the stream started
        assert result.total_cost_usd == pytest.approx(5000 * 3.0 / 1e6 + 1 * 15.0 / 1e6)
        await assert_settled(ran)


async def test_closing_the_runtime_aborts_and_drains_every_running_query(
    autojump_clock: trio.testing.MockClock,
) -> None:
    handles = []
    async with Runtime.open() as runtime:
        for _ in range(3):
            model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply()])
            session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=3600)])
            handles.append(session.query("go"))
        await trio.sleep(1)  # every query has its tool running
    for handle in handles:  # the runtime is gone; what each query sent is still there to read
        events = [event async for event in handle]
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        assert events[-1].label == "result"
        results = [b for e in events if isinstance(e, UserMessage) and isinstance(e.content, list) for b in e.content]
        assert results[0]["tool_use_id"] == "t1" and results[0]["content"] == INTERRUPTED_BY_USER
    assert trio.current_time() < 10


async def test_an_abort_while_the_loop_waits_on_its_turn_ends_the_query_inside_the_abort_call() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply()])
        session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=3600)])
        handle = session.query("go")
        seen = []
        async for event in handle:
            seen.append(event)
            if isinstance(event, StreamEvent) and event.event["type"] == "message_stop":
                break
        await trio.testing.wait_all_tasks_blocked()  # the tool runs; the loop waits on its turn
        session.abort_nowait("user")
        # No task has run since the abort: what the consumer can take now was written by the abort's call.
        ready = list(handle._events.items)
        assert isinstance(ready[-1], ResultMessage) and ready[-1].subtype == "error_during_execution"
        assert session.live_tasks() > 0  # the cancelled tool still has to unwind: the stream has not ended
        rest = [event async for event in handle]
        assert session.live_tasks() == 0  # the stream ends once it has
        ran = Ran(session, handle, [*seen, *rest], model)
        assert ran.reason == "aborted_tools"
        assert ran.tool_results()["t1"]["content"] == INTERRUPTED_BY_USER
        assert ran.texts_of_user_events()[-1] == INTERRUPT_MESSAGE_FOR_TOOL_USE
        await assert_settled(ran)


async def test_an_abort_with_a_transcript_sends_the_result_only_once_the_log_is_flushed(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"

    async def slow(_: Any, ctx: Any) -> ToolOutput:
        await trio.sleep(0.01)
        await ctx.progress("working")  # reaches the consumer after the response's flush: the loop is waiting
        await trio.sleep(3600)
        return "never"

    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "slow")), text_reply()])
        options = QueryOptions(provider=model, tools=[Tool(name="slow", call=slow)])
        session = await runtime.open_session(options, transcript=path)
        handle = session.query("go")
        async for event in handle:
            if isinstance(event, ProgressEvent):
                break
        await trio.testing.wait_all_tasks_blocked()
        session.abort_nowait("user")
        ready = list(handle._events.items)
        assert ready and not any(isinstance(item, ResultMessage) for item in ready)  # the flush comes first
        async for event in handle:
            if isinstance(event, ResultMessage):
                on_disk = load_transcript(path).messages
                assert on_disk == await session.transcript()  # all of it, the interruption included
                assert transcript_problems(on_disk) == []
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        await session.close()


async def test_an_abort_while_a_slow_consumer_holds_the_stream_back_answers_every_tool_use_it_saw() -> None:
    # With room for one event, the stream waits for the consumer at every step; the abort comes after
    # each number of events read in turn, so it finds the stream stopped at each of its steps once (at 0, the
    # response's held start waits for the consumer: nothing of the stream may follow the result).
    async with Runtime.open() as runtime:
        for read_before_abort in range(16):
            model = ScriptedModel([tools_reply(tool_use("t1", "slow"), tool_use("t2", "slow"), text="Reading.")])
            session = await open_session(runtime, model, tools=[scripted_tool("slow", latency=3600)], event_buffer=1)
            handle = session.query("go")
            events = []
            async for event in handle:
                events.append(event)
                if len(events) == read_before_abort + 1:  # the `init` event, then as many as before it had
                    break
            await trio.testing.wait_all_tasks_blocked()
            session.abort_nowait("user")
            events += [event async for event in handle]
            ran = Ran(session, handle, events, model)
            seen_uses = [
                b["id"] for e in events if isinstance(e, AssistantMessage) for b in e.content if b["type"] == "tool_use"
            ]
            assert sorted(ran.tool_results()) == sorted(seen_uses), read_before_abort
            await assert_settled(ran)
            await session.close()


async def test_effort_reaches_the_querys_calls_and_not_the_runtimes_summaries() -> None:
    summaries = ScriptedModel([text_reply("Read a file.")], repeat=True)
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "read")), text_reply("done")],
            tools=[scripted_tool("read", result="x")],
            effort="high",
            tool_use_summaries=True,
            summary_provider=summaries,
        )
        assert ran.reason == "completed"
    assert [r.effort for r in ran.model.requests] == ["high", "high"]
    assert [r.effort for r in summaries.requests] == [None]
    assert [r.purpose for r in summaries.requests] == ["summary"]


class StartsThenStalls:
    """A provider whose response starts (`message_start`, 1,234 input tokens) and then sends nothing more."""

    def __init__(self) -> None:
        self.started = trio.Event()

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        usage = {"input_tokens": 1_234, "output_tokens": 1}
        message = {"id": "msg_1", "type": "message", "role": "assistant", "model": request.model, "content": []}
        yield {"type": "message_start", "message": {**message, "usage": usage}}
        self.started.set()
        await trio.sleep_forever()
        yield {}  # unreachable: makes this an async generator


async def test_an_abort_before_a_responses_first_content_shows_its_held_start_and_bills_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A response's `message_start` is held back until its next event (a failure before then is retried
    unseen); an abort meanwhile shows it before the query's end, as the spend it reported is billed."""
    provider = StartsThenStalls()
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=provider, pricing=PRICE))
        handle = session.query("go")
        events = []
        async with trio.open_nursery() as nursery:

            async def abort_once_started() -> None:
                await provider.started.wait()
                await session.abort("user")

            nursery.start_soon(abort_once_started)
            events = [event async for event in handle]
        assert handle.terminal is not None and handle.terminal.reason == "aborted_streaming"
        starts = [e for e in events if isinstance(e, StreamEvent) and e.event["type"] == "message_start"]
        assert len(starts) == 1 and starts[0].event["message"]["usage"]["input_tokens"] == 1_234
        assert events.index(starts[0]) < len(events) - 1 and events[-1].label == "result"
        assert handle.result is not None and handle.result.usage.input_tokens == 1_234
        assert session.live_tasks() == 0
