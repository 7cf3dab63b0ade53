"""Throughput of workload W: C loops at once, through the runtime and through the baseline.

A runtime loop is what a host does for one independent agent run: open a session (six actors),
run the query to its result, close the session. `throughput_ratio` = runtime loops/s over
baseline loops/s, best round of each; rounds alternate, and the two sides take turns at going first in
a round (`bench.collector.in_turn`: the second place is an advantage), so that both see the same machine.
`--concurrency` takes a list (`10,100,1000`) for a throughput curve; the JSON's top-level
figures are then those of the largest level, and `--plot FILE.png` draws the curve.

Both sides of a ratio run under the same collector settings (bench/collector.py). By default one
run measures two pairs: tuned (the runtime opened with `tune_gc=True`, the baseline's phase under
the same thresholds): `throughput_ratio`; and untuned (both at Python's defaults):
`throughput_ratio_untuned`. `--gc tuned|untuned` measures one pair (`--no-tune-gc` = untuned);
`--gc off` one pair with the collector disabled on both sides (`throughput_ratio_off`, `cpu_ratio_off`:
what the two sides' own code costs).
`--host asyncio` runs the runtime side through `queryloop.aio` under `asyncio.run`, beside the trio
host, against the same baseline (bench/aio_loops.py says what it reports).
Per side and pair, `gc.callbacks` measure the collector: `gc_share` (CPU in collections / CPU of
the side's rounds), `tracked_per_loop` (GC-tracked objects allocated per loop, net, as the
collector counts them), `cpu_us_per_loop`; the baseline's carry a `baseline_` prefix, the
untuned pair's an `_untuned` suffix. `cpu_ratio` = the baseline's CPU per loop over the runtime's,
over all rounds: the throughput ratio of a CPU-bound host, steadier than the best rounds' wall time
on a shared machine. An untimed census round of each side (the collector off) counts the tracked
objects alive at once: `in_flight_per_loop`. The two pairs take turns going first in a round.

`--transcript`: every runtime session logs to a transcript file of its own (a fresh directory per
round, under `--transcript-dir`), and the baseline writes the same messages to a file per loop, each
before it is yielded, with an fsync (in a worker thread) after each turn and at the end: what a
durable transcript costs, on both sides.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path
from typing import Any

import trio

from bench import workload
from bench.baseline import BaselineAbort, BaselineLog, baseline_loop
from bench.collector import PAIRS, GcMeter, add_gc_arguments, collector_off, gc_setting, in_flight, in_turn
from bench.profiling import RuntimeProfile, add_profile_argument
from bench.report import check_plot_target, plot_throughput, progress
from queryloop import Runtime
from queryloop.runtime.loop.options import QueryOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", default="1000", help="loops at once; a list (10,100,1000) for a curve")
    parser.add_argument("--model-ms", type=float, default=0.0)
    parser.add_argument("--tool-ms", type=float, default=0.0)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per side; even, each side goes first as often")
    parser.add_argument("--plot", metavar="FILE.png", help="draw loops/s against concurrency")
    parser.add_argument("--transcript", action="store_true", help="a transcript file per loop, on both sides")
    parser.add_argument("--transcript-dir", default=None, help="where the transcript files go (default: temp dir)")
    host = "the runtime side's host; asyncio: through queryloop.aio, beside the trio host (bench/aio_loops.py)"
    parser.add_argument("--host", choices=("trio", "asyncio"), default="trio", help=host)
    parser.add_argument("--mode", choices=("guest", "thread"), default="guest", help="--host asyncio: its mode")
    parser.add_argument("--tools", choices=("trio", "asyncio"), default="trio", help="--host asyncio: W's tools' loop")
    add_gc_arguments(parser)
    add_profile_argument(parser)


@contextmanager
def transcript_dir(parent: str | None) -> Iterator[Path]:
    """A fresh directory for one round's transcript files, removed (untimed) after it."""
    directory = Path(tempfile.mkdtemp(prefix="bench-loops-", dir=parent))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def runtime_round(
    concurrency: int,
    model_ms: float,
    tool_ms: float,
    *,
    tune_gc: bool = True,
    meter: GcMeter | None = None,
    transcripts: Path | None = None,
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    numbers = iter(range(concurrency))
    async with Runtime.open(tune_gc=tune_gc) as runtime:
        if meter is not None:
            meter.note_thresholds()

        async def one() -> None:
            start = time.perf_counter()
            path = None if transcripts is None else transcripts / f"{next(numbers)}.jsonl"
            session = await runtime.open_session(
                QueryOptions(provider=workload.model(model_ms), tools=workload.tools(tool_ms)), transcript=path
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


async def baseline_round(
    concurrency: int, model_ms: float, tool_ms: float, *, transcripts: Path | None = None
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    numbers = iter(range(concurrency))

    async def one() -> None:
        start = time.perf_counter()
        log = None if transcripts is None else BaselineLog(transcripts / f"{next(numbers)}.jsonl")
        abort = BaselineAbort()
        loop = baseline_loop(workload.model(model_ms), workload.tools(tool_ms), workload.PROMPT, abort, log=log)
        try:
            async with aclosing(loop) as events:
                async for _ in events:
                    pass
        finally:
            if log is not None:
                log.close()
        latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(one)
    return time.perf_counter() - start, latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Round = tuple[float, list[float]]


def pair_figures(c: int, pair: str, ours: list[Round], base: list[Round], meters: dict[str, GcMeter]) -> dict[str, Any]:
    """The figures of one pair at one level; the untuned pair's names end in `_untuned`."""
    best_ours = min(ours, key=lambda r: r[0])
    best_base = min(base, key=lambda r: r[0])
    ours_rate, base_rate = c / best_ours[0], c / best_base[0]
    ratio = ours_rate / base_rate
    loops = c * len(ours)
    runtime, baseline = meters["runtime"], meters["baseline"]
    print(f"  {pair} (thresholds {runtime.thresholds} on both sides)")
    print(
        f"    baseline : {base_rate:8.0f} loops/s  p50 {percentile(best_base[1], 0.5) * 1e3:7.1f} ms"
        f"  cpu {baseline.cpu / loops * 1e6:6.0f} us/loop  gc {baseline.gc_share:6.1%}"
        f"  tracked {baseline.tracked / loops:7.0f}/loop"
    )
    print(
        f"    runtime  : {ours_rate:8.0f} loops/s  p50 {percentile(best_ours[1], 0.5) * 1e3:7.1f} ms"
        f"  cpu {runtime.cpu / loops * 1e6:6.0f} us/loop  gc {runtime.gc_share:6.1%}"
        f"  tracked {runtime.tracked / loops:7.0f}/loop"
    )
    cpu_ratio = baseline.cpu / runtime.cpu if runtime.cpu else 0.0
    print(f"    throughput_ratio (runtime / baseline): {ratio:.2f}; cpu_ratio (baseline / runtime): {cpu_ratio:.2f}")
    figures: dict[str, Any] = {
        "loops_per_s": round(ours_rate, 1),
        "baseline_loops_per_s": round(base_rate, 1),
        "throughput_ratio": round(ratio, 3),
        "cpu_ratio": round(cpu_ratio, 3),
        "p50_ms": round(percentile(best_ours[1], 0.5) * 1e3, 2),
        "p99_ms": round(percentile(best_ours[1], 0.99) * 1e3, 2),
        "baseline_p50_ms": round(percentile(best_base[1], 0.5) * 1e3, 2),
        "baseline_p99_ms": round(percentile(best_base[1], 0.99) * 1e3, 2),
        "rounds": [round(r[0], 3) for r in ours],
        "baseline_rounds": [round(r[0], 3) for r in base],
        "median_round_ratio": round(statistics.median(b[0] for b in base) / statistics.median(o[0] for o in ours), 3),
        "gc_thresholds": list(runtime.thresholds),
        **runtime.figures(loops),
        **baseline.figures(loops, prefix="baseline_"),
    }
    suffix = "" if pair == "tuned" else f"_{pair}"
    return {f"{name}{suffix}": value for name, value in figures.items()}


async def measure_level(c: int, args: argparse.Namespace, profile: RuntimeProfile, advance: Any) -> dict[str, Any]:
    model_ms, tool_ms = args.model_ms, args.tool_ms
    pairs = PAIRS[args.gc]
    ours: dict[str, list[Round]] = {pair: [] for pair in pairs}
    base: dict[str, list[Round]] = {pair: [] for pair in pairs}
    meters = {pair: {"runtime": GcMeter(), "baseline": GcMeter()} for pair in pairs}
    # Untimed, a small round of each side first: the process's warm-up (caches, first allocations of
    # its arenas) would otherwise go to whichever side runs the first timed round.
    await baseline_round(min(c, 100), model_ms, tool_ms)
    await runtime_round(min(c, 100), model_ms, tool_ms)
    for index in range(args.rounds):
        for pair in pairs[:: -1 if index % 2 else 1]:  # the pairs' order alternates from round to round
            tuned, off = pair == "tuned", pair == "off"
            meter = meters[pair]["runtime"]
            for side in in_turn(("baseline", "runtime"), index):
                gc.collect()
                with transcript_dir(args.transcript_dir) as directory:
                    files = directory if args.transcript else None
                    if side == "baseline":
                        with gc_setting(tuned), collector_off(off), meters[pair]["baseline"]:
                            base[pair].append(await baseline_round(c, model_ms, tool_ms, transcripts=files))
                    else:
                        with collector_off(off), meter, profile.on():
                            ours[pair].append(
                                await runtime_round(c, model_ms, tool_ms, tune_gc=tuned, meter=meter, transcripts=files)
                            )
            if meter.thresholds != meters[pair]["baseline"].thresholds:
                msg = f"{pair}: the two sides ran under different thresholds ({meters[pair]})"
                raise RuntimeError(msg)
        advance()
    # An untimed census round of each side: tracked objects alive at once (the collector off).
    async with in_flight() as base_census:
        await baseline_round(c, model_ms, tool_ms)
    async with in_flight() as ours_census:
        await runtime_round(c, model_ms, tool_ms, tune_gc=False)
    note = ", a transcript file per loop" if args.transcript else ""
    print(f"workload W, {c} loops at once, model {model_ms} ms, tools {tool_ms} ms{note}, best of {args.rounds} rounds")
    print(
        f"  tracked objects alive at once, per loop at its busiest: runtime {ours_census.peak / c:.0f},"
        f" baseline {base_census.peak / c:.0f}"
    )
    point: dict[str, Any] = {
        "concurrency": c,
        "in_flight_per_loop": round(ours_census.peak / c, 1),
        "baseline_in_flight_per_loop": round(base_census.peak / c, 1),
    }
    for pair in pairs:
        point.update(pair_figures(c, pair, ours[pair], base[pair], meters[pair]))
    return point


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    target = check_plot_target(args.plot)
    profile = RuntimeProfile(args.profile)
    levels = sorted(int(c) for c in str(args.concurrency).split(","))
    with progress(len(levels) * args.rounds, "loops") as advance:
        points = [await measure_level(c, args, profile, advance) for c in levels]
    if target is not None:
        plot_throughput(target, points, f"workload W, model {args.model_ms} ms, tools {args.tool_ms} ms")
        print(f"  plot: {target}")
    result = {
        "benchmark": "loops",
        "model_ms": args.model_ms,
        "tool_ms": args.tool_ms,
        "gc": args.gc,
        "transcript": args.transcript,
        **points[-1],
        **profile.save(),
    }
    if len(points) > 1:
        result["points"] = points
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.host == "asyncio":
        from bench import aio_loops

        return aio_loops.run(args)
    return trio.run(measure, args)
