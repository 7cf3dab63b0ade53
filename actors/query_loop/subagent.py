"""Subagents: the agent tool a query carries, and the child query loop each call of it runs.

A call of the `Agent` tool (`queryloop.runtime.loop.agents`) runs as work of the parent's
StreamingToolExecutor, like any tool. It opens a child actor group under the parent session's
`Supervisor` (`Supervisor.child`: a supervision tree), spawns a StreamingToolExecutor, a ModelCaller
and a QueryLoop there (the helpers follow on first need, as in a session), runs one query with the
agent's system prompt and tool subset, relays the child's events to the parent's consumer, tagged
with `parent_tool_use_id` (through the parent's turn channel, as `Forwarded` items), and returns the
child's final text as the tool's result. Then it closes the child group: when the tool returns, no
task of the child runs.

* **Aborts.** An abort of the parent reaches the child's actors twice over: the parent's
  `Supervisor.abort` reaches every descendant group (and waits for their acks), and the parent's
  executor cancels this tool's work, whose shielded ending aborts the child (if it still runs: a
  budget stop or a fallback aborts only the executor), waits for the child's query to end, and closes
  the child group. The executor acks its abort only then, and the parent's stream ends only after
  that ack (`QueryLoop.stop_workers_soon`, awaited by `QueryLoop._query`): no task of any descendant
  runs after the parent's stream ends.
* **Crashes.** A crash in a child's actor closes the child group alone (its supervisor's failure is
  its own); the tool call ends with an error result and the parent goes on.
* **Budget.** The child's ledger reports each priced call to the parent as it is accounted
  (`BudgetLedger.above`): into the parent's ledger (or, under a host budget, its BudgetGuard, which
  reports to the host's), so the parent's `max_budget_usd` and the host budget count it, and the
  parent's result lists it per agent (`ResultMessage.usage_by_agent`). A child whose spend takes the
  parent past its cap stops (`max_budget_usd`), and so does the parent. The child's `agent_id` stops
  the token-budget gate for it.
* **Transcript.** With a transcript, the child's records go into the parent's file as a sidechain
  (`SidechainLog`); the child's conversation is kept by the parent's QueryLoop (`sidechains`).
* **Caps.** `max_concurrent_agents` per query (a call waits for a slot), `max_live_agents` per host
  (refused at once past it: a wait there could deadlock parents on their own children), and
  `max_agent_depth`: a child at that depth gets no agent tool.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, cast

import trio

from queryloop.actors.budget_guard import BudgetLedger, BudgetStatus, SpendAbove
from queryloop.actors.compactor import SESSION_DIR
from queryloop.actors.model_caller import ModelCaller
from queryloop.actors.query_loop.lifecycle import subagent_start
from queryloop.actors.query_loop.messages import Forwarded, GetConversation, QueryControl, RunQuery
from queryloop.actors.tool_executor import StreamingToolExecutor
from queryloop.runtime import telemetry
from queryloop.runtime._frozen import EMPTY_DICT
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.supervisor import Supervisor
from queryloop.runtime.loop.agents import (
    AGENT_TOOL_NAME,
    DEFAULT_MAX_LIVE_AGENTS,
    AgentDefinition,
    AgentInput,
    agent_tool_description,
)
from queryloop.runtime.loop.events import (
    AgentUsage,
    ResultMessage,
    TranscriptMessage,
    Usage,
    UserMessage,
    stream_event,
)
from queryloop.runtime.loop.persistence import SidechainLog
from queryloop.runtime.loop.restore import Sidechain
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError

if TYPE_CHECKING:
    from pathlib import Path

    from pykka import ActorRef

    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.actors.query_loop.run import Run
    from queryloop.runtime.kernel._future import TrioFuture
    from queryloop.runtime.loop.options import QueryOptions


class AgentSlots:
    """The host-wide count of live subagents and its cap (`Runtime.open(max_live_agents=...)`)."""

    __slots__ = ("limit", "live", "peak")

    def __init__(self, limit: int | None = DEFAULT_MAX_LIVE_AGENTS) -> None:
        self.limit = limit
        self.live = 0
        self.peak = 0
        """The most subagents that were live at once."""

    def try_acquire(self) -> bool:
        if self.limit is not None and self.live >= self.limit:
            return False
        self.live += 1
        self.peak = max(self.peak, self.live)
        return True

    def release(self) -> None:
        self.live -= 1


@dataclasses.dataclass(slots=True)
class AgentsHost:
    """What the subagents of every session of a runtime share: the host-wide cap and model-call limiter."""

    slots: AgentSlots = dataclasses.field(default_factory=AgentSlots)
    model_calls: trio.CapacityLimiter | None = None


def child_options(parent: QueryOptions, definition: AgentDefinition) -> QueryOptions:
    """The child's options: the agent's prompt, tools, model and turns; no cap of its own (the parent
    accounts its spend), the parent's `subagent_stop_hooks` as its stop hooks, no structured output,
    attachments or memory; the parent's `agents`, for deeper levels."""
    names = None if definition.tools is None else set(definition.tools)
    model = definition.model or parent.model
    return parent.model_copy(
        update={
            "system_prompt": definition.prompt,
            "append_system_prompt": None,
            "tools": list(parent.tools) if names is None else [t for t in parent.tools if t.name in names],
            "mcp_servers": parent.mcp_servers if names is None else [],
            "model": model,
            "fallback_model": parent.fallback_model if model == parent.model else None,
            "pricing": parent.pricing if model == parent.model else None,
            "max_turns": definition.max_turns,
            "max_budget_usd": None,
            "provider": definition.provider or parent.provider,
            "stop_hooks": parent.subagent_stop_hooks,
            "output_type": None,
            "attachment_sources": [],
            "memory_prefetch": None,
            "user_context": {},
        }
    )


