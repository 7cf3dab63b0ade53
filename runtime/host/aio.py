"""The asyncio facade: `AsyncioRuntime`, `AsyncioSession`, `AsyncioQuery` (public as `queryloop.aio`).

    async with AsyncioRuntime.open() as rt:              # a trio guest on the running asyncio loop
        session = await rt.open_session(QueryOptions(provider=..., tools=[...]))
        query = session.query("Fix the bug")
        async with query:                                # leaving early (or being cancelled) aborts it
            async for event in query:
                print(event.label)
        print(query.terminal.reason, (await query.wait()).subtype)

A thin layer over the trio `Runtime`, `Session` and `QueryHandle`, through `aio_bridge.Bridge`:

* A query's events are moved by one trio task (its pump) in batches: everything its channel holds
  when the pump runs crosses in one call, and the calls of one trio tick in one hop. The pump stays
  at most `event_buffer` events ahead of the consumer (it parks; the consumer wakes it when its
  buffer runs dry), so a slow consumer holds the loop back as on trio. The `result` crosses with the
  end of the stream: when the consumer sees it, no task of the query runs any more.
* Cancelling the consumer (its task cancelled, `asyncio.timeout`, a `TaskGroup` sibling failing, a
  client gone) hands the abort (`user`) to trio synchronously, in the `except CancelledError` of the
  wait (or the first line of `aclose`): no `await` comes before it, so a host that cancels every await
  of its cleanup again (Starlette) cannot lose it. The pump then drains the query without delivering.
* Async tools run on the host's loop (`Tool.runs_on`: "asyncio", or None under this runtime) as
  asyncio tasks; an abort answers the tool at once on the trio side and cancels its task. So do the
  options' other host code: `can_use_tool`, stop and PostToolUse hooks, `memory_prefetch` and
  attachment sources' `collect()` (a web host's permission prompt awaits its own asyncio objects), and
  a model provider marked `runs_on = "asyncio"` (`host.aio_provider`).
Imports `host.aio_bridge`, `host.aio_pipe`, `host.aio_provider`, `host.session`, `loop`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from queryloop.runtime import telemetry
from queryloop.runtime.errors import RuntimeClosed, SessionClosed
from queryloop.runtime.host.aio_bridge import Bridge, HostAttachmentSource, Mode, host_callback, host_tool
from queryloop.runtime.host.aio_pipe import Pipe, StreamedQuery
from queryloop.runtime.host.aio_provider import HostModelProvider
from queryloop.runtime.loop.agents import DEFAULT_MAX_LIVE_AGENTS, AgentDefinition
from queryloop.runtime.loop.events import ResultMessage
from queryloop.runtime.loop.model import runs_on_asyncio
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.sdk_hooks import HookMatcher
from queryloop.runtime.loop.tools import Tool

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable
    from pathlib import Path

    from queryloop.runtime.host.runtime import Runtime
    from queryloop.runtime.host.session import Session
    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.context_usage import ContextUsageResponse
    from queryloop.runtime.loop.events import Block, QueryEvent, SystemMessage, TranscriptMessage
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.mcp.elicitation import McpElicitation, McpElicitationAnswer
    from queryloop.runtime.mcp.servers import McpServer

    AsyncioElicitationHandler = Callable[[McpElicitation], Awaitable[McpElicitationAnswer]]


_HOSTED_FIELDS = (
    "tools",
    "can_use_tool",
    "stop_hooks",
    "subagent_stop_hooks",
    "post_tool_use_hooks",
    "hooks",
    "stop_failure_hooks",
    "memory_prefetch",
    "attachment_sources",
    "provider",
    "summary_provider",
    "compact_provider",
    "agents",
)
"""The options whose code the host writes: under this runtime it runs on the host's asyncio loop (a model
provider only if it says it is written for asyncio: the built-in ones, and wrappers of them, are trio's)."""


