"""Instructions a loop of workload W costs, runtime against baseline, counted by valgrind's callgrind.

`bench loops` times the two sides' best rounds: on a shared machine its ratio moves by several
hundredths from one run to the next (docs/benchmarks.md). An instruction count does not drift
with the machine's load: this benchmark runs each side's loops in a process of its own under
`valgrind --tool=callgrind` (hash seed and trio's scheduling coin fixed), once with `--loops N1`
and once with `N2` loops, C at once, and takes (instructions at N2 - instructions at N1) /
(N2 - N1) as the cost of one loop, so that the interpreter's start, the imports and a round's
warm-up cancel out. The sides are the ones `bench loops` runs (its `runtime_round` and
`baseline_round`), under the same collector setting (`--gc tuned`, the default: the runtime's
thresholds on both sides, its collections counted; `off`: the two sides' own code only).

`instruction_ratio` = the baseline's instructions per loop over the runtime's: what
`throughput_ratio` would be on a machine where every instruction cost the same. It leaves out what
instructions do not show: cache misses, which a larger working set pays for.

Needs valgrind (`apt install valgrind`); callgrind runs a process some fifty times slower, so the
default (1,000 and 2,000 loops, 1,000 at once) takes a few minutes, two processes at a time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import trio
import trio._core._run as trio_run

from bench.collector import collector_off, gc_setting
from bench.loops import baseline_round, runtime_round

SIDES = ("runtime", "baseline")
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=1000, help="loops at once")
    parser.add_argument("--loops", default="1000,2000", help="N1,N2: the two loop counts differenced")
    parser.add_argument("--gc", choices=("tuned", "off"), default="tuned", help="the collector, both sides alike")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process: run one side
    parser.add_argument("--count", type=int, help=argparse.SUPPRESS)  # the child's number of loops


async def _loops(side: str, concurrency: int, count: int, tuned: bool) -> int:
    """`count` loops of one side, `concurrency` at once (the last round takes what is left): how many ended."""
    ended = 0
    while ended < count:
        c = min(concurrency, count - ended)
        if side == "runtime":
            _, latencies = await runtime_round(c, 0.0, 0.0, tune_gc=tuned)
        else:
            with gc_setting(tuned):
                _, latencies = await baseline_round(c, 0.0, 0.0)
        ended += len(latencies)
    return ended


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One side's loops in this process, for the parent's callgrind run."""
    # trio reverses each batch of its run queue at random: seeded, two runs of one build count the same
    # instructions to within a few a loop (unseeded, ±0.5 %: the order of the tasks changes what they do).
    trio_run._r.seed(0)  # noqa: SLF001 - the scheduler's own coin; nothing else reads it
    with collector_off(args.gc == "off"):
        ended = trio.run(_loops, args.side, args.concurrency, args.count, args.gc == "tuned")
    return {"benchmark": "instructions", "side": args.side, "loops": ended}


def _count(side: str, loops: int, args: argparse.Namespace, directory: Path) -> int:
    """The instructions one child process runs, `loops` loops of `side`, under callgrind."""
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={directory / f'{side}.{loops}.out'}",
        sys.executable,
        "-m",
        "bench",
        "instructions",
        f"--side={side}",
        f"--count={loops}",
        f"--concurrency={args.concurrency}",
        f"--gc={args.gc}",
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        msg = f"callgrind run of {side} ({loops} loops) failed, exit {done.returncode}:\n{done.stderr[-2000:]}"
        raise RuntimeError(msg)
    return int(found.group(1))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.side is not None:
        return _child(args)
    n1, n2 = (int(n) for n in str(args.loops).split(","))
    if not 0 < n1 < n2:
        sys.exit(f"--loops N1,N2 needs 0 < N1 < N2, not {args.loops}")
    if shutil.which("valgrind") is None:
        sys.exit("bench instructions needs valgrind (apt install valgrind)")
    started = time.perf_counter()
    jobs = [(side, n) for n in (n1, n2) for side in SIDES]
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as directory, ThreadPoolExecutor(2) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: _count(job[0], job[1], args, Path(directory)), jobs), strict=True))
    per_loop = {side: (counts[side, n2] - counts[side, n1]) / (n2 - n1) for side in SIDES}
    ratio = per_loop["baseline"] / per_loop["runtime"]
    print(f"workload W, {args.concurrency} loops at once, collector {args.gc}, {n2 - n1} loops differenced")
    print(f"  runtime : {per_loop['runtime']:12,.0f} instructions/loop")
    print(f"  baseline: {per_loop['baseline']:12,.0f} instructions/loop")
    print(f"  instruction_ratio (baseline / runtime): {ratio:.3f}  ({time.perf_counter() - started:.0f} s)")
    return {
        "benchmark": "instructions",
        "concurrency": args.concurrency,
        "gc": args.gc,
        "loops": [n1, n2],
        "instructions_per_loop": round(per_loop["runtime"]),
        "baseline_instructions_per_loop": round(per_loop["baseline"]),
        "instruction_ratio": round(ratio, 4),
    }
