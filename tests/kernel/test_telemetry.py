"""OpenTelemetry (`queryloop.runtime.telemetry`): a scripted query's spans and metrics, recorded by the SDK's
in-memory exporter and reader through providers injected with `telemetry.use` (the API's global providers are
never set, so no other test sees any); their parents (the host's span, `TRACEPARENT`); and nothing at all, without
error, while telemetry is off."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from queryloop import HookJSONOutput, HookMatcher, Runtime
from queryloop.actors.query_loop import QueryControl
from queryloop.runtime import telemetry
from tests.helpers import assert_settled, run_query, scripted_tool, text_reply, tool_use, tools_reply

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
SPAN_ID = "b7ad6b7169203331"


class Recorded:
    """What the injected providers recorded."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def spans(self, prefix: str = "") -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith(prefix)]

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for found in scope.metrics
            if found.name == metric
            for point in found.data.data_points
        ]


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    on = Recorded()
    telemetry.use(tracer_provider=on.tracer_provider, meter_provider=on.meter_provider)
    try:
        yield on
    finally:
        telemetry.use()
        on.tracer_provider.shutdown()
        on.meter_provider.shutdown()


def blocks(tokens: int) -> dict[str, Any]:
    return {"input_tokens": tokens, "output_tokens": 7, "cache_read_input_tokens": 30}


def reading_tool_script() -> list[dict[str, Any]]:
    return [
        tools_reply(tool_use("toolu_1", "read", {"path": "a.py"}), usage=blocks(100)),
        text_reply("Fixed.", usage=blocks(200)),
    ]


async def allow(_input: Any, _id: str | None, _ctx: Any) -> HookJSONOutput:
    return {}


async def test_a_query_records_chat_tool_and_hook_spans_and_token_metrics(runtime: Runtime, recorded: Recorded) -> None:
    ran = await run_query(
        runtime,
        reading_tool_script(),
        tools=[scripted_tool("read", result="x = 1")],
        hooks={"PreToolUse": [HookMatcher(hooks=[allow])]},
    )
    await assert_settled(ran)
    assert ran.reason == "completed"

    chats = recorded.spans("chat ")
    assert len(chats) == 2  # one per model call
    for chat, tokens, finish in zip(chats, (100, 200), ("tool_use", "end_turn"), strict=True):
        attributes = dict(chat.attributes or {})
        assert chat.kind is trace.SpanKind.CLIENT
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == "anthropic"
        assert chat.name == f"chat {attributes['gen_ai.request.model']}"
        assert attributes["gen_ai.usage.input_tokens"] == tokens
        assert attributes["gen_ai.usage.output_tokens"] == 7
        assert attributes["gen_ai.usage.cache_read.input_tokens"] == 30
        assert attributes["gen_ai.usage.cache_creation.input_tokens"] == 0
        assert attributes["gen_ai.response.finish_reasons"] == (finish,)
        assert "error.type" not in attributes

    (tool,) = recorded.spans("execute_tool ")
    attributes = dict(tool.attributes or {})
    assert tool.name == "execute_tool read"
    assert attributes["gen_ai.operation.name"] == "execute_tool"
    assert attributes["gen_ai.tool.name"] == "read"
    assert attributes["gen_ai.tool.call.id"] == "toolu_1"
    assert tool.status.status_code is not StatusCode.ERROR

    (hook,) = recorded.spans("hook ")
    assert hook.name == "hook PreToolUse"
    assert dict(hook.attributes or {}) == {"queryloop.hook.event": "PreToolUse", "queryloop.hook.callbacks": 1}

    usage = {
        (p.attributes["gen_ai.token.type"], p.attributes["gen_ai.request.model"]): p
        for p in recorded.points("gen_ai.client.token.usage")
    }
    model = dict(chats[0].attributes or {})["gen_ai.request.model"]
    assert usage["input", model].sum == 300 and usage["input", model].count == 2
    assert usage["output", model].sum == 14
    assert usage["cache_read", model].sum == 60
    (duration,) = recorded.points("gen_ai.client.operation.duration")
    assert duration.count == 2
    (tool_duration,) = recorded.points("gen_ai.execute_tool.duration")
    assert tool_duration.count == 1


async def test_a_failing_tool_is_an_error_span(runtime: Runtime, recorded: Recorded) -> None:
    ran = await run_query(
        runtime,
        [tools_reply(tool_use("toolu_9", "flaky")), text_reply()],
        tools=[scripted_tool("flaky", raises="disk on fire")],
    )
    await assert_settled(ran)
    (tool,) = recorded.spans("execute_tool ")
    assert dict(tool.attributes or {})["error.type"] == "tool_error"
    assert tool.status.status_code is StatusCode.ERROR


async def test_a_failed_model_call_names_its_error_type(runtime: Runtime, recorded: Recorded) -> None:
    ran = await run_query(runtime, [{"error": "api_error"}], max_retries=0)
    assert ran.reason == "api_error"
    (chat,) = recorded.spans("chat ")
    assert dict(chat.attributes or {})["error.type"] == "api_error"
    assert chat.status.status_code is StatusCode.ERROR


