"""The hot path's hops: a query's model calls in one ModelCaller task, helpers spawned on first need,
the BudgetGuard's accounting inline where no host budget is set; aborts still reach every live actor."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import trio
import trio.testing

from queryloop import Runtime
from queryloop.runtime.kernel.messages import AbortAck
from queryloop.runtime.loop.events import StreamEvent
from queryloop.runtime.loop.hooks import HookDecision, StopHookInput
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
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
                acks = await session.abort("user")
        ran = await consume(session, handle, model)
        ran.events = events
        assert ran.reason == "aborted_tools"
        cancelled = {ack.actor: ack.cancelled_work for ack in acks}
        assert cancelled["ModelCaller"] == 1 and cancelled["StreamingToolExecutor"] == 1
        assert len(model.requests) == 1
        await assert_settled(ran)
