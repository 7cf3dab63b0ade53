"""A query's context in three parts, one model call and its tools (`Turn`), and the pure helpers on them.

- `QuerySetup`: what the query was configured with, fixed when it starts (`intake.new_run`) and never
  changed while it runs: its options, its event sink and control, the system prompt, the tools and their
  schemas, its context limits and user context message, when it started. A frozen record.
- `SessionCaches`: what the session's queries share, made once with the QueryLoop: the incremental views
  of the conversation (normalised messages, oversized-result scan, token count, compact boundary) and the
  last user context's message, so that a query picks up where the one before left off.
- `Run`: the mutable state of the one query running, with references to its `setup` and the session's
  `caches`: the model (a fallback switches it), the turn in flight, abort and ending flags, accounting.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.budget_guard import BudgetStatus
from queryloop.actors.compactor import ContextConfig
from queryloop.actors.model_caller import CallEnded, CallFeed, CallProgress
from queryloop.actors.query_loop.messages import QueryControl, RunQuery, Settled
from queryloop.actors.tool_executor import ResponseGate, ToolResult
from queryloop.runtime import telemetry
from queryloop.runtime._frozen import EMPTY_DICT, EMPTY_LIST, empty_list, empty_set
from queryloop.runtime._records import record
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import AbortReason
from queryloop.runtime.loop.context import OversizedResultScan, TokenCountMemo
from queryloop.runtime.loop.control import PermissionAsker, Permissions, PermissionUpdate
from queryloop.runtime.loop.decisions import rapid_refill_breaker_holds, refills_after_compaction
from queryloop.runtime.loop.disk import DISK_FULL_WAIT_S, disk_error_text, retry_while_full
from queryloop.runtime.loop.event_hooks import QueryHooks
from queryloop.runtime.loop.events import (
    AgentUsage,
    AssistantMessage,
    AttachmentMessage,
    DeferredToolUse,
    ResultMessage,
    SystemMessage,
    TranscriptMessage,
    Usage,
    UserMessage,
)
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import ContinueReason, Terminal
from queryloop.runtime.loop.structured_output import StructuredAnswer
from queryloop.runtime.loop.transcript import CompactBoundary, IncrementalNormalizer, user_context_message

if TYPE_CHECKING:
    from collections.abc import Iterable
    from types import TracebackType

    from queryloop.runtime.kernel._future import TrioFuture
    from queryloop.runtime.loop.persistence import TranscriptLog

TRANSCRIPT_TYPES = (UserMessage, AssistantMessage, SystemMessage, AttachmentMessage)


class BudgetExceeded(Exception):
    pass


class TranscriptUnwritable(Exception):
    """The query gave up on its transcript (`wait_for_room`): it ends, its `result` saying why (the message)."""


@dataclass(slots=True)
class Turn:
    """One model call and its tools."""

    channel: EventChannel[Any]
    """The call's events and its tools' results, in production order."""
    assistant_messages: list[AssistantMessage] = field(default_factory=list)
    # The shared empties until the turn's first tool use (`note_assistant`) or result (`add_tool_results`): a
    # turn that ends the query has none, and its containers would be three objects more in flight at its end.
    tool_results: list[TranscriptMessage] = field(default_factory=empty_list)
    tool_ids: list[str] = field(default_factory=empty_list)
    pending: set[str] = field(default_factory=empty_set)
    ended: CallEnded | None = None
    prevent_continuation: bool = False
    response_closed: bool = False
    held_results: list[TranscriptMessage] | None = None
    """Tool results emitted while their response was still streaming, waiting for its last block (None: no
    result has had to wait, as on most turns)."""
    progress: CallProgress = field(default_factory=CallProgress)
    """What the call's stream reported so far, kept by the ModelCaller (billed even if the call never ends)."""
    usage_recorded: bool = False
    gates: list[ResponseGate] | None = None
    """Calls deferred by their PreToolUse hooks, waiting for the response to be whole (`turn.end_call` opens
    their gates); None while none waits, as on almost every turn."""


