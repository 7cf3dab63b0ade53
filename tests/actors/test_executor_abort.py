"""The StreamingToolExecutor under an abort: nothing of an aborted query starts once the abort is acked."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from queryloop import Runtime
from queryloop.actors.query_loop.messages import QueryControl
from queryloop.actors.tool_executor import AddTool, BeginTurn, StreamingToolExecutor
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import Abort
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput


async def test_a_tool_added_while_the_abort_unwinds_never_starts_after_the_ack() -> None:
    """A block that completes while an abort is unwinding the executor's work waits behind the abort
    (the inbox lets only supervisor mail in meanwhile). Once the abort is acked it must not start: the
    query's end answers it, and no task of an aborted query may run after its stream has ended."""
    started: list[str] = []
    release = trio.Event()

    async def slow_to_unwind(_: Any, ctx: ToolContext) -> ToolOutput:
        started.append(ctx.tool_use_id)
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await release.wait()  # a cleanup that takes a while (a subagent closing its group, say)
        return "never"

    tool = Tool(name="slow", call=slow_to_unwind, concurrency_safe=True)
    control = QueryControl()
    turn = BeginTurn(sink=EventChannel(16), tools={"slow": tool}, control=control)

    def block(tool_id: str) -> dict[str, Any]:
        return {"type": "tool_use", "id": tool_id, "name": "slow", "input": {}}

    async with Runtime.open() as runtime:
        group = await runtime.start_group()
        executor = group.spawn(StreamingToolExecutor)
        executor.tell(AddTool(block=block("first"), turn=turn))
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["first"]
        control.request_abort("user")
        ack = executor.ask(Abort(reason="user"), block=False)
        executor.tell(AddTool(block=block("second"), turn=turn))  # queued behind the abort
        release.set()
        await ack
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["first"]
        assert group.live_tasks() == 0
        await group.close()
