"""Context and budget end to end: the Compactor, BudgetGuard's token budget, the ToolUseSummarizer, on real actors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from queryloop import Runtime
from queryloop.runtime.loop.context import CLEARED_TOOL_RESULT, COMPACT_INSTRUCTIONS, COMPACT_SUMMARY_PREFIX
from queryloop.runtime.loop.events import AssistantMessage, SystemMessage, ToolUseSummaryEvent, UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.spill import spill_file_name
from queryloop.runtime.loop.state import State, stop_hook_blocking
from queryloop.runtime.loop.transcript import transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import Ran, assert_settled, consume, scripted_tool, text_reply, tool_use, tools_reply

PTL = {"error": "prompt_too_long"}

# A small window with explicit buffers, so that a few tool rounds cross the thresholds:
# effective 9,000; autocompact at 8,000; warning (microcompact, collapse staging) from 1,000; blocking at 8,500.
SMALL_WINDOW: dict[str, Any] = {
    "context_window": 10_000,
    "max_output_tokens": 1_000,
    "escalated_max_output_tokens": 1_000,
    "autocompact_buffer_tokens": 1_000,
    "warning_buffer_tokens": 7_000,
    "blocking_buffer_tokens": 500,
}


def summary_model(*texts: str) -> ScriptedModel:
    return ScriptedModel([text_reply(t) for t in texts], name="compactor")


async def run(
    runtime: Runtime, entries: list[dict[str, Any]], *, compactor: ScriptedModel | None = None, **options: Any
) -> Ran:
    model = ScriptedModel(entries)
    session = await runtime.open_session(
        QueryOptions(provider=model, compact_provider=compactor or summary_model("unused"), **options)
    )
    return await consume(session, session.query("Fix the bug"), model)


def rounds(count: int, size: int = 2_000) -> list[dict[str, Any]]:
    return [tools_reply(tool_use(f"t{i}", "read"), text=f"round {i}") for i in range(count)]


async def test_collapse_drain_retry_commits_staged_collapses_and_retries() -> None:
    async with Runtime.open() as runtime:
        compactor = summary_model("unused")
        ran = await run(
            runtime,
            [*rounds(3), PTL, text_reply("Done.")],
            compactor=compactor,
            tools=[scripted_tool("read", result="x" * 2_000)],
            auto_compact=False,
            collapse_keep_recent_rounds=1,
            **SMALL_WINDOW,
        )
        assert ran.reason == "completed"
        assert ran.handle.transitions == ["next_turn"] * 3 + ["collapse_drain_retry"]
        retry = ran.model.requests[-1]
        texts = [b.get("text", "") for m in retry.messages for b in m["content"] if b["type"] == "text"]
        assert any(t.startswith("[Collapsed") for t in texts)  # the older rounds went into one note
        assert compactor.requests == []  # collapse is the lighter remedy: no compaction call
        await assert_settled(ran)


async def test_collapse_drain_is_never_tried_twice_in_a_row_then_reactive_compact() -> None:
    async with Runtime.open() as runtime:
        compactor = summary_model("What happened so far.")
        ran = await run(
            runtime,
            [*rounds(3), PTL, PTL, text_reply("Done.")],
            compactor=compactor,
            tools=[scripted_tool("read", result="x" * 2_000)],
            auto_compact=False,
            collapse_keep_recent_rounds=1,
            **SMALL_WINDOW,
        )
        assert ran.handle.transitions[-2:] == ["collapse_drain_retry", "reactive_compact_retry"]
        assert len(compactor.requests) == 1
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_reactive_compact_retry_compacts_once_and_sends_only_the_summary_onwards() -> None:
    async with Runtime.open() as runtime:
        compactor = summary_model("The user asked to fix a bug; a file was read.")
        ran = await run(
            runtime,
            [tools_reply(tool_use("t1", "read")), PTL, text_reply("Fixed.")],
            compactor=compactor,
            tools=[scripted_tool("read")],
            context_collapse=False,
        )
        assert ran.handle.transitions == ["next_turn", "reactive_compact_retry"]
        assert len(compactor.requests) == 1
        boundary = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "compact_boundary"]
        assert len(boundary) == 1 and boundary[0].data["trigger"] == "reactive"
        retry = ran.model.requests[-1]
        assert len(retry.messages) == 1  # only what follows the boundary: the summary
        assert retry.messages[0]["content"][0]["text"].startswith(COMPACT_SUMMARY_PREFIX)
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_reactive_compact_is_single_fire_and_prompt_too_long_surfaces() -> None:
    async with Runtime.open() as runtime:
        compactor = summary_model("summary", "a second summary that must not be asked for")
        ran = await run(runtime, [PTL, PTL, text_reply()], compactor=compactor, context_collapse=False)
        assert ran.reason == "prompt_too_long"
        assert ran.handle.transitions == ["reactive_compact_retry"]
        assert len(compactor.requests) == 1
        assert len(ran.model.requests) == 2
        errors = [e for e in ran.events if isinstance(e, AssistantMessage) and e.is_api_error]
        assert errors[-1].content[0]["text"] == "Prompt is too long"
        assert ran.handle.result is not None and ran.handle.result.is_error
        await assert_settled(ran)


async def test_production_incident_stop_hook_blocking_never_allows_a_second_reactive_compact() -> None:
    """Claude Code's production incident: compact → still too long → stop hook blocks → (no) compact again → ..."""
    from queryloop.runtime.loop.hooks import HookDecision, StopHookInput

    async def always_blocks(_: StopHookInput) -> HookDecision:
        return HookDecision(blocking_error="tests still fail")

    async with Runtime.open() as runtime:
        compactor = summary_model("first summary", "second summary", "third summary")
        ran = await run(
            runtime,
            [PTL, text_reply("I think it is done."), PTL, PTL, PTL],
            compactor=compactor,
            context_collapse=False,
            stop_hooks=[always_blocks],
        )
        assert ran.reason == "prompt_too_long"
        assert ran.handle.transitions == ["reactive_compact_retry", "stop_hook_blocking"]
        assert len(compactor.requests) == 1  # exactly one compaction call
        assert len(ran.model.requests) == 3
        await assert_settled(ran)


