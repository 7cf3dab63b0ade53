"""`Shard`: the body of a Ray async actor hosting one queryloop runtime, made remote by `ShardedRuntime`.

The runtime is an `AsyncioRuntime` in guest mode on the actor's asyncio loop (Ray runs an async actor's
default concurrency group on one event loop thread): trio's scheduler runs as callbacks of that loop,
and every entry into the runtime goes through the facade's bridge (its trio token). It starts on the
first call of the default group (`info`, which `ShardedRuntime.start` makes).

* `open_session(key, spec, resume)`: the factory (`"module:function"`, imported here) builds the
  `QueryOptions` from the JSON-able spec: providers, tools and hooks never cross a process. The
  transcript is `transcript_dir/KEY.jsonl`; `resume` restores the session (and its id) from it.
* `submit([Submission])`: each query's events are forwarded, filtered by its `events` mode, to the
  outbox of the driver's stream by a callback of the facade (`AsyncioQuery.on_ready`), not a task.
* `events(stream)`: one Ray streaming generator per driver: at most one object per `batch_ms`, carrying
  what every query of that driver produced since the last one (at once when the stream was idle, or
  for the end of a query the driver aborted).
  When the driver lags `max_buffered` events behind, the queries' readers wait, and so do the loops.
* `abort(key, qid, reason)`: the control lane (a concurrency group of its own, its own loop thread);
  from there it enters the trio run directly (`AsyncioSession.abort_threadsafe`) and becomes the
  session's supervisor abort; returns the acks' count.
  An abort that overtakes its query's submission is kept and applied when the query starts.

A shard Ray restarted comes back empty: `info()["restarted"]` says so, and every call naming a
session it does not hold raises `SessionNotHere` (the driver's `ShardLost`).
Imports `queryloop.runtime.host.aio` and `queryloop.runtime.ray.wire`.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import os
import secrets
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from loguru import logger

from queryloop.runtime import telemetry
from queryloop.runtime.errors import FactoryError, RuntimeClosed
from queryloop.runtime.host.aio import AsyncioRuntime
from queryloop.runtime.loop.events import ResultMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.ray.wire import CONTROL, DELTAS, Ending, Entry, SessionNotHere, encode, method, portable

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from queryloop.runtime.host.aio import AsyncioQuery, AsyncioSession
    from queryloop.runtime.kernel.messages import AbortReason
    from queryloop.runtime.loop.context_usage import ContextUsageResponse
    from queryloop.runtime.loop.events import SystemMessage, TranscriptMessage
    from queryloop.runtime.loop.restore import Sidechain
    from queryloop.runtime.ray.wire import Submission


class _Hosted:
    __slots__ = ("running", "session", "started")

    def __init__(self, session: AsyncioSession) -> None:
        self.session = session
        self.running: tuple[int, AsyncioQuery] | None = None
        self.started = 0
        """The id of the last query started in this session."""


class _Outbox:
    """What one driver's stream has not shipped yet, and the one wait of its stream.

    The stream waits on a bare future that `put` resolves, or a timer: awaited, an `asyncio.Event`
    inside `wait_for` costs two more turns of the shard's loop, each behind a tick of the trio run.
    """

    def __init__(self, max_buffered: int) -> None:
        self.entries: list[Entry] = []
        self.events = 0
        self.max_buffered = max_buffered
        self.hurried = False
        """An entry must not wait out the window (an aborted query's end)."""
        self.closed = False
        self.paused: list[_Forward] = []
        """Queries that stopped forwarding while the outbox was full: resumed by `take`."""
        self._waiter: asyncio.Future[None] | None = None
        self._wake_on_any = False

    @property
    def full(self) -> bool:
        return self.events >= self.max_buffered

    def put(self, entry: Entry, hurry: bool = False) -> None:
        self.entries.append(entry)
        self.events += len(entry[1])
        self.hurried = self.hurried or hurry
        if self._wake_on_any or hurry or self.events >= self.max_buffered:
            self._wake()

    def take(self) -> list[Entry]:
        entries, self.entries, self.events = self.entries, [], 0
        self.hurried = False
        paused, self.paused = self.paused, []
        for forward in paused:
            forward()
        return entries

    def close(self) -> None:
        self.closed = True
        self._wake()

    async def wait(self, *, any_entry: bool, window: float | None = None) -> None:
        """Until an entry comes (`any_entry`), or one that must not wait (a hurried one, a full outbox,
        the close), or `window` seconds."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._wake_on_any = any_entry
        timer = loop.call_later(window, self._wake) if window is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Forward:
    """One query's events, forwarded to its driver's outbox from the facade's callback (`on_ready`):
    no task per query, no turn of the loop per batch. It pauses while the outbox is full (the driver
    lags: the query's pump, then its loop, wait) and ends with the query's `Ending` or error."""

    __slots__ = ("hosted", "outbox", "query", "shard", "sub")

    def __init__(self, shard: Shard, sub: Submission, hosted: _Hosted, query: AsyncioQuery, outbox: _Outbox) -> None:
        self.shard = shard
        self.sub = sub
        self.hosted = hosted
        self.query = query
        self.outbox = outbox

    def __call__(self) -> None:
        outbox, query, mode = self.outbox, self.query, self.sub.events
        while not outbox.full:
            try:
                batch = query.take_ready()
            except Exception as error:  # noqa: BLE001 - the driver's consumer raises it
                self._end(None, portable(error))
                return
            if batch is None:
                self._end(Ending(query.terminal, query.transitions), None)
                return
            if not batch:
                return
            if mode == "messages":
                batch = [event for event in batch if not isinstance(event, DELTAS)]
            elif mode == "result":
                batch = [event for event in batch if type(event) is ResultMessage]
            if batch:
                outbox.put((self.sub.qid, batch, None, None))
        if self not in outbox.paused:
            outbox.paused.append(self)

    def _end(self, ending: Ending | None, error: BaseException | None) -> None:
        self.query.on_ready(None)
        self.shard._ended(self, ending, error)  # noqa: SLF001 - its own shard


class Shard:
    """One shard: a queryloop runtime in a Ray actor. Its methods are called through Ray only."""

    def __init__(self, index: int, factory: str, transcript_dir: str, batch_ms: float, max_buffered: int) -> None:
        self.index = index
        self.factory_name = factory
        self.transcript_dir = Path(transcript_dir)
        self.batch_s = batch_ms / 1000
        self.max_buffered = max_buffered
        self.incarnation = secrets.token_hex(4)
        with warnings.catch_warnings():  # Ray 2.60 warns about its own deprecated call inside it
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        self.log = logger.bind(shard=index, incarnation=self.incarnation)
        if self.restarted:
            self.log.warning("shard {} was restarted by Ray: it holds no sessions (resume them)", index)
        self._runtime: AsyncioRuntime | None = None
        self._starting: asyncio.Lock | None = None
        self._factory: Callable[[Mapping[str, Any]], Any] | None = None
        self._sessions: dict[str, _Hosted] = {}
        self._outboxes: dict[str, _Outbox] = {}
        self._early_aborts: dict[int, AbortReason] = {}
        self._aborted: set[int] = set()
        """Running queries the driver aborted: their ends ship at once, without waiting out the window."""
        self._abort_lock = threading.Lock()
        """Between the control lane's thread and the runtime's loop: which query runs, early aborts, aborted."""
        self._forwards: set[_Forward] = set()
        """The queries whose ends are not in their outboxes yet."""
        self._idle: asyncio.Event | None = None
        """Set when the last of `_forwards` ends (made by `shutdown`)."""

    async def _rt(self) -> AsyncioRuntime:
        if self._runtime is None:
            if self._starting is None:
                self._starting = asyncio.Lock()
            async with self._starting:
                if self._runtime is None:
                    # A shard owns its worker process: the runtime's collector thresholds are its to set,
                    # and what is built by now (Ray's heap, the imports) is frozen out of the collector's
                    # walks: a full collection otherwise pauses every session of the shard for tens of ms.
                    self._runtime = await AsyncioRuntime.start(mode="guest", tune_gc=True)
                    gc.freeze()
                    self.log.info("shard {} runs its runtime (pid {})", self.index, os.getpid())
        return self._runtime

    async def info(self) -> dict[str, Any]:
        """Who this shard is (`restarted`: Ray restarted it, empty), its load and its process's CPU time."""
        await self._rt()
        return {
            "index": self.index,
            "incarnation": self.incarnation,
            "restarted": self.restarted,
            "pid": os.getpid(),
            "sessions": len(self._sessions),
            "cpu_s": time.process_time(),
        }

    def _options(self, spec: Mapping[str, Any]) -> QueryOptions:
        where = f"factory {self.factory_name!r} on shard {self.index}"
        if self._factory is None:
            module, _, name = self.factory_name.partition(":")
            try:
                self._factory = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError, ValueError) as error:
                msg = f"{where} cannot be imported: {error!r} (give it as 'module:function')"
                raise FactoryError(msg) from None
        try:
            options = self._factory(spec)
        except Exception as error:  # noqa: BLE001 - whatever the factory raised, named in the error
            msg = f"{where} raised {error!r} for spec {dict(spec)!r}"
            raise FactoryError(msg) from None
        if not isinstance(options, QueryOptions):
            msg = f"{where} returned a {type(options).__name__}, not QueryOptions"
            raise FactoryError(msg)
        return options

    async def open_session(
        self, key: str, spec: Mapping[str, Any], resume: bool, fork_of: str | None = None, at: str | None = None
    ) -> str:
        """Open (or, `resume`, restore from its transcript) the session `key`; returns its session id.
        `fork_of`: a new session `key` that goes on from the conversation in session `fork_of`'s transcript.
        `at`: a resume or a fork up to and including that message (`resume_session_at`)."""
        runtime = await self._rt()
        if key in self._sessions:
            msg = f"session {key!r} is already open on shard {self.index}"
            raise ValueError(msg)
        options = self._options(spec)
        path = self.transcript_dir / f"{key}.jsonl"
        source = self.transcript_dir / f"{fork_of if fork_of is not None else key}.jsonl"
        exists, found = await asyncio.to_thread(lambda: (_has_records(path), _has_records(source)))
        if (resume or fork_of is not None) and not found:
            what = f"fork {fork_of!r} into {key!r}" if fork_of is not None else f"resume session {key!r} from"
            msg = f"no transcript {source.name} in the transcript directory to {what}"
            raise FileNotFoundError(msg)
        if resume:
            session = await runtime.open_session(options, resume=path, resume_session_at=at)
        else:
            if exists:
                msg = f"session {key!r} has a transcript already: resume it, or open it under another key"
                raise FileExistsError(msg)
            if fork_of is not None:
                session = await runtime.open_session(
                    options, resume=source, transcript=path, fork=True, resume_session_at=at
                )
            else:
                session = await runtime.open_session(options, transcript=path)
        self._sessions[key] = _Hosted(session)
        done = "resumed" if resume else f"forked from {fork_of}" if fork_of else "opened"
        self.log.bind(session=session.id).debug("{} session {}", done, key)
        return session.id

    def _hosted(self, key: str) -> _Hosted:
        hosted = self._sessions.get(key)
        if hosted is None:
            again = " (it was restarted by Ray, empty)" if self.restarted else ""
            msg = f"shard {self.index}{again} holds no session {key!r}: resume it from its transcript"
            raise SessionNotHere(msg)
        return hosted

    async def close_session(self, key: str) -> None:
        hosted = self._sessions.pop(key, None)
        if hosted is not None:
            await hosted.session.close()

    async def transcript(self, key: str) -> list[TranscriptMessage]:
        return await self._hosted(key).session.transcript()

    async def sidechains(self, key: str) -> dict[str, Sidechain]:
        return await self._hosted(key).session.sidechains()

    async def compact(self, key: str, instructions: str | None) -> SystemMessage:
        return await self._hosted(key).session.compact(instructions)

    async def context_usage(self, key: str) -> ContextUsageResponse:
        return await self._hosted(key).session.context_usage()

    async def set_model(self, key: str, model: str | None) -> None:
        await self._hosted(key).session.set_model(model)

    async def submit(self, submissions: list[Submission]) -> None:
        """Start the queries (in order); their events and ends go to their drivers' streams."""
        for submission in submissions:
            self._start(submission)

    def _start(self, sub: Submission) -> None:
        outbox = self._outboxes.get(sub.stream)
        if outbox is None:
            outbox = self._outboxes[sub.stream] = _Outbox(self.max_buffered)
        try:
            hosted = self._hosted(sub.key)
            with telemetry.submitted_under(sub.trace):  # the driver's span: the parent of the query's spans here
                query = hosted.session.query(sub.prompt, **sub.overrides)
        except Exception as error:  # noqa: BLE001 - the driver's consumer raises it
            outbox.put((sub.qid, [], None, portable(error)))
            return
        with self._abort_lock:
            hosted.running, hosted.started = (sub.qid, query), sub.qid
            early = self._early_aborts.pop(sub.qid, None)
            if early is not None:
                self._aborted.add(sub.qid)
        if early is not None:
            query.abort(early)
        forward = _Forward(self, sub, hosted, query, outbox)
        self._forwards.add(forward)
        query.on_ready(forward)
        forward()

    def _ended(self, forward: _Forward, ending: Ending | None, error: BaseException | None) -> None:
        """A query's end (or error) into its outbox: at once, not after the window, if the driver aborted it."""
        sub, hosted = forward.sub, forward.hosted
        with self._abort_lock:
            hurry = sub.qid in self._aborted
            self._aborted.discard(sub.qid)
            if hosted.running is not None and hosted.running[0] == sub.qid:
                hosted.running = None
        forward.outbox.put((sub.qid, [], ending, error), hurry)
        self._forwards.discard(forward)
        if not self._forwards and self._idle is not None:
            self._idle.set()

    @method(num_returns="streaming")
    async def events(self, stream: str) -> AsyncIterator[bytes]:
        """The driver `stream`'s events: one object per `batch_ms` window, for every query it runs here."""
        outbox = self._outboxes.get(stream)
        if outbox is None:
            outbox = self._outboxes[stream] = _Outbox(self.max_buffered)
        loop = asyncio.get_running_loop()
        shipped = 0.0
        try:
            while True:
                if not outbox.entries and not outbox.closed:
                    await outbox.wait(any_entry=True)
                if outbox.closed:
                    if outbox.entries:
                        yield encode(outbox.take())
                    return
                wait = shipped + self.batch_s - loop.time()
                if wait > 0 and not outbox.full and not outbox.hurried:
                    # At most one object a window: what comes meanwhile ships along; an aborted
                    # query's end ships at once.
                    await outbox.wait(any_entry=False, window=wait)
                shipped = loop.time()
                yield encode(outbox.take())
        finally:
            if self._outboxes.get(stream) is outbox:
                del self._outboxes[stream]

    @method(concurrency_group=CONTROL)
    async def abort(self, key: str, qid: int | None, reason: AbortReason) -> int:
        """Abort query `qid` of session `key` (None: whatever runs in it); the acks' count.

        Runs on the control lane's thread and enters the trio run from there
        (`AsyncioSession.abort_threadsafe`): the abort does not queue behind the runtime's asyncio loop."""
        hosted = self._sessions.get(key)
        runtime = self._runtime
        if hosted is None or runtime is None:
            return 0
        with self._abort_lock:
            running = hosted.running
            if qid is not None and (running is None or running[0] != qid):
                if qid > hosted.started:
                    self._early_aborts[qid] = reason  # it overtook its submission: applied when it starts
                return 0
            if running is not None:
                self._aborted.add(running[0])
        try:
            count = await asyncio.wrap_future(hosted.session.abort_threadsafe(reason))
        except RuntimeClosed:
            return 0  # the runtime is closing: its queries end aborted anyway
        self.log.bind(session=hosted.session.id).debug("aborted ({}): {} acks", reason, count)
        return count

    async def shutdown(self) -> None:
        """Close every session (running queries end aborted, `shutdown`) and the runtime; end the streams."""
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            await runtime.aclose()
        self._sessions.clear()
        if self._forwards:
            self._idle = asyncio.Event()
            await self._idle.wait()  # every query's end is in its outbox
        for outbox in self._outboxes.values():
            outbox.close()


def _has_records(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 0
