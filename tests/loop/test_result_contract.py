"""Claude Code 2.1's result contract, as the Agent SDK reads it: `terminal_reason` in Claude Code's vocabulary,
`session_id` and `uuid` on every event, `model_usage` per model (subagents, summaries and compactions included)
with `usage` the main loop's own calls, `duration_api_ms`, `api_error_status`, the `system` `init` event each
query opens with; and one trace for a parent query and its subagents."""

from __future__ import annotations

from typing import Any, get_args

import pytest
import trio
import trio.testing

from queryloop import (
    AgentDefinition,
    QueryOptions,
    ResultMessage,
    Runtime,
    ScriptedModel,
    StreamEvent,
    SystemMessage,
)
from queryloop.runtime.loop.decisions import claude_code_terminal_reason, result_is_error, result_subtype
from queryloop.runtime.loop.events import ClaudeCodeTerminalReason
from queryloop.runtime.loop.state import TerminalReason
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import assert_settled, run_query, scripted_tool, text_reply, tool_use, tools_reply

EXPLORER = AgentDefinition(description="Explores", prompt="You explore.", model="claude-haiku-5-5")


def usage(tokens: int, output: int = 10) -> dict[str, int]:
    return {"input_tokens": tokens, "output_tokens": output}


def two_subagents() -> ByPrompt:
    return ByPrompt(
        {
            "Explore": [
                tools_reply(agent_call("call_a", "explorer", "area a"), agent_call("call_b", "explorer", "area b")),
                text_reply("Both explored.", usage=usage(300)),
            ],
            "area a": [text_reply("a explored", usage=usage(1000))],
            "area b": [text_reply("b explored", usage=usage(2000))],
        }
    )


# -- terminal_reason --------------------------------------------------------------------------------


def test_terminal_reason_has_claude_codes_nineteen_values() -> None:
    assert len(get_args(ClaudeCodeTerminalReason)) == 19
    assert {"background_requested", "tool_deferred_unavailable", "rapid_refill_breaker"} <= set(
        get_args(ClaudeCodeTerminalReason)
    )


def test_terminal_reason_maps_every_runtime_reason_into_claude_codes_vocabulary() -> None:
    vocabulary = set(get_args(ClaudeCodeTerminalReason))
    for reason in get_args(TerminalReason):
        assert claude_code_terminal_reason(reason) in vocabulary, reason
    assert claude_code_terminal_reason("max_budget_usd") == "budget_exhausted"
    assert claude_code_terminal_reason("max_structured_output_retries") == "structured_output_retry_exhausted"
    assert claude_code_terminal_reason("api_error") == "api_error"
    assert claude_code_terminal_reason("model_error") == "model_error"  # a model that cannot be used
    assert claude_code_terminal_reason("completed") == "completed"


def test_terminal_reason_api_error_is_a_success_subtype_that_is_an_error() -> None:
    """The Python SDK's rule: an API-error ending has `subtype: "success"`, `is_error` and `api_error`."""
    assert result_subtype("api_error") == "success" and result_is_error("api_error", False)


async def test_terminal_reason_of_a_completed_query_is_completed(runtime: Runtime) -> None:
    ran = await run_query(runtime, [text_reply("Done.")])
    assert ran.handle.result is not None and ran.handle.result.terminal_reason == "completed"
    await assert_settled(ran)


async def test_terminal_reason_of_a_spent_budget_is_budget_exhausted(runtime: Runtime) -> None:
    entries = [tools_reply(tool_use("t1", "noop"), usage=usage(100_000)), text_reply("never")]
    ran = await run_query(runtime, entries, tools=[scripted_tool("noop")], max_budget_usd=0.001)
    result = ran.handle.result
    assert ran.reason == "max_budget_usd" and result is not None
    assert result.terminal_reason == "budget_exhausted"
    assert (result.subtype, result.is_error) == ("error_max_budget_usd", True)