def test_stop_hook_blocking_keeps_the_reactive_compact_guard_set_by_a_compaction() -> None:
    state = State(messages=[], has_attempted_reactive_compact=True, max_output_tokens_recovery_count=2)
    after = stop_hook_blocking(state, [], [], [UserMessage(content="hook says no", is_meta=True)])
    assert after.has_attempted_reactive_compact is True
    assert after.max_output_tokens_recovery_count == 0


async def test_prompt_too_long_surfaces_at_once_without_collapse_or_reactive_compact() -> None:
    async with Runtime.open() as runtime:
        compactor = summary_model("unused")
        ran = await run(
            runtime, [PTL, text_reply()], compactor=compactor, context_collapse=False, reactive_compact=False
        )
        assert ran.reason == "prompt_too_long"
        assert ran.handle.transitions == []
        assert compactor.requests == []
        await assert_settled(ran)


async def test_blocking_limit_is_preemptive_when_autocompact_is_off() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply()])
        session = await runtime.open_session(
            QueryOptions(provider=model, auto_compact=False, compact_provider=summary_model(), **SMALL_WINDOW)
        )
        ran = await consume(session, session.query("x" * 40_000), model)  # ~10,000 tokens > 8,500
        assert ran.reason == "blocking_limit"
        assert model.requests == []  # no round-trip for a guaranteed 413
        errors = [e for e in ran.events if isinstance(e, AssistantMessage) and e.is_api_error]
        assert errors[0].content[0]["text"] == "Prompt is too long"
        await assert_settled(ran)


async def test_blocking_limit_does_not_apply_when_autocompact_and_reactive_compact_are_on() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Answered.")])
        compactor = summary_model("The user sent a very long message.")
        session = await runtime.open_session(QueryOptions(provider=model, compact_provider=compactor, **SMALL_WINDOW))
        ran = await consume(session, session.query("x" * 40_000), model)
        assert ran.reason == "completed"
        assert len(compactor.requests) == 1  # autocompact took care of it instead
        await assert_settled(ran)


