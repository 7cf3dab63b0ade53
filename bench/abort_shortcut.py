"""Abort latency with and without the abort's own-call ending, side by side in one run.

`python -m bench.abort_shortcut [--concurrency C] [--alternations N] [bench abort's options]` runs the
runtime side of `python -m bench abort` (`abort.runtime_run`, the same seeded abort moments for both)
N times each way, alternating: with the QueryLoop's `on_abort` as it is (an abort that finds the loop
waiting on its turn ends the query in its own call, `ending.end_now`), and with an `on_abort` that
only records the abort and wakes the loop, whose task then writes the same ending (`ending.end_early`).
Latency is from the abort call to the `result` event, pooled per side. docs/design.md quotes it.
"""

from __future__ import annotations

import argparse
import gc
from typing import Any

import trio

from bench import abort
from bench.loops import percentile
from queryloop.actors.query_loop.loop import QueryLoop
from queryloop.runtime.kernel.messages import AbortReason

_WITH = QueryLoop.on_abort


def _without(self: QueryLoop, reason: AbortReason) -> None:
    """`QueryLoop.on_abort` without `after_handlers(end_now)`: the loop's task ends every aborted query."""
    run = self.running
    if run is not None:
        run.helpers_aborted = True
        run.abort(reason)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    sides: dict[str, Any] = {"with": _WITH, "without": _without}
    latencies: dict[str, list[float]] = {side: [] for side in sides}
    wrong = 0
    for index in range(args.alternations):
        slots = abort.moments(args, args.seed + index)
        for side in sorted(sides, reverse=bool(index % 2)):  # which side goes first alternates
            setattr(QueryLoop, "on_abort", sides[side])  # noqa: B010 - a method swapped for the measurement
            gc.collect()
            try:
                ours = await abort.runtime_run(args, slots)
            finally:
                setattr(QueryLoop, "on_abort", _WITH)  # noqa: B010
            latencies[side] += ours["latencies"]
            wrong += ours["violations"] + ours["leftover"]
    result: dict[str, Any] = {"benchmark": "abort_shortcut", "concurrency": args.concurrency, "violations": wrong}
    for side, values in latencies.items():
        p50, p99 = percentile(values, 0.5) * 1e3, percentile(values, 0.99) * 1e3
        print(f"  {side:7} end_now: abort p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  ({len(values)} aborts)")
        result[f"{side}_p50_ms"], result[f"{side}_p99_ms"] = round(p50, 3), round(p99, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.abort_shortcut", description=__doc__)
    abort.add_arguments(parser)
    parser.add_argument("--alternations", type=int, default=6, help="runs of each side, alternating")
    args = parser.parse_args()
    if args.loops_per_slot is None:
        args.loops_per_slot = 10
    print(trio.run(measure, args))


if __name__ == "__main__":
    main()
