"""Many live sessions: N sessions each mid-query, waiting on the model.

At each level it measures the cost of starting one more session and its query (`--probe`
starts while N are live, in five batches, the median batch counting) and the resident memory
per live session.
`start_flatness` = start cost at the largest level / at the smallest.

There is no baseline: all of it is the runtime side (under `Runtime.open(tune_gc=True)`), and
`--profile FILE` profiles the timed probes (bench/profiling.py).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from typing import Any

import trio
import trio.testing

from bench import workload
from bench.kernel import rss_kb
from bench.profiling import RuntimeProfile, add_profile_argument
from queryloop import Runtime
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.loop.options import QueryOptions

WAITING_MS = 10_000_000  # the model "thinks" for hours: every query stays mid-flight
PROBE_BATCHES = 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", default="100,1000,10000")
    parser.add_argument("--probe", type=int, default=1000, help="starts timed at each level (fewer: noisier)")
    add_profile_argument(parser)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    levels = sorted({int(n) for n in args.sessions.split(",")})
    if len(levels) < 2:
        sys.exit(f"--sessions needs two levels or more to compare (e.g. 100,1000), not {args.sessions!r}")
    live: list[tuple[Session, QueryHandle]] = []
    costs: dict[int, float] = {}
    rss_at: dict[int, float] = {}
    profile = RuntimeProfile(args.profile)
    async with Runtime.open(tune_gc=True) as runtime:

        async def start_one() -> tuple[Session, QueryHandle]:
            session = await runtime.open_session(
                QueryOptions(provider=workload.model(WAITING_MS), tools=workload.tools(0))
            )
            return session, session.query(workload.PROMPT)

        for level in levels:
            while len(live) < level:
                live.append(await start_one())
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            rss_at[level] = rss_kb()
            # The probe runs in batches; the median batch counts, so that one hiccup of a shared
            # machine (or one collection landing in one batch) does not decide the level's figure.
            batches: list[float] = []
            size = max(1, args.probe // PROBE_BATCHES)
            for _ in range(PROBE_BATCHES):
                probes = []
                with profile.on():
                    start = time.perf_counter()
                    for _ in range(size):
                        probes.append(await start_one())
                    await trio.testing.wait_all_tasks_blocked()
                    batches.append((time.perf_counter() - start) / size)
                for session, _ in probes:
                    await session.close()
            costs[level] = statistics.median(batches)
            print(f"  {level:>6} live sessions mid-query: start {costs[level] * 1e6:7.0f} us per session")
        flatness = costs[levels[-1]] / costs[levels[0]]
        per_session = (rss_at[levels[-1]] - rss_at[levels[0]]) / (levels[-1] - levels[0])
        print(f"  start_flatness {flatness:.2f}; resident memory {per_session:.1f} KiB per live session")
        for session, _ in live:
            await session.close()
    return {
        "benchmark": "scale",
        "start_us": {str(level): round(cost * 1e6, 1) for level, cost in costs.items()},
        "start_flatness": round(flatness, 3),
        "rss_per_session_kb": round(per_session, 1),
        **profile.save(),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return trio.run(measure, args)
