"""Compactor: keeps a loop inside its context window (Claude Code's context pipeline and its 413 cascade).

`Prepare` runs the pipeline on the messages of one iteration, lightest first:
tool-result budget (oversized results written to the session's directory,
replaced by a preview and the path), snip, microcompact, (context collapse is
staged in the background and only committed on overflow), autocompact when the
count reaches the threshold (a summary from the compaction model, a
`compact_boundary`, the summary as the new start), then the preemptive
blocking-limit check, which applies only when autocompact and reactive compact
are not both on.

`StageCollapse` (told after each turn) stages a collapse of the older rounds;
`DrainCollapses` commits what is staged (the 413 cascade's first step);
`Compact` with trigger `reactive` is its second step. A failed compaction
costs the compaction, never the loop: `Compacted` is then None (a `manual`
one, `session.compact()`'s, raises its `ModelError` to the one who asked).

The QueryLoop spawns it the first time one of these is needed: a session whose context never
needs the pipeline never has a Compactor.

Its spill folder is the loop's `session_dir` (the host's, or a durable session's beside its
transcript: never removed here) or, when there is none, a temporary folder it makes at the first
spill and removes when it stops (the session's close, the runtime's, a crash of the session): full
tool outputs must not outlive their session. A subagent's loop is given its parent's folder
(`SessionDir`), so a subagent's spills live and die with the session that started it.
"""

from __future__ import annotations

import operator
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import trio
from pykka import ActorDeadError

from queryloop.actors.budget_guard import RecordUsage
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.kernel.messages import CarrierMessage, Message, record
from queryloop.runtime.loop.context import (
    ContextLimits,
    StagedCollapse,
    apply_tool_result_budget,
    commit_collapses,
    compact_prompt,
    fit_for_summary,
    microcompact,
    post_compact_messages,
    snip,
    stage_collapse,
    token_count_with_estimation,
    token_warning_state,
)
from queryloop.runtime.loop.events import TranscriptMessage, UserMessage
from queryloop.runtime.loop.model import (
    DEFAULT_STREAM_IDLE_TIMEOUT_S,
    ModelError,
    ModelProvider,
    ModelRequest,
    retry_delay_s,
)
from queryloop.runtime.loop.pricing import context_window_for
from queryloop.runtime.loop.spill import (
    UnsafeSpillPath,
    make_spill_folder,
    remove_spill_folder,
    safe_file_stem,
    spill_file_name,
    spill_path,
    write_spilled,
)
from queryloop.runtime.loop.stream import complete_text
from queryloop.runtime.loop.transcript import normalize_messages_for_api

if TYPE_CHECKING:
    from pykka import ActorRef

    from queryloop.actors.budget_guard import BudgetGuard
    from queryloop.runtime.kernel._future import TrioFuture
    from queryloop.runtime.loop.options import QueryOptions

MAX_CONSECUTIVE_AUTOCOMPACT_FAILURES = 3
"""After this many failed autocompactions in a row a query stops trying (a circuit breaker). Counted per
query, as Claude Code keeps it in the loop's `autoCompactTracking` ("always undefined on the first
iteration"): the next query tries again. Only autocompactions count; a success resets it."""

CompactTrigger = Literal["auto", "reactive", "manual"]
"""Why a compaction runs: the pipeline's autocompaction, the prompt-too-long cascade's, or `session.compact()`."""

COMPACT_SYSTEM_PROMPT = "You are a helpful AI assistant tasked with summarizing conversations."


@record
class ContextConfig(Message):
    """The context settings of one query (part of its config snapshot)."""

    model: str
    limits: ContextLimits
    auto_compact: bool
    reactive_compact: bool
    context_collapse: bool
    max_tool_result_chars: int
    tool_result_preview_chars: int
    microcompact_keep_recent: int
    collapse_keep_recent_rounds: int
    snip_max_rounds: int | None
    compact_instructions: str | None = None
    max_retries: int = 2
    """A compaction request that fails as a model call may (overloaded, rate-limited, 5xx, cut) is sent again,
    after a backoff, up to this many times: the query's own `max_retries`."""
    stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S
    """The query's stream watchdog, which bounds a compaction request's stream as it does the loop's own."""