class Subagents:
    """One QueryLoop's subagent calls: its queries' agent tool, and the child loop each call runs."""

    def __init__(self, parent: QueryLoop, loop_class: type[QueryLoop], host: AgentsHost, depth: int) -> None:
        self._parent = parent
        self._loop_class = loop_class
        """The QueryLoop class (given, not imported: the loop imports this module)."""
        self._host = host
        self.depth = depth
        """0 for a session's own loop, 1 for its subagents, ..."""
        self._tool: Tool | None = None
        self._tool_for: QueryOptions | None = None
        self._limiter: trio.CapacityLimiter | None = None

    def tool_for(self, options: QueryOptions) -> Tool | None:
        """The agent tool for a query with these options; None past the depth cap."""
        if not options.agents or self.depth >= options.max_agent_depth:
            return None
        if self._tool_for is not options:  # made once per options (a tool's schema costs ~300 µs)
            self._tool = Tool(
                name=AGENT_TOOL_NAME,
                call=self._call,
                description=agent_tool_description(options.agents),
                input_model=AgentInput,
                concurrency_safe=True,
            )
            self._tool_for = options
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(options.max_concurrent_agents)
        else:
            self._limiter.total_tokens = options.max_concurrent_agents
        return self._tool

    async def _call(self, args: AgentInput, ctx: ToolContext) -> str:
        run = self._parent.running  # the tool runs inside this loop's query
        if run is None:
            raise ToolError("the query that started this agent has ended")
        options = run.setup.options
        definition = options.agents.get(args.subagent_type)
        if definition is None:
            known = ", ".join(options.agents)
            raise ToolError(f"Agent type '{args.subagent_type}' not found. Available agents: {known}")
        assert self._limiter is not None
        # The parent session's folder (its spills' folder asked of its Compactor when it is a temporary one): the
        # child's spills live and die with that session, not with this call. Asked before the child exists, so
        # an abort during the ask leaves nothing to stop.
        parent = self._parent
        session_dir = parent._session_dir or await parent.compactor.ask(SESSION_DIR, block=False)  # noqa: SLF001
        opening: tuple[TranscriptMessage, ...] = ()
        hooks = run.setup.hooks
        if hooks is not None and hooks.has("SubagentStart"):  # the parent's, before the child exists
            group_id = cast("Supervisor", parent.supervisor).session_id
            opening = await subagent_start(run, hooks, f"{group_id}/{ctx.tool_use_id}", args.subagent_type)
        async with self._limiter:
            slots = self._host.slots
            if not slots.try_acquire():
                msg = f"too many subagents are running on this host (max_live_agents={slots.limit}); try again later"
                raise ToolError(msg)
            try:
                return await self._run_child(run, definition, args, ctx.tool_use_id, session_dir, opening=opening)
            finally:
                slots.release()

    async def _run_child(
        self,
        run: Run,
        definition: AgentDefinition,
        args: AgentInput,
        tool_use_id: str,
        session_dir: Path,
        *,
        opening: tuple[TranscriptMessage, ...],
    ) -> str:
        parent = self._parent
        options = child_options(run.setup.options, definition)
        group = cast("Supervisor", parent.supervisor)
        agent_id = f"{group.session_id}/{tool_use_id}"
        child = group.child(agent_id)
        above = self._spend_above(run, agent_id, args.subagent_type, tool_use_id)
        log = parent.transcript
        sidechain = (
            SidechainLog(log, agent_id=agent_id, agent_type=args.subagent_type, parent_tool_use_id=tool_use_id)
            if log is not None
            else None
        )
        events: EventChannel[Any] = EventChannel(options.event_buffer)
        control = QueryControl()

        def crashed(_: object) -> None:
            events.close()  # the relay ends; the call answers with the failure
            control.end()  # nothing of the child's query is left to wait for: its group is closing

        child.add_crash_listener(crashed)
        turn = run.turn
        channel = turn.channel if turn is not None else None  # the parent turn this call belongs to
        handed_over = False  # the child's loop has the query: only then will its `control` end
        try:
            provider = options.provider
            executor = child.spawn(StreamingToolExecutor)
            caller = child.spawn(ModelCaller, provider, executor=executor, limiter=self._host.model_calls)
            loop = child.spawn(
                self._loop_class,
                model_caller=caller,
                executor=executor,
                compact_provider=options.compact_provider or provider,
                summary_provider=options.summary_provider or provider,
                session_dir=session_dir,
                ledger=BudgetLedger(agent_id=agent_id, above=above),
                transcript=sidechain,
                agents_host=self._host,
                depth=self.depth + 1,
                mcp_tools=self._parent.mcp_tools,
                agent=(agent_id, args.subagent_type),
                detach=self._parent.detach,
            )
            # What the parent's SubagentStart hooks added follows the prompt in the child's conversation.
            _start(
                loop,
                RunQuery(
                    prompt=UserMessage(content=args.prompt),
                    options=options,
                    sink=events,
                    control=control,
                    opening=opening,
                ),
            )
            handed_over = True
            result = await _relay(events, channel, tool_use_id)
            if result is not None:
                run.agents_api_ms += result.duration_api_ms
            if child.failure is not None:
                raise ToolError(f"the {args.subagent_type} agent crashed: {child.failure}")
            conversation = await loop.ask(GetConversation(), block=False)
            _keep_sidechain(parent, Sidechain(agent_id, args.subagent_type, tool_use_id, conversation))
        finally:
            with trio.CancelScope(shield=True):
                if handed_over and not control.finished:  # cut short (an abort, a budget stop, a discarded response)
                    control.request_abort("user")
                    await child.abort("user")
                    await control.wait_ended()
                await child.close()
                events.close_receiver()
                _write_sidechain(sidechain)
        if result is None:
            raise ToolError(f"the {args.subagent_type} agent ended without a result")
        if result.is_error or result.subtype != "success":
            why = "; ".join(result.errors) or result.result or result.subtype
            raise ToolError(f"the {args.subagent_type} agent stopped ({result.subtype}): {why}")
        return result.result or f"(the {args.subagent_type} agent returned no text)"

    def _spend_above(self, run: Run, agent_id: str, agent_type: str, tool_use_id: str) -> SpendAbove:
        """How the child's ledger reports each priced call: into the parent's `usage_by_agent` entry for it (its
        own query tokens, not its side calls'), then to the parent's accounts (`_charge`)."""
        usage_by_agent = run.agent_usage
        if usage_by_agent is None:
            usage_by_agent = run.agent_usage = {}
        usage_by_agent[agent_id] = AgentUsage(
            agent_type=agent_type, parent_tool_use_id=tool_use_id, usage=Usage(), total_cost_usd=0.0
        )

        def above(model: str, usage: Usage, cost: float, agent_usage: bool) -> bool:
            spent = usage_by_agent[agent_id]
            usage_by_agent[agent_id] = dataclasses.replace(
                spent,
                usage=spent.usage + usage if agent_usage else spent.usage,
                total_cost_usd=spent.total_cost_usd + cost,
            )
            return self._charge(run, model, usage, cost, agent_usage)

        return above

    def _charge(self, run: Run, model: str, usage: Usage, cost: float, agent_usage: bool) -> bool:
        """A child's priced call, counted as the parent query's; True when the parent's cap is reached."""
        answer = self._parent.accounts.charge_spend(model, usage, cost, agent_usage)

        def answered(future: TrioFuture[BudgetStatus]) -> None:
            try:
                status = future.get_nowait()
            except Exception:  # noqa: BLE001 - the guard is gone: the session is closing
                return
            if status.exceeded:
                run.budget_exceeded = True

        # At once for the parent's own ledger (which a grandparent's cap may fill); under a host budget, when
        # the parent's BudgetGuard (which reports it to the host's) answers.
        answer.add_done_callback(answered)
        return run.budget_exceeded  # set, the parent stops at its next emission