async def test_autocompact_fires_at_the_threshold_and_later_queries_send_only_after_the_boundary() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([*rounds(6), text_reply("Done."), text_reply("Second answer.")])
        compactor = summary_model("Six files were read.")
        session = await runtime.open_session(
            QueryOptions(
                provider=model,
                compact_provider=compactor,
                tools=[scripted_tool("read", result="y" * 6_000)],
                microcompact_keep_recent=100,
                context_collapse=False,
                **SMALL_WINDOW,
            )
        )
        ran = await consume(session, session.query("Read everything"), model)
        assert ran.reason == "completed"
        assert len(compactor.requests) >= 1
        assert compactor.requests[0].purpose == "compact"
        boundaries = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "compact_boundary"]
        assert boundaries and boundaries[0].data["trigger"] == "auto"
        transcript = await session.transcript()
        assert transcript_problems(transcript) == []
        second = await consume(session, session.query("And now?"), model)
        sent = model.requests[-1].messages
        assert sent[0]["content"][0]["text"].startswith(COMPACT_SUMMARY_PREFIX)
        assert all("y" * 6_000 not in str(m) for m in sent)  # nothing from before the boundary
        await assert_settled(second)


async def test_oversized_tool_results_are_persisted_with_a_preview_and_their_path(tmp_path: Path) -> None:
    big = "line of output\n" * 5_000
    async with Runtime.open() as runtime:
        ran = await run(
            runtime,
            [tools_reply(tool_use("big", "dump")), text_reply()],
            tools=[scripted_tool("dump", result=big)],
            max_tool_result_chars=10_000,
            tool_result_preview_chars=100,
            session_dir=tmp_path,
        )
        sent = ran.model.requests[1].messages[-1]["content"][0]
        assert sent["type"] == "tool_result" and sent["tool_use_id"] == "big"
        assert sent["content"].startswith("<persisted-output>")
        saved = tmp_path / "tool-results" / spill_file_name("big")
        assert str(saved) in sent["content"]
        assert saved.read_text() == big
        assert len(sent["content"]) < 500
        await assert_settled(ran)


async def test_microcompact_clears_old_tool_results_past_the_warning_threshold() -> None:
    async with Runtime.open() as runtime:
        ran = await run(
            runtime,
            [*rounds(4), text_reply()],
            tools=[scripted_tool("read", result="z" * 2_000)],
            microcompact_keep_recent=2,
            auto_compact=False,
            context_collapse=False,
            **{**SMALL_WINDOW, "blocking_buffer_tokens": 0},
        )
        last = ran.model.requests[-1].messages
        results = [b for m in last for b in m["content"] if b["type"] == "tool_result"]
        assert [r["content"] == CLEARED_TOOL_RESULT for r in results] == [True, True, False, False]
        assert [r["tool_use_id"] for r in results] == ["t0", "t1", "t2", "t3"]  # pairing intact
        await assert_settled(ran)


async def test_token_budget_continuation_nudges_until_ninety_percent_then_completes() -> None:
    usage = {"input_tokens": 100, "output_tokens": 300}
    async with Runtime.open() as runtime:
        ran = await run(
            runtime,
            [text_reply("part", usage=usage), text_reply("more", usage=usage), text_reply("done", usage=usage)],
            token_budget=1_000,
        )
        assert ran.handle.transitions == ["token_budget_continuation", "token_budget_continuation"]
        nudges = [e for e in ran.events if isinstance(e, UserMessage) and e.is_meta]
        assert [n.content for n in nudges] == [
            "Stopped at 30% of token target (300 / 1,000). Keep working \u2014 do not summarize.",
            "Stopped at 60% of token target (600 / 1,000). Keep working \u2014 do not summarize.",
        ]
        completion = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "token_budget"]
        assert completion[0].data["pct"] == 90 and completion[0].data["continuation_count"] == 2
        assert ran.reason == "completed"
        await assert_settled(ran)