_context_key = operator.attrgetter(
    "model",
    "context_window",
    "max_output_tokens",
    "summary_output_reserve",
    "autocompact_buffer_tokens",
    "warning_buffer_tokens",
    "blocking_buffer_tokens",
    "auto_compact",
    "reactive_compact",
    "context_collapse",
    "max_tool_result_chars",
    "tool_result_preview_chars",
    "microcompact_keep_recent",
    "collapse_keep_recent_rounds",
    "snip_max_rounds",
    "compact_instructions",
    "max_retries",
    "stream_idle_timeout_s",
)
"""The options a query's `ContextConfig` is made of, read in one C call (a tuple: the key of its cache)."""

_context_configs: dict[tuple[Any, ...], ContextConfig] = {}


def context_config(options: QueryOptions) -> ContextConfig:
    """A query's context settings, part of its config snapshot.

    Frozen, so one object serves every query with the same settings: made anew for each query, the
    two of them cost about 3.6 µs (a frozen dataclass sets each field through `object.__setattr__`),
    against a lookup of its options' values.
    """
    key = _context_key(options)
    config = _context_configs.get(key)
    if config is None:
        if len(_context_configs) >= 256:  # a host with ever new settings: kept bounded
            _context_configs.clear()
        config = _context_configs[key] = ContextConfig(
            model=options.model,
            limits=ContextLimits(
                context_window=options.context_window or context_window_for(options.model),
                max_output_tokens=options.max_output_tokens,
                summary_output_reserve=options.summary_output_reserve,
                autocompact_buffer=options.autocompact_buffer_tokens,
                warning_buffer=options.warning_buffer_tokens,
                blocking_buffer=options.blocking_buffer_tokens,
            ),
            auto_compact=options.auto_compact,
            reactive_compact=options.reactive_compact,
            context_collapse=options.context_collapse,
            max_tool_result_chars=options.max_tool_result_chars,
            tool_result_preview_chars=options.tool_result_preview_chars,
            microcompact_keep_recent=options.microcompact_keep_recent,
            collapse_keep_recent_rounds=options.collapse_keep_recent_rounds,
            snip_max_rounds=options.snip_max_rounds,
            compact_instructions=options.compact_instructions,
            max_retries=options.max_retries,
            stream_idle_timeout_s=options.stream_idle_timeout_s,
        )
    return config


@record
class Prepare(CarrierMessage):
    messages: list[TranscriptMessage]
    config: ContextConfig
    autocompact_failures: int = 0
    """The query's autocompactions that failed in a row so far (`MAX_CONSECUTIVE_AUTOCOMPACT_FAILURES`)."""
    defer_compact: bool = False
    """A due autocompaction is not run but said (`Prepared.compact_due`): the query's PreCompact hooks decide it."""


@record
class Prepared(CarrierMessage):
    messages: list[TranscriptMessage]
    tokens: int
    compacted: list[TranscriptMessage] | None = None
    """The boundary and summary that now start the conversation, if an autocompaction ran."""
    pre_compact_tokens: int = 0
    snip_tokens_freed: int = 0
    autocompact_failed: bool = False
    """An autocompaction was due and its call failed (the query counts it toward the circuit breaker)."""
    blocking: bool = False
    compact_due: bool = False
    """An autocompaction is due and was deferred (`Prepare.defer_compact`): `messages` and `blocking` are what
    they are without one; the query asks for it (`Compact`) once its PreCompact hooks let it."""


@record
class Compact(CarrierMessage):
    messages: list[TranscriptMessage]
    config: ContextConfig
    trigger: CompactTrigger


@record
class Compacted(CarrierMessage):
    messages: list[TranscriptMessage]
    pre_tokens: int


