"""The hot path's hops: a query's model calls in one ModelCaller task, helpers spawned on first need,
the BudgetGuard's accounting inline where no host budget is set; aborts still reach every live actor."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import pytest
import trio
import trio.testing
from pykka import ActorRef

from queryloop import Runtime
from queryloop.actors.budget_guard import HostSpend, cost_usd
from queryloop.runtime.host.session import Session
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import AbortAck
from queryloop.runtime.loop.events import ResultMessage, StreamEvent, Usage
from queryloop.runtime.loop.hooks import HookDecision, StopHookInput
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.pricing import Pricing
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import (
    assert_settled,
    consume,
    open_session,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)

PRICE = Pricing(input=3.0, output=15.0, cache_write=3.75, cache_read=0.3)
PTL = {"error": "prompt_too_long"}


class TaskRecording:
    """A provider that records which trio task streams each request."""

    def __init__(self, inner: ScriptedModel) -> None:
        self.inner = inner
        self.requests: list[ModelRequest] = inner.requests
        self.tasks: list[trio.lowlevel.Task] = []

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        self.tasks.append(trio.lowlevel.current_task())
        async with aclosing(self.inner.stream(request)) as events:
            async for event in events:
                yield event


async def test_the_calls_of_a_tool_using_query_run_in_one_model_caller_task() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel(
            [
                tools_reply(tool_use("a", "read"), tool_use("b", "read")),
                tools_reply(tool_use("c", "read")),
                text_reply("done"),
                tools_reply(tool_use("d", "read")),
                text_reply("again"),
            ]
        )
        provider = TaskRecording(model)
        session = await runtime.open_session(QueryOptions(provider=provider, tools=[scripted_tool("read", safe=True)]))
        first = await consume(session, session.query("go"), model)
        assert first.reason == "completed"
        assert len(provider.tasks) == 3 and len(set(provider.tasks)) == 1  # one task for the query's three calls
        await assert_settled(first)
        second = await consume(session, session.query("more"), model)
        assert second.reason == "completed"
        assert len(provider.tasks) == 5 and provider.tasks[3] is provider.tasks[4]
        assert provider.tasks[3] is not provider.tasks[0]  # each query has its own
        await assert_settled(second)


async def test_a_call_after_a_response_that_ended_the_turn_starts_a_new_task() -> None:
    blocked: list[bool] = []

    async def stop_hook(_: StopHookInput) -> HookDecision | None:
        if blocked:
            return None
        blocked.append(True)
        return HookDecision(blocking_error="not yet")

    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("first"), text_reply("second")])
        provider = TaskRecording(model)
        session = await runtime.open_session(QueryOptions(provider=provider, stop_hooks=[stop_hook]))
        ran = await consume(session, session.query("go"), model)
        assert ran.reason == "completed" and ran.handle.transitions == ["stop_hook_blocking"]
        assert len(provider.tasks) == 2 and provider.tasks[0] is not provider.tasks[1]
        await assert_settled(ran)


async def test_an_abort_between_calls_cancels_the_waiting_model_caller_task_and_is_acked(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("slow", "lengthy")), text_reply()])
        session = await open_session(runtime, model, tools=[scripted_tool("lengthy", latency=60)])
        handle = session.query("go")
        events = []
        acks: list[AbortAck] = []
        async for event in handle:
            events.append(event)
            if isinstance(event, StreamEvent) and event.event["type"] == "message_stop" and not acks:
                await trio.sleep(1)  # the tool runs; the ModelCaller's task waits for the next call
                acks = await session.supervisor.abort("user")  # the kernel's acks, one per actor
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_tools"
        cancelled = {ack.actor: ack.cancelled_work for ack in acks}
        assert cancelled["ModelCaller"] == 1 and cancelled["StreamingToolExecutor"] == 1
        assert len(model.requests) == 1
        await assert_settled(ran)


def live_actor_names(session: Session) -> list[str]:
    return sorted(actor.name for actor in session.supervisor.actors if not actor.actor_stopped.is_set())


async def test_a_session_that_never_compacts_or_summarizes_spawns_neither_and_an_abort_acks_from_the_rest() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("a", "read")), text_reply()])
        session = await open_session(runtime, model, tools=[scripted_tool("read")], max_budget_usd=5.0)
        ran = await consume(session, session.query("go"), model)
        assert ran.reason == "completed"
        await assert_settled(ran)
        assert live_actor_names(session) == ["ModelCaller", "QueryLoop", "StreamingToolExecutor"]
        acks = await session.supervisor.abort("user")  # the kernel's acks, one per actor
        assert sorted(ack.actor for ack in acks) == ["ModelCaller", "QueryLoop", "StreamingToolExecutor"]


async def test_the_compactor_is_spawned_when_the_context_first_needs_it() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "read")), PTL, text_reply("Done.")])
        compactor = ScriptedModel([text_reply("What happened so far.")], name="compactor")
        session = await runtime.open_session(
            QueryOptions(
                provider=model, compact_provider=compactor, tools=[scripted_tool("read")], context_collapse=False
            )
        )
        ran = await consume(session, session.query("go"), model)
        assert ran.reason == "completed" and ran.handle.transitions == ["next_turn", "reactive_compact_retry"]
        assert len(compactor.requests) == 1
        assert "Compactor" in live_actor_names(session) and "BudgetGuard" in live_actor_names(session)
        await assert_settled(ran)


async def test_an_abort_reaches_every_live_actor_those_spawned_on_first_need_included(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("a", "read")), tools_reply(tool_use("b", "read")), text_reply()])
        summaries = ScriptedModel([text_reply("Read a file", latency_ms=30_000)], name="summarizer", repeat=True)
        session = await open_session(
            runtime,
            model,
            tools=[scripted_tool("read", latency=60)],
            tool_use_summaries=True,
            summary_provider=summaries,
        )
        handle = session.query("go")
        events = []
        before: list[str] = []
        acks: list[AbortAck] = []
        async for event in handle:
            events.append(event)
            if isinstance(event, StreamEvent) and event.event["type"] == "message_stop" and not before:
                before = live_actor_names(session)  # the first turn: no summary asked for yet
            elif isinstance(event, StreamEvent) and event.event["type"] == "message_stop" and not acks:
                await trio.sleep(5)  # the second turn's tool runs, the first turn's summary is being made
                live = live_actor_names(session)
                acks = await session.supervisor.abort("user")  # the kernel's acks, one per actor
        ran = await consume(session, handle, model)
        ran.events = events
        assert before == ["ModelCaller", "QueryLoop", "StreamingToolExecutor"]
        assert live == ["BudgetGuard", "ModelCaller", "QueryLoop", "StreamingToolExecutor", "ToolUseSummarizer"]
        assert sorted(ack.actor for ack in acks) == live
        cancelled = {ack.actor: ack.cancelled_work for ack in acks}
        assert cancelled["ToolUseSummarizer"] == 1 and cancelled["StreamingToolExecutor"] == 1
        assert ran.reason == "aborted_tools"
        await assert_settled(ran)


USAGE = [
    {"input_tokens": 1_200, "output_tokens": 310, "cache_read_input_tokens": 4_000},
    {"input_tokens": 2_300, "output_tokens": 170, "cache_creation_input_tokens": 900},
    {"input_tokens": 2_900, "output_tokens": 45},
]


async def _totals(runtime: Runtime, **options: Any) -> tuple[str, ResultMessage]:
    model = ScriptedModel(
        [
            tools_reply(tool_use("a", "read"), usage=USAGE[0]),
            tools_reply(tool_use("b", "read"), usage=USAGE[1]),
            text_reply("done", usage=USAGE[2]),
        ]
    )
    summaries = ScriptedModel(
        [text_reply("Read a file", usage={"input_tokens": 800, "output_tokens": 12})], name="summarizer", repeat=True
    )
    session = await open_session(
        runtime,
        model,
        tools=[scripted_tool("read")],
        tool_use_summaries=True,
        summary_provider=summaries,
        pricing=PRICE,
        **options,
    )
    ran = await consume(session, session.query("go"), model)
    await assert_settled(ran)
    assert ran.handle.result is not None
    return ran.reason, ran.handle.result


async def test_the_inline_budget_gives_the_totals_and_terminals_the_budget_guard_actor_gives() -> None:
    async with Runtime.open() as runtime:
        inline = [await _totals(runtime, max_budget_usd=cap) for cap in (10.0, 0.004, None)]
        assert [reason for reason, _ in inline] == ["completed", "max_budget_usd", "completed"]
        await runtime.open_host_budget(max_budget_usd=1_000.0)  # from now on every session reports to it
        actor = [await _totals(runtime, max_budget_usd=cap) for cap in (10.0, 0.004, None)]
    for (inline_reason, inline_result), (actor_reason, actor_result) in zip(inline, actor, strict=True):
        assert inline_reason == actor_reason
        assert inline_result.usage == actor_result.usage
        assert (inline_result.subtype, inline_result.num_turns) == (actor_result.subtype, actor_result.num_turns)
        assert inline_result.total_cost_usd == pytest.approx(actor_result.total_cost_usd, rel=1e-12)
    # Capped, both account call by call in the same order: the same float, to the last bit.
    assert inline[0][1].total_cost_usd == actor[0][1].total_cost_usd
    assert inline[1][1].total_cost_usd == actor[1][1].total_cost_usd
    # The summaries' spend counts in the query's cost, not in its tokens.
    calls = sum(cost_usd(Usage(**u), PRICE) for u in USAGE)
    assert inline[0][1].total_cost_usd > calls
    assert inline[0][1].usage == sum((Usage(**u) for u in USAGE), Usage())


class SlowHostBudget(TrioActor):
    """A host budget that takes ten seconds to answer each session's spend."""

    actor_name = "SlowHostBudget"

    def __init__(self) -> None:
        super().__init__()
        self.spent = 0.0

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, HostSpend):
            return self._answer(message.cost_usd)
        return super().on_receive(message)

    async def _answer(self, cost: float) -> bool:
        await trio.sleep(10)
        self.spent += cost
        return False


