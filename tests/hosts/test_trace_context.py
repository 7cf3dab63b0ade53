"""A query's parent trace context where the host submits it away from its caller (`telemetry.propagation`): the
asyncio host's caller's span on its trio side, a W3C carrier (a Ray driver's, tests/hosts/test_ray.py runs the
shard) made current for a submission, and nothing carried while telemetry is off."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace

from queryloop.aio import AsyncioRuntime
from queryloop.runtime import telemetry
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import text_reply
from tests.kernel.test_telemetry import SPAN_ID, TRACE_ID, Recorded, recorded  # noqa: F401 - the fixture

TRACEPARENT = f"00-{TRACE_ID}-{SPAN_ID}-01"


def test_an_asyncio_callers_span_is_the_parent_of_its_query(recorded: Recorded) -> None:  # noqa: F811
    async def host() -> int:
        async with AsyncioRuntime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=ScriptedModel([text_reply()])))
            with recorded.tracer_provider.get_tracer("host").start_as_current_span("request") as span:
                await session.query("Hi").wait()
            await session.close()
            return span.get_span_context().span_id

    host_span = asyncio.run(host())
    (query,) = recorded.spans("invoke_agent")
    assert query.parent is not None and query.parent.span_id == host_span


def test_a_carrier_names_the_parent_of_a_submission_made_under_it(recorded: Recorded) -> None:  # noqa: F811
    with telemetry.submitted_under({"traceparent": TRACEPARENT}):
        context = trace.get_current_span().get_span_context()
        assert (f"{context.trace_id:032x}", f"{context.span_id:016x}") == (TRACE_ID, SPAN_ID)
        assert telemetry.caller_carrier() == {"traceparent": TRACEPARENT}  # and it goes on as it came
    assert not trace.get_current_span().get_span_context().is_valid  # detached after the block


@pytest.mark.parametrize("carrier", [None, {}, {"traceparent": "00-not-a-trace-01"}])
def test_no_carrier_or_a_malformed_one_is_no_parent(carrier: dict[str, str] | None) -> None:
    with telemetry.submitted_under(carrier):
        assert not trace.get_current_span().get_span_context().is_valid


def test_nothing_is_carried_while_telemetry_is_off() -> None:
    telemetry.use()
    assert telemetry.refresh() is None
    with trace.get_tracer("host").start_as_current_span("request"):
        assert telemetry.caller_context() is None and telemetry.caller_carrier() is None