async def test_task_budget_is_sent_and_its_remainder_falls_on_compaction() -> None:
    async with Runtime.open() as runtime:
        compactor = summary_model("summary")
        ran = await run(runtime, [PTL, text_reply()], compactor=compactor, context_collapse=False, task_budget=50_000)
        first, retry = ran.model.requests
        assert first.task_budget == {"total": 50_000}
        assert retry.task_budget is not None and retry.task_budget["total"] == 50_000
        assert retry.task_budget["remaining"] < 50_000
        await assert_settled(ran)


async def _timed_run(summaries: bool) -> tuple[float, list[Any]]:
    async with Runtime.open() as runtime:
        start = trio.current_time()
        model = ScriptedModel(
            [tools_reply(tool_use("t1", "read"), latency_ms=1_000), text_reply("Done.", latency_ms=1_000)]
        )
        summarizer = ScriptedModel([text_reply("Read a file", latency_ms=1_000)], name="summarizer")
        session = await runtime.open_session(
            QueryOptions(
                provider=model, tools=[scripted_tool("read")], tool_use_summaries=summaries, summary_provider=summarizer
            )
        )
        ran = await consume(session, session.query("go"), model)
        await assert_settled(ran)
        return trio.current_time() - start, ran.events


async def test_summary_as_slow_as_the_next_model_call_adds_no_wall_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with_summary, events = await _timed_run(summaries=True)
    without_summary, _ = await _timed_run(summaries=False)
    assert with_summary == without_summary == 2.0
    summaries = [e for e in events if isinstance(e, ToolUseSummaryEvent)]
    assert [(s.summary, s.preceding_tool_use_ids) for s in summaries] == [("Read a file", ["t1"])]


class _Broken:
    """A summary provider that always fails."""

    async def stream(self, request: Any) -> Any:
        raise RuntimeError("the summary model is down")
        yield {}  # pragma: no cover - makes this an async generator


async def test_summary_failure_costs_the_summary_never_the_loop() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "read")), text_reply("Done.")])
        session = await runtime.open_session(
            QueryOptions(
                provider=model, tools=[scripted_tool("read")], tool_use_summaries=True, summary_provider=_Broken()
            )
        )
        ran = await consume(session, session.query("go"), model)
        assert ran.reason == "completed"
        assert not [e for e in ran.events if isinstance(e, ToolUseSummaryEvent)]
        await assert_settled(ran)


async def test_abort_during_compaction_cancels_it_and_ends_aborted(autojump_clock: trio.testing.MockClock) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([PTL, text_reply()])
        compactor = ScriptedModel([text_reply("slow summary", latency_ms=60_000)], name="compactor")
        session = await runtime.open_session(
            QueryOptions(provider=model, compact_provider=compactor, context_collapse=False)
        )
        handle = session.query("go")

        async def abort_soon() -> None:
            await trio.sleep(5)  # the compaction is under way
            await session.abort("user")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abort_soon)
            ran = await consume(session, handle, model)
        assert ran.reason == "aborted_streaming"
        assert len(compactor.requests) == 1 and trio.current_time() < 60
        assert ran.handle.transitions == []
        await assert_settled(ran)


def _api_valid(messages: list[dict[str, Any]]) -> bool:
    """What the Messages API checks: alternation from a user message, every tool_use answered next."""
    if not messages or messages[0]["role"] != "user":
        return False
    for index, message in enumerate(messages):
        if index and messages[index - 1]["role"] == message["role"]:
            return False
        if message["role"] == "assistant":
            uses = {b["id"] for b in message["content"] if b["type"] == "tool_use"}
            following = messages[index + 1]["content"] if index + 1 < len(messages) else []
            answered = {b["tool_use_id"] for b in following if b["type"] == "tool_result"}
            if uses != answered:
                return False
    return True