async def test_an_abort_while_the_loop_waits_for_the_host_budgets_answer_ends_the_query_with_the_call_billed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with Runtime.open() as runtime:
        host = await runtime.start_group("host")
        slow: ActorRef[Any] = host.spawn(SlowHostBudget)
        runtime.host_budget = slow  # a stand-in: the sessions only ask it `HostSpend`
        model = ScriptedModel([text_reply("done", usage=USAGE[0])])
        session = await open_session(runtime, model, pricing=PRICE)
        handle = session.query("go")

        async def abort_soon() -> None:
            await trio.sleep(5)  # the response is whole; the loop waits for the host's answer
            await session.abort("user")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abort_soon)
            ran = await consume(session, handle, model)
        assert ran.reason == "aborted_streaming" and trio.current_time() < 10
        assert ran.handle.result is not None
        assert ran.handle.result.usage == Usage(**USAGE[0])  # the call was billed before the abort cut the answer
        assert ran.handle.result.total_cost_usd == pytest.approx(cost_usd(Usage(**USAGE[0]), PRICE))
        await assert_settled(ran)


async def test_wake_receiver_wakes_a_waiting_consumer_with_nothing_new_and_is_a_no_op_otherwise() -> None:
    channel = EventChannel[int](4)
    channel.wake_receiver()  # nobody waits: nothing happens, nothing is buffered
    woken: list[bool] = []

    async def consumer() -> None:
        woken.append(await channel.wait())
        woken.append(await channel.wait())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        await trio.testing.wait_all_tasks_blocked()
        channel.wake_receiver()
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [False]  # woken with nothing buffered
        channel.send_nowait(7)
    assert woken == [False, True] and channel.take() == 7