# -- api_error_status -------------------------------------------------------------------------------


async def test_api_error_status_is_the_http_status_of_the_error_the_query_ended_on(runtime: Runtime) -> None:
    ran = await run_query(runtime, [{"error": "api_error"}], max_retries=0)
    result = ran.handle.result
    assert result is not None and ran.reason == "api_error"
    assert (result.terminal_reason, result.subtype, result.is_error) == ("api_error", "success", True)
    assert result.api_error_status == 500


async def test_api_error_status_is_none_for_a_query_that_recovered_from_its_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [{"error": "overloaded"}, text_reply("Done.")])
    result = ran.handle.result
    assert result is not None and result.terminal_reason == "completed" and result.api_error_status is None


# -- session_id and uuid ----------------------------------------------------------------------------


async def test_every_event_carries_the_sessions_id_and_a_uuid_of_its_own(runtime: Runtime) -> None:
    entries = [tools_reply(tool_use("t1", "noop")), text_reply("Done.")]
    ran = await run_query(runtime, entries, tools=[scripted_tool("noop")])
    kinds = {type(event) for event in ran.events}
    assert StreamEvent in kinds and ResultMessage in kinds
    assert {event.session_id for event in ran.events} == {ran.session.id}
    uuids = [event.uuid for event in ran.events]
    assert all(uuids) and len(set(uuids)) == len(uuids)
    assert ran.events[-1].model_dump(mode="json")["session_id"] == ran.session.id


async def test_a_subagents_events_carry_the_sessions_id() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=two_subagents(), agents={"explorer": EXPLORER}))
        events = [event async for event in session.query("Explore")]
    children = [event for event in events if getattr(event, "parent_tool_use_id", None) is not None]
    assert {event.parent_tool_use_id for event in children} == {"call_a", "call_b"}  # type: ignore[union-attr]
    assert {event.session_id for event in events} == {session.id}


# -- model_usage and usage --------------------------------------------------------------------------


async def test_model_usage_lists_each_model_subagents_included_and_sums_to_the_total_cost() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=two_subagents(), agents={"explorer": EXPLORER}))
        result = await session.query("Explore").wait()
    main, child = result.model_usage["claude-sonnet-5-5"], result.model_usage["claude-haiku-5-5"]
    assert set(main) == {
        "inputTokens",
        "outputTokens",
        "cacheReadInputTokens",
        "cacheCreationInputTokens",
        "webSearchRequests",
        "costUSD",
        "contextWindow",
        "maxOutputTokens",
    }
    assert child["inputTokens"] == 3000 and child["outputTokens"] == 20
    assert main["contextWindow"] == 1_000_000 and main["maxOutputTokens"] == 8000
    assert sum(m["costUSD"] for m in result.model_usage.values()) == pytest.approx(result.total_cost_usd)


async def test_usage_counts_the_main_loops_own_calls_only_as_claude_code_does() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=two_subagents(), agents={"explorer": EXPLORER}))
        result = await session.query("Explore").wait()
    main = result.model_usage["claude-sonnet-5-5"]
    assert result.usage.input_tokens == main["inputTokens"]  # the subagents' 3000 are not in it
    assert sum(a.usage.input_tokens for a in result.usage_by_agent.values()) == 3000
    assert result.total_cost_usd > main["costUSD"]


async def test_model_usage_includes_the_tool_use_summaries_model(runtime: Runtime) -> None:
    entries = [tools_reply(tool_use("t1", "noop"), usage=usage(100)), text_reply("Done.", latency_ms=50)]
    summary = [text_reply("Ran noop", usage=usage(40))]
    ran = await run_query(
        runtime,
        entries,
        tools=[scripted_tool("noop")],
        tool_use_summaries=True,
        small_model="claude-haiku-4-5",
        summary_provider=ScriptedModel(summary),
    )
    result = ran.handle.result
    assert result is not None and "tool_use_summary" in ran.labels
    assert result.model_usage["claude-haiku-4-5"]["inputTokens"] == 40
    assert result.model_usage["claude-haiku-4-5"]["contextWindow"] == 200_000
    # A summary's tokens are not the main loop's.
    assert result.usage.input_tokens == result.model_usage["claude-sonnet-5-5"]["inputTokens"]