class AsyncioRuntime:
    """A queryloop runtime for asyncio programs: `async with AsyncioRuntime.open() as rt:`, or
    `rt = await AsyncioRuntime.start()` ... `await rt.aclose()` (a notebook, where it spans cells)."""

    def __init__(self, bridge: Bridge) -> None:
        self._bridge = bridge
        self._stand_ins: dict[int, tuple[Any, Any]] = {}
        """Each async tool, callback or attachment source of the host's → its trio-side stand-in."""

    @classmethod
    async def start(
        cls,
        *,
        mode: Mode = "guest",
        max_concurrent_model_calls: int | None = None,
        tune_gc: bool = False,
        max_live_agents: int | None = DEFAULT_MAX_LIVE_AGENTS,
    ) -> AsyncioRuntime:
        """Start a runtime on the running asyncio loop and return it (close it with `aclose`).

        `mode="guest"` (the default) runs trio as a guest of this loop (`trio.lowlevel.start_guest_run`),
        on this thread; `mode="thread"` runs it on a thread of its own (for a host that already runs a
        trio guest on this thread, or whose loop must not share its thread). The other arguments
        (`max_concurrent_model_calls`, `tune_gc`, `max_live_agents`) are `Runtime.open`'s, passed to it.
        """
        bridge = Bridge(asyncio.get_running_loop(), mode)
        await bridge.start(
            max_concurrent_model_calls=max_concurrent_model_calls, tune_gc=tune_gc, max_live_agents=max_live_agents
        )
        return cls(bridge)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        *,
        mode: Mode = "guest",
        max_concurrent_model_calls: int | None = None,
        tune_gc: bool = False,
        max_live_agents: int | None = DEFAULT_MAX_LIVE_AGENTS,
    ) -> AsyncIterator[AsyncioRuntime]:
        """`start` (same arguments) for the duration of the block; leaving it closes every session (see `aclose`)."""
        runtime = await cls.start(
            mode=mode,
            max_concurrent_model_calls=max_concurrent_model_calls,
            tune_gc=tune_gc,
            max_live_agents=max_live_agents,
        )
        try:
            yield runtime
        finally:
            await runtime.aclose()

    async def aclose(self) -> None:
        """Close every session (running queries are aborted and end properly), then end the trio run.
        Idempotent; calls made after it began raise `RuntimeClosed`."""
        await self._bridge.aclose()

    @property
    def mode(self) -> Mode:
        return self._bridge.mode

    @property
    def closed(self) -> bool:
        return self._bridge.closing

    @property
    def open_sessions(self) -> int:
        """How many sessions are open (read on this thread: exact in guest mode, a snapshot in thread mode)."""
        runtime = self._bridge.runtime
        return 0 if runtime is None or self._bridge.finished else len(runtime.groups)

    @property
    def host_tasks(self) -> int:
        """Asyncio tasks of tools running now."""
        return len(self._bridge.host_tasks)

    async def open_mcp(
        self, name: str, server: McpServer, *, on_elicitation: AsyncioElicitationHandler | None = None
    ) -> list[Tool]:
        """As `Runtime.open_mcp`: the server's one client lives in the trio run, for every session.
        `on_elicitation`, an asyncio coroutine function, answers the server's requests for the user's input
        on this loop (as a hook does: an abort of the call that asked cancels it here)."""
        runtime = self._running()
        handler = None if on_elicitation is None else host_callback(self._bridge, on_elicitation)
        return await self._bridge.acall(lambda: runtime.open_mcp(name, server, on_elicitation=handler))

    def mcp_tools(self, name: str) -> list[Tool]:
        """As `Runtime.mcp_tools`: the server's tools as last listed."""
        return self._running().mcp_tools(name)

    async def mcp_tools_after(self, name: str, seen: list[Tool]) -> list[Tool]:
        """As `Runtime.mcp_tools_after`: the server's tools once listed again after `seen`."""
        runtime = self._running()
        return await self._bridge.acall(lambda: runtime.mcp_tools_after(name, seen))

    async def mcp_prompts(self, name: str) -> list[dict[str, Any]]:
        """As `Runtime.mcp_prompts`."""
        runtime = self._running()
        return await self._bridge.acall(lambda: runtime.mcp_prompts(name))

    async def mcp_prompt(self, name: str, prompt: str, arguments: dict[str, str] | None = None) -> list[Block]:
        """As `Runtime.mcp_prompt`: the prompt filled in, as one user message's blocks for `session.query`."""
        runtime = self._running()
        return await self._bridge.acall(lambda: runtime.mcp_prompt(name, prompt, arguments))

    async def open_host_budget(self, max_budget_usd: float) -> None:
        """As `Runtime.open_host_budget`: every session opened from now on counts toward one cap."""
        runtime = self._running()
        await self._bridge.acall(lambda: runtime.open_host_budget(max_budget_usd))

    async def host_cost_usd(self) -> float:
        """As `Runtime.host_cost_usd`: what the sessions under the host budget have spent so far."""
        runtime = self._running()
        return await self._bridge.acall(runtime.host_cost_usd)

    def _running(self) -> Runtime:
        runtime = self._bridge.runtime
        if runtime is None or self._bridge.closing:
            raise RuntimeClosed("the asyncio runtime is not running")
        return runtime

    def hops(self) -> dict[str, int]:
        """Hops between the loops so far, and the calls they carried (for benchmarks and tests)."""
        return self._bridge.counters()

    async def open_session(
        self,
        options: QueryOptions | None = None,
        *,
        transcript: Path | None = None,
        resume: Path | None = None,
        fork: bool = False,
        resume_session_at: str | None = None,
        **fields: Any,
    ) -> AsyncioSession:
        """As `Runtime.open_session`: a `QueryOptions` (or its fields), `transcript`, `resume`, `fork`,
        `resume_session_at`."""
        options = options or QueryOptions(**fields)
        hosted = self._hosted_options(options)
        runtime = self._bridge.runtime
        if runtime is None:
            raise RuntimeClosed("the asyncio runtime is not running")

        async def close_orphan(session: Session) -> None:
            await session.close()

        session = await self._bridge.acall(
            lambda: runtime.open_session(
                hosted, transcript=transcript, resume=resume, fork=fork, resume_session_at=resume_session_at
            ),
            orphan=lambda s: self._bridge.nursery.start_soon(close_orphan, s) if self._bridge.nursery else None,
        )
        return AsyncioSession(self, session, options)

    def _hosted_options(self, options: QueryOptions) -> QueryOptions:
        """`options` with its async tools and callbacks replaced by their stand-ins (`_hosted_fields`)."""
        update = self._hosted_fields({name: getattr(options, name) for name in _HOSTED_FIELDS})
        changed = {name: value for name, value in update.items() if value is not getattr(options, name)}
        return options.model_copy(update=changed) if changed else options

    def _hosted_overrides(self, overrides: dict[str, Any]) -> dict[str, Any]:
        hosted = self._hosted_fields({name: overrides[name] for name in _HOSTED_FIELDS if name in overrides})
        return {**overrides, **hosted} if hosted else overrides

    def _hosted_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """The options' fields whose code the host wrote for asyncio, each run on this loop through a stand-in:
        async tools, `can_use_tool`, stop (and SubagentStop), PostToolUse and StopFailure hooks, `memory_prefetch`,
        attachment sources, and the providers (main, summary, compaction, the agents') marked for asyncio.
        A value that is not what `QueryOptions` takes is left as it is (its validation reports it); a list
        (or the agents' dict) none of whose items needs a stand-in is kept as it is (the options then need no
        copy)."""
        hosted: dict[str, Any] = {}
        for name, value in fields.items():
            if name == "hooks" and isinstance(value, dict):  # each event's matchers, their callbacks hosted
                hosted[name] = {event: self._hosted_matchers(listed) for event, listed in value.items()}
            elif isinstance(value, dict):  # `agents`: each definition, by name
                by_key = {key: self._stand_in(name, item) for key, item in value.items()}
                hosted[name] = value if all(by_key[key] is item for key, item in value.items()) else by_key
            elif isinstance(value, list):
                items = [self._stand_in(name, item) for item in value]
                hosted[name] = value if all(a is b for a, b in zip(items, value, strict=True)) else items
            else:
                hosted[name] = self._stand_in(name, value)
        return hosted

    def _stand_in(self, field: str, original: Any) -> Any:
        """The trio-side stand-in of one value of `field` (itself if it needs none), made once: hosting the
        same options again changes nothing."""
        make: Callable[[], Any]
        if field == "tools":
            if not isinstance(original, Tool) or original.runs_in_thread or original.runs_on == "trio":
                return original
            make = functools.partial(host_tool, self._bridge, original)
        elif field in ("provider", "summary_provider", "compact_provider"):
            if not runs_on_asyncio(original):
                return original
            make = functools.partial(HostModelProvider, self._bridge, original)
        elif field == "agents":
            if not isinstance(original, AgentDefinition) or not runs_on_asyncio(original.provider):
                return original
            make = functools.partial(self._hosted_agent, original)
        elif field == "attachment_sources":
            if not callable(getattr(original, "collect", None)):
                return original
            make = functools.partial(HostAttachmentSource, self._bridge, original)
        else:  # can_use_tool, memory_prefetch, a hook
            if not callable(original):
                return original
            make = functools.partial(host_callback, self._bridge, original)
        known = self._stand_ins.get(id(original))
        if known is not None and known[0] is original:
            return known[1]
        hosted = make()
        self._stand_ins[id(original)] = (original, hosted)
        return hosted

    def _hosted_matchers(self, matchers: Any) -> Any:
        """An event's `HookMatcher`s with each callback run on this loop (a value that is not a list of
        matchers is left for `QueryOptions`' validation to report)."""
        if not isinstance(matchers, list):
            return matchers
        return [
            dataclasses.replace(m, hooks=[self._stand_in("hooks", callback) for callback in m.hooks])
            if isinstance(m, HookMatcher) and isinstance(m.hooks, list)
            else m
            for m in matchers
        ]

    def _hosted_agent(self, agent: AgentDefinition) -> AgentDefinition:
        return agent.model_copy(update={"provider": self._stand_in("provider", agent.provider)})


