"""`Runtime`: the trio nursery whose tasks are the work of every session's actors."""

from __future__ import annotations

import itertools
import os
import secrets
from contextlib import asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any

import trio
from loguru import logger

from queryloop.actors.budget_guard import BudgetGuard
from queryloop.actors.model_caller import ModelCaller
from queryloop.actors.query_loop import QueryLoop
from queryloop.actors.query_loop.subagent import AgentsHost, AgentSlots
from queryloop.actors.tool_executor import StreamingToolExecutor
from queryloop.runtime.errors import NotInTrio, RuntimeClosed
from queryloop.runtime.host import _gc
from queryloop.runtime.host._leaving import attach, what_leaves
from queryloop.runtime.host.session import Session, refuse_asyncio_provider
from queryloop.runtime.kernel.supervisor import Supervisor
from queryloop.runtime.loop.agents import DEFAULT_MAX_LIVE_AGENTS
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.restore import LoadedTranscript, load_transcript, open_log, refuse_damaged, resumed_at
from queryloop.runtime.loop.tools import Tool
from queryloop.runtime.mcp.elicitation import ElicitationHandler
from queryloop.runtime.mcp.resources import resource_tools
from queryloop.runtime.mcp.servers import McpServer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
    from pathlib import Path

    from pykka import ActorRef

    from queryloop.runtime.loop.events import Block
    from queryloop.runtime.loop.persistence import TranscriptLog
    from queryloop.runtime.mcp.connection import McpConnection


SHUTDOWN_GRACE_S = 5.0
"""How long leaving `Runtime.open()` waits for its sessions' queries to end before cutting them."""