@record
class QuerySetup:
    """What a query was configured with: fixed when it starts, the same for every one of its turns.

    The objects `sink` and `control` change state (events pass, an abort is recorded); which ones they
    are does not. The model is not here: a fallback switches it mid-query (`Run.model`)."""

    options: QueryOptions
    sink: EventChannel[Any]
    """The query's events, to its consumer."""
    control: QueryControl
    """The query's abort and ending, shared with the session's handle."""
    system: list[dict[str, Any]]
    tool_schemas: list[dict[str, Any]]
    tools: dict[str, Any]
    """The query's tools by name: its own, its MCP servers', the agent and structured-answer tools."""
    started: float
    """`time.monotonic()` when the query started: its `result`'s `duration_ms`."""
    context_config: ContextConfig
    context_message: UserMessage | None
    """The user context's message (`SessionCaches.context_message`): the same object heads every request's
    messages, so that the session's normalizer finds them unchanged."""
    prompt_uuid: str
    """The `uuid` of the user message that started the query: its `result`'s `user_message_uuid`."""
    hooks: QueryHooks | None
    """The query's hooks by event, and where it runs (None without any: no event runs any)."""
    permissions: Permissions | None
    """The session's permission rules and mode (None: no rule, mode or `can_use_tool` decides anything)."""
    can_use_tool: PermissionAsker | None
    """`can_use_tool`, called with the SDK's context (`permission_asker`)."""
    setup_error: str | None
    """Why the query cannot start (a settings file or rule it cannot use): it ends `turn_setup_failed`."""
    opening: tuple[TranscriptMessage, ...] = ()
    """What follows the prompt in the conversation (a subagent's: its parent's SubagentStart hooks' messages)."""


_NO_CONTEXT: tuple[dict[str, str], UserMessage | None] = (EMPTY_DICT, None)
"""`SessionCaches.user_context` before any user context: shared, as most sessions never have one."""


class SessionCaches:
    """What a session's queries share, one per QueryLoop: each query's first request then normalises (scans
    for an oversized result, counts, searches for a compact boundary) only what the conversation gained since
    the previous query's last one (made per query, every query of a long session would walk the whole
    conversation again).

    A query's user context message is its `QuerySetup`'s: fixed while it runs, though the next query may
    carry another context. What is shared is the last context and its message (`context_message`), so that
    queries with the same context head their requests with the same object."""

    __slots__ = (
        "boundary",
        "hooks",
        "normalizer",
        "oversized_scan",
        "permission_updates",
        "restored",
        "token_count",
        "user_context",
    )

    def __init__(self, restored: int = 0) -> None:
        self.normalizer = IncrementalNormalizer()
        """Each request's `messages`: the previous request's, and only what is new normalised (`_request`)."""
        self.oversized_scan = OversizedResultScan()
        """Whether the conversation holds an oversized tool result, each message looked at once (`_prepare`)."""
        self.token_count = TokenCountMemo()
        """The conversation's tokens, counted once per turn for both the collapse and the pipeline checks."""
        self.boundary = CompactBoundary()
        """What follows the conversation's last compact boundary, searched only in what is new."""
        self.user_context: tuple[dict[str, str], UserMessage | None] = _NO_CONTEXT
        """The last user context and its message, kept while queries carry the same context."""
        self.permission_updates: list[PermissionUpdate] = []
        """Every `Allow(updated_permissions=...)` of the session's queries: each query's permissions replay them."""
        self.restored = restored
        """How many messages the session's conversation was restored with (a resume): until it holds more, no
        query has started (SessionStart)."""
        self.hooks: QueryHooks | None = None
        """The hooks of the session's last query (its SessionEnd hooks run when it closes)."""

    def context_message(self, user_context: dict[str, str]) -> UserMessage | None:
        """The user context's message: the same object while the context is the same."""
        known, made = self.user_context
        if user_context != known:
            made = user_context_message(user_context)
            self.user_context = (dict(user_context), made)
        return made


class QueryPhase(enum.IntEnum):
    """Where a query is in its life (`Run.phase`), in order. The ending is written by one function whoever
    reaches it first (`ending.end_early`, then `ending.send_outcome`): the loop's task, or, where the task is
    suspended at its turn's wait, the abort's own call (`ending.end_now`); the phase says which may still act."""

    RUNNING = 0
    """The loop's task runs, or awaits a step that has a cancel scope (`PhaseScope`)."""
    AWAITING_TURN = 1
    """The loop's task is suspended at its turn's wait: an abort ends the query in the abort's own call."""
    ENDING = 2
    """The query's ending is under way: emission no longer checks the budget."""
    RESULT_SENT = 3
    """`Settled` and the `result` are in the query's stream."""


