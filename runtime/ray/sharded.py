"""`ShardedRuntime`: sessions sharded over Ray actors, driven from asyncio (public as `queryloop.ray`).

    async with ShardedRuntime.open(shards=2, factory="myapp.agents:options", transcript_dir=DIR) as rt:
        session = await rt.open_session({"task": "fix-1234"})      # on the least-loaded shard
        async with session.query("Fix the bug", events="messages") as query:
            async for event in query:
                print(event.label)
        print(query.terminal.reason)

* One `Shard` actor per shard (a core each by default). A session is placed on the least-loaded live
  shard (open sessions counted by this driver) and stays there.
* Submissions made in one tick of the driver's loop go to a shard in one Ray call; the events of
  every query this driver runs on a shard come back on one Ray streaming generator (the driver's
  stream), a Ray object per `batch_ms` window, demultiplexed here to the queries.
* Aborts go on the shard's control lane (a concurrency group of their own).
* A shard that dies: its stream fails, every open query of its sessions ends with `ShardLost`, the
  sessions are marked lost; `await rt.resume(key, spec)` restores one from its transcript on a live
  shard (same session id). A shard Ray restarted (`max_restarts`) comes back empty and says so; it
  takes new sessions again.
* `await rt.fork(key)` opens a new session on the least-loaded shard that goes on from session `key`'s
  transcript (`Runtime.open_session(..., fork=True)` there), with an id of its own.
Imports `queryloop.runtime.ray.shard`, `query`, `wire`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import ray
from loguru import logger
from ray.exceptions import RayActorError, RayTaskError

from queryloop.runtime.errors import QueryloopError, RuntimeClosed, ShardLost
from queryloop.runtime.ray.query import Inbox, RemoteSession
from queryloop.runtime.ray.shard import Shard
from queryloop.runtime.ray.wire import CONTROL, KEY, SessionNotHere, Submission, decode

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from queryloop.runtime.kernel.messages import AbortReason

log = logger.bind(actor="ray-driver")

START_TIMEOUT_S = 120.0
"""How long `start` waits for its shards to be placed and running."""
RESTART_WAIT_S = 60.0
"""How long a lost shard is watched for Ray's restart of it before it counts as gone for good."""
RESTART_POLL_S = 0.2