class Runtime:
    """Hosts sessions side by side in one trio run; open it with `Runtime.open()`."""

    def __init__(
        self,
        nursery: trio.Nursery,
        *,
        max_concurrent_model_calls: int | None = None,
        max_live_agents: int | None = DEFAULT_MAX_LIVE_AGENTS,
    ) -> None:
        self._nursery = nursery
        self.model_calls = (
            trio.CapacityLimiter(max_concurrent_model_calls) if max_concurrent_model_calls is not None else None
        )
        """Host-wide: at most this many model calls stream at once, across every session (None: no cap)."""
        self.agents = AgentsHost(slots=AgentSlots(max_live_agents), model_calls=self.model_calls)
        """Host-wide: the live subagents of every session (`agents.slots.live`) and their cap."""
        self._groups: dict[str, Supervisor] = {}
        self._sessions: dict[str, Session] = {}
        self._prefix = secrets.token_hex(3)
        self._ids = itertools.count(1)
        self.host_budget: ActorRef[BudgetGuard] | None = None
        """A host-wide BudgetGuard every new session reports its spend to (optional)."""
        self._mcp: dict[str, McpConnection] = {}
        self._resource_tools: dict[tuple[str, ...], list[Tool]] = {}
        self._detached = 0
        """Detached runs (StopFailure hooks) not yet ended: the runtime's close waits for them."""
        self._detached_ended = trio.lowlevel.ParkingLot()
        self._closed = False
        """Set when the runtime's block has been left: nothing more is started through it."""

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        *,
        max_concurrent_model_calls: int | None = None,
        tune_gc: bool = False,
        max_live_agents: int | None = DEFAULT_MAX_LIVE_AGENTS,
    ) -> AsyncIterator[Runtime]:
        """Run a runtime for the duration of the `async with` block; leaving it closes every session.

        It must be entered inside a trio run (`trio.run(...)`): elsewhere, under asyncio for one, it
        raises `NotInTrio` (`BlockingRuntime` runs one on its own trio thread, for asyncio and sync code).

        `max_concurrent_model_calls` caps the model calls streaming at once across all sessions
        (a call waits for a slot; its retries' backoff does not hold one).

        `max_live_agents` caps the subagents running at once across all sessions (None: no cap); an
        agent call past it is answered at once with an error result (docs/agents.md).

        `tune_gc` (off by default: a library leaves its host's process settings alone): a host that
        owns its process and runs hundreds of loops at once should pass True. While a runtime opened
        so is open, the collector's youngest generation is collected every 10,000 allocations instead
        of 700, the middle one after 100 young collections instead of 10, and full collections are
        considered after 100 middle ones instead of 10; the thresholds
        are put back when the last such runtime closes. At a thousand loops in flight that gave the
        runtime 1.4× the throughput of `bench loops` and cut the abort p99 of `bench abort` by 30 % (medians
        against one untuned baseline, docs/collector.md; why: `queryloop.runtime.host._gc`). A host may instead
        set `gc.set_threshold(...)` itself.

        Errors leave the block as themselves, never wrapped in the `ExceptionGroup` of the runtime's nursery:
        what the block raises leaves as that very object, its traceback kept (a `ValueError` as itself, Ctrl+C
        as `KeyboardInterrupt`, queryloop's errors as their classes of `queryloop.runtime.errors`), and so does
        the `trio.Cancelled` of an enclosing scope, which `trio.move_on_after` around the block then catches.
        Every session is closed first, whatever the block raised. If closing also fails meanwhile, neither is
        lost: the block's exception leaves with the failure as a note, its traceback included, unless the
        failure is no `Exception` (a `KeyboardInterrupt` while closing) or the block was only cancelled; then
        the failure leaves, with the block's exception as its `__context__`. A task of the runtime that fails
        while the block's exception propagates is noted on it the same way (or, a `KeyboardInterrupt`, leaves
        with the block's exception as a note). When the block raised nothing (or was only cancelled, the
        runtime's tasks having failed), one failure of the runtime's own tasks leaves as itself; several,
        being independent of each other, leave as an `ExceptionGroup` of them.
        """
        if not trio.lowlevel.in_trio_run():
            raise NotInTrio("Runtime.open()")
        if tune_gc:
            _gc.acquire()
        try:
            async with cls._open(max_concurrent_model_calls, max_live_agents) as runtime:
                yield runtime
        finally:
            if tune_gc:
                _gc.release()

    @classmethod
    @asynccontextmanager
    async def _open(cls, max_concurrent_model_calls: int | None, max_live_agents: int | None) -> AsyncIterator[Runtime]:
        runtime: Runtime | None = None
        host_error: BaseException | None = None
        leaving: BaseException | None = None
        try:
            async with trio.open_nursery() as nursery:
                runtime = cls(
                    nursery, max_concurrent_model_calls=max_concurrent_model_calls, max_live_agents=max_live_agents
                )
                try:
                    yield runtime
                except BaseException as error:
                    host_error = error
                    try:
                        await cls._close(runtime, nursery)
                    except BaseException as failure:
                        # An interrupt while closing, or a failure where the block was only cancelled (an outer
                        # scope would swallow the Cancelled, and the failure with it): the failure goes on.
                        if not isinstance(failure, Exception) or isinstance(error, trio.Cancelled):
                            raise
                        attach(error, failure, "closing the runtime failed meanwhile")
                    raise
                await cls._close(runtime, nursery)
        except BaseExceptionGroup as group:
            leaving = what_leaves(group, host_error)
        finally:
            if runtime is not None:
                runtime._closed = True  # every later use raises `RuntimeClosed`
        if leaving is not None:
            # Raised here, outside the handler: inside it, `leaving.__context__` would become the group that
            # holds it, and the block's own exception would print twice.
            raise leaving

    @staticmethod
    async def _close(runtime: Runtime, nursery: trio.Nursery) -> None:
        """Leave `Runtime.open()`: every running query is aborted and ends properly (its tool_uses answered, its
        result sent) before the rest is cancelled; a session that does not settle in time is cut."""
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_GRACE_S):
                for session in list(runtime._sessions.values()):
                    await session.close()
                while runtime._detached:  # the StopFailure hooks those sessions' last queries started
                    await runtime._detached_ended.park()
        finally:
            # Even when a session's close failed: what is left is stopped all the same.
            for connection in runtime._mcp.values():
                connection.close()  # its task ends with the nursery: a stdio server is stopped and reaped
            # What did not settle in time is stopped now: its actors' work is cancelled, their
            # on_stop runs once it has unwound, which leaving the nursery waits for.
            for group in list(runtime._groups.values()):
                group.close_nowait()
            nursery.cancel_scope.cancel()

    @property
    def groups(self) -> Mapping[str, Supervisor]:
        """The open session groups, by session id (the runtime's own index, O(1) add and remove)."""
        return self._groups

    def new_session_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def open_session(
        self,
        options: QueryOptions | None = None,
        *,
        transcript: Path | None = None,
        resume: Path | None = None,
        fork: bool = False,
        resume_session_at: str | None = None,
        **fields: Any,
    ) -> Session:
        """Start a session's actor group; `options` (or the fields of one) configure its queries.

        `transcript`: append the conversation to that JSONL file, absent or empty (one that holds a
        session is refused, `TranscriptHoldsAnotherSession`; one an open session holds, `TranscriptInUse`).
        `resume`: restore the conversation of that file (repaired if a crash cut it; refused with
        `TranscriptDamaged` where damage elsewhere may have lost what the model would be sent) and its
        session id, and go on appending to it unless `transcript` names another file.
        `fork` (with `resume` and a `transcript` of another, new file): the restored conversation goes on
        as a new session, with an id of its own, in that file; the resumed one is left as it was.
        `resume_session_at` (with `resume`, the Agent SDK's option): restore the conversation only up to and
        including the message of that uuid (`ValueError` naming it if the conversation has none). Going on in the
        same file, what followed it is retracted there (a tombstone each: the file keeps it, no load restores it);
        with `fork`, the new file holds the conversation up to that message alone, the resumed one left as it was.
        """
        options = options or QueryOptions(**fields)
        self._check_session_options(options, transcript=transcript, resume=resume, fork=fork)
        loaded: LoadedTranscript | None = None
        if resume is not None:
            loaded = await _load_to_resume(resume)
            if resume_session_at is not None:
                loaded = resumed_at(loaded, resume_session_at, resume)
            transcript = resume if transcript is None else transcript
        elif resume_session_at is not None:
            raise ValueError("resume_session_at= resumes a transcript up to a message: give resume= too")
        # The group first: a session id already open fails here, before anything is written.
        group = await self.start_group(loaded.session_id if loaded is not None and not fork else None)
        log = await _open_transcript(group, transcript, loaded, resume) if transcript is not None else None
        loop = self._spawn_actors(group, options, log, loaded, _session_dir(options.session_dir, transcript))
        session = Session(group, options, loop, log)
        self._sessions[session.id] = session
        return session

    def _check_session_options(
        self, options: QueryOptions, *, transcript: Path | None, resume: Path | None, fork: bool
    ) -> None:
        """`open_session`'s arguments, refused with a clear error before anything is started."""
        if options.provider is None:
            msg = "QueryOptions.provider is required: a ScriptedModel offline, an AnthropicModel for the API"
            raise ValueError(msg)
        refuse_asyncio_provider(options)
        for name in options.mcp_servers:
            self._mcp_connection(name)  # an unknown name fails here, not at the first query
        if fork and (resume is None or transcript is None or _same_path(transcript, resume)):
            msg = "fork=True forks a resumed transcript into another file: give resume= and another transcript="
            raise ValueError(msg)

    def _spawn_actors(
        self,
        group: Supervisor,
        options: QueryOptions,
        log: TranscriptLog | None,
        loaded: LoadedTranscript | None,
        session_dir: Path | None,
    ) -> ActorRef[QueryLoop]:
        """The session's actors; its QueryLoop's ref."""
        # The Compactor and the ToolUseSummarizer are spawned by the QueryLoop on first need, and so is the
        # BudgetGuard where no host budget is set (the loop then accounts inline): most sessions never need
        # them. Under a host budget every call's cost goes to the host, through this session's guard.
        assert options.provider is not None  # `_check_session_options`
        budget = group.spawn(BudgetGuard, parent=self.host_budget) if self.host_budget is not None else None
        executor = group.spawn(StreamingToolExecutor)
        caller = group.spawn(ModelCaller, options.provider, executor=executor, limiter=self.model_calls)
        return group.spawn(
            QueryLoop,
            model_caller=caller,
            executor=executor,
            compact_provider=options.compact_provider or options.provider,
            summary_provider=options.summary_provider or options.provider,
            session_dir=session_dir,
            budget_guard=budget,
            conversation=loaded.messages if loaded is not None else None,
            transcript=log,
            agents_host=self.agents,
            sidechains=loaded.sidechains if loaded is not None else None,
            mcp_tools=self._session_mcp_tools,
            detach=self._detach,
        )

    def _detach(self, run: Callable[[], Awaitable[None]]) -> None:
        """Run `run()` in the runtime's nursery, outliving the query and session that started it (a StopFailure
        hook, which the loop does not await); the runtime's close waits for it, up to its grace period."""
        self._detached += 1
        self._nursery.start_soon(self._run_detached, run)

    async def _run_detached(self, run: Callable[[], Awaitable[None]]) -> None:
        try:
            await run()
        finally:
            self._detached -= 1
            if not self._detached:
                self._detached_ended.unpark_all()

    async def open_mcp(
        self, name: str, server: McpServer, *, on_elicitation: ElicitationHandler | None = None
    ) -> list[Tool]:
        """Connect an MCP server for every session of this runtime; returns its tools, for `QueryOptions.tools`.

        One client per server per runtime: every session given these tools calls through it. They are
        named `mcp__<name>__<tool>`, with the server's input schema as is; `readOnlyHint` makes one
        concurrency-safe. A server that dies gives error results and is restarted on next use; the
        runtime's close stops it. `McpServerUnavailable` if it cannot be started or listed now.
        `on_elicitation` answers the server's requests for the user's input during its calls
        (`queryloop.runtime.mcp.elicitation`); without it they are refused.
        Needs the `mcp` extra (`pip install 'queryloop[mcp]'`).
        """
        if name in self._mcp:
            msg = f"an MCP server named {name!r} is already open in this runtime"
            raise ValueError(msg)
        try:
            from queryloop.runtime.mcp.connection import McpConnection
        except ModuleNotFoundError as error:
            if error.name not in {"mcp", "mcp_types"}:
                raise
            msg = "MCP servers need the mcp extra: pip install 'queryloop[mcp]'"
            raise ModuleNotFoundError(msg, name=error.name) from error
        connection = self._mcp[name] = McpConnection(name, server, self._nursery, on_elicitation)
        try:
            return await connection.open()
        except BaseException:
            del self._mcp[name]
            raise

    def mcp_tools(self, name: str) -> list[Tool]:
        """The tools of the MCP server opened as `name`, as last listed (a new list after each change)."""
        return self._mcp_connection(name).tools

    def _session_mcp_tools(self, names: list[str]) -> list[Tool]:
        """A query's tools from its `mcp_servers`: theirs as listed now, and the resource tools if one has any."""
        connections = [self._mcp_connection(name) for name in names]
        tools = [tool for connection in connections for tool in connection.tools]
        with_resources = tuple(c.name for c in connections if c.has_resources)
        if with_resources:
            made = self._resource_tools.get(with_resources)
            if made is None:  # made once per set of servers (a tool's schema costs ~300 µs)
                made = self._resource_tools[with_resources] = resource_tools(with_resources, self._mcp_connection)
            tools += made
        return tools

    async def mcp_tools_after(self, name: str, seen: list[Tool]) -> list[Tool]:
        """The tools of the MCP server `name` once listed again after `seen` (at once if they were)."""
        return await self._mcp_connection(name).tools_after(seen)

    async def mcp_prompts(self, name: str) -> list[dict[str, Any]]:
        """The prompts of the MCP server `name` (`name`, `description`, `arguments`); `McpRequestFailed`."""
        return await self._mcp_connection(name).prompts()

    async def mcp_prompt(self, name: str, prompt: str, arguments: dict[str, str] | None = None) -> list[Block]:
        """The MCP server `name`'s prompt `prompt` filled in with `arguments`, as the content blocks of one
        user message: `session.query(blocks)` sends it (Claude Code's `/mcp__server__prompt`).
        `McpRequestFailed` with the server's words for an unknown prompt or a missing argument."""
        return await self._mcp_connection(name).prompt(prompt, arguments)

    def _mcp_connection(self, name: str) -> McpConnection:
        connection = self._mcp.get(name)
        if connection is None:
            msg = f"no MCP server named {name!r} is open in this runtime (open_mcp opens one)"
            raise ValueError(msg)
        return connection

    async def open_host_budget(self, max_budget_usd: float) -> ActorRef[BudgetGuard]:
        """One BudgetGuard above every session opened from now on: their spend, summed, is capped here.

        A query whose call takes the host's total to the cap ends `max_budget_usd`, as its own cap would.
        """
        group = await self.start_group(f"{self._prefix}-host-budget")
        self.host_budget = group.spawn(BudgetGuard, max_budget_usd=max_budget_usd)
        return self.host_budget

    async def host_cost_usd(self) -> float:
        """What the sessions under the host budget have spent so far, in USD (0.0 without one)."""
        if self.host_budget is None:
            return 0.0
        spent: float = await self.host_budget.proxy().session_cost_usd
        return spent

    async def start_group(self, session_id: str | None = None) -> Supervisor:
        """Open an empty actor group for a session; `Supervisor.spawn` fills it. `RuntimeClosed` once the
        runtime's `async with` block has been left (its nursery, where the actors' work runs, is gone)."""
        if self._closed:
            msg = "the runtime is closed: open sessions inside its `async with Runtime.open()` block"
            raise RuntimeClosed(msg)
        session_id = session_id or self.new_session_id()
        if session_id in self._groups:
            msg = f"session id {session_id!r} is already open"
            raise ValueError(msg)
        supervisor = Supervisor(session_id, self._nursery, on_closed=self._forget)
        self._groups[session_id] = supervisor
        return supervisor

    def _forget(self, supervisor: Supervisor) -> None:
        self._groups.pop(supervisor.session_id, None)
        self._sessions.pop(supervisor.session_id, None)