@dataclass(slots=True)
class Run:
    """The mutable state of one query (Claude Code's toolUseContext): model, turn, abort, accounting; with
    what it was configured with (`setup`) and the session's caches (`caches`)."""

    setup: QuerySetup
    caches: SessionCaches
    model: str
    """The model of the query's calls: its options' until a fallback switches it."""
    calls: CallFeed = field(default_factory=CallFeed)
    """The query's model calls, to the ModelCaller's one task for this query."""
    transitions: list[ContinueReason] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    unsettled: list[tuple[str, Usage]] = field(default_factory=list)
    """Calls of an uncapped query (model, usage), accounted in one go when the query settles."""
    cost_usd: float = 0.0
    last_stop_reason: str | None = None
    last_text: str = ""
    last_message_id: str = ""
    api_error_surfaced: bool = False
    api_error_status: int | None = None
    """The HTTP status of the query's latest failed call (`turn.end_call`): its result's `api_error_status` when
    the query ends on that error."""
    agents_api_ms: int = 0
    """What the query's subagents spent in API calls (their results' `duration_api_ms`)."""
    phase: QueryPhase = QueryPhase.RUNNING
    phase_scope: trio.CancelScope | None = None
    """The cancel scope of the step in flight that awaits code of others (`PhaseScope`), where `abort` finds it."""
    turn_count: int = 1
    autocompact_failures: int = 0
    """Autocompactions of this query that failed in a row (the Compactor's circuit breaker, per query)."""
    compacted_at: int = -2
    """The iteration (`len(transitions)`: one transition a continue) of the query's last autocompaction."""
    rapid_refills: int = 0
    """Autocompactions in a row each due right after the one before (`decisions.rapid_refill`)."""
    terminal: Terminal | None = None
    """Set when an abort ended the query's turn in the abort's own call (`ending.end_now`)."""
    settling: TrioFuture[BudgetStatus] | None = None
    helpers_aborted: bool = False
    """An `Abort` broadcast reached this query: the helpers' work is being cancelled already."""
    consumer_open: bool = True
    budget_exceeded: bool = False
    task_budget_remaining: int | None = None
    turn: Turn | None = None
    memory: str | None = None
    memory_used: bool = False
    memory_failure: SystemMessage | None = None
    """The `hook_error` event of a memory prefetch that failed, until the next attachments emit it."""
    agent_usage: dict[str, AgentUsage] | None = None
    """What each subagent of this query spent, by agent id (`subagent.Subagents`); None: it started none."""
    structured: StructuredAnswer | None = None
    """The query's structured answer so far, when its options have an `output_type`: made with the query, as
    its tool is, but it counts the failed attempts as the query runs (state, not setup)."""
    structured_output: dict[str, Any] | None = None
    """The valid answer (its JSON form) that ended the query: the `result`'s `structured_output`."""
    hook_errors: list[str] = field(default_factory=empty_list)
    """The text of every hook error of this query, in order: the `result`'s `errors` after its ending's own
    (`add_hook_errors`; the shared empty list until the first)."""
    span: telemetry.QuerySpan | None = None
    """The query's `invoke_agent` span while telemetry is on (`runtime.telemetry`)."""
    permission_denials: list[dict[str, Any]] = field(default_factory=empty_list)
    """The calls whose permission was denied (`add_denial`): the result's `permission_denials`."""
    absorbed: list[RunQuery] | None = None
    """Messages sent while this query ran and taken in at one of its turn boundaries (`QueryLoop`): each is
    answered by this query's `result`. None until the first (most queries take none in)."""
    outcome: tuple[Settled, ResultMessage] | None = None
    """The query's last events, once sent: what the messages it took in are answered with."""
    deferred_tool_use: DeferredToolUse | None = None
    """The call a PreToolUse hook deferred (the query ends `tool_deferred`), or that cannot be replayed
    (`tool_deferred_unavailable`): the result's `deferred_tool_use`."""
    disk_error: str | None = None
    """Why this query gave up on its transcript (`wait_for_room`); None while its writes succeed. Set, the
    query's later writes are tried once and never waited for, and its `result`'s `errors` name it."""

    def add_denial(self, denial: dict[str, Any]) -> None:
        if self.permission_denials is EMPTY_LIST:
            self.permission_denials = []
        self.permission_denials.append(denial)

    def add_hook_errors(self, texts: Iterable[str]) -> None:
        if self.hook_errors is EMPTY_LIST:
            self.hook_errors = []
        self.hook_errors.extend(texts)

    @property
    def refill_breaker_armed(self) -> bool:
        """An autocompaction due now would be the rapid-refill breaker's limit: held, the query ends instead."""
        return rapid_refill_breaker_holds(self.compacted_at, len(self.transitions), self.rapid_refills)

    def note_autocompaction(self) -> None:
        """An autocompaction ran at this iteration: the refills in a row, counted (`refills_after_compaction`)."""
        iteration = len(self.transitions)
        self.rapid_refills = refills_after_compaction(self.compacted_at, iteration, self.rapid_refills)
        self.compacted_at = iteration

    def begin_ending(self) -> None:
        """The query's ending is under way (`QueryPhase.ENDING`), unless its result is out already."""
        self.phase = max(self.phase, QueryPhase.ENDING)

    def abort(self, reason: AbortReason) -> None:
        """Record the abort; cancel the step in flight, or wake the loop waiting on its turn."""
        self.setup.control.request_abort(reason)
        if self.phase_scope is not None:
            self.phase_scope.cancel()
        if self.turn is not None:
            self.turn.channel.wake_receiver()  # the model phase has no cancel scope: it looks at the abort


