"""Throughput of workload W: C loops at once, through the runtime and through the baseline.

A runtime loop is what a host does for one independent agent run: open a session (six actors),
run the query to its result, close the session. `throughput_ratio` = runtime loops/s over
baseline loops/s, best round of each, rounds alternating so that both see the same machine.
`--concurrency` takes a list (`10,100,1000`) for a throughput curve; the JSON's top-level
figures are then those of the largest level, and `--plot FILE.png` draws the curve.

The runtime side opens its runtimes with `tune_gc=True`, as a host that owns its process would
(`--no-tune-gc`: with the collector at the process's thresholds); the baseline side always runs at
the process's thresholds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from contextlib import aclosing
from typing import Any

import trio

from bench import workload
from bench.baseline import BaselineAbort, baseline_loop
from bench.report import check_plot_target, plot_throughput, progress
from queryloop import Runtime
from queryloop.runtime.loop.options import QueryOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1000", help="loops at once; a list (10,100,1000) for a curve")
    parser.add_argument("--model-ms", type=float, default=0.0)
    parser.add_argument("--tool-ms", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", metavar="FILE.png", help="draw loops/s against concurrency")
    parser.add_argument(
        "--no-tune-gc",
        dest="tune_gc",
        action="store_false",
        help="open the runtime side with Runtime.open(tune_gc=False), the library's default, instead of"
        " tune_gc=True, which raises the collector's thresholds while the runtime side runs (never while"
        " the baseline does); docs/collector.md",
    )


async def runtime_round(
    concurrency: int, model_ms: float, tool_ms: float, *, tune_gc: bool = True
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    async with Runtime.open(tune_gc=tune_gc) as runtime:

        async def one() -> None:
            start = time.perf_counter()
            session = await runtime.open_session(
                QueryOptions(provider=workload.model(model_ms), tools=workload.tools(tool_ms))
            )
            async for _ in session.query(workload.PROMPT):
                pass
            await session.close()
            latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(one)
        elapsed = time.perf_counter() - start
    return elapsed, latencies


async def baseline_round(concurrency: int, model_ms: float, tool_ms: float) -> tuple[float, list[float]]:
    latencies: list[float] = []

    async def one() -> None:
        start = time.perf_counter()
        async with aclosing(
            baseline_loop(workload.model(model_ms), workload.tools(tool_ms), workload.PROMPT, BaselineAbort())
        ) as events:
            async for _ in events:
                pass
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(one)
    return time.perf_counter() - start, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure_level(c: int, args: argparse.Namespace, advance: Any) -> dict[str, Any]:
    model_ms, tool_ms = args.model_ms, args.tool_ms
    ours: list[tuple[float, list[float]]] = []
    base: list[tuple[float, list[float]]] = []
    for _ in range(args.rounds):
        gc.collect()
        base.append(await baseline_round(c, model_ms, tool_ms))
        gc.collect()
        ours.append(await runtime_round(c, model_ms, tool_ms, tune_gc=args.tune_gc))
        advance()
    best_ours = min(ours, key=lambda r: r[0])
    best_base = min(base, key=lambda r: r[0])
    ours_rate, base_rate = c / best_ours[0], c / best_base[0]
    ratio = ours_rate / base_rate
    gc_note = "" if args.tune_gc else ", runtime with tune_gc=False"
    print(f"workload W, {c} loops at once, model {model_ms} ms, tools {tool_ms} ms{gc_note}")
    print(f"  baseline : {base_rate:8.0f} loops/s  p50 {percentile(best_base[1], 0.5) * 1e3:7.1f} ms")
    print(f"  runtime  : {ours_rate:8.0f} loops/s  p50 {percentile(best_ours[1], 0.5) * 1e3:7.1f} ms")
    print(f"  throughput_ratio (runtime / baseline): {ratio:.2f}")
    return {
        "concurrency": c,
        "loops_per_s": round(ours_rate, 1),
        "baseline_loops_per_s": round(base_rate, 1),
        "throughput_ratio": round(ratio, 3),
        "p50_ms": round(percentile(best_ours[1], 0.5) * 1e3, 2),
        "p99_ms": round(percentile(best_ours[1], 0.99) * 1e3, 2),
        "baseline_p50_ms": round(percentile(best_base[1], 0.5) * 1e3, 2),
        "baseline_p99_ms": round(percentile(best_base[1], 0.99) * 1e3, 2),
        "rounds": [round(r[0], 3) for r in ours],
        "baseline_rounds": [round(r[0], 3) for r in base],
        "median_round_ratio": round(statistics.median(b[0] for b in base) / statistics.median(o[0] for o in ours), 3),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    target = check_plot_target(args.plot)
    levels = sorted(int(c) for c in str(args.concurrency).split(","))
    with progress(len(levels) * args.rounds, "loops") as advance:
        points = [await measure_level(c, args, advance) for c in levels]
    if target is not None:
        plot_throughput(target, points, f"workload W, model {args.model_ms} ms, tools {args.tool_ms} ms")
        print(f"  plot: {target}")
    result = {
        "benchmark": "loops",
        "model_ms": args.model_ms,
        "tool_ms": args.tool_ms,
        "tune_gc": args.tune_gc,
        **points[-1],
    }
    if len(points) > 1:
        result["points"] = points
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    return trio.run(measure, args)