@record
class StageCollapse(CarrierMessage):
    messages: list[TranscriptMessage]
    config: ContextConfig


@record
class DrainCollapses(CarrierMessage):
    messages: list[TranscriptMessage]


@record
class Drained(CarrierMessage):
    messages: list[TranscriptMessage]
    committed: int


@record
class SessionDir(Message):
    """Asked by a subagent's call: the folder this session's spills go in (a `Path`), made now if it is
    a temporary one not made yet, so that the subagent spills there and not in a folder of its own."""


SESSION_DIR = SessionDir()


class Compactor(TrioActor):
    actor_name = "Compactor"

    def __init__(
        self,
        provider: ModelProvider,
        *,
        budget_guard: ActorRef[BudgetGuard] | None = None,
        session_dir: Path | None = None,
    ) -> None:
        super().__init__()
        self.provider = provider
        self.budget_guard = budget_guard
        self.session_dir = session_dir
        self._own_folder: Path | None = None
        """The temporary folder this Compactor made (`session_dir` then names it), until its removal starts."""
        self._temporary = False
        """Whether `session_dir` is that folder: writes never make it again (`write_spilled`'s `make_folder`)."""
        self.compactions = 0
        self._staged: list[StagedCollapse] = []

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, Prepare):
            return self._prepare(message)
        if isinstance(message, Compact):
            return self._compact(message.messages, message.config, message.trigger)
        if isinstance(message, StageCollapse):
            self._stage(message)
            return None
        if isinstance(message, DrainCollapses):
            drained, committed = commit_collapses(message.messages, self._staged)
            self._staged = []
            return Drained(messages=drained, committed=committed)
        if isinstance(message, SessionDir):
            return self._results_dir().parent
        return super().on_receive(message)

    def _begin_stop(self, reply_to: TrioFuture[Any] | None = None) -> None:
        # The removal starts here, as work, rather than in `on_stop`: `on_stop` runs once the work has
        # unwound, too late to start any, and a removal there would either block the trio thread or
        # outlive the close. As work, stopping waits for it: a session's close returns once it is gone.
        folder, self._own_folder = self._own_folder, None
        if folder is not None:
            try:
                self.start_work(self._remove_own_folder, folder, abortable=False)
            except ActorDeadError:
                self.log.warning("the spill folder {} is left on disk: the runtime has closed", folder)
        super()._begin_stop(reply_to)

    async def _remove_own_folder(self, folder: Path) -> None:
        # Stopping cancels all work, this too: it must run whole. It does not wait for the subagents' groups
        # (shielded, that wait could hold the session's close forever when one of them waits on this group).
        with trio.CancelScope(shield=True):
            await remove_spill_folder(folder)

    async def _prepare(self, request: Prepare) -> Prepared:
        config = request.config
        limits = config.limits
        pending: list[tuple[Path, str]] = []

        def store(tool_use_id: str, text: str) -> str:
            # The tool_use id came from the server: the file is named by the project, never by the id.
            path = spill_path(self._results_dir(), spill_file_name(tool_use_id))
            pending.append((path, text))
            return str(path)

        try:
            messages, _ = apply_tool_result_budget(
                request.messages,
                max_chars=config.max_tool_result_chars,
                preview_chars=config.tool_result_preview_chars,
                store=store,
            )
            if pending:
                await trio.to_thread.run_sync(_write_all, pending, not self._temporary)
        except (OSError, UnsafeSpillPath) as error:
            # Results not saved stay whole in the conversation: a larger request, never a lost result.
            self.log.warning("tool results over the budget kept inline: saving them failed: {}", error)
            messages = request.messages
        messages, snip_freed = snip(messages, config.snip_max_rounds)
        tokens = token_count_with_estimation(messages)
        if token_warning_state(tokens, limits).above_warning:
            messages, _ = microcompact(messages, config.microcompact_keep_recent)
            tokens = token_count_with_estimation(messages)
        failed = due = False
        if (
            config.auto_compact
            and token_warning_state(tokens, limits).above_autocompact
            and request.autocompact_failures < MAX_CONSECUTIVE_AUTOCOMPACT_FAILURES
        ):
            due = request.defer_compact
            compacted = None if due else await self._compact(messages, config, "auto")
            if compacted is not None:
                return Prepared(
                    messages=compacted.messages,
                    tokens=token_count_with_estimation(compacted.messages),
                    compacted=compacted.messages,
                    pre_compact_tokens=compacted.pre_tokens,
                    snip_tokens_freed=snip_freed,
                )
            failed = not due
        blocking_check = not (config.reactive_compact and config.auto_compact)
        # Claude Code counts what snip freed as gone before it checks the limit.
        blocking = blocking_check and token_warning_state(tokens - snip_freed, limits).at_blocking_limit
        return Prepared(
            messages=messages,
            tokens=tokens,
            snip_tokens_freed=snip_freed,
            blocking=blocking,
            autocompact_failed=failed,
            compact_due=due,
        )

    async def _compact(
        self, messages: list[TranscriptMessage], config: ContextConfig, trigger: CompactTrigger
    ) -> Compacted | None:
        pre_tokens = token_count_with_estimation(messages)
        budget = config.limits.context_window - config.limits.summary_output_reserve
        source = fit_for_summary(messages, budget)
        request = ModelRequest(
            model=config.model,
            system=[{"type": "text", "text": COMPACT_SYSTEM_PROMPT}],
            messages=normalize_messages_for_api(
                [*source, UserMessage(content=compact_prompt(config.compact_instructions))]
            ),
            max_tokens=config.limits.summary_output_reserve,
            purpose="compact",
            stream_idle_timeout_s=config.stream_idle_timeout_s,
        )
        try:
            summary = await self._summarize(request, config.max_retries)
        except ModelError as error:
            if trigger == "manual":
                raise  # to `session.compact()`'s caller, who asked for it
            self.log.warning("{} compaction failed: {!r}", trigger, error)
            return None
        self.compactions += 1
        self._staged = []  # staged spans refer to messages the summary has replaced
        return Compacted(
            messages=post_compact_messages(summary, trigger=trigger, pre_tokens=pre_tokens), pre_tokens=pre_tokens
        )

    async def _summarize(self, request: ModelRequest, max_retries: int) -> str:
        attempt = 0
        while True:  # retried as the ModelCaller retries a call: a retryable kind, or the server's word
            try:
                summary, usage = await complete_text(self.provider, request)
                break
            except ModelError as error:
                if not error.retryable or attempt >= max_retries:
                    raise
                delay = retry_delay_s(attempt, error, jitter=random.uniform(0.75, 1.0))
                attempt += 1
                self.log.warning(
                    "compaction request failed ({}); retrying in {:.1f}s ({}/{})",
                    error.kind,
                    delay,
                    attempt,
                    max_retries,
                )
                await trio.sleep(delay)
        if self.budget_guard is not None:
            self.budget_guard.tell(RecordUsage(model=request.model, usage=usage, query_usage=False))
        if not summary:
            raise ModelError("api_error", "the compaction model returned no summary")
        return summary

    def _stage(self, request: StageCollapse) -> None:
        config = request.config
        if not config.context_collapse:
            return
        if not token_warning_state(token_count_with_estimation(request.messages), config.limits).above_warning:
            return
        staged = stage_collapse(request.messages, config.collapse_keep_recent_rounds)
        if staged is not None:
            self._staged = [staged]

    def _results_dir(self) -> Path:
        if self.session_dir is None:
            # A resumed session's id was read from a file: cleaned before it names a folder.
            stem = safe_file_stem(self.supervisor.session_id)
            self.session_dir = self._own_folder = make_spill_folder(f"queryloop-{stem}-")
            self._temporary = True
        return self.session_dir / "tool-results"


def _write_all(pending: list[tuple[Path, str]], make_folder: bool) -> None:
    for path, text in pending:
        write_spilled(path, text, make_folder=make_folder)
