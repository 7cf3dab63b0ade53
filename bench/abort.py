"""Abort under load: C loops of workload W, each aborted at a uniform random moment of its life.

The same seeded moments are used for the baseline. Latency is measured from the abort call to
the loop's `result` event. `violations` counts loops the abort reached (before they had decided
how they end) whose terminal is not an aborted one, and loops whose transcript is invalid;
`leftover_tasks` counts session tasks still running once every stream has ended.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import trio

from bench import workload
from bench.baseline import BaselineAbort, baseline_loop
from bench.loops import percentile
from bench.report import check_plot_target, plot_cdf, progress
from runtime import Runtime
from runtime.events import ResultMessage
from runtime.options import QueryOptions
from runtime.session import Session
from runtime.transcript import transcript_problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--model-ms", type=float, default=50.0)
    parser.add_argument("--tool-ms", type=float, default=50.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds pooled into the percentiles, each with its own seeded moments (default: enough for 2,000 aborts)",
    )
    parser.add_argument("--plot", metavar="FILE.png", help="draw the abort-latency CDF of both")
    parser.add_argument(
        "--stagger-ms",
        type=float,
        default=0.0,
        help="start each loop at a seeded moment within this many ms (0: all at once, their steps in lockstep)",
    )


def moments(args: argparse.Namespace, seed: int) -> list[tuple[float, float]]:
    """Per loop: when it starts (within `--stagger-ms`) and when, after its start, it is aborted."""
    life = (3 * args.model_ms + 2 * args.tool_ms) / 1000
    stagger = args.stagger_ms / 1000
    rng = random.Random(seed)
    return [(rng.uniform(0, stagger), rng.uniform(0, life)) for _ in range(args.concurrency)]


async def runtime_run(args: argparse.Namespace, at: list[tuple[float, float]]) -> dict[str, Any]:
    latencies: list[float] = []
    violations = 0
    sessions: list[Session] = []
    async with Runtime.open() as runtime:

        async def one(start: float, delay: float) -> None:
            nonlocal violations
            await trio.sleep(start)
            session = await runtime.open_session(
                QueryOptions(provider=workload.model(args.model_ms), tools=workload.tools(args.tool_ms))
            )
            sessions.append(session)
            handle = session.query(workload.PROMPT)
            latency = await _abort_while_consuming(handle, lambda: session.abort("user"), delay)
            if latency is not None:
                latencies.append(latency)
                terminal = handle.terminal.reason if handle.terminal else None
                # An abort that lands after the loop has decided its ending (its last check passed, its
                # result on the way) does not change it, as in the reference: `abort_reason` stays None.
                if handle.abort_reason is not None and terminal not in ("aborted_streaming", "aborted_tools"):
                    violations += 1
            if transcript_problems(await session.transcript()):
                violations += 1

        async with trio.open_nursery() as nursery:
            for start, delay in at:
                nursery.start_soon(one, start, delay)
        leftover = sum(s.live_tasks() for s in sessions)
        for session in sessions:
            await session.close()
    return {"latencies": latencies, "violations": violations, "leftover": leftover}


async def baseline_run(args: argparse.Namespace, at: list[tuple[float, float]]) -> list[float]:
    latencies: list[float] = []

    async def one(start: float, delay: float) -> None:
        await trio.sleep(start)
        control = BaselineAbort()

        async def abort() -> None:
            control.abort("user")

        loop = baseline_loop(workload.model(args.model_ms), workload.tools(args.tool_ms), workload.PROMPT, control)
        async with aclosing(loop) as events:
            latency = await _abort_while_consuming(events, abort, delay)
        if latency is not None:
            latencies.append(latency)

    async with trio.open_nursery() as nursery:
        for start, delay in at:
            nursery.start_soon(one, start, delay)
    return latencies


async def _abort_while_consuming(
    events: AsyncIterator[Any], abort: Callable[[], Awaitable[Any]], delay: float
) -> float | None:
    """Consume `events`, calling `abort()` `delay` seconds in: seconds from that call to the `result`
    event, or None if the loop ended first."""
    asked: list[float] = []
    ended = 0.0
    async with trio.open_nursery() as nursery:

        async def abort_later() -> None:
            await trio.sleep(delay)
            asked.append(time.perf_counter())
            await abort()

        nursery.start_soon(abort_later)
        async for event in events:
            if isinstance(event, ResultMessage):
                ended = time.perf_counter()
                nursery.cancel_scope.cancel()
    return ended - asked[0] if asked and asked[0] <= ended else None


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    # One round of C loops gives C samples: at C=50 its "p99" would be its maximum. Rounds are
    # pooled (the same seeded moments for both sides in each round, the two sides alternating).
    target = check_plot_target(args.plot)
    rounds = args.rounds or max(1, -(-2000 // args.concurrency))
    base: list[float] = []
    lat: list[float] = []
    violations = leftover = 0
    with progress(rounds, "abort rounds") as advance:
        for index in range(rounds):
            at = moments(args, args.seed + index)
            base += await baseline_run(args, at)
            ours = await runtime_run(args, at)
            lat += ours["latencies"]
            violations += ours["violations"]
            leftover += ours["leftover"]
            advance()
    p50, p99 = percentile(lat, 0.5) * 1e3, percentile(lat, 0.99) * 1e3
    b50, b99 = percentile(base, 0.5) * 1e3, percentile(base, 0.99) * 1e3
    ratio = p99 / b99 if b99 else float("inf")
    load = f"{args.concurrency} loops, model {args.model_ms} ms, tools {args.tool_ms} ms"
    load += f", starts within {args.stagger_ms} ms" if args.stagger_ms else ", all started at once"
    print(f"abort under load: {load}, {rounds} rounds")
    print(f"  baseline : abort p50 {b50:7.2f} ms  p99 {b99:7.2f} ms  ({len(base)} aborted before their end)")
    print(f"  runtime  : abort p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  ({len(lat)} aborted before their end)")
    print(f"  abort_p99_ratio {ratio:.2f}; violations {violations}; leftover tasks {leftover}")
    if target is not None:
        title = f"abort latency, {args.concurrency} loops, model {args.model_ms} ms, tools {args.tool_ms} ms"
        plot_cdf(target, {"queryloop runtime": lat, "baseline (plain trio loop)": base}, title)
        print(f"  plot: {target}")
    return {
        "benchmark": "abort",
        "concurrency": args.concurrency,
        "model_ms": args.model_ms,
        "tool_ms": args.tool_ms,
        "stagger_ms": args.stagger_ms,
        "abort_p50_ms": round(p50, 3),
        "abort_p99_ms": round(p99, 3),
        "baseline_abort_p50_ms": round(b50, 3),
        "baseline_abort_p99_ms": round(b99, 3),
        "abort_p99_ratio": round(ratio, 3),
        "aborted_before_end": len(lat),
        "baseline_aborted_before_end": len(base),
        "rounds": rounds,
        "violations": violations,
        "leftover_tasks": leftover,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return trio.run(measure, args)
