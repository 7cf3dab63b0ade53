"""Abort under load: C loops at once, each aborted at a uniform random moment of its life.

The load is closed: C slots, each running loops of workload W back to back, a new loop starting
as soon as the previous one's stream has ended, so once every slot has started exactly C loops are
alive at every moment. The slots start at seeded moments spread over one loop life, as a host's
loops do not all start in the same instant; from then on the random abort moments keep their
phases apart. `--lockstep` starts them all at once instead: C=50 loops then reach every step of W
in the same instant, a burst that saturates the scheduler for milliseconds, in which even the
baseline's abort p99 exceeds 2 ms.

The same seeded moments are used for the baseline. Latency is measured from the abort call to
the loop's `result` event. `violations` counts loops the abort reached (before they had decided
how they end) whose terminal is not an aborted one, and loops whose transcript is invalid;
`leftover_tasks` counts tasks of a session still running once its query's stream has ended.

Both sides of a ratio run under the same collector settings (bench/collector.py). By default one
run measures two pairs, each round running both: tuned (the runtime opened with `tune_gc=True`, the
baseline's phase under the same thresholds): `abort_p99_ratio`; and untuned (both at Python's
defaults): `abort_p99_ratio_untuned` (the untuned pair's figures end in `_untuned`). `--gc
tuned|untuned` measures one pair (`--no-tune-gc` = untuned). `violations` and `leftover_tasks` add
up every runtime run of the benchmark, both pairs.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import trio

from bench import workload
from bench.baseline import BaselineAbort, baseline_loop
from bench.collector import PAIRS, GcMeter, add_gc_arguments, collector_off, gc_setting, in_turn
from bench.loops import percentile
from bench.profiling import RuntimeProfile, add_profile_argument
from bench.report import check_plot_target, plot_cdf, progress
from queryloop import Runtime
from queryloop.runtime.loop.events import ResultMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.transcript import transcript_problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=1000, help="loops alive at every moment")
    parser.add_argument("--model-ms", type=float, default=50.0)
    parser.add_argument("--tool-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating, pooled")
    parser.add_argument(
        "--loops-per-slot",
        type=int,
        default=None,
        help="loops each slot runs back to back in a round (default: at least 5, and 2,000 aborts in all)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the abort-latency CDF of both")
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="start every slot in the same instant (with --loops-per-slot 1: C loops whose steps coincide)",
    )
    add_gc_arguments(parser)
    add_profile_argument(parser)


Slot = tuple[float, list[float]]


def moments(args: argparse.Namespace, seed: int) -> list[Slot]:
    """Per slot: when it starts, and for each of its loops in turn when, after that loop's start, it is aborted."""
    life = (3 * args.model_ms + 2 * args.tool_ms) / 1000
    rng = random.Random(seed)
    slots = []
    for _ in range(args.concurrency):
        start = rng.uniform(0, life)  # drawn with --lockstep too: the abort moments stay the same
        slots.append((0.0 if args.lockstep else start, [rng.uniform(0, life) for _ in range(args.loops_per_slot)]))
    return slots


async def _run_slots(slots: list[Slot], one: Callable[[float], Awaitable[None]]) -> None:
    """Each slot, from its start, runs `one(delay)` for its loops one after another; all slots at once."""

    async def slot(start: float, delays: list[float]) -> None:
        await trio.sleep(start)
        for delay in delays:
            await one(delay)

    async with trio.open_nursery() as nursery:
        for start, delays in slots:
            nursery.start_soon(slot, start, delays)


async def runtime_run(
    args: argparse.Namespace, slots: list[Slot], *, tune_gc: bool = True, meter: GcMeter | None = None
) -> dict[str, Any]:
    latencies: list[float] = []
    violations = leftover = 0
    async with Runtime.open(tune_gc=tune_gc) as runtime:
        if meter is not None:
            meter.note_thresholds()

        async def one(delay: float) -> None:
            nonlocal violations, leftover
            session = await runtime.open_session(
                QueryOptions(provider=workload.model(args.model_ms), tools=workload.tools(args.tool_ms))
            )
            handle = session.query(workload.PROMPT)
            latency = await _abort_while_consuming(handle, lambda: session.abort("user"), delay)
            leftover += session.live_tasks()  # the stream has ended: nothing of the session may run
            if latency is not None:
                latencies.append(latency)
                terminal = handle.terminal.reason if handle.terminal else None
                # An abort that lands after the loop has decided its ending (its last check passed, its
                # result on the way) does not change it, as in Claude Code's loop: `abort_reason` stays None.
                if handle.abort_reason is not None and terminal not in ("aborted_streaming", "aborted_tools"):
                    violations += 1
            if handle.result is None or transcript_problems(await session.transcript()):
                violations += 1
            await session.close()

        await _run_slots(slots, one)
    return {"latencies": latencies, "violations": violations, "leftover": leftover}


async def baseline_run(args: argparse.Namespace, slots: list[Slot]) -> list[float]:
    latencies: list[float] = []

    async def one(delay: float) -> None:
        control = BaselineAbort()

        async def abort() -> None:
            control.abort("user")

        loop = baseline_loop(workload.model(args.model_ms), workload.tools(args.tool_ms), workload.PROMPT, control)
        async with aclosing(loop) as events:
            latency = await _abort_while_consuming(events, abort, delay)
        if latency is not None:
            latencies.append(latency)

    await _run_slots(slots, one)
    return latencies


