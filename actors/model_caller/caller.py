"""ModelCaller: streams a query's model calls to the query's consumer and the QueryLoop.

One task per query: the first `StartCall` of a query carries the query's `CallFeed` and starts one piece of abortable
work that runs that call, then every later call of the query the QueryLoop puts in the feed, in order (no message, no
task and no cancel scope per call). The task waits for the next call only after a response that asks for one (tool uses
to answer, a withheld error to recover from, a fallback); after a response that ends the turn it ends at once, so that
the query's last call leaves no task to wake when the query ends (the rare call after such a response, a stop hook's
feedback or a token-budget nudge, is sent as a `StartCall` and starts a new task), and the loop closes the feed when
the query ends. An abort cancels the task (the call in flight, if any: closing the provider's stream stops billing) and
is acked once it has unwound. The call's own events go straight to the query's event channel, in production order:
every raw event as it is (the consumer's handle wraps it in its `StreamEvent` as it hands it out) and an
`AssistantMessage` for each content block as it completes (its transcript record buffered in the session's log first,
so that the consumer's handle writes it before taking the message: `runtime.loop.persistence`). The QueryLoop gets,
through the turn channel, each `AssistantMessage` once the consumer has it (to record it and pair its tool uses) and a
final `CallEnded`. Each completed `tool_use` goes to the StreamingToolExecutor right after its message, while the
stream still runs; a `tool_use` cut off by `max_tokens` goes too, marked so that it is answered with an error and never
run. Why not through the QueryLoop: an extra hop per token-sized event, and each event kept alive a scheduler round
longer (measured: `bench loops` at C=1000, 12 % of the round).

Errors: 429 / 529 / 5xx / a cut connection are retried with backoff (honouring `retry-after`, or the server's
`x-should-retry`) up to `max_retries` times, each announced (`system:api_retry`), but only while nothing of that
request has been shown (its `message_start` is held back until its next event); a request that stays overloaded ends
asking for the fallback model, if one is set. A 400 that asks for fewer output tokens is sent again at once with the
`max_tokens` of `runtime.loop.max_tokens`, once per kind per call, outside `max_retries`. Prompt-too-long and
`max_tokens` truncation are *withheld* (`CallEnded.withheld`) for the QueryLoop's recovery. A malformed stream (an event
not a dict with a string `type`, or unreadable; a usage count not a non-negative integer; anything but a `ping` before
`message_start`) is an `api_error` ModelError, never an unclassified exception. docs/design.md has the reasons."""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.model_caller.messages import (
    CallEnded,
    CallFeed,
    ConsumerGone,
    RetryAnnounced,
    StartCall,
    call_ended,
)
from queryloop.actors.tool_executor import add_tool
from queryloop.runtime import telemetry
from queryloop.runtime._frozen import EMPTY_DICT
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.loop import model
from queryloop.runtime.loop.events import (
    SystemMessage,
    Usage,
    api_error_message,
    assistant_message,
    new_uuid,
)
from queryloop.runtime.loop.max_tokens import max_tokens_fix, withheld_cut_off
from queryloop.runtime.loop.model import (
    FORWARDED_AS_THEY_ARE,
    MAX_TOKENS_KINDS,
    FallbackTriggered,
    ModelError,
    ModelProvider,
    ModelRequest,
    noted_event,
)
from queryloop.runtime.loop.stream import MALFORMED, CompletedBlock, ResponseAssembler

if TYPE_CHECKING:
    from pykka import ActorRef

    from queryloop.actors.tool_executor import StreamingToolExecutor

PROMPT_TOO_LONG_ERROR_MESSAGE = "Prompt is too long"


def _asks_for_more(ended: CallEnded) -> bool:
    """Whether the loop will most likely call again after this end: tools to answer, a withheld error
    to recover from, a fallback to retry on. After any other end the query usually ends (a stop hook's
    feedback or a token-budget nudge may still call again: that call starts a new task)."""
    return ended.stop_reason in _MORE_AFTER or ended.withheld is not None or ended.fallback


_MORE_AFTER = frozenset({"tool_use", "pause_turn", "refusal"})
"""Stop reasons after which the loop calls again (a refusal: on the fallback model, if there is one)."""


