"""A deferred tool call replayed, as steps of the query (functions of the `QueryLoop`).

A PreToolUse hook's `permissionDecision: "defer"` ends the query `tool_deferred`, the call left in the
conversation without a result (`runtime.loop.deferred`). The session's next query (or the first of a session
resumed from its transcript) answers it before its first model call, inside the query, so that an abort, the
hooks, the permissions and the budget apply as to any call: the call goes to the StreamingToolExecutor again,
with its id and input, in a turn of its own whose response is whole already (`replay`). Its PreToolUse hooks
fire again: an allow runs it, a deny answers it with the deny's error, a defer ends the query `tool_deferred`
again (no model call). A tool no longer among the query's tools ends it `tool_deferred_unavailable` before any
hook fires (`unavailable`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from queryloop.actors.model_caller import call_ended
from queryloop.actors.query_loop.ending import end_early
from queryloop.actors.query_loop.run import BudgetExceeded, QueryPhase, Run, Turn
from queryloop.actors.query_loop.turn import TURN_BUFFER, dispatch
from queryloop.actors.tool_executor import add_tool, begin_turn
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop.decisions import tools_stopped_terminal
from queryloop.runtime.loop.deferred import deferred_tool_use, pending_deferred
from queryloop.runtime.loop.state import Terminal

if TYPE_CHECKING:
    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.runtime.loop.events import AssistantMessage, Block, UserMessage


def joins_plainly(loop: QueryLoop, run: Run) -> bool:
    """Whether the query's prompt just joins the conversation, as for most queries: no hook or setup error to see
    to first, no deferred call to replay (else `intake.admit_prompt`)."""
    setup = run.setup
    return setup.hooks is None and setup.setup_error is None and pending_deferred(loop.conversation) is None


def has_text(prompt: UserMessage) -> bool:
    """Whether a prompt says anything: a deferred call's resuming query with an empty one only says "go on"."""
    content = prompt.content
    if isinstance(content, str):
        return bool(content.strip())
    return any(block.get("type") != "text" or str(block.get("text", "")).strip() for block in content)


def unavailable(run: Run, block: Block) -> Terminal:
    """The deferred call's tool is not among the query's tools: the query ends `tool_deferred_unavailable` (an
    error), the call still waiting for a query that has its tool."""
    call = run.deferred_tool_use = deferred_tool_use(block)
    return Terminal(reason="tool_deferred_unavailable", error=f"Deferred tool {call.name} is no longer available")


async def replay(loop: QueryLoop, run: Run, pending: tuple[AssistantMessage, Block]) -> Terminal | None:
    """Answer the deferred call through the executor, its result joining the conversation; the query's end if the
    replay ends it (deferred again, a hook's stop, an abort, the budget), else None: the loop goes on to the model."""
    message, block = pending
    setup = run.setup
    tool_use_id: str = block["id"]
    channel: EventChannel[Any] = EventChannel(TURN_BUFFER)
    # The call's own turn: its response is whole (the gate of a defer opens at once, one call) and has ended.
    turn = Turn(channel, assistant_messages=[message], tool_ids=[tool_use_id], pending={tool_use_id})
    turn.ended, turn.response_closed = call_ended(stop_reason="tool_use"), True
    run.turn = turn
    setting = begin_turn(
        sink=channel,
        tools=setup.tools,
        can_use_tool=setup.can_use_tool,
        permissions=setup.permissions,
        agent_id=None,  # only the session's own loop defers (`tool_executor.calls.honours_defer`)
        hooks=setup.hooks,
        control=setup.control,
    )
    loop.executor.tell(add_tool(block=block, turn=setting))
    control = setup.control
    try:
        while run.terminal is None and control.abort_reason is None and turn.pending:
            if not channel.items:
                run.phase = QueryPhase.AWAITING_TURN  # an abort ends the query in its own call (`ending.end_now`)
                try:
                    await channel.wait()
                finally:
                    if run.phase is QueryPhase.AWAITING_TURN:
                        run.phase = QueryPhase.RUNNING
                continue
            await dispatch(loop, run, turn, channel.take())
    except BudgetExceeded:  # a subagent the replayed call ran spent the query's cap
        return end_early(loop, run, turn, "max_budget_usd")
    if run.terminal is not None:
        return run.terminal
    if control.abort_reason is not None:
        return end_early(loop, run, turn, "aborted_tools")
    if turn.prevent_continuation:
        return Terminal(reason=tools_stopped_terminal(run.deferred_tool_use is not None))
    return None
