"""The QueryLoop's messages, and the abort request a query's handle shares with the loop."""

from __future__ import annotations

from typing import Any

import trio

from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import AbortReason, CarrierMessage, Message, record
from queryloop.runtime.loop.events import TranscriptMessage, UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import ContinueReason, Terminal


class QueryControl:
    """Shared by a query's handle and the loop, on the trio thread: the abort request.

    The session sets `abort_reason` before broadcasting `Abort`, so an abort that
    overtakes the `RunQuery` in the mailbox still reaches the query. Once the loop has
    decided how the query ends (`decided`), an abort changes nothing and is not recorded:
    the query ends as decided, like Claude Code's, whose last abort check has passed.
    """

    __slots__ = ("_ended", "abort_reason", "decided", "finished")

    def __init__(self) -> None:
        self.abort_reason: AbortReason | None = None
        self.decided = False
        """Set when the loop has its terminal: what is left is stopping helpers and sending the result."""
        self.finished = False
        """Set once the query's work is over (its result sent, or the session closed under it): `end()`."""
        self._ended: trio.Event | None = None
        """Made only for a caller that waits for the end (most never do)."""

    def end(self) -> None:
        """The query's work is over: wake whoever waits in `wait_ended`."""
        self.finished = True
        if self._ended is not None:
            self._ended.set()

    async def wait_ended(self) -> None:
        """Until `end()` (at once, without a checkpoint, if it has been called)."""
        if self.finished:
            return
        if self._ended is None:
            self._ended = trio.Event()
        await self._ended.wait()

    def request_abort(self, reason: AbortReason) -> bool:
        """Record the first abort reason while it can still change the ending; True if recorded now."""
        if self.abort_reason is not None or self.decided or self.finished:
            return False
        self.abort_reason = reason
        return True


@record
class RunQuery(CarrierMessage):
    """A user message to answer. Sent while a query runs, it waits (`QueryLoop`: taken in at that query's next
    turn boundary, or run next); with `interrupt`, the session has aborted the running query and it runs first."""

    prompt: UserMessage
    options: QueryOptions
    sink: EventChannel[Any]
    control: QueryControl
    interrupt: bool = False
    opening: tuple[TranscriptMessage, ...] = ()
    """Messages that follow the prompt in the conversation (`QuerySetup.opening`: a subagent's SubagentStart's)."""


@record
class GetConversation(Message):
    """Answered with a copy of the session's conversation."""


@record
class Settled(Message):
    """Sent to the query's channel just before `result`: how the query ended (the handle keeps it)."""

    terminal: Terminal
    transitions: list[ContinueReason]


@record
class Forwarded(CarrierMessage):
    """A subagent's event, tagged with its `parent_tool_use_id`, on its way through the parent's turn
    channel to the parent's consumer (the parent's conversation never takes it: the subagent's log has it)."""

    event: Any


@record
class GetSidechains(Message):
    """Answered with the subagents' conversations, by agent id (restored on resume, or run since)."""


@record
class CompactNow(Message):
    """`session.compact()`: compact the conversation now, between queries (`controls.compact_now`); answered
    with the compact boundary (a `SystemMessage`)."""

    options: QueryOptions
    """The options the session's next query would run with (its hooks, its compaction model and window)."""
    instructions: str | None = None


@record
class GetContextUsage(Message):
    """`session.context_usage()`: answered with a `ContextUsageResponse` for the session's next query."""

    options: QueryOptions