class Paced(TaskRecording):
    """Yields to the scheduler before every event, as a network read does."""

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        async with aclosing(super().stream(request)) as events:
            async for event in events:
                await trio.lowlevel.checkpoint()
                yield event


class StepCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps: dict[trio.lowlevel.Task, int] = {}

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task] = self.steps.get(task, 0) + 1


async def test_a_streamed_event_costs_one_task_switch_from_the_read_to_the_consumer() -> None:
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("x" * 48 * 200)])  # 200 text deltas
        provider = Paced(model)
        session = await runtime.open_session(QueryOptions(provider=provider))
        counter = StepCounter()
        trio.lowlevel.add_instrument(counter)
        try:
            ran = await consume(session, session.query("go"), model)
        finally:
            trio.lowlevel.remove_instrument(counter)
        events = sum(1 for event in ran.events if isinstance(event, StreamEvent))
        assert events > 200
        model_caller, consumer = provider.tasks[0], trio.lowlevel.current_task()
        others = sum(n for task, n in counter.steps.items() if task not in (model_caller, consumer))
        assert counter.steps[model_caller] <= events + 3  # one step per read
        assert counter.steps[consumer] <= events  # at most one wakeup per event, fewer when several are ready
        assert others <= 5  # the QueryLoop is woken per content block, never per event
        await assert_settled(ran)