class AsyncioSession:
    """One conversation (`session.id`); made by `AsyncioRuntime.open_session`."""

    def __init__(self, runtime: AsyncioRuntime, session: Session, options: QueryOptions) -> None:
        self._runtime = runtime
        self._bridge = runtime._bridge  # noqa: SLF001 - the facade's own parts
        self.session = session
        """The trio `Session` underneath (use it only from the trio side)."""
        self.options = options

    @property
    def id(self) -> str:
        return self.session.id

    def query(self, prompt: str | list[Block], *, interrupt: bool = False, **overrides: Any) -> AsyncioQuery:
        """Submit one user message (as `Session.query`: it waits its turn, or `interrupt`s); iterate the returned
        query for its events.

        An error of the submission itself (`SessionClosed`, invalid overrides)
        is raised by the first wait on the query. `RuntimeClosed` is raised here.
        """
        if self._bridge.finished or self.session.supervisor.closed:
            if self._bridge.closing:
                raise RuntimeClosed("the asyncio runtime is closed")
            msg = f"session {self.id} is closed"
            raise SessionClosed(msg)
        overrides = self._runtime._hosted_overrides(overrides)  # noqa: SLF001 - the facade's own parts
        if interrupt:
            overrides = {**overrides, "interrupt": True}  # `Session.query`'s own keyword
        pipe = Pipe(self._bridge, self.session)
        parent = telemetry.caller_context()  # the asyncio task's span: the query's parent, on the trio side too
        self._bridge.to_trio(lambda: pipe.submit(prompt, overrides, parent))
        self._bridge.pipes.add(pipe)
        return AsyncioQuery(pipe)

    async def abort(self, reason: AbortReason = "user") -> int:
        """Abort the running query and every in-flight call and tool of the session; returns how many actors
        acknowledged it."""
        session = self.session
        return await self._bridge.acall(lambda: session.abort(reason))

    def abort_nowait(self, reason: AbortReason = "user") -> None:
        """`abort` without waiting for the acks; from any task or thread."""
        self._bridge.send(lambda: self.session.abort_nowait(reason))

    def abort_threadsafe(self, reason: AbortReason = "user") -> concurrent.futures.Future[int]:
        """`abort` from any thread, not through the host's loop: the actors are told in the trio run's
        next tick (`abort_nowait`), then a task gathers their acks (a second `Abort`, idempotent)."""
        session = self.session
        return self._bridge.from_thread(lambda: session.abort(reason), lambda: session.abort_nowait(reason))

    async def transcript(self) -> list[TranscriptMessage]:
        return await self._bridge.acall(self.session.transcript)

    async def sidechains(self) -> dict[str, Sidechain]:
        """As `Session.sidechains`: the subagents' conversations, by agent id."""
        return await self._bridge.acall(self.session.sidechains)

    async def compact(self, instructions: str | None = None) -> SystemMessage:
        """As `Session.compact`: Claude Code's `/compact [instructions]`, between queries; the compact boundary."""
        session = self.session
        return await self._bridge.acall(lambda: session.compact(instructions))

    async def context_usage(self) -> ContextUsageResponse:
        """As `Session.context_usage`: the next query's context, keyed as the Agent SDK's `ContextUsageResponse`."""
        return await self._bridge.acall(self.session.context_usage)

    async def set_model(self, model: str | None = None) -> None:
        """As `Session.set_model`: the model of the session's next queries (None: the options' own again)."""
        session = self.session
        await self._bridge.acall(lambda: session.set_model(model))

    def live_tasks(self) -> int:
        """Work tasks of the session still running (a snapshot in thread mode)."""
        return self.session.live_tasks()

    async def close(self) -> None:
        """Abort what runs, then stop every actor of the session."""
        await self._bridge.acall(self.session.close)


