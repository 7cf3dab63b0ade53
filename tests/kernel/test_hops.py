"""What the hot path's fewer hops must keep: an abort between calls cancels the ModelCaller's waiting task and
reaches every live actor, helpers spawned on first need included; the BudgetGuard's accounting kept inline
gives the totals the actor gives. How few the hops are (one ModelCaller task a query, helpers spawned on
first need, one task switch per streamed event) is `bench tricks`'."""

from __future__ import annotations

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
        acks: list[AbortAck] = []
        summarized: list[bool] = []
        async for event in handle:
            events.append(event)
            if isinstance(event, StreamEvent) and event.event["type"] == "message_stop" and not summarized:
                summarized.append(True)  # the first turn: its summary is asked for as its tool runs
            elif isinstance(event, StreamEvent) and event.event["type"] == "message_stop" and not acks:
                await trio.sleep(5)  # the second turn's tool runs, the first turn's summary is being made
                live = live_actor_names(session)
                acks = await session.supervisor.abort("user")  # the kernel's acks, one per actor
        ran = await consume(session, handle, model)
        ran.events = events
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