async def _relay(
    events: EventChannel[Any], channel: EventChannel[Any] | None, tool_use_id: str
) -> ResultMessage | None:
    """The child's events to the parent's turn channel, tagged, until its stream ends; its `result`."""
    result: ResultMessage | None = None
    while True:
        if not events.items and not await events.wait():
            return result
        item = events.take()
        if type(item) is dict:  # a raw stream event, as the handle would hand it out
            item = stream_event(item)
        elif type(item) is ResultMessage:
            result = item
            continue
        if not hasattr(item, "parent_tool_use_id"):
            continue  # the loop's own bookkeeping (`Settled`)
        if item.parent_tool_use_id is None:  # a grandchild's keeps its own parent's id
            item = dataclasses.replace(item, parent_tool_use_id=tool_use_id)
        if channel is not None:
            await channel.send(Forwarded(event=item))


def _write_sidechain(sidechain: SidechainLog | None) -> None:
    """What the child left buffered, written (the parent's log: its file, its buffer). A failure (a full disk)
    is not the child's: the records stay first in line in the parent's buffer, and the parent's own writes
    wait for room, or end its query, by `runtime.loop.disk`'s rule."""
    if sidechain is not None:
        with contextlib.suppress(OSError):
            sidechain.write()


def _start(loop: ActorRef[Any], message: RunQuery) -> None:
    """The child's query is sent; its span (while telemetry is on) is this Agent call's child."""
    telemetry.subagent_submitted(message.control)
    loop.tell(message)


def _keep_sidechain(parent: QueryLoop, sidechain: Sidechain) -> None:
    """The parent keeps a finished subagent's conversation (`sidechains`: the shared empty dict until the first)."""
    if parent.sidechains is EMPTY_DICT:
        parent.sidechains = {}
    parent.sidechains[sidechain.agent_id] = sidechain