# -- duration_api_ms --------------------------------------------------------------------------------


async def test_duration_api_ms_sums_the_querys_api_calls_retries_included(
    autojump_clock: trio.testing.MockClock,
) -> None:
    entries: list[dict[str, Any]] = [
        {"error": "overloaded"},
        tools_reply(tool_use("t1", "noop"), latency_ms=200),
        text_reply("Done.", latency_ms=300),
    ]
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, entries, tools=[scripted_tool("noop")])
    result = ran.handle.result
    assert result is not None and result.terminal_reason == "completed"
    assert 500 <= result.duration_api_ms < 520  # the retry's backoff is not API time


async def test_duration_api_ms_includes_the_subagents_calls(autojump_clock: trio.testing.MockClock) -> None:
    provider = ByPrompt(
        {
            "Explore": [tools_reply(agent_call("call_a", "explorer", "area a")), text_reply("Done.")],
            "area a": [text_reply("a explored", latency_ms=400)],
        }
    )
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=provider, agents={"explorer": EXPLORER}))
        result = await session.query("Explore").wait()
    assert result.duration_api_ms >= 400


# -- the system init event --------------------------------------------------------------------------


async def test_each_query_opens_with_a_system_init_event_as_the_sdks(runtime: Runtime) -> None:
    ran = await run_query(runtime, [text_reply("Done.")], tools=[scripted_tool("noop")], permission_mode="plan")
    init = ran.events[0]
    assert isinstance(init, SystemMessage) and init.subtype == "init"
    assert init.data["session_id"] == ran.session.id == init.session_id
    assert init.data["model"] == "claude-sonnet-5-5" and init.data["tools"] == ["noop"]
    assert init.data["mcp_servers"] == [] and init.data["permissionMode"] == "plan" and init.data["cwd"]
    assert [event.label for event in ran.events].count("system:init") == 1
    second = [event async for event in ran.session.query("again")]
    assert second[0].label == "system:init"
    # A notice for the host, not the conversation: the transcript has no init.
    assert all(getattr(m, "subtype", None) != "init" for m in await ran.session.transcript())


async def test_a_subagents_query_opens_with_no_init_event_of_its_own() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=two_subagents(), agents={"explorer": EXPLORER}))
        events = [event async for event in session.query("Explore")]
    assert [event.label for event in events].count("system:init") == 1


# -- one trace --------------------------------------------------------------------------------------


async def test_the_spans_of_a_parent_query_and_its_two_subagents_form_one_trace() -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from queryloop.runtime import telemetry

    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry.use(tracer_provider=tracer_provider)
    try:
        async with Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=two_subagents(), agents={"explorer": EXPLORER}))
            result = await session.query("Explore").wait()
    finally:
        telemetry.use()
        tracer_provider.shutdown()
    assert result.terminal_reason == "completed"
    spans = exporter.get_finished_spans()
    queries = [s for s in spans if s.name.startswith("invoke_agent")]
    assert len(queries) == 3
    assert len({s.context.trace_id for s in spans}) == 1  # one trace: the parent's
    (parent,) = [s for s in queries if s.parent is None]
    children = [s for s in queries if s.parent is not None]
    assert len(children) == 2
    by_id = {s.context.span_id: s for s in spans}
    for child in children:  # each subagent's query hangs from an Agent tool call of the parent's query
        assert child.parent is not None
        tool_call = by_id[child.parent.span_id]
        assert tool_call.name.startswith("execute_tool")
        assert tool_call.parent is not None and tool_call.parent.span_id == parent.context.span_id