class AsyncioQuery(StreamedQuery[Pipe]):
    """A query's events: `async for event in query`; `await query.wait()` (then `query.result`); `query.terminal`;
    `query.abort()` from any task or thread. `async with query:` aborts it when the block is left
    early; a consumer cancelled while it waits for an event aborts it too (`aio_pipe.StreamedQuery`)."""

    async def next_batch(self) -> list[QueryEvent]:
        """Every event buffered now, waiting only if none is; [] once the stream has ended (as
        `QueryHandle.next_batch`: for a consumer that moves events on in batches)."""
        while (batch := self.take_ready()) == []:
            await self._arrival()
        return batch or []

    def on_ready(self, listener: Callable[[], object] | None) -> None:
        """Call `listener()` on the host's loop whenever events arrive or the stream ends, then read
        them with `take_ready`: for a consumer that forwards events from a callback (a Ray shard),
        which costs no task step and no loop iteration per batch, as awaiting `next_batch` would.
        Events already buffered do not call it: call `take_ready` once after setting it."""
        self._stream.listener = listener

    def take_ready(self) -> list[QueryEvent] | None:
        """Every event buffered now, without waiting: [] when none is, None once the stream has ended
        (its error, if it failed, raised once). The `result` is kept as `__anext__` keeps it."""
        pipe = self._stream
        buffer = pipe.buffer
        if not buffer:
            if pipe.over():
                return None
            pipe.ready_for_more()
            return []
        batch = list(buffer)
        buffer.clear()
        pipe.consumed += len(batch)
        if type(batch[-1]) is ResultMessage:
            pipe.keep_result(batch[-1])
        pipe.ready_for_more()
        return batch