async def test_two_hundred_turns_with_large_tool_results_stay_inside_the_window() -> None:
    turns = 200
    async with Runtime.open() as runtime:
        model = ScriptedModel([*rounds(turns), text_reply("All done.")])
        compactor = ScriptedModel([text_reply("Summary of the work so far.")], name="compactor", repeat=True)
        session = await runtime.open_session(
            QueryOptions(
                provider=model,
                compact_provider=compactor,
                tools=[scripted_tool("read", result="r" * 8_000)],
                microcompact_keep_recent=12,
                context_window=30_000,
                max_output_tokens=2_000,
                escalated_max_output_tokens=2_000,
                autocompact_buffer_tokens=4_000,
                warning_buffer_tokens=6_000,
            )
        )
        ran = await consume(session, session.query("Process every file"), model)
        assert ran.reason == "completed"
        assert ran.handle.transitions.count("next_turn") == turns
        assert len(compactor.requests) >= 5  # it had to compact many times
        window = 30_000
        for request in model.requests:
            assert _api_valid(request.messages)
            assert sum(len(str(m)) for m in request.messages) // 4 < window
        assert transcript_problems(await session.transcript()) == []
        await assert_settled(ran)


async def test_a_host_wide_budget_guard_caps_the_sum_over_sessions() -> None:
    from queryloop.runtime.loop.pricing import Pricing

    price = Pricing(input=3.0, output=15.0, cache_write=3.75, cache_read=0.3)
    usage = {"input_tokens": 100_000, "output_tokens": 0}  # $0.30 a call
    async with Runtime.open() as runtime:
        host = await runtime.open_host_budget(max_budget_usd=0.5)
        first_model = ScriptedModel([text_reply("one", usage=usage)])
        second_model = ScriptedModel([tools_reply(tool_use("t", "read"), usage=usage), text_reply("never")])
        first = await runtime.open_session(QueryOptions(provider=first_model, pricing=price, max_budget_usd=10))
        second = await runtime.open_session(
            QueryOptions(provider=second_model, pricing=price, max_budget_usd=10, tools=[scripted_tool("read")])
        )
        ran_first = await consume(first, first.query("a"), first_model)
        ran_second = await consume(second, second.query("b"), second_model)
        assert ran_first.reason == "completed"  # $0.30 of $0.50
        assert ran_second.reason == "max_budget_usd"  # $0.60: the host's cap, not its own $10
        assert ran_second.handle.result is not None
        assert ran_second.handle.result.errors == [
            "Reached maximum budget (a shared cap: the host's or a parent query's)"
        ]
        assert len(second_model.requests) == 1
        assert await host.proxy().session_cost_usd == pytest.approx(0.6, abs=1e-4)
        assert await runtime.host_cost_usd() == pytest.approx(0.6, abs=1e-4)
        await assert_settled(ran_second)


def test_the_asyncio_and_blocking_hosts_open_a_host_wide_budget_guard_too() -> None:
    """The host budget from asyncio and from sync code: the second session's call passes the summed cap."""
    import asyncio

    from queryloop import BlockingRuntime
    from queryloop.aio import AsyncioRuntime
    from queryloop.runtime.loop.pricing import Pricing

    price = Pricing(input=3.0, output=15.0, cache_write=3.75, cache_read=0.3)
    usage = {"input_tokens": 100_000, "output_tokens": 0}  # $0.30 a call

    def options() -> list[QueryOptions]:
        replies = [[text_reply("one", usage=usage)], [tools_reply(tool_use("t", "read"), usage=usage), text_reply("x")]]
        tools = [scripted_tool("read")]
        return [QueryOptions(provider=ScriptedModel(r), pricing=price, max_budget_usd=10, tools=tools) for r in replies]

    async def on_asyncio() -> tuple[list[str], float, float]:
        async with AsyncioRuntime.open() as rt:
            before = await rt.host_cost_usd()
            await rt.open_host_budget(0.5)
            reasons: list[str] = []
            for opts in options():
                query = (await rt.open_session(opts)).query("go")
                await query.wait()
                assert query.terminal is not None
                reasons.append(query.terminal.reason)
            return reasons, before, await rt.host_cost_usd()

    with BlockingRuntime() as rt:
        rt.open_host_budget(0.5)
        blocking: list[str] = []
        for opts in options():
            query = rt.open_session(opts).query("go")
            query.wait()
            assert query.terminal is not None
            blocking.append(query.terminal.reason)
        spent = rt.host_cost_usd()
    reasons, before, spent_on_asyncio = asyncio.run(on_asyncio())
    assert reasons == blocking == ["completed", "max_budget_usd"] and before == 0.0
    assert spent == pytest.approx(0.6, abs=1e-4) and spent_on_asyncio == pytest.approx(0.6, abs=1e-4)