async def _abort_while_consuming(
    events: AsyncIterator[Any], abort: Callable[[], Awaitable[Any]], delay: float
) -> float | None:
    """Consume `events` to their end, calling `abort()` `delay` seconds in: seconds from that call to
    the `result` event, or None if the loop had its result first."""
    asked: float | None = None
    ended: float | None = None
    timer = trio.CancelScope()
    async with trio.open_nursery() as nursery:

        async def abort_later() -> None:
            nonlocal asked
            with timer:
                await trio.sleep(delay)
            if ended is None:
                asked = time.perf_counter()
                await abort()

        nursery.start_soon(abort_later)
        async for event in events:
            if isinstance(event, ResultMessage):
                ended = time.perf_counter()
                timer.cancel()
    return ended - asked if asked is not None and ended is not None else None


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    # A p99 needs many samples: rounds are pooled, each with its own seeded moments (the same for
    # both sides), the two sides alternating so that both see the same machine.
    target = check_plot_target(args.plot)
    profile = RuntimeProfile(args.profile)
    if args.rounds < 1 or args.concurrency < 1:
        sys.exit("--rounds and --concurrency must be at least 1")
    if args.loops_per_slot is None:
        args.loops_per_slot = max(5, -(-2000 // (args.concurrency * args.rounds)))
    elif args.loops_per_slot < 1:
        sys.exit("--loops-per-slot must be at least 1")
    rounds = args.rounds
    pairs = PAIRS[args.gc]
    base: dict[str, list[float]] = {pair: [] for pair in pairs}
    lat: dict[str, list[float]] = {pair: [] for pair in pairs}
    meters = {pair: {"runtime": GcMeter(), "baseline": GcMeter()} for pair in pairs}
    violations = leftover = 0
    with progress(2 * rounds * len(pairs), "abort rounds") as advance:
        for index in range(rounds):
            slots = moments(args, args.seed + index)
            for pair in pairs[:: -1 if index % 2 else 1]:  # the pairs' order alternates from round to round
                tuned, off = pair == "tuned", pair == "off"
                meter = meters[pair]["runtime"]
                for side in in_turn(("baseline", "runtime"), index):
                    gc.collect()
                    if side == "baseline":
                        with gc_setting(tuned), collector_off(off), meters[pair]["baseline"]:
                            base[pair] += await baseline_run(args, slots)
                    else:
                        with collector_off(off), meter, profile.on():
                            ours = await runtime_run(args, slots, tune_gc=tuned, meter=meter)
                        lat[pair] += ours["latencies"]
                        violations += ours["violations"]
                        leftover += ours["leftover"]
                    advance()
                if meter.thresholds != meters[pair]["baseline"].thresholds:
                    msg = f"{pair}: the two sides ran under different thresholds ({meters[pair]})"
                    raise RuntimeError(msg)
    load = f"{args.concurrency} loops at once, {args.loops_per_slot} after one another in each slot"
    load += ", all slots started together" if args.lockstep else ""
    print(f"abort under load: {load}, model {args.model_ms} ms, tools {args.tool_ms} ms, {rounds} rounds")
    result: dict[str, Any] = {
        "benchmark": "abort",
        "concurrency": args.concurrency,
        "model_ms": args.model_ms,
        "tool_ms": args.tool_ms,
        "loops_per_slot": args.loops_per_slot,
        "lockstep": args.lockstep,
        "gc": args.gc,
        "rounds": rounds,
    }
    loops = rounds * args.concurrency * args.loops_per_slot
    for pair in pairs:
        result.update(pair_figures(pair, lat[pair], base[pair], meters[pair], loops))
    print(f"  violations {violations}; leftover tasks {leftover}")
    if target is not None:
        title = f"abort latency, {args.concurrency} loops, model {args.model_ms} ms, tools {args.tool_ms} ms"
        series: dict[str, list[float]] = {}
        for pair in pairs:
            series[f"queryloop runtime (GC {pair})"] = lat[pair]
            series[f"baseline, plain trio loop (GC {pair})"] = base[pair]
        plot_cdf(target, series, title)
        print(f"  plot: {target}")
    return {**result, "violations": violations, "leftover_tasks": leftover, **profile.save()}


def pair_figures(
    pair: str, lat: list[float], base: list[float], meters: dict[str, GcMeter], loops: int
) -> dict[str, Any]:
    """The figures of one pair; the untuned pair's names end in `_untuned`."""
    p50, p99 = percentile(lat, 0.5) * 1e3, percentile(lat, 0.99) * 1e3
    b50, b99 = percentile(base, 0.5) * 1e3, percentile(base, 0.99) * 1e3
    ratio = p99 / b99 if b99 else float("inf")
    runtime, baseline = meters["runtime"], meters["baseline"]
    print(f"  {pair} (thresholds {runtime.thresholds} on both sides)")
    print(
        f"    baseline : abort p50 {b50:7.2f} ms  p99 {b99:7.2f} ms  ({len(base)} aborted before their end)"
        f"  gc {baseline.gc_share:6.1%}, longest {baseline.longest * 1e3:.0f} ms"
    )
    print(
        f"    runtime  : abort p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  ({len(lat)} aborted before their end)"
        f"  gc {runtime.gc_share:6.1%}, longest {runtime.longest * 1e3:.0f} ms"
    )
    print(f"    abort_p99_ratio {ratio:.2f}")
    figures: dict[str, Any] = {
        "abort_p50_ms": round(p50, 3),
        "abort_p99_ms": round(p99, 3),
        "baseline_abort_p50_ms": round(b50, 3),
        "baseline_abort_p99_ms": round(b99, 3),
        "abort_p99_ratio": round(ratio, 3),
        "aborted_before_end": len(lat),
        "baseline_aborted_before_end": len(base),
        "gc_thresholds": list(runtime.thresholds),
        **runtime.figures(loops),
        **baseline.figures(loops, prefix="baseline_"),
    }
    suffix = "" if pair == "tuned" else f"_{pair}"
    return {f"{name}{suffix}": value for name, value in figures.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return trio.run(measure, args)
