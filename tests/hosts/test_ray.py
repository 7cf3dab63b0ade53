"""`queryloop.ray.ShardedRuntime` on a local Ray cluster bound to loopback (one cluster for the module).

Each test is a sync function running its own asyncio loop (as tests/hosts/test_aio.py); waits are bounded
with `asyncio.timeout`. Skipped where Ray is not installed (`pip install 'queryloop[ray]'`).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import shutil
import signal
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# tests/conftest.py sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before any module imports Ray: every Ray
# server of these clusters then binds to the loopback address.
ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'queryloop[ray]'")

from queryloop import AssistantMessage, ResultMessage, StreamEvent, UserMessage  # noqa: E402
from queryloop.aio import AsyncioRuntime  # noqa: E402
from queryloop.ray import FactoryError, RemoteQuery, RemoteSession, ShardedRuntime, ShardLost  # noqa: E402
from queryloop.runtime.loop.transcript import transcript_problems  # noqa: E402
from tests import ray_factory  # noqa: E402

LIMIT_S = 60.0
FACTORY = "tests.ray_factory:options"


@pytest.fixture(scope="module", autouse=True)
def cluster() -> Iterator[None]:
    # Room for two runtimes of two shards: a shard Ray restarts never waits for the CPU of a shard of
    # the test before, still being torn down (with exactly two, the restart could pend past LIMIT_S).
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(LIMIT_S):
            return await main()

    return asyncio.run(bounded())


def sharded(tmp_path: Path, main: Callable[[ShardedRuntime], Awaitable[Any]], **options: Any) -> Any:
    async def with_runtime() -> Any:
        async with ShardedRuntime.open(shards=2, factory=FACTORY, transcript_dir=tmp_path, **options) as rt:
            return await main(rt)

    return run(with_runtime)


async def until_tool_runs(query: RemoteQuery) -> None:
    """Read the query's events until the model's tool call has been made (the tool then blocks)."""
    async for event in query:
        if isinstance(event, AssistantMessage) and any(b["type"] == "tool_use" for b in event.content):
            return
    raise AssertionError("the query ended before its tool call")


async def until(condition: Callable[[], Awaitable[bool]]) -> None:
    """Poll a shard's state (no event of ours tells when it changes); the test's timeout bounds it."""
    for _ in itertools.count():
        if await condition():
            return
        await asyncio.sleep(0.01)


def test_sessions_are_placed_on_the_least_loaded_shard_and_stay_there(tmp_path: Path) -> None:
    async def main(rt: ShardedRuntime) -> None:
        sessions = [await rt.open_session({"replies": ["one", "two"]}) for _ in range(4)]
        assert [s.shard for s in sessions] == [0, 1, 0, 1]
        assert [s["sessions"] for s in rt.shards] == [2, 2]
        assert len({s["pid"] for s in rt.shards}) == 2
        for text in ("one", "two"):
            results = await asyncio.gather(*(s.query("hi", events="result").wait() for s in sessions))
            assert [r.result for r in results] == [text] * 4
        assert [s.shard for s in sessions] == [0, 1, 0, 1]
        await sessions[0].close()
        assert (await rt.open_session()).shard == 0  # the least-loaded one again
        kept = {f"{key}.jsonl" for key in [*rt.sessions, sessions[0].key]}
        assert set(await asyncio.to_thread(os.listdir, tmp_path)) == kept  # a closed session's transcript stays

    sharded(tmp_path, main)


def test_typed_events_cross_the_process_boundary_as_the_local_runtime_produces_them(tmp_path: Path) -> None:
    async def local() -> list[tuple[str, str]]:
        async with AsyncioRuntime.open() as rt:
            session = await rt.open_session(ray_factory.options({"kind": "add"}))
            async with session.query("add") as query:
                return [(type(e).__name__, e.label) async for e in query]

    expected = run(local)

    async def main(rt: ShardedRuntime) -> None:
        session = await rt.open_session({"kind": "add"})
        async with session.query("add") as query:
            events = [e async for e in query]
        assert [(type(e).__name__, e.label) for e in events] == expected
        assert query.terminal is not None and query.terminal.reason == "completed"
        assert isinstance(events[-1], ResultMessage) and events[-1].result == "2 + 3 = 5"
        assert any(isinstance(e, StreamEvent) for e in events)

        again = await rt.open_session({"kind": "add"})
        messages = [e async for e in again.query("add", events="messages")]
        assert [(type(e).__name__, e.label) for e in messages] == [
            pair for pair in expected if pair[1] not in ("stream_event", "stream_request_start")
        ]
        third = await rt.open_session({"kind": "add"})
        only = third.query("add", events="result")
        assert [type(e) async for e in only] == [ResultMessage]
        assert only.terminal is not None and only.terminal.reason == "completed"
        last = (await third.transcript())[-1]
        assert isinstance(last, AssistantMessage) and last.content[0]["text"] == "2 + 3 = 5"

    sharded(tmp_path, main)


def test_an_abort_from_the_driver_ends_the_remote_query_aborted_and_the_session_takes_the_next(
    tmp_path: Path,
) -> None:
    async def main(rt: ShardedRuntime) -> None:
        session = await rt.open_session({"kind": "block"})
        query = session.query("block")
        await until_tool_runs(query)
        query.abort()
        result = await query.wait()
        assert query.terminal is not None and query.terminal.reason.startswith("aborted_")
        assert result.is_error
        assert (await session.query("again", events="result").wait()).result == "next"

        other = await rt.open_session({"kind": "block"}, key="by-session")
        running = other.query("block")
        await until_tool_runs(running)
        assert await other.abort() >= 1  # the shard's supervisor abort, acked by its actors
        await running.wait()
        assert running.terminal is not None and running.terminal.reason.startswith("aborted_")

    sharded(tmp_path, main)


def test_an_aborted_query_ends_at_once_under_load_not_after_the_shipping_window(tmp_path: Path) -> None:
    """The abort enters the shard's trio run from the control lane, and the aborted query's end ships
    without waiting out the window: with a 3 s window and other queries' events flowing on the same
    stream, the end still arrives well within it."""
    window_s = 3.0

    async def main(rt: ShardedRuntime) -> None:
        session = await rt.open_session({"kind": "block"})
        busy = [await rt.open_session({"replies": ["hello"] * 50}) for _ in range(4)]
        stop = asyncio.Event()

        async def load(other: RemoteSession) -> None:
            while not stop.is_set():
                await other.query("hi").wait()

        loads = [asyncio.ensure_future(load(other)) for other in busy]
        try:
            for _ in range(2):
                query = session.query("block")
                await until_tool_runs(query)  # an object just shipped: the next one waits for the window
                loop = asyncio.get_running_loop()
                start = loop.time()
                query.abort()
                async with asyncio.timeout(window_s / 2):
                    result = await query.wait()
                assert loop.time() - start < window_s / 2
                assert result.is_error
                assert query.terminal is not None and query.terminal.reason.startswith("aborted_")
                session = await rt.open_session({"kind": "block"})
        finally:
            stop.set()
            await asyncio.gather(*loads)

    async def with_runtime() -> None:
        async with ShardedRuntime.open(
            shards=1, factory=FACTORY, transcript_dir=tmp_path, batch_ms=window_s * 1000
        ) as rt:
            await main(rt)

    run(with_runtime)


def test_leaving_the_block_or_dropping_the_query_aborts_it_on_the_shard(tmp_path: Path) -> None:
    async def answered(session: RemoteSession) -> bool:
        messages = await session.transcript()
        blocks = [b for m in messages if isinstance(m, UserMessage) and isinstance(m.content, list) for b in m.content]
        return any(b.get("type") == "tool_result" for b in blocks)

    async def main(rt: ShardedRuntime) -> None:
        session = await rt.open_session({"kind": "block"})
        async with session.query("block") as query:
            await until_tool_runs(query)
        assert query.terminal is not None and query.terminal.reason.startswith("aborted_")

        dropped = await rt.open_session({"kind": "block"})
        query = dropped.query("block")
        await until_tool_runs(query)
        del query
        gc.collect()
        await until(lambda: answered(dropped))  # the abort answered the blocked tool call
        assert (await dropped.query("again", events="result").wait()).result == "next"

    sharded(tmp_path, main)


def test_a_killed_shard_ends_its_queries_with_shard_lost_and_the_session_resumes_on_the_other(
    tmp_path: Path,
) -> None:
    async def main(rt: ShardedRuntime) -> None:
        victim = await rt.open_session({"kind": "block", "greet": True}, key="victim")
        survivor = await rt.open_session({"replies": ["still here"]})
        assert victim.shard != survivor.shard
        assert (await victim.query("say hi", events="result").wait()).result == "hi"  # a turn, then a blocked one
        query = victim.query("block")
        await until_tool_runs(query)
        pid = rt.shards[victim.shard]["pid"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ShardLost):
            await query.wait()
        with pytest.raises(ShardLost):
            victim.query("again")
        assert not rt.shards[victim.shard]["alive"]
        resumed = await rt.resume("victim", {"replies": ["after the crash"]})
        assert resumed.shard == survivor.shard and resumed.id == victim.id
        conversation = await resumed.transcript()
        assert transcript_problems(conversation) == []
        assert isinstance(conversation[0], UserMessage) and conversation[0].content == "say hi"
        assert (await resumed.query("go on", events="result").wait()).result == "after the crash"
        assert (await survivor.query("hi", events="result").wait()).result == "still here"

    sharded(tmp_path, main)


def test_a_session_forked_on_another_shard_goes_on_from_its_conversation_and_leaves_it_as_it_was(
    tmp_path: Path,
) -> None:
    async def main(rt: ShardedRuntime) -> None:
        original = await rt.open_session({"replies": ["first answer", "original goes on"]}, key="orig")
        assert (await original.query("question one", events="result").wait()).result == "first answer"
        before = (tmp_path / "orig.jsonl").read_bytes()
        fork = await rt.fork("orig", "branch", {"replies": ["branch goes on"]})
        assert fork.shard != original.shard  # the least-loaded shard
        assert fork.key == "branch" and fork.id != original.id
        assert (await fork.query("question two", events="result").wait()).result == "branch goes on"
        texts = [m.model_dump()["content"] for m in await fork.transcript()]
        assert texts[0] == "question one" and texts[-2] == "question two"
        assert (tmp_path / "orig.jsonl").read_bytes() == before  # the original file is untouched
        assert (await original.query("and on", events="result").wait()).result == "original goes on"
        with pytest.raises(FileNotFoundError, match=r"no transcript nowhere\.jsonl"):
            await rt.fork("nowhere")
        with pytest.raises(ValueError, match="'branch' is already open"):
            await rt.fork("orig", "branch")

    sharded(tmp_path, main)


def test_a_remote_sessions_controls_compact_count_set_its_model_and_fork_at_a_message_on_its_shard(
    tmp_path: Path,
) -> None:
    async def main(rt: ShardedRuntime) -> None:
        # The factory's one scripted model answers the query, the compaction's summary, then the next query.
        session = await rt.open_session({"replies": ["Noted.", "We fixed tokens.py.", "Fixed."]}, key="ctl")
        await session.query("Remember the parser bug. " * 100, events="result").wait()
        before = await session.context_usage()
        boundary = await session.compact("Keep the file names.")
        after = await session.context_usage()
        await session.set_model("claude-opus-4-6")
        result = await session.query("Go on", events="result").wait()
        assert boundary.subtype == "compact_boundary" and boundary.data["trigger"] == "manual"
        assert after["totalTokens"] < before["totalTokens"] and before["model"] != "claude-opus-4-6"
        assert (await session.context_usage())["model"] == "claude-opus-4-6"
        assert result.result == "Fixed." and list(result.model_usage) == ["claude-opus-4-6"]
        first, answer = (await session.transcript())[:2]
        fork = await rt.fork("ctl", "ctl-fork", {"replies": []}, resume_session_at=answer.uuid)
        assert [m.uuid for m in await fork.transcript()] == [first.uuid, answer.uuid]
        with pytest.raises(ValueError, match="'unknown' names no message"):
            await rt.fork("ctl", "ctl-bad", resume_session_at="unknown")

    sharded(tmp_path, main)


def test_a_shard_restarted_by_ray_comes_back_empty_says_so_and_takes_sessions_again(tmp_path: Path) -> None:
    async def main(rt: ShardedRuntime) -> None:
        victim = await rt.open_session({"kind": "block"}, key="victim")
        other = await rt.open_session({"replies": ["still here"]})
        before = rt.shards[victim.shard]
        query = victim.query("block")
        await until_tool_runs(query)
        os.kill(before["pid"], signal.SIGKILL)
        with pytest.raises(ShardLost):
            await query.wait()

        async def back() -> bool:
            return bool(rt.shards[victim.shard]["alive"])

        await until(back)  # Ray starts a new process for the actor; the runtime watches for it
        after = rt.shards[victim.shard]
        assert after["incarnation"] != before["incarnation"] and after["pid"] != before["pid"]
        reports = {report["index"]: report for report in await rt.shard_info()}
        assert reports[victim.shard]["restarted"] and reports[victim.shard]["sessions"] == 0
        assert not reports[other.shard]["restarted"] and reports[other.shard]["sessions"] == 1
        with pytest.raises(ShardLost):
            victim.query("again")  # the session was on the old incarnation: resume it
        resumed = await rt.resume("victim", {"replies": ["after the restart"]})
        assert resumed.id == victim.id and resumed.shard == other.shard  # not where it was lost
        assert (await resumed.query("go on", events="result").wait()).result == "after the restart"
        fresh = await rt.open_session({"replies": ["new"]})
        assert fresh.shard == victim.shard  # the restarted shard, empty, is the least loaded
        assert (await fresh.query("hi", events="result").wait()).result == "new"

    sharded(tmp_path, main, max_restarts=1)


def test_a_factory_that_raises_gives_a_clear_error_on_open_session(tmp_path: Path) -> None:
    async def main(rt: ShardedRuntime) -> None:
        with pytest.raises(FactoryError, match=r"tests.ray_factory:options.*raised ValueError\('no such agent'\)"):
            await rt.open_session({"kind": "raise"})
        assert [s["sessions"] for s in rt.shards] == [0, 0]
        assert (await (await rt.open_session()).query("hi", events="result").wait()).result == "hello"

    sharded(tmp_path, main)

    async def unimportable(rt: ShardedRuntime) -> None:
        with pytest.raises(FactoryError, match="cannot be imported"):
            await rt.open_session()

    async def bad() -> None:
        async with ShardedRuntime.open(shards=1, factory="tests.nowhere:options", transcript_dir=tmp_path) as rt:
            await unimportable(rt)

    run(bad)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
def test_the_cluster_listens_on_loopback_only(tmp_path: Path) -> None:
    async def main(rt: ShardedRuntime) -> list[str]:
        pids = {str(s["pid"]) for s in rt.shards}
        ss = await asyncio.create_subprocess_exec("ss", "-ltnpH", stdout=asyncio.subprocess.PIPE)
        listing = (await ss.communicate())[0].decode()
        ours = [
            line
            for line in listing.splitlines()
            if any(f"pid={pid}," in line for pid in pids) or "raylet" in line or "gcs_server" in line
        ]
        assert ours, listing
        loopback = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
        return [line for line in ours if line.split()[3].rsplit(":", 1)[0].strip("[]") not in loopback]

    assert sharded(tmp_path, main) == []


def tool_outputs(events: list[Any]) -> list[Any]:
    return [
        block["content"]
        for event in events
        if isinstance(event, UserMessage) and isinstance(event.content, list)
        for block in event.content
        if block["type"] == "tool_result"
    ]


def test_a_drivers_span_is_the_parent_of_its_query_on_the_shard(tmp_path: Path) -> None:
    """Trace context crosses the process boundary: the query's spans on the shard join the driver's trace."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider

    from queryloop.runtime import telemetry

    provider = TracerProvider()

    async def main(rt: ShardedRuntime) -> None:
        session = await rt.open_session({"kind": "traced"})
        with provider.get_tracer("driver").start_as_current_span("request") as span:
            events = [e async for e in session.query("trace")]
        driver_trace = f"{span.get_span_context().trace_id:032x}"
        assert tool_outputs(events) == [driver_trace]
        other = await rt.open_session({"kind": "traced"})
        untraced = [e async for e in other.query("trace")]  # no span current: a trace of its own
        (own,) = tool_outputs(untraced)
        assert own not in ("none", driver_trace)

    telemetry.use(tracer_provider=provider)
    try:
        sharded(tmp_path, main)
    finally:
        telemetry.use()
        provider.shutdown()