class _Tries:
    """One call's requests so far: the request to send, the retries made, the max_tokens kinds refit, and
    whether the request streaming now has emitted anything (only an unseen failure may be retried)."""

    __slots__ = ("attempt", "emitted", "refitted", "request")

    def __init__(self, request: ModelRequest) -> None:
        self.request = request
        self.attempt = 0
        self.refitted: tuple[str, ...] = ()
        self.emitted = False


class ModelCaller(TrioActor):
    actor_name = "ModelCaller"

    def __init__(
        self,
        provider: ModelProvider,
        *,
        executor: ActorRef[StreamingToolExecutor] | None = None,
        limiter: trio.CapacityLimiter | None = None,
        retry_base_s: float = 0.5,
        retry_max_s: float = 8.0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        self.provider = provider
        self.executor = executor
        self.limiter = limiter
        """A host-wide cap on concurrent model calls, shared by every session's ModelCaller."""
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._seed = seed
        self._random: random.Random | None = None  # seeded on the first retry: most callers never retry
        self._output_caps: dict[str, int] = EMPTY_DICT
        """Model → the most output tokens the API accepts (a `max_tokens_cap` 400); shared empty until one is learnt."""

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, StartCall):
            feed = message.feed
            if feed is None:  # this call alone: served from a feed that holds nothing more
                feed = CallFeed()
                feed.close()
            elif feed.closed:
                return None
            feed.serving = self.start_work(self._serve, message, feed)
            return None
        return super().on_receive(message)

    def retry_delay(self, attempt: int, error: ModelError) -> float:
        """Seconds before retry `attempt` (0-based): the server's `retry-after` wins, else jittered backoff."""
        if error.retry_after is not None:  # no draw of the jitter then: a seeded caller's sequence stays as it was
            return float(error.retry_after)
        if self._random is None:
            self._random = random.Random(self._seed)
        jitter = self._random.uniform(0.75, 1.0)
        return model.retry_delay_s(attempt, error, jitter=jitter, base_s=self.retry_base_s, max_s=self.retry_max_s)

    async def _serve(self, first: StartCall, feed: CallFeed) -> None:
        """A query's calls, one after the other, in this one task, until the loop closes the feed. Each call's
        requests (retries included) run here too, not in a coroutine of their own: every streamed event
        passes each coroutine of the task twice (measured: about 0.1 µs an event for one more)."""
        mine = feed.serving  # set by the handler before this task first runs
        call: StartCall | None = first
        del first  # a call's objects (request, turn channel) live while it runs, not the whole query (below)
        try:
            while call is not None:
                feed.calling = True
                tries = _Tries(self._within_cap(call.request) if self._output_caps else call.request)
                while True:
                    tries.emitted = False
                    try:
                        if self.limiter is None:
                            ended = await self._stream_once(call, tries, feed)
                        else:
                            async with self.limiter:  # held while the request streams, not during backoff
                                ended = await self._stream_once(call, tries, feed)
                    except Exception as error:  # noqa: BLE001 - each kind is decided in `_after_failure`
                        after = self._after_failure(call, tries, error)
                        if after is None:
                            continue  # sent again at once, with a max_tokens it leaves room for
                        if isinstance(after, ModelError):
                            await self._announce_retry_and_wait(call, after, tries.attempt)
                            continue
                        ended = after
                    break
                try:
                    call.sink.send_nowait(ended)
                except trio.WouldBlock:  # the turn's buffer is full (a flood of progress events): rare
                    await call.sink.send(ended)
                feed.calling = False
                if not feed.queued and not _asks_for_more(ended):
                    return  # the query likely ends here: no step is left to take when it does
                # Nothing of this call is kept while the next is awaited: at a thousand loops in flight, each
                # one's last request, turn channel and end were that many more objects for the collector.
                del call, tries, ended
                call = feed.take() if await feed.wait() else None
        finally:
            if feed.serving is mine:
                feed.calling = False
                feed.served()

    def _after_failure(self, call: StartCall, tries: _Tries, error: Exception) -> CallEnded | ModelError | None:
        """What follows a request that failed with `error`: None, send it again at once (`tries.request`
        refit); the `ModelError` to retry after a backoff (`tries.attempt` counted); or the call's end."""
        if isinstance(error, FallbackTriggered):
            return CallEnded(fallback=True, stop_reason=None, usage=Usage(), withheld=None, error=None)
        if not isinstance(error, ModelError):  # a provider's bug is this call's model error, not a dead session
            self.log.opt(exception=error).error("model provider raised an unclassified error")
            return CallEnded(error=ModelError("api_error", f"{type(error).__name__}: {error}"))
        if error.kind in MAX_TOKENS_KINDS and error.kind not in tries.refitted and not tries.emitted:
            tries.refitted += (error.kind,)  # each max_tokens kind is fixed once per call
            refit = self._refit(tries.request, error)
            if refit is not None:
                tries.request = refit
                return None
        if error.retryable and not tries.emitted and tries.attempt < call.max_retries:
            tries.attempt += 1
            return error
        if error.kind == "overloaded" and call.fallback_available and not tries.emitted:
            return CallEnded(fallback=True)
        withheld = None
        if error.kind in ("prompt_too_long", "context_overflow"):
            # A context overflow no smaller max_tokens fits: the prompt is what must shrink.
            withheld = api_error_message(call.request.model, PROMPT_TOO_LONG_ERROR_MESSAGE)
        return CallEnded(withheld=withheld, error=error)

    def _within_cap(self, request: ModelRequest) -> ModelRequest:
        """The request, asking no more than its model's output cap learnt in this session."""
        cap = self._output_caps.get(request.model)
        if cap is None or request.max_tokens <= cap:
            return request
        return dataclasses.replace(request, max_tokens=cap)

    def _refit(self, request: ModelRequest, error: ModelError) -> ModelRequest | None:
        """The request with a `max_tokens` the 400 `error` leaves room for (None: lowering it cannot help)."""
        fix = max_tokens_fix(error.message, request.max_tokens, request.thinking)
        if fix is None:
            return None
        if fix.model_cap is not None:
            self._output_caps = {**self._output_caps, request.model: fix.model_cap}
        asked, kind = request.max_tokens, error.kind
        self.log.info(f"{request.model}: max_tokens {asked} refused ({kind}), sending again with {fix.max_tokens}")
        return dataclasses.replace(request, max_tokens=fix.max_tokens)

    async def _stream_once(self, call: StartCall, tries: _Tries, feed: CallFeed) -> CallEnded:
        """One request (`tries.request`): forward its events, hand over its blocks; the end, or the provider's error.
        Its time in the API is the query's (`feed.api_s`, `duration_api_ms`): every attempt, whatever its end."""
        request, sent = tries.request, trio.current_time()
        assembler = ResponseAssembler()
        stream = self.provider.stream(request)
        if telemetry.active is not None:  # the request's `chat` span, seeing its events (docs/telemetry.md)
            stream = telemetry.active.chat_stream(stream, request, call.turn.control)
        held: list[Any] = []
        try:  # `aclosing` written out: two coroutines fewer per request
            events, progress = call.events, call.progress
            # Not this request's: what an earlier try noted (an unseen failure is neither shown nor billed).
            progress.held, progress.start_usage, progress.delta_usage = held, None, None
            buffered, item = events.items, None
            async for raw in stream:
                # An event in a plain dict that carries no usage (all but two a response): no `noted_event` checks.
                kind = raw.get("type") if raw.__class__ is dict else None
                if kind == "content_block_delta" or kind in FORWARDED_AS_THEY_ARE:  # a delta first: most events
                    item = raw
                else:
                    item = noted_event(raw, kind, progress)
                if progress.cut:
                    continue  # the loop has ended the query: this task's cancellation lands at the next step
                if not tries.emitted:
                    if not assembler.started:  # nothing shown yet: a malformed start is retried
                        model.before_message_start(raw, kind, item, held)
                        item = None
                    else:
                        await self._show_held(call, tries, held)
                        if progress.cut:  # the query ended while the held start waited for the consumer
                            continue
                if item is None:
                    pass
                elif len(buffered) < events.limit:  # `events.send_nowait(item)` written out (`EventChannel`'s note)
                    buffered.append(item)
                    if events.receiver is not None:
                        events.wake_receiver()
                else:
                    await self._emit(call, item)  # a full buffer (a slow consumer), or the consumer gone
                try:
                    completed = assembler.feed(raw)
                except MALFORMED as error:
                    msg = f"malformed stream event {raw['type']!r}: {type(error).__name__}: {error} in {raw!r:.200}"
                    raise ModelError("api_error", msg) from error
                if completed is not None:
                    self._hand_over(completed, assembler, call)
        finally:
            feed.api_s += trio.current_time() - sent
            await stream.aclose()
        return self._ended(call, request, assembler)

    async def _show_held(self, call: StartCall, tries: _Tries, held: list[Any]) -> None:
        """The request's first event past its `message_start` came: from now on it has been seen (a failure is no
        longer retried), and the held start is forwarded, ahead of that event."""
        tries.emitted = True
        call.progress.held = None
        events = call.events
        buffered = events.items
        if len(buffered) + len(held) < events.limit:  # the start goes first; the event wakes the consumer
            buffered.extend(held)
        else:
            for early in held:
                await self._emit(call, early)

    def _ended(self, call: StartCall, request: ModelRequest, assembler: ResponseAssembler) -> CallEnded:
        """The end of a request whose stream has ended: its blocks cut off handed over (answered with an error,
        never run), or a `connection` error for a stream that ended before `message_stop`."""
        if not assembler.stopped:
            raise ModelError("connection", "stream ended before message_stop")
        for cut in assembler.close_truncated():
            self._hand_over(cut, assembler, call)
        return call_ended(
            stop_reason=assembler.stop_reason,
            usage=assembler.usage,
            withheld=withheld_cut_off(assembler.stop_reason, request.model, request.max_tokens),
            error=None,
            fallback=False,
            stop_details=assembler.stop_details,
        )

    async def _announce_retry_and_wait(self, call: StartCall, error: ModelError, attempt: int) -> None:
        delay = self.retry_delay(attempt - 1, error)
        message = SystemMessage(
            subtype="api_retry",
            content=f"API error ({error.kind}); retrying in {delay:.1f}s (attempt {attempt}/{call.max_retries})",
            data={"attempt": attempt, "delay_s": delay, "kind": error.kind},
        )
        if not call.progress.cut:  # as a block's message is handed over: no checkpoint from here to the loop's push
            self._show(call, message)
            call.sink.push(RetryAnnounced(message=message))
        await trio.sleep(delay)

    def _hand_over(self, completed: CompletedBlock, assembler: ResponseAssembler, call: StartCall) -> None:
        if call.progress.cut:
            return
        block = completed.block
        message = assistant_message(new_uuid(), assembler.message_id, call.request.model, [block], assembler.usage)
        shown = message
        if is_tool := block.get("type") == "tool_use":  # shown with its input backfilled, if its tool says so
            tool = call.turn.tools.get(block["name"])
            if tool is not None and tool.backfill_observable_input is not None:
                shown = tool.observed_message(message, block)
        # The consumer first, then the loop, without a checkpoint in between: an abort cannot come between the
        # two. So the message waits neither for the consumer nor for the loop (`push`: one per block past each
        # bound, while its stream events wait): a consumer must not hold a tool_use the loop has not seen,
        # which no abort would answer.
        self._show(call, shown)
        call.sink.push(message)  # as the model wrote it: the conversation goes back to the API byte for byte
        # The message goes first: a tool is only ever started for a block the loop has seen.
        if is_tool and self.executor is not None:
            self.executor.tell(add_tool(block=block, turn=call.turn, input_error=completed.input_error))

    @staticmethod
    def _show(call: StartCall, shown: Any) -> None:
        """`shown` to the log, then to the consumer now, past its bound (one a block or a retry).
        No checkpoint: with the loop's push that follows, the consumer and the conversation both have it, or
        neither does (an abort cannot come between)."""
        progress, log = call.progress, call.transcript
        if log is not None:
            log.append(shown)  # before the push: the consumer's handle writes the buffer before it takes an event
        if not progress.consumer_gone:
            try:
                call.events.push(shown)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                progress.consumer_gone = True
                call.sink.push(ConsumerGone())  # once a call

    async def _emit(self, call: StartCall, event: Any) -> None:
        """To the query's consumer; waits if it is slow. A consumer gone is reported to the loop, once."""
        progress = call.progress
        if progress.consumer_gone or progress.cut:
            return
        try:
            try:
                call.events.send_nowait(event)
            except trio.WouldBlock:
                # A slow consumer: wait for it, shielded, as the loop's own emission does (an abort never
                # drops an event the stream has produced).
                with trio.CancelScope(shield=True):
                    await call.events.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            progress.consumer_gone = True
            await call.sink.send(ConsumerGone())
