"""The actor kernel: ask round-trip, session start+teardown under load, memory per idle session.

In one run it measures
(a) `await ref.ask(msg, block=False)` through a `TrioActor` against the in-run
    baseline, a bare trio memory-channel round-trip (request channel in, reply
    channel out, one server task): `ask_rtt_ratio` = ours / baseline;
(b) the cost of starting a six-actor session group, asking each actor once and
    closing it, while 100, 1,000 and 10,000 idle groups are alive:
    `teardown_flatness` = cost at the largest count / cost at the smallest;
(c) resident memory per idle six-actor group: `rss_per_session_kb`.

The whole run is under the runtime's collector thresholds (`Runtime.open(tune_gc=True)`), the
baseline's round-trips included. `--profile FILE` profiles the actor side: the asks and the
start+teardown cycles (bench/profiling.py).
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import sys
import time
from typing import TYPE_CHECKING, Any

import trio

from bench.collector import in_turn
from bench.profiling import RuntimeProfile, add_profile_argument
from queryloop import Runtime
from queryloop.lowlevel import Supervisor, TrioActor

if TYPE_CHECKING:
    import argparse

GROUP_SIZE = 6


class Idle(TrioActor):
    """Stands in for each of a session's six actors: answers pings, otherwise waits."""

    def on_receive(self, message: Any) -> Any:
        return message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--asks", type=int, default=20_000, help="round-trips per timed round")
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each side first in turn; the best counts")
    parser.add_argument("--sessions", default="100,1000,10000", help="live idle groups during (b)")
    parser.add_argument("--cycles", type=int, default=300, help="start+teardown cycles timed per level")
    add_profile_argument(parser)


def rss_kb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024


async def bare_channel_rtt(count: int) -> float:
    """Seconds per round-trip over two trio memory channels and one server task."""
    request_send, request_receive = trio.open_memory_channel[object](math.inf)
    reply_send, reply_receive = trio.open_memory_channel[object](math.inf)

    async def server() -> None:
        async for message in request_receive:
            reply_send.send_nowait(message)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        start = time.perf_counter()
        for i in range(count):
            await request_send.send(i)
            await reply_receive.receive()
        elapsed = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return elapsed / count


async def actor_ask_rtt(runtime: Runtime, count: int) -> float:
    """Seconds per `await ref.ask(i, block=False)` to a `TrioActor`."""
    group = await runtime.start_group()
    ref = group.spawn(Idle)
    start = time.perf_counter()
    for i in range(count):
        await ref.ask(i, block=False)
    elapsed = time.perf_counter() - start
    await group.close()
    return elapsed / count


async def start_six(runtime: Runtime) -> Supervisor:
    group = await runtime.start_group()
    refs = [group.spawn(Idle) for _ in range(GROUP_SIZE)]
    for ref in refs:
        await ref.ask(None, block=False)  # each actor is running, not merely scheduled
    return group


async def cycle_cost(runtime: Runtime, cycles: int) -> float:
    """Seconds per start+ask+close of a six-actor group."""
    start = time.perf_counter()
    for _ in range(cycles):
        group = await start_six(runtime)
        await group.close()
    return (time.perf_counter() - start) / cycles


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    levels = sorted({int(n) for n in args.sessions.split(",")})
    if len(levels) < 2:
        sys.exit(f"--sessions needs two levels or more to compare (e.g. 100,1000), not {args.sessions!r}")
    profile = RuntimeProfile(args.profile)
    async with Runtime.open(tune_gc=True) as runtime:
        bare: list[float] = []
        ours: list[float] = []
        for index in range(args.rounds):
            for side in in_turn(("bare", "actor"), index):
                if side == "bare":
                    bare.append(await bare_channel_rtt(args.asks))
                else:
                    with profile.on():
                        ours.append(await actor_ask_rtt(runtime, args.asks))
        ask_ratio = min(ours) / min(bare)
        print(
            f"ask round-trip: actor {min(ours) * 1e6:.1f} us, bare channel {min(bare) * 1e6:.1f} us, "
            f"ratio {ask_ratio:.2f}"
        )

        live: list[Supervisor] = []
        costs: dict[int, float] = {}
        rss_at: dict[int, float] = {}
        for level in levels:
            while len(live) < level:
                live.append(await start_six(runtime))
            gc.collect()
            rss_at[level] = rss_kb()
            with profile.on():
                samples = [await cycle_cost(runtime, args.cycles) for _ in range(3)]
            costs[level] = statistics.median(samples)
            print(f"start+teardown with {level:>6} live groups: {costs[level] * 1e6:.0f} us per group")
        flatness = costs[levels[-1]] / costs[levels[0]]
        rss_per = (rss_at[levels[-1]] - rss_at[levels[0]]) / (levels[-1] - levels[0])
        print(f"teardown flatness ({levels[-1]} / {levels[0]}): {flatness:.2f}")
        print(f"resident memory per idle six-actor group: {rss_per:.1f} KiB")
        leftover = sum(group.live_tasks() for group in live)
        for group in live:
            await group.close()
    return {
        "benchmark": "kernel",
        "ask_rtt_ratio": round(ask_ratio, 3),
        "ask_rtt_us": round(min(ours) * 1e6, 2),
        "bare_rtt_us": round(min(bare) * 1e6, 2),
        "teardown_flatness": round(flatness, 3),
        "teardown_us": {str(level): round(cost * 1e6, 1) for level, cost in costs.items()},
        "rss_per_session_kb": round(rss_per, 1),
        "live_tasks_before_close": leftover,
        **profile.save(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return trio.run(measure, args)