class PhaseScope:
    """The cancel scope of the step in flight (`Run.phase_scope`), where `Run.abort` finds it.

    For the phases that await code of others (a summary, a compaction, the stop hooks). The model
    phase, in every turn, has none: its only wait is on the turn channel, which `Run.abort` wakes
    (measured: one scope fewer per model call saved about 35 µs of CPU per loop of workload W at C=1,
    about 4 %)."""

    __slots__ = ("_run", "_scope")

    def __init__(self, run: Run) -> None:
        self._run = run
        self._scope = trio.CancelScope()

    def __enter__(self) -> trio.CancelScope:
        scope = self._scope
        if self._run.setup.control.abort_reason is not None:
            scope.cancel()
        self._run.phase_scope = scope
        return scope.__enter__()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        try:
            return self._scope.__exit__(exc_type, exc, tb)
        finally:
            self._run.phase_scope = None


async def wait_for_room(
    run: Run, log: TranscriptLog, error: OSError, *, flush: bool = False, bound_s: float = DISK_FULL_WAIT_S
) -> None:
    """The query's write to `log` (its `flush` if `flush`) failed with `error`: try it again while the disk
    is full, with `runtime.loop.disk`'s backoff, for at most `bound_s`.

    Returns once the write has succeeded, or once an abort has cut the wait (in a `PhaseScope`: the query's
    own cancellation; `run.disk_error` is then set and the abort ends the query as usual). Past the bound,
    or at once for an error that room will not end, raises `TranscriptUnwritable` (`run.disk_error` set):
    the query ends with an error result. Either way what was not written stays in the log's buffer, first
    in line for its next write. A query that has given up already does not wait again.
    """
    if run.disk_error is not None:
        return

    async def attempt() -> None:
        if flush:
            await log.flush()
        else:
            log.write()

    failure: OSError | None = None
    with PhaseScope(run):
        try:
            await retry_while_full(attempt, error, bound_s=bound_s)
        except OSError as failed:
            failure = failed
        else:
            return
    run.disk_error = disk_error_text(log.path, failure or error)
    if failure is not None:
        raise TranscriptUnwritable(run.disk_error) from failure


async def flush_for_room(run: Run, log: TranscriptLog) -> None:
    """`log.flush()`, waiting for room while the disk is full (`wait_for_room`: past the bound, it raises)."""
    try:
        await log.flush()
    except OSError as error:
        await wait_for_room(run, log, error, flush=True)


@dataclass(frozen=True, slots=True)
class PendingSummary:
    future: Any
    tool_use_ids: list[str]


def task_budget_of(run: Run) -> dict[str, int] | None:
    total = run.setup.options.task_budget
    if total is None:
        return None
    if run.task_budget_remaining is None:
        return {"total": total}
    return {"total": total, "remaining": run.task_budget_remaining}


def turn_done(turn: Turn) -> bool:
    ended = turn.ended
    if ended is None:
        return False
    return not turn.pending or ended.error is not None or ended.fallback


def note_assistant(turn: Turn, message: AssistantMessage) -> None:
    """A block of the turn's response has arrived: its tool_use (if any) now awaits a result."""
    turn.assistant_messages.append(message)
    for block in message.content:
        if block.get("type") == "tool_use":
            if turn.tool_ids is EMPTY_LIST:
                turn.tool_ids, turn.pending = [], set()
            turn.tool_ids.append(block["id"])
            turn.pending.add(block["id"])


def add_tool_results(turn: Turn, messages: Iterable[TranscriptMessage]) -> None:
    """Messages join the turn's tool results (its own list made at the first)."""
    if turn.tool_results is EMPTY_LIST:
        turn.tool_results = []
    turn.tool_results.extend(messages)


def accept_result(run: Run, turn: Turn, result: ToolResult) -> list[TranscriptMessage]:
    """A tool's answer joins the turn, once: what to emit (its result, then what its PostToolUse hooks
    produced, whose `hook_error` messages' texts join the query's `hook_errors`, as do the failures of
    host code that answered it, `host_errors`)."""
    if result.tool_use_id not in turn.pending:
        return []  # answered already, or not of this turn
    turn.pending.discard(result.tool_use_id)
    if result.host_errors:
        run.add_hook_errors(result.host_errors)
    if result.denial is not None:
        run.add_denial(result.denial)
    if not result.hook_messages:  # (a deferred call's has its attachment)
        add_tool_results(turn, (result.message,))
        return [result.message]
    turn.prevent_continuation |= result.prevent_continuation
    run.add_hook_errors(m.content for m in result.hook_messages if type(m) is SystemMessage)
    messages: list[TranscriptMessage]
    if result.deferred is None:
        messages = [result.message, *result.hook_messages]
    else:  # deferred: no result, its hooks' messages then its `hook_deferred_tool` attachment (`message`)
        run.deferred_tool_use = result.deferred
        messages = list(result.hook_messages)
    add_tool_results(turn, messages)
    return messages