async def test_spans_hang_from_the_hosts_span(runtime: Runtime, recorded: Recorded) -> None:
    tracer = recorded.tracer_provider.get_tracer("host")
    with tracer.start_as_current_span("request") as host:
        ran = await run_query(runtime, reading_tool_script(), tools=[scripted_tool("read")])
    await assert_settled(ran)
    host_context = host.get_span_context()
    (query,) = recorded.spans("invoke_agent")
    assert query.parent is not None and query.parent.span_id == host_context.span_id
    assert query.context is not None
    for span in [*recorded.spans("chat "), *recorded.spans("execute_tool ")]:
        assert span.context is not None and span.context.trace_id == host_context.trace_id
        assert span.parent is not None and span.parent.span_id == query.context.span_id  # the query's span


async def test_traceparent_is_the_parent_without_a_current_span(
    runtime: Runtime, recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRACEPARENT", f"00-{TRACE_ID}-{SPAN_ID}-01")
    ran = await run_query(runtime, [text_reply()])
    await assert_settled(ran)
    (query,) = recorded.spans("invoke_agent")
    assert query.context is not None and f"{query.context.trace_id:032x}" == TRACE_ID
    assert query.parent is not None and f"{query.parent.span_id:016x}" == SPAN_ID
    (chat,) = recorded.spans("chat ")
    assert chat.context is not None and f"{chat.context.trace_id:032x}" == TRACE_ID


async def test_the_query_span_functions(recorded: Recorded) -> None:
    """What the QueryLoop calls at a query's start and result: the `invoke_agent` span, its parent the host's
    span, the calls' parent once it has started, and its end (terminal reason, error status, metrics)."""
    tracer = recorded.tracer_provider.get_tracer("host")
    control = QueryControl()
    with tracer.start_as_current_span("request") as host:
        telemetry.query_submitted(control)
    active = telemetry.active
    assert active is not None

    def query_task() -> None:  # the QueryLoop's task for the query: a context of its own
        query = telemetry.query_span_start(control, session_id="s-1", model="claude-x")
        assert query is not None
        assert trace.get_current_span() is query.span  # current in the query's task: its hooks nest under it
        assert active.parent_of(control) is query.context
        with telemetry.hook_span("Stop", 2):
            pass
        telemetry.query_span_end(query, "completed", cost_usd=0.25)

    contextvars.copy_context().run(query_task)

    aborted = QueryControl()
    telemetry.query_submitted(aborted)
    aborted.request_abort("interrupt")
    failed = contextvars.copy_context().run(telemetry.query_span_start, aborted, session_id="s-1", model="claude-x")
    telemetry.query_span_end(failed, "aborted_tools", error="interrupted")

    first, second = recorded.spans("invoke_agent ")
    assert first.name == "invoke_agent queryloop"
    attributes = dict(first.attributes or {})
    assert attributes["gen_ai.operation.name"] == "invoke_agent"
    assert attributes["gen_ai.agent.name"] == "queryloop"
    assert attributes["gen_ai.conversation.id"] == "s-1"
    assert attributes["gen_ai.request.model"] == "claude-x"
    assert attributes["queryloop.terminal_reason"] == "completed"
    assert first.parent is not None and first.parent.span_id == host.get_span_context().span_id
    assert first.status.status_code is not StatusCode.ERROR
    (hook,) = recorded.spans("hook ")
    assert hook.parent is not None and first.context is not None and hook.parent.span_id == first.context.span_id

    assert second.status.status_code is StatusCode.ERROR
    assert dict(second.attributes or {})["error.type"] == "aborted_tools"
    assert second.parent is None  # no host span, no TRACEPARENT: a root
    (cost,) = recorded.points("queryloop.cost.usd")
    assert cost.value == 0.25
    (abort,) = recorded.points("queryloop.query.aborts")
    assert abort.value == 1 and abort.attributes["queryloop.abort.reason"] == "interrupt"
    assert sum(p.count for p in recorded.points("gen_ai.invoke_agent.duration")) == 2
    assert active.parent_of(control) is None  # nothing kept once the query has ended


async def test_a_subagents_query_hangs_from_the_agent_tool_call(recorded: Recorded) -> None:
    active = telemetry.refresh()
    assert active is not None
    call = active.tool_span("Agent", "toolu_a")
    child = QueryControl()
    with trace.use_span(call):
        telemetry.subagent_submitted(child)
    active.tool_done(call, "Agent", 0.0, None)
    start = telemetry.query_span_start
    query = contextvars.copy_context().run(start, child, session_id="s", model="m", agent_name="explorer", agent_id="a")
    telemetry.query_span_end(query, "completed", cost_usd=1.0)
    (span,) = recorded.spans("invoke_agent ")
    assert span.name == "invoke_agent explorer"
    assert span.parent is not None and span.parent.span_id == call.get_span_context().span_id
    assert recorded.points("queryloop.cost.usd") == []  # counted in the parent query's cost


async def test_off_records_nothing_and_costs_one_check(runtime: Runtime) -> None:
    telemetry.use()  # the API's global providers, which no test sets: telemetry is off
    assert telemetry.refresh() is None and telemetry.active is None
    ran = await run_query(
        runtime,
        reading_tool_script(),
        tools=[scripted_tool("read")],
        hooks={"PreToolUse": [HookMatcher(hooks=[allow])]},
    )
    await assert_settled(ran)
    assert telemetry.active is None
    control = QueryControl()
    telemetry.query_submitted(control)
    assert telemetry.query_span_start(control, session_id="s", model="m") is None
    telemetry.query_span_end(None, "completed")
    assert telemetry.hook_span("Stop", 1) is telemetry.hook_span("Stop", 2)  # one shared do-nothing object