def _directory(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


class _ShardState:
    __slots__ = ("actor", "alive", "incarnation", "index", "info", "pending", "pump", "sessions")

    def __init__(self, index: int, actor: Any) -> None:
        self.index = index
        self.actor = actor
        self.alive = True
        self.incarnation = ""
        self.info: dict[str, Any] = {}
        self.sessions: dict[str, RemoteSession] = {}
        self.pending: list[Submission] = []
        self.pump: asyncio.Task[None] | None = None


class ShardedRuntime:
    """Sessions over Ray shards: `await ShardedRuntime.start(...)` ... `await rt.aclose()`, or `open`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, factory: str, transcript_dir: Path, owns_ray: bool) -> None:
        self.loop = loop
        self.factory = factory
        self.transcript_dir = transcript_dir
        self.stream = secrets.token_hex(6)
        """This driver's name on its shards' event streams."""
        self._owns_ray = owns_ray
        self._shards: list[_ShardState] = []
        self._sessions: dict[str, RemoteSession] = {}
        self._inboxes: dict[int, tuple[_ShardState, Inbox]] = {}
        self._qids = itertools.count(1)
        self._flushing = False
        self._background: set[asyncio.Task[Any]] = set()
        self.closed = False
        self.log = log.bind(stream=self.stream)

    @classmethod
    async def start(
        cls,
        *,
        shards: int,
        factory: str,
        transcript_dir: str | Path,
        ray_address: str | None = None,
        ray_init: Mapping[str, Any] | None = None,
        num_cpus_per_shard: float = 1,
        batch_ms: float = 5.0,
        max_buffered: int = 20_000,
        max_restarts: int = 0,
    ) -> ShardedRuntime:
        """Start `shards` shard actors and return the runtime (close it with `aclose`).

        `factory`: "module:function", importable on every node; called in the shard with a session's
        JSON-able spec, it returns the session's `QueryOptions`. `transcript_dir`: where each session's
        transcript is kept (`KEY.jsonl`), on storage every node sees. `ray_address`: if Ray is not
        initialized in this process, `ray.init(address=ray_address, **ray_init)` (None: a local
        cluster; "auto": the one `ray start` made here; else its address); otherwise the connection
        in place is used. `batch_ms`: the shards' shipping window. `max_buffered`: events a shard holds
        for this driver before its queries wait. `max_restarts`: Ray's, per shard actor.
        """
        owns_ray = False
        if not ray.is_initialized():
            ray.init(address=ray_address, **dict(ray_init or {}))
            owns_ray = True
        directory = await asyncio.to_thread(_directory, Path(transcript_dir))
        runtime = cls(asyncio.get_running_loop(), factory, directory, owns_ray)
        make_remote = cast("Any", ray.remote)
        remote = make_remote(concurrency_groups={CONTROL: 4}, max_concurrency=1000)(Shard)
        for index in range(shards):
            actor = remote.options(num_cpus=num_cpus_per_shard, max_restarts=max_restarts).remote(
                index, factory, str(directory), batch_ms, max_buffered
            )
            runtime._shards.append(_ShardState(index, actor))
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                infos = await asyncio.gather(*(state.actor.info.remote() for state in runtime._shards))
        except BaseException:
            await runtime.aclose()
            raise
        for state, info in zip(runtime._shards, infos, strict=True):
            state.info, state.incarnation = info, info["incarnation"]
            state.pump = runtime._spawn(runtime._pump(state))
        runtime.log.info("{} shards up (pids {})", shards, [state.info["pid"] for state in runtime._shards])
        return runtime

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        *,
        shards: int,
        factory: str,
        transcript_dir: str | Path,
        ray_address: str | None = None,
        ray_init: Mapping[str, Any] | None = None,
        num_cpus_per_shard: float = 1,
        batch_ms: float = 5.0,
        max_buffered: int = 20_000,
        max_restarts: int = 0,
    ) -> AsyncIterator[ShardedRuntime]:
        """`start` (same arguments) for the duration of the block; leaving it closes the runtime."""
        runtime = await cls.start(
            shards=shards,
            factory=factory,
            transcript_dir=transcript_dir,
            ray_address=ray_address,
            ray_init=ray_init,
            num_cpus_per_shard=num_cpus_per_shard,
            batch_ms=batch_ms,
            max_buffered=max_buffered,
            max_restarts=max_restarts,
        )
        try:
            yield runtime
        finally:
            await runtime.aclose()

    # -- sessions ---------------------------------------------------------------------------------

    @property
    def shards(self) -> list[dict[str, Any]]:
        """Each shard: `index`, `alive`, `incarnation`, `pid`, `sessions` (open here)."""
        return [
            {
                "index": s.index,
                "alive": s.alive,
                "incarnation": s.incarnation,
                "pid": s.info.get("pid"),
                "sessions": len(s.sessions),
            }
            for s in self._shards
        ]

    async def shard_info(self) -> list[dict[str, Any]]:
        """Each live shard's own report (`pid`, `sessions`, `cpu_s`: its process's CPU time so far, ...)."""
        live = [s for s in self._shards if s.alive]
        return list(await asyncio.gather(*(self._unwrap(s, None, s.actor.info.remote()) for s in live)))

    @property
    def sessions(self) -> Mapping[str, RemoteSession]:
        return self._sessions

    async def open_session(self, spec: Mapping[str, Any] | None = None, key: str | None = None) -> RemoteSession:
        """Open a session on the least-loaded live shard; its factory gets `spec`. `key` names it (and
        its transcript, `KEY.jsonl`); a new one is made if not given. `FactoryError` if the factory fails."""
        key = key or f"s{secrets.token_hex(8)}"
        return await self._place(key, spec or {}, resume=False, avoid=None)

    async def resume(
        self, key: str, spec: Mapping[str, Any] | None = None, *, resume_session_at: str | None = None
    ) -> RemoteSession:
        """Restore session `key` from its transcript on a live shard (another than the one that lost it,
        if there is one); the same session id, the conversation so far (`resume_session_at`: up to and including
        that message, what followed it retracted in the file, as `Runtime.open_session`'s)."""
        known = self._sessions.get(key)
        if known is not None and known.lost is None and not known.closed:
            msg = f"session {key!r} is open on shard {known.shard}: nothing to resume"
            raise ValueError(msg)
        avoid = known.shard if known is not None else None
        spec = spec if spec is not None else (known.spec if known else {})
        return await self._place(key, spec, True, avoid, at=resume_session_at)

    async def fork(
        self,
        key: str,
        new_key: str | None = None,
        spec: Mapping[str, Any] | None = None,
        *,
        resume_session_at: str | None = None,
    ) -> RemoteSession:
        """A new session (`new_key`, made if not given) on the least-loaded live shard that goes on from
        the conversation in session `key`'s transcript (`resume_session_at`: up to and including that message),
        with a session id of its own; `key`'s session and transcript are left as they are, open or not. `spec`
        defaults to `key`'s."""
        known = self._sessions.get(key)
        spec = spec if spec is not None else (known.spec if known is not None else {})
        return await self._place(
            new_key or f"s{secrets.token_hex(8)}", spec, False, None, fork_of=key, at=resume_session_at
        )

    async def _place(
        self,
        key: str,
        spec: Mapping[str, Any],
        resume: bool,
        avoid: int | None,
        *,
        fork_of: str | None = None,
        at: str | None = None,
    ) -> RemoteSession:
        if self.closed:
            raise RuntimeClosed("the sharded runtime is closed")
        for name in (key, fork_of):
            if name is not None and not KEY.fullmatch(name):
                msg = f"a session key is letters, digits, '.', '_', '-' (≤ 128, a file name): not {name!r}"
                raise ValueError(msg)
        if key in self._sessions and not resume:
            msg = f"session {key!r} is already open"
            raise ValueError(msg)
        json.dumps(spec)  # JSON-able, or TypeError here rather than in the shard
        live = [s for s in self._shards if s.alive]
        if not live:
            raise ShardLost("no live shard to place the session on", key=key)
        candidates = [s for s in live if s.index != avoid] or live
        state = min(candidates, key=lambda s: len(s.sessions))
        session = RemoteSession(self, key, "", state.index, spec)
        state.sessions[key] = session  # counted at once: concurrent openings spread
        self._sessions[key] = session
        try:
            opened = state.actor.open_session.remote(key, dict(spec), resume, fork_of, at)
            session._id = await self._unwrap(state, key, opened)  # noqa: SLF001 - its id, once its shard has it
        except BaseException:
            state.sessions.pop(key, None)
            if self._sessions.get(key) is session:
                del self._sessions[key]
            raise
        return session

    # -- what sessions and queries ask (`query._Router`: private, the runtime's own) -------------------------

    def _next_qid(self) -> int:
        return next(self._qids)

    def _submit(self, session: RemoteSession, inbox: Inbox, submission: Submission) -> None:
        state = self._shards[session.shard]
        self._inboxes[inbox.qid] = (state, inbox)
        state.pending.append(submission)
        if not self._flushing:
            self._flushing = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Everything submitted in this tick, one Ray call per shard."""
        self._flushing = False
        for state in self._shards:
            if state.pending:
                pending, state.pending = state.pending, []
                if state.alive:
                    self._spawn(self._checked(state, state.actor.submit.remote(pending)))

    def _send_abort(self, session: RemoteSession, qid: int | None, reason: AbortReason) -> asyncio.Future[int]:
        """Abort query `qid` (None: whatever runs) of `session` on its shard's control lane."""
        state = self._shards[session.shard]
        if not state.alive or session.lost is not None:
            done: asyncio.Future[int] = self.loop.create_future()
            done.set_result(0)
            return done
        return self._spawn(self._checked(state, state.actor.abort.remote(session.key, qid, reason), default=0))

    async def _ask_shard(self, session: RemoteSession, request: Callable[[Any], Any]) -> Any:
        """`request(shard actor)` (a Ray call on `session`'s shard), its answer unwrapped; a lost session raises."""
        if session.lost is not None:
            raise session.lost
        state = self._shards[session.shard]
        return await self._unwrap(state, session.key, request(state.actor))

    def _forget(self, session: RemoteSession) -> None:
        if self._sessions.get(session.key) is session:
            del self._sessions[session.key]
        state = self._shards[session.shard]
        if state.sessions.get(session.key) is session:
            del state.sessions[session.key]

    # -- Ray calls and the streams --------------------------------------------------------------------

    def _spawn(self, coroutine: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = self.loop.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _unwrap(self, state: _ShardState, key: str | None, ref: Any) -> Any:
        """Await a shard's answer: its queryloop errors as they were raised there, a dead shard as `ShardLost`."""
        try:
            return await ref
        except RayTaskError as error:
            cause = error.cause
            if isinstance(cause, SessionNotHere):
                raise ShardLost(str(cause), shard=state.index, key=key) from None
            if isinstance(cause, (QueryloopError, ValueError, OSError, TypeError)):
                raise cause from None
            raise
        except RayActorError as error:
            lost = self._lost(state, error)
            raise ShardLost(str(lost), shard=state.index, key=key) from None

    async def _checked(self, state: _ShardState, ref: Any, default: Any = None) -> Any:
        try:
            return await self._unwrap(state, None, ref)
        except ShardLost:
            return default
        except Exception:  # noqa: BLE001 - a background call: logged, never raised
            self.log.bind(shard=state.index).exception("a call to shard {} failed", state.index)
            return default

    async def _pump(self, state: _ShardState) -> None:
        """This driver's stream from `state`: each object's entries to their queries."""
        inboxes = self._inboxes
        generator = state.actor.events.remote(self.stream)
        try:
            async for ref in generator:
                for qid, events, ending, error in decode(await ref):
                    found = inboxes.get(qid)
                    if found is None:
                        continue  # a query nobody waits for any more
                    inbox = found[1]
                    inbox.receive(events, ending, error)
                    if inbox.ended:
                        del inboxes[qid]
        except RayActorError as error:
            self._lost(state, error)
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the stream is broken: the shard counts as lost
            self.log.bind(shard=state.index).exception("the stream of shard {} failed", state.index)
            self._lost(state, error)
            return
        self._end_queries(state, RuntimeClosed(f"shard {state.index} closed its stream (the runtime is closing)"))

    def _end_queries(self, state: _ShardState, error: BaseException) -> None:
        for qid, (shard, inbox) in list(self._inboxes.items()):
            if shard is state:
                del self._inboxes[qid]
                inbox.fail(error)

    def _lost(self, state: _ShardState, error: BaseException) -> ShardLost:
        """The shard died: its queries end `ShardLost`, its sessions are lost (resumable)."""
        lost = ShardLost(f"shard {state.index} died: {type(error).__name__}", shard=state.index)
        if not state.alive:
            return lost
        state.alive = False
        keys = sorted(state.sessions)
        self.log.bind(shard=state.index).warning("shard {} lost with {} sessions: {}", state.index, len(keys), error)
        for key, session in state.sessions.items():
            session.lost = ShardLost(
                f"shard {state.index} died with session {key!r}: resume it (`await rt.resume(key)`)",
                shard=state.index,
                key=key,
            )
        for qid, (shard, inbox) in list(self._inboxes.items()):
            if shard is state:
                del self._inboxes[qid]
                inbox.fail(ShardLost(str(inbox.session.lost or lost), shard=state.index, key=inbox.session.key))
        state.sessions.clear()
        if not self.closed:
            self._spawn(self._watch_restart(state))
        return lost

    async def _watch_restart(self, state: _ShardState) -> None:
        """A shard Ray restarts comes back empty: it takes new sessions again (a dead one never answers).

        The first call may still reach the incarnation that just died (Ray not told yet) and fail at once:
        the call is tried again, every `RESTART_POLL_S`, until `RESTART_WAIT_S` have passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESTART_WAIT_S
        while True:
            try:
                info = await state.actor.info.remote()
                break
            except Exception:  # noqa: BLE001 - restarting, or dead for good
                if self.closed or loop.time() > deadline:
                    self.log.bind(shard=state.index).info("shard {} is gone for good", state.index)
                    return
                await asyncio.sleep(RESTART_POLL_S)
        if self.closed:
            return
        state.info, state.incarnation, state.alive = info, info["incarnation"], True
        self.log.bind(shard=state.index).warning("shard {} was restarted by Ray, empty", state.index)
        state.pump = self._spawn(self._pump(state))

    async def aclose(self) -> None:
        """Close every shard (their running queries end aborted, `shutdown`), then kill the actors (and
        shut Ray down if `start` initialized it). Idempotent."""
        if self.closed:
            return
        self.closed = True
        live = [s for s in self._shards if s.alive]
        if live:
            closing = [self._checked(s, s.actor.shutdown.remote()) for s in live]
            await asyncio.wait([self._spawn(c) for c in closing], timeout=30)
        pumps = [s.pump for s in self._shards if s.pump is not None]
        if pumps:
            await asyncio.wait(pumps, timeout=5)  # what the shards shipped last reaches its queries
        for state in self._shards:
            if state.pump is not None:
                state.pump.cancel()
            self._end_queries(state, RuntimeClosed("the sharded runtime is closed"))
            try:
                ray.kill(state.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - dead already
                pass
        self._sessions.clear()
        if self._owns_ray:
            ray.shutdown()
