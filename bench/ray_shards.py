"""`bench ray`: workload W on sessions sharded over Ray actors (`queryloop.ray.ShardedRuntime`), one driver.

A local Ray cluster bound to loopback (`num_cpus` = the largest shard count). For each shard count:
T sessions per shard (`--throughput-concurrency`, 200) each run `--queries` W queries in a row, once
with `events="result"` and once with `events="all"`; reported per mode: loops/s, CPU per loop of the
driver and of the shards (their processes' CPU time). T keeps the shards busy: a session runs its
queries one after the other, each a round trip through Ray and the shipping window, so at C two
shards on two cores idle about 40 % of the time and loops/s measures that latency, not capacity.
The same at C sessions per shard (`--concurrency`, 50; figures ending in `_at_c`), the medians of
`--ship-rounds` rounds on fresh sessions; `ship_us_per_event` = (all-mode CPU per loop, both sides,
− results mode's) / events per loop, at C: a difference of two CPU figures near 2 ms per loop, it
moves by several µs per event from one run to the next (a shard's CPU per loop varies by 10-30 %
between runs on a shared 2-core machine; one round at T gave 9 and 31 µs). At the largest count,
`--aborts` aborts (400: of 100, the p99 would be the largest) of a blocked query through Ray (driver
`abort()` to its `result` back), under a results-mode load of C sessions per shard kept up until the
last sample, twice:
- `abort_p50_ms`, `abort_p90_ms`, `abort_p99_ms`: the load's model calls and tools take
  `--abort-model-ms` and `--abort-tool-ms` (50 each, as `bench abort`'s load): queries in flight, each
  waiting on its model or its tools, which is what an abort meets in a real host; its sessions start
  at seeded moments spread over one loop's life, as `bench abort`'s slots do;
- the same ending in `_saturated`: the load is W at 0 ms, every shard at a full core on a machine with
  no core to spare (two shards, the driver and Ray's own processes on two cores), so the tail is the
  operating system's scheduler and the GIL hand-offs it delays, not the abort's path;
each with `..._shard_cpu`, the shards' mean CPU use (cores) during the round. Then a kill round: a
shard SIGKILLed while its sessions' queries run; every `ShardLost` session is resumed on a survivor
and must complete a query (`lost_after_kill`: those that could not). `scaling_2_over_1`:
results-mode loops/s on two shards over one, at T.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

from bench import workload
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.providers.scripted import ScriptedModel

if TYPE_CHECKING:
    import argparse

    from queryloop.ray import ShardedRuntime

FACTORY = "bench.ray_shards:options"
SEED = 15
"""Of the aborts' load: when its sessions start."""