async def _load_to_resume(resume: Path) -> LoadedTranscript:
    """The transcript to resume, its problems logged; `TranscriptDamaged` before anything is opened or written."""
    loaded = await trio.to_thread.run_sync(load_transcript, resume)
    for problem in loaded.problems:
        logger.bind(session=loaded.session_id).warning("resuming {}: {}", resume, problem)
    refuse_damaged(loaded, resume)
    return loaded


async def _open_transcript(
    group: Supervisor, transcript: Path, loaded: LoadedTranscript | None, resume: Path | None
) -> TranscriptLog:
    """The session's log, the repairs (or the restored history) on disk before any new message; on a failure
    the group is closed and the error raised."""
    log = None
    try:
        log = await trio.to_thread.run_sync(open_log, transcript, group.session_id, loaded, resume)
        await log.flush()
    except BaseException:
        if log is not None:
            with suppress(OSError):  # a full disk fails this write too: the error raised says so
                log.close()
        await group.close()
        raise
    return log


def _same_path(a: Path, b: Path) -> bool:
    """Whether two paths name one file, by their absolute spelling (no filesystem access)."""
    return os.path.abspath(a) == os.path.abspath(b)


def _session_dir(given: Path | None, transcript: Path | None) -> Path | None:
    """The folder a session's oversized tool results go in (`<it>/tool-results/`): the host's, if it gave one;
    else a durable session's beside its transcript, the transcript's path without its suffix (Claude Code's
    `<session-id>.jsonl` and `<session-id>/`), where a resume finds them and which outlives the session;
    else None, and the session's Compactor makes a temporary one, removed when the session closes."""
    if given is not None or transcript is None:
        return given
    folder = transcript.with_suffix("")
    # A transcript named without a suffix would be its own folder: the folder takes a suffix instead.
    return folder if folder != transcript else transcript.with_name(f"{transcript.name}.d")
