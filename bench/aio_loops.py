"""`bench loops --host asyncio`: workload W through `queryloop.aio.AsyncioRuntime` under `asyncio.run`.

Each round runs three sides one after the other, each under the same collector setting: the in-run
baseline (`trio.run`, unchanged), the trio host (`Runtime` under `trio.run`, as `bench loops`), and
the asyncio host (the facade under `asyncio.run`, guest mode unless `--mode thread`). Reported:
`throughput_ratio` (asyncio host / baseline, best rounds), `trio_throughput_ratio` (the trio host's,
same run), `ratio_to_trio` (the first over the second), CPU per loop of each side, the hops each loop
cost (`hops_per_loop`: asyncio→trio drains plus trio→asyncio drains, with the calls they carried), and
`cpu_us_per_hop` = (asyncio host's CPU per loop − trio host's) / hops per loop: what the bridge costs,
charged to its hops (and `cpu_us_per_call`, to the calls they carried: a hop carries every call made
ready in one tick, hundreds at a thousand loops at once, one at `--concurrency 1`). `--tools asyncio`
runs W's two tools as asyncio tasks on the host loop (`asyncio.sleep`), as an asyncio host would
write them; by default they stay trio tools.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from typing import TYPE_CHECKING, Any

import trio

from bench import workload
from bench.collector import PAIRS, GcMeter, collector_off, gc_setting, in_turn
from bench.loops import Round, baseline_round, pair_figures, runtime_round
from bench.report import progress
from queryloop.aio import AsyncioRuntime
from queryloop.runtime.loop.options import QueryOptions

if TYPE_CHECKING:
    import argparse

    from queryloop.runtime.host.aio_bridge import Mode


async def asyncio_round(
    concurrency: int, args: argparse.Namespace, *, tune_gc: bool, meter: GcMeter
) -> tuple[float, list[float], dict[str, int]]:
    latencies: list[float] = []
    tools = workload.asyncio_tools(args.tool_ms) if args.tools == "asyncio" else workload.tools(args.tool_ms)
    mode: Mode = args.mode
    async with AsyncioRuntime.open(mode=mode, tune_gc=tune_gc) as runtime:
        meter.note_thresholds()

        async def one() -> None:
            start = time.perf_counter()
            session = await runtime.open_session(QueryOptions(provider=workload.model(args.model_ms), tools=tools))
            async for _ in session.query(workload.PROMPT):
                pass
            await session.close()
            latencies.append(time.perf_counter() - start)

        before = runtime.hops()
        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(concurrency):
                group.create_task(one())
        elapsed = time.perf_counter() - start
        hops = {name: value - before[name] for name, value in runtime.hops().items()}
    return elapsed, latencies, hops


def as_runtime(meters: dict[str, GcMeter], side: str) -> dict[str, GcMeter]:
    """The meters as `pair_figures` reads them: this side as its runtime."""
    return {"runtime": meters[side], "baseline": meters["baseline"]}


def measure_level(c: int, args: argparse.Namespace, advance: Any) -> dict[str, Any]:
    pairs = PAIRS[args.gc]
    sides = ("baseline", "trio", "asyncio")
    rounds: dict[str, dict[str, list[Round]]] = {pair: {side: [] for side in sides} for pair in pairs}
    meters = {pair: {side: GcMeter() for side in sides} for pair in pairs}
    hops: dict[str, dict[str, int]] = {pair: {} for pair in pairs}
    for index in range(args.rounds):
        for pair in pairs[:: -1 if index % 2 else 1]:
            tuned, off = pair == "tuned", pair == "off"
            for side in in_turn(sides, index):
                gc.collect()
                meter = meters[pair][side]
                if side == "baseline":
                    with gc_setting(tuned), collector_off(off), meter:
                        rounds[pair]["baseline"].append(trio.run(baseline_round, c, args.model_ms, args.tool_ms))
                elif side == "trio":
                    with collector_off(off), meter:
                        trio_round = functools.partial(runtime_round, tune_gc=tuned, meter=meter)
                        rounds[pair]["trio"].append(trio.run(trio_round, c, args.model_ms, args.tool_ms))
                else:
                    with collector_off(off), meter:
                        elapsed, latencies, counted = asyncio.run(asyncio_round(c, args, tune_gc=tuned, meter=meter))
                    rounds[pair]["asyncio"].append((elapsed, latencies))
                    for name, value in counted.items():
                        hops[pair][name] = hops[pair].get(name, 0) + value
        advance()
    print(f"workload W, {c} loops at once, model {args.model_ms} ms, tools {args.tool_ms} ms ({args.tools} tools),")
    print(f"  asyncio host in {args.mode} mode, best of {args.rounds} rounds")
    point: dict[str, Any] = {"concurrency": c}
    for pair in pairs:
        suffix = "" if pair == "tuned" else f"_{pair}"
        of = rounds[pair]
        ours = pair_figures(c, pair, of["asyncio"], of["baseline"], as_runtime(meters[pair], "asyncio"))
        theirs = pair_figures(c, pair, of["trio"], of["baseline"], as_runtime(meters[pair], "trio"))
        loops = c * args.rounds
        counted = hops[pair]
        per_loop = (counted["hops_to_trio"] + counted["hops_to_host"]) / loops
        calls = (counted["calls_to_trio"] + counted["calls_to_host"]) / loops
        extra_cpu = (meters[pair]["asyncio"].cpu - meters[pair]["trio"].cpu) / loops
        figures = {
            **ours,
            "trio_throughput_ratio": theirs[f"throughput_ratio{suffix}"],
            "trio_cpu_us_per_loop": round(meters[pair]["trio"].cpu / loops * 1e6, 2),
            "ratio_to_trio": round(ours[f"throughput_ratio{suffix}"] / theirs[f"throughput_ratio{suffix}"], 3),
            "hops_per_loop": round(per_loop, 4),
            "calls_per_loop": round(calls, 2),
            "cpu_us_per_hop": round(extra_cpu / per_loop * 1e6, 2) if per_loop else 0.0,
            "cpu_us_per_call": round(extra_cpu / calls * 1e6, 2) if calls else 0.0,
        }
        print(
            f"  {pair}: asyncio host {figures['ratio_to_trio']:.2f}x the trio host's throughput ratio"
            f" ({ours[f'throughput_ratio{suffix}']:.2f} against {theirs[f'throughput_ratio{suffix}']:.2f});"
            f" {per_loop:.3f} hops per loop carrying {calls:.1f} calls; the bridge's CPU:"
            f" {figures['cpu_us_per_hop']:.1f} us per hop, {figures['cpu_us_per_call']:.1f} us per call"
        )
        point.update({name if name.endswith(suffix) else f"{name}{suffix}": value for name, value in figures.items()})
    return point


def run(args: argparse.Namespace) -> dict[str, Any]:
    levels = sorted(int(c) for c in str(args.concurrency).split(","))
    with progress(len(levels) * args.rounds, "loops --host asyncio") as advance:
        points = [measure_level(c, args, advance) for c in levels]
    result = {
        "benchmark": "loops",
        "host": "asyncio",
        "mode": args.mode,
        "tools": args.tools,
        "model_ms": args.model_ms,
        "tool_ms": args.tool_ms,
        "gc": args.gc,
        **points[-1],
    }
    if len(points) > 1:
        result["points"] = points
    return result
