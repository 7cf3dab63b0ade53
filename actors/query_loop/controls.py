"""What a session asks of its `QueryLoop` beside its queries, as functions of the loop (`answer`):

* `GetConversation`, `GetSidechains`: copies of the conversation and of the subagents' conversations;
* `GetContextUsage`: `session.context_usage()`, counted from the conversation and the next query's options
  (`runtime.loop.context_usage`: no model call);
* `CompactNow`: `session.compact()`, Claude Code's `/compact` (`compact_now`).

A manual compaction runs between queries, as a query does: it holds the loop (`loop.running`) while it runs, so
a message sent meanwhile waits its turn and runs once it is over; asked while a query runs or waits, it is
refused (`QueryInProgress`). It compacts what the next request would send (what follows the conversation's last
compact boundary) as an autocompaction does, with trigger `manual`: the PreCompact hooks (`custom_instructions`:
the instructions given, else the options' `compact_instructions`), the Compactor's summary request (the
instructions appended under Claude Code's `Additional Instructions:`), the boundary and the summary joining the
conversation and the transcript, then the SessionStart (`compact`) and PostCompact hooks. Its answer is the
compact boundary; `CompactFailed` says why there is none, in Claude Code's words (nothing to compact, a
PreCompact block, the summary request's error, an abort).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final

from queryloop.actors.compactor import Compact, Compacted, context_config
from queryloop.actors.query_loop.context import install_compaction
from queryloop.actors.query_loop.intake import control, query_tools, system_prompt
from queryloop.actors.query_loop.lifecycle import pre_compact
from queryloop.actors.query_loop.messages import (
    CompactNow,
    GetContextUsage,
    GetConversation,
    GetSidechains,
    QueryControl,
)
from queryloop.actors.query_loop.run import PhaseScope, QuerySetup, Run, TranscriptUnwritable, flush_for_room
from queryloop.runtime._frozen import EMPTY_DICT, EMPTY_LIST
from queryloop.runtime.errors import CompactFailed, QueryInProgress, WorkCancelled
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.loop.context_usage import ContextUsageResponse, context_usage
from queryloop.runtime.loop.events import SystemMessage
from queryloop.runtime.loop.model import ModelError
from queryloop.runtime.loop.transcript import messages_after_compact_boundary, user_context_message

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.runtime.loop.options import QueryOptions

SESSION_ASKS = (GetConversation, GetSidechains, GetContextUsage, CompactNow)
"""The messages `answer` takes."""

MANUAL: Final = "manual"
NOT_ENOUGH_MESSAGES = "Not enough messages to compact."
IN_PROGRESS = "a query or a compaction of the session runs (or waits its turn): compact once it has ended"
CANCELED = "Compaction canceled."
"""Claude Code's words for a compaction that an abort cut."""


def answer(loop: QueryLoop, message: Any) -> Any:
    """The answer to one of `SESSION_ASKS` (a coroutine, run as the loop's work, for `CompactNow`)."""
    kind = type(message)
    if kind is GetConversation:
        return list(loop.conversation)
    if kind is GetSidechains:
        return dict(loop.sidechains)
    if kind is GetContextUsage:
        return usage_of(loop, message.options)
    return compact_now(loop, message)


def usage_of(loop: QueryLoop, options: QueryOptions) -> ContextUsageResponse:
    """The context a query of `options` would start with now: its system prompt, its tools, and what its first
    request would send of the conversation (the user context's message first)."""
    tools, _ = query_tools(loop, options)
    head = user_context_message(options.user_context)
    messages = messages_after_compact_boundary(loop.conversation)
    return context_usage(
        model=options.model,
        system=system_prompt(options),
        tool_schemas=[tool.api_schema() for tool in tools],
        messages=[head, *messages] if head is not None else messages,
        limits=context_config(options).limits,
        auto_compact=options.auto_compact,
    )


def compact_now(loop: QueryLoop, message: CompactNow) -> Coroutine[Any, Any, SystemMessage]:
    """Start a manual compaction (module docstring); `QueryInProgress` at once while a query runs or waits."""
    if loop.running is not None or loop.queued:
        raise QueryInProgress(IN_PROGRESS)
    options = message.options
    instructions = message.instructions
    if instructions is not None and instructions.strip() and instructions != options.compact_instructions:
        options = options.model_copy(update={"compact_instructions": instructions})
    setup = QuerySetup(
        options=options,
        sink=EventChannel(1),  # never sent to: no consumer reads a compaction's events (`consumer_open`)
        control=QueryControl(),
        system=EMPTY_LIST,
        tool_schemas=EMPTY_LIST,
        tools=EMPTY_DICT,
        started=time.monotonic(),
        context_config=context_config(options),
        context_message=None,
        prompt_uuid="",
        can_use_tool=None,
        **control(loop, options),
    )
    run = Run(setup=setup, caches=loop.caches, model=options.model, consumer_open=False)
    loop.running = run  # the loop is held: a message sent meanwhile waits its turn
    return _held(loop, run)


async def _held(loop: QueryLoop, run: Run) -> SystemMessage:
    try:
        return await _compact(loop, run)
    finally:
        loop.running = None
        run.setup.control.end()
        if loop.queued:
            loop._submit(loop.queued.popleft())  # noqa: SLF001 - the loop's own step


async def _compact(loop: QueryLoop, run: Run) -> SystemMessage:
    setup = run.setup
    if setup.setup_error is not None:
        raise CompactFailed(setup.setup_error)
    messages = messages_after_compact_boundary(loop.conversation)
    if not messages:
        raise CompactFailed(NOT_ENOUGH_MESSAGES)
    hooks = setup.hooks
    if hooks is not None and hooks.has("PreCompact"):
        reason, _ = await pre_compact(loop, run, hooks, MANUAL)
        if setup.control.abort_reason is not None:
            raise CompactFailed(CANCELED)
        if reason is not None:
            raise CompactFailed(reason)
    compacted: Compacted | None = None
    with PhaseScope(run):
        try:
            ask = Compact(messages=messages, config=setup.context_config, trigger=MANUAL)
            compacted = await loop.compactor.ask(ask, block=False)
        except WorkCancelled:
            compacted = None
        except ModelError as error:  # a manual compaction's failure is its caller's (an automatic one's is logged)
            raise CompactFailed(f"Error during compaction: {error}") from error
    if setup.control.abort_reason is not None or compacted is None:
        raise CompactFailed(CANCELED)
    installed = await install_compaction(loop, run, compacted.messages, compacted.pre_tokens, MANUAL)
    if loop.transcript is not None:
        try:
            await flush_for_room(run, loop.transcript)
        except TranscriptUnwritable as unwritable:
            raise CompactFailed(f"the compaction is in the conversation, not in its transcript: {unwritable}") from None
    boundary = installed[0]
    assert type(boundary) is SystemMessage  # `post_compact_messages`: the boundary first
    return boundary