async def test_compact_instructions_follow_the_runtimes_own_in_the_compaction_request() -> None:
    async with Runtime.open() as runtime:
        plain, told = summary_model("Summary."), summary_model("Summary, with the file names.")
        for compactor, extra in ((plain, {}), (told, {"compact_instructions": "  Keep every file name.  "})):
            ran = await run(runtime, [PTL, text_reply("Fixed.")], compactor=compactor, context_collapse=False, **extra)
            assert ran.handle.transitions == ["reactive_compact_retry"] and ran.reason == "completed"
    asked = [request.messages[-1]["content"] for request in (plain.requests[0], told.requests[0])]
    texts = [c if isinstance(c, str) else c[-1]["text"] for c in asked]  # the last block: the prompt's merged before
    assert texts[0] == COMPACT_INSTRUCTIONS
    assert texts[1] == f"{COMPACT_INSTRUCTIONS}\n\nAdditional Instructions:\nKeep every file name."


async def test_autocompact_circuit_breaker_stops_after_three_failures_and_resets_for_the_next_query() -> None:
    """Claude Code keeps the failures in the loop's `autoCompactTracking`, "always undefined on the first
    iteration": three failed autocompactions in a row stop a query from trying again, and the
    session's next query tries afresh."""
    async with Runtime.open() as runtime:
        model = ScriptedModel([*rounds(5), text_reply("Done."), text_reply("Second answer.")])
        compactor = ScriptedModel([{"error": "api_error"}] * 10, name="compactor")
        session = await runtime.open_session(
            QueryOptions(
                provider=model,
                compact_provider=compactor,
                tools=[scripted_tool("read")],
                max_retries=0,
                context_collapse=False,
                **SMALL_WINDOW,
            )
        )
        big = "x" * 40_000  # above the autocompact threshold from the first turn on
        first = await consume(session, session.query(big), model)
        assert first.reason == "completed"
        assert len(model.requests) == 6  # every turn went on uncompacted
        assert len(compactor.requests) == 3  # turns 1-3 tried and failed; turns 4-6 did not try
        second = await consume(session, session.query("And now?"), model)
        assert second.reason == "completed"
        assert len(compactor.requests) == 4  # a new query: its first turn tries again
        await assert_settled(second)


@pytest.mark.parametrize(
    ("failure", "max_retries", "compactions_asked", "compacted"),
    [
        ({"error": "overloaded"}, 2, 2, True),  # retried after its backoff, as the query's own calls are
        ({"error": "overloaded"}, 0, 1, False),  # the query's max_retries bounds it
        ({"error": "prompt_too_long"}, 2, 1, False),  # not a kind that sending again can cure
    ],
    ids=["overloaded_is_retried", "within_max_retries", "prompt_too_long_is_not"],
)
async def test_a_compaction_request_is_retried_as_a_model_call_is(
    autojump_clock: trio.testing.MockClock,
    failure: dict[str, Any],
    max_retries: int,
    compactions_asked: int,
    compacted: bool,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Answered.")])
        compactor = ScriptedModel([failure, text_reply("The user sent a very long message.")], name="compactor")
        session = await runtime.open_session(
            QueryOptions(provider=model, compact_provider=compactor, max_retries=max_retries, **SMALL_WINDOW)
        )
        ran = await consume(session, session.query("x" * 40_000), model)  # over the autocompact threshold
        assert ran.reason == "completed"
        assert len(compactor.requests) == compactions_asked
        boundaries = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "compact_boundary"]
        assert bool(boundaries) == compacted
        sent = model.requests[0].messages[0]["content"][0]["text"]
        assert sent.startswith(COMPACT_SUMMARY_PREFIX) == compacted
        await assert_settled(ran)