async def _block(args: Any, ctx: ToolContext) -> ToolOutput:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def options(spec: Mapping[str, Any]) -> QueryOptions:
    """The shards' factory: W (repeated), or a query whose tool blocks until aborted (`{"block": true}`)."""
    if spec.get("block"):
        reply = {"content": [{"type": "tool_use", "id": "t1", "name": "block", "input": {}}], "stop_reason": "tool_use"}
        model = ScriptedModel([reply], repeat=True)
        return QueryOptions(provider=model, tools=[Tool(name="block", call=_block, runs_on="trio")])
    model = ScriptedModel(workload.script(spec.get("model_ms", 0.0)), name="bench", repeat=True)
    return QueryOptions(provider=model, tools=workload.tools(spec.get("tool_ms", 0.0)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", default="1,2", help="shard counts to compare")
    parser.add_argument(
        "--concurrency", type=int, default=50, help="sessions per shard (C): the aborts' load, ship_us_per_event"
    )
    parser.add_argument(
        "--throughput-concurrency", type=int, default=200, help="sessions per shard (T) of the loops/s figures"
    )
    parser.add_argument(
        "--ship-rounds", type=int, default=3, help="rounds at C (medians): CPU per loop is a noisy difference"
    )
    parser.add_argument("--queries", type=int, default=10, help="W queries each session runs in a row")
    parser.add_argument("--model-ms", type=float, default=0.0)
    parser.add_argument("--tool-ms", type=float, default=0.0)
    parser.add_argument("--batch-ms", type=float, default=5.0, help="the shards' shipping window")
    parser.add_argument(
        "--aborts", type=int, default=400, help="abort samples under each load (with 100, p99 would be the largest)"
    )
    parser.add_argument("--abort-model-ms", type=float, default=50.0, help="the model's time in the aborts' load")
    parser.add_argument("--abort-tool-ms", type=float, default=50.0, help="the tools' time in the aborts' load")
    parser.add_argument(
        "--transcript-dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the transcripts go (a temporary directory inside it)",
    )
    parser.add_argument("--kill-sessions", type=int, default=20, help="sessions per shard in the kill round")


def run(args: argparse.Namespace) -> dict[str, Any]:
    # Read when Ray is imported: the node takes the loopback address and every Ray server binds to it.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    counts = [int(n) for n in args.shards.split(",")]
    ray.init(num_cpus=max(counts), include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    # The driver owns its process: what was imported and built so far (Ray's and ours) is frozen out
    # of the collector's walks, as the shards do; else a full collection pauses the driver 40-60 ms.
    gc.freeze()
    try:
        return asyncio.run(_measure(args, counts))
    finally:
        ray.shutdown()


async def _cpu(rt: ShardedRuntime) -> tuple[float, float]:
    return time.process_time(), sum(info["cpu_s"] for info in await rt.shard_info())


async def _load(rt: ShardedRuntime, args: argparse.Namespace, sessions: list[Any], events: str) -> dict[str, Any]:
    async def one(session: Any) -> int:
        count = 0
        for _ in range(args.queries):
            query = session.query(workload.PROMPT, events=events)
            count += sum([1 async for _ in query])
        return count

    driver0, shards0 = await _cpu(rt)
    start = time.perf_counter()
    counts = await asyncio.gather(*(one(s) for s in sessions))
    elapsed = time.perf_counter() - start
    driver1, shards1 = await _cpu(rt)
    loops = len(sessions) * args.queries
    return {
        "loops_per_s": loops / elapsed,
        "driver_cpu_us_per_loop": (driver1 - driver0) / loops * 1e6,
        "shard_cpu_us_per_loop": (shards1 - shards0) / loops * 1e6,
        "events_per_loop": sum(counts) / loops,
    }


async def _sustain(sessions: list[Any], stop: asyncio.Event, starts: list[float]) -> None:
    """Every session runs W queries back to back (`events="result"`) from its start on, until `stop`:
    the aborts' load."""

    async def one(session: Any, start: float) -> None:
        await asyncio.sleep(start)  # the session's seeded start (see `_abort_round`), not a wait for a state
        while not stop.is_set():
            await session.query(workload.PROMPT, events="result").wait()

    await asyncio.gather(*(one(s, start) for s, start in zip(sessions, starts, strict=True)))


async def _abort_round(
    rt: ShardedRuntime, args: argparse.Namespace, load: list[Any], label: str, *, life_s: float
) -> dict[str, Any]:
    """`--aborts` abort samples while the `load` sessions run queries back to back; its figures, `label`led.

    The sessions start at seeded moments spread over one loop's life (`life_s`), as `bench abort`'s
    slots do: a host's loops do not all start in the same instant, and loops started together reach
    every step of W together, a burst of every session's work at each step. The samples begin once
    every session has started."""
    rng = random.Random(SEED)
    starts = [rng.uniform(0, life_s) for _ in load]
    stop = asyncio.Event()
    running = asyncio.ensure_future(_sustain(load, stop, starts))
    await asyncio.sleep(life_s)  # every session of the load has started (a measurement's setup)
    start, (_, shards0) = time.perf_counter(), await _cpu(rt)
    times = sorted(await _aborts(rt, args.aborts))
    elapsed, (_, shards1) = time.perf_counter() - start, await _cpu(rt)
    stop.set()
    await running
    return {
        f"abort_p50_ms{label}": round(statistics.median(times), 2),
        f"abort_p90_ms{label}": round(times[int(len(times) * 0.9)], 2),
        f"abort_p99_ms{label}": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
        f"abort{label}_shard_cpu": round((shards1 - shards0) / elapsed / len(rt.shards), 2),
    }


async def _aborts(rt: ShardedRuntime, samples: int) -> list[float]:
    session = await rt.open_session({"block": True})
    times = []
    for _ in range(samples):
        query = session.query("block", events="messages")
        async for event in query:
            if event.label == "assistant":
                break
        start = time.perf_counter()
        query.abort()
        await query.wait()
        times.append((time.perf_counter() - start) * 1000)
    await session.close()
    return times


async def _kill_round(rt: ShardedRuntime, args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    from queryloop.ray import ShardLost

    sessions = [await rt.open_session(spec) for _ in range(args.kill_sessions * len(rt.shards))]
    stop = asyncio.Event()
    victim = rt.shards[0]
    on_victim = [s.shard == victim["index"] for s in sessions]
    tasks = [asyncio.ensure_future(_outcome(s, stop)) for s in sessions]
    await asyncio.sleep(0.05)  # the load under way when the shard dies (a measurement, not a wait for a state)
    killed = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    await asyncio.gather(*(t for t, hit in zip(tasks, on_victim, strict=True) if hit))
    stop.set()
    outcomes = await asyncio.gather(*tasks)
    detected = [t - killed for t in outcomes if t is not None]
    lost_keys = [s.key for s, o in zip(sessions, outcomes, strict=True) if o is not None]
    resume_ms, failed = [], sum(on_victim) - len(lost_keys)
    for key in lost_keys:
        start = time.perf_counter()
        try:
            resumed = await rt.resume(key, spec)
            resume_ms.append((time.perf_counter() - start) * 1000)
            await resumed.query(workload.PROMPT, events="result").wait()
        except (ShardLost, Exception):  # noqa: BLE001 - counted, not raised
            failed += 1
    return {
        "kill_sessions_lost": len(lost_keys),
        "kill_detect_ms_max": round(max(detected) * 1000, 1) if detected else None,
        "resume_ms_p50": round(statistics.median(resume_ms), 1) if resume_ms else None,
        "lost_after_kill": failed,
    }


async def _outcome(session: Any, stop: asyncio.Event) -> float | None:
    """Queries until the shard dies (the moment its `ShardLost` arrived) or until told to stop (None)."""
    from queryloop.ray import ShardLost

    try:
        while not stop.is_set():
            await session.query(workload.PROMPT, events="result").wait()
    except ShardLost:
        return time.perf_counter()
    return None


async def _measure(args: argparse.Namespace, counts: list[int]) -> dict[str, Any]:
    from queryloop.ray import ShardedRuntime

    spec = {"model_ms": args.model_ms, "tool_ms": args.tool_ms}
    figures: dict[str, Any] = {
        "concurrency_per_shard": args.concurrency,
        "throughput_concurrency_per_shard": args.throughput_concurrency,
        "queries_per_session": args.queries,
    }
    with tempfile.TemporaryDirectory(prefix="bench-ray-", dir=args.transcript_dir) as directory:
        for n in counts:
            async with ShardedRuntime.open(
                shards=n, factory=FACTORY, transcript_dir=f"{directory}/{n}", batch_ms=args.batch_ms
            ) as rt:
                sessions = [await rt.open_session(spec) for _ in range(2 * n)]
                await _load(rt, args, sessions, "result")  # warm-up
                for label, count, rounds in (
                    ("", args.throughput_concurrency, 1),
                    ("_at_c", args.concurrency, args.ship_rounds),
                ):
                    levels: dict[str, list[float]] = {}
                    for _ in range(rounds):
                        # Fresh sessions each round (a session's conversation grows with its queries),
                        # the last round's closed first (idle sessions still cost the shards' collector).
                        await asyncio.gather(*(session.close() for session in sessions))
                        sessions = [await rt.open_session(spec) for _ in range(count * n)]
                        for events in ("result", "all"):
                            level = await _load(rt, args, sessions, events)
                            print(f"shards={n} sessions/shard={count} events={events}: {level}")
                            for name, value in level.items():
                                levels.setdefault(f"{name}_{events}_{n}{label}", []).append(value)
                    figures.update({key: round(statistics.median(values), 2) for key, values in levels.items()})
                if n == max(counts):
                    paced = {"model_ms": args.abort_model_ms, "tool_ms": args.abort_tool_ms}
                    loaded = [await rt.open_session(paced) for _ in range(args.concurrency * n)]
                    life_s = (3 * args.abort_model_ms + 2 * args.abort_tool_ms) / 1000  # W: 3 calls, 2 tool rounds
                    figures.update(await _abort_round(rt, args, loaded, "", life_s=life_s))
                    await asyncio.gather(*(session.close() for session in loaded))
                    figures.update(await _abort_round(rt, args, sessions, "_saturated", life_s=0.0))
                    if n >= 2:
                        figures.update(await _kill_round(rt, args, spec))
    for n in counts:
        for label in ("", "_at_c"):
            cpu = {
                e: figures[f"driver_cpu_us_per_loop_{e}_{n}{label}"] + figures[f"shard_cpu_us_per_loop_{e}_{n}{label}"]
                for e in ("result", "all")
            }
            events = figures[f"events_per_loop_all_{n}{label}"]
            figures[f"ship_us_per_event_{n}{label}"] = round((cpu["all"] - cpu["result"]) / events, 2)
    figures["ship_us_per_event"] = figures[f"ship_us_per_event_{max(counts)}_at_c"]
    if 1 in counts and 2 in counts:
        figures["scaling_2_over_1"] = round(figures["loops_per_s_result_2"] / figures["loops_per_s_result_1"], 2)
    return figures
