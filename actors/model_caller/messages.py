"""The ModelCaller's messages: a call's start (`StartCall`, with the query's `CallFeed` and the call's
`CallProgress`), and what it sends to the turn channel (`RetryAnnounced`, `ConsumerGone`, `CallEnded`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.tool_executor import BeginTurn
from queryloop.runtime.kernel.flow import EventChannel
from queryloop.runtime.kernel.messages import CarrierMessage, Message, keyword_maker, record
from queryloop.runtime.loop.events import AssistantMessage, SystemMessage, Usage
from queryloop.runtime.loop.model import ModelError, ModelRequest
from queryloop.runtime.loop.stream import usage_from

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from queryloop.runtime.loop.persistence import TranscriptLog


class CallProgress:
    """What a call's stream has reported so far, kept current by the ModelCaller.

    The QueryLoop reads it when it bills a call that was cut short (an abort): the spend the stream reported is
    kept. Raw `usage` objects, turned into a `Usage` only then. Also whether the consumer has gone (reported to
    the loop once), and whether the loop has cut the call."""

    __slots__ = ("consumer_gone", "cut", "delta_usage", "held", "start_usage")

    def __init__(self) -> None:
        self.start_usage: dict[str, Any] | None = None
        self.delta_usage: dict[str, Any] | None = None
        self.held: list[Any] | None = None
        """The `message_start` held back until the next event: a loop that cuts the call shows it (as it bills it)."""
        self.consumer_gone = False
        self.cut = False
        """Set by the loop when it ends the query under this call: nothing more of it reaches anyone
        (the call's task may still run a step before its cancellation lands)."""

    def usage(self) -> Usage | None:
        """The usage the stream reported (None if it never started)."""
        if self.start_usage is None:
            return None
        usage = usage_from(self.start_usage, Usage())
        return usage if self.delta_usage is None else usage_from(self.delta_usage, usage)


@record
class RetryAnnounced(CarrierMessage):
    """Sent to the turn channel: a retry's `system:api_retry`, which the ModelCaller has logged and given to the
    consumer itself, so that it comes before every event of the retried request (the loop takes it into the
    conversation only; were it sent through the loop, a retry without backoff could stream first)."""

    message: SystemMessage


@record
class ConsumerGone(Message):
    """Sent to the turn channel: the query's consumer stopped listening (the loop takes it as the user's abort)."""


class CallFeed:
    """One query's model calls, run in order by one task of the ModelCaller (see the module docstring).

    Made by the QueryLoop, one per query, and used on the trio thread only. The loop's side: `accepting` (a task
    serves the feed: `feed` a call to it; else send it as a `StartCall`), `feed` and `close`. The ModelCaller's
    side: `serving` (the scope of the task serving it), `wait` and `take` (the loop's next call, without a
    checkpoint when one is queued)."""

    __slots__ = ("_calls", "_on_served", "api_s", "calling", "serving")

    def __init__(self) -> None:
        self.api_s = 0.0  # seconds the query's requests spent in the API, every attempt (`duration_api_ms`)
        self._calls: EventChannel[StartCall] = EventChannel(1)  # a few calls a query, each `push`ed: never waits
        self._on_served: Callable[[], None] | None = None
        self.serving: trio.CancelScope | None = None
        """The cancel scope of the ModelCaller's task serving this feed (None: no task serves it)."""
        self.calling = False
        """The serving task is running a call (not waiting for the next one)."""

    @property
    def accepting(self) -> bool:
        """A task serves the feed and no abort has cut it: a call `feed` to it will be run."""
        serving = self.serving
        return serving is not None and not serving.cancel_called and not self._calls.closed

    @property
    def closed(self) -> bool:
        return self._calls.closed

    @property
    def queued(self) -> bool:
        """A call is waiting in the feed for the serving task."""
        return bool(self._calls.items)

    def feed(self, call: StartCall) -> None:
        """The next call of the query, to the task serving the feed (`accepting` must be True)."""
        self._calls.push(call)

    def close(self, then: Callable[[], None] | None = None) -> None:
        """No more calls: the serving task ends. `then()` runs once no task serves the feed (now if none does)."""
        self._calls.close()
        if then is not None:
            if self.serving is None:
                then()
            else:
                self._on_served = then

    def wait(self) -> Awaitable[bool]:
        """The ModelCaller's side: True when the next call may be `take`n, False at the end (the channel's own wait)."""
        return self._calls.wait()

    def take(self) -> StartCall:
        return self._calls.take()

    def served(self) -> None:
        """The ModelCaller's side: the task serving the feed has ended."""
        self.serving = None
        then, self._on_served = self._on_served, None
        if then is not None:
            then()


@record
class StartCall(CarrierMessage):
    request: ModelRequest
    sink: EventChannel[Any]
    """The turn channel, to the QueryLoop."""
    events: EventChannel[Any]
    """The query's event channel, to its consumer."""
    progress: CallProgress
    turn: BeginTurn
    """What the executor needs to run this call's tools (passed on with each `AddTool`)."""
    max_retries: int
    fallback_available: bool = False
    """Persistent overload (retries exhausted on 529s) then asks for the fallback model, as Claude Code does."""
    feed: CallFeed | None = None
    """The query's feed: the task this call starts runs the query's later calls from it (None: this call only)."""
    transcript: TranscriptLog | None = None
    """The session's log: each message's record is buffered there before the consumer can take the message
    (`persistence`'s rule); the QueryLoop then does not log it again."""


@record
class CallEnded(CarrierMessage):
    """The last item a call sends to the turn channel."""

    stop_reason: str | None = None
    usage: Usage = Usage()
    withheld: AssistantMessage | None = None
    """A prompt-too-long or max-output-tokens error message, held back for recovery."""
    error: ModelError | None = None
    """The call failed for good (after retries); not withheld."""
    fallback: bool = False
    stop_details: dict[str, Any] | None = None
    """The API's `stop_details` (a refusal's category and explanation), as sent."""


start_call = keyword_maker(StartCall)
call_ended = keyword_maker(CallEnded)
"""`StartCall(...)` and `CallEnded(...)` for every call (`keyword_maker`)."""
