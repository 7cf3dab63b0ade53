"""What a PreToolUse hook costs per tool call: workload W (three tool calls a loop) run with no hook, with one
SDK callback that answers `{}`, and with one settings-file command hook (`cat >/dev/null`, a real `/bin/sh`
subprocess per call), the three arms alternating round by round in one process, C loops at once.

Reported per arm: the process's CPU seconds (this process only: a command hook's own subprocess is not
counted, it runs beside the runtime) and wall seconds per loop, their ratio to the no-hook arm, and the
added cost per tool call (`(arm - none) / 3`). `--arms` picks the arms (the command hook's arm spawns
3 x C x rounds processes).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench import workload
from queryloop import HookContext, HookInput, HookJSONOutput, HookMatcher, QueryOptions, Runtime

ARMS = ("none", "callback", "command")
CALLS_PER_LOOP = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=int, default=100, help="loops at once")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each arm, alternating")
    parser.add_argument("--arms", default=",".join(ARMS), help="which arms: none,callback,command")


async def _no_opinion(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
    return {}


def _options(arm: str, folder: Path) -> dict[str, Any]:
    if arm == "callback":
        return {"hooks": {"PreToolUse": [HookMatcher(hooks=[_no_opinion])]}}
    if arm == "command":
        hook = '{"hooks": {"PreToolUse": [{"hooks": [{"type": "command", "command": "cat >/dev/null"}]}]}}'
        return {"settings": hook, "cwd": folder}
    return {}


async def _round(arm: str, concurrency: int, folder: Path) -> tuple[float, float]:
    """One round of `arm`: its CPU and wall seconds for `concurrency` loops."""
    extra = _options(arm, folder)

    async def one(runtime: Runtime) -> None:
        options = QueryOptions(provider=workload.model(0.0), tools=workload.tools(0.0), **extra)
        session = await runtime.open_session(options)
        async for _ in session.query(workload.PROMPT):
            pass
        await session.close()

    cpu, wall = time.process_time(), time.perf_counter()
    async with Runtime.open() as runtime, trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(one, runtime)
    return time.process_time() - cpu, time.perf_counter() - wall


async def _measure(arms: list[str], concurrency: int, rounds: int) -> dict[str, dict[str, float]]:
    samples: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="bench-hooks-") as folder:
        for arm in arms:  # a warm-up round of each: imports, the first subprocess
            await _round(arm, concurrency, Path(folder))
        for _ in range(rounds):
            for arm in arms:
                samples[arm].append(await _round(arm, concurrency, Path(folder)))
    return {
        arm: {
            "cpu_ms_per_loop": 1000 * statistics.median(s[0] for s in taken) / concurrency,
            "wall_ms_per_loop": 1000 * statistics.median(s[1] for s in taken) / concurrency,
        }
        for arm, taken in samples.items()
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    arms = [arm for arm in str(args.arms).split(",") if arm]
    if not arms or any(arm not in ARMS for arm in arms) or arms[0] != "none":
        raise SystemExit(f"--arms: a comma list of {', '.join(ARMS)}, starting with none")
    figures = trio.run(_measure, arms, args.concurrency, args.rounds)
    base = figures["none"]
    print(f"workload W ({CALLS_PER_LOOP} tool calls a loop), {args.concurrency} loops at once, {args.rounds} rounds")
    for arm, figure in figures.items():
        figure["cpu_ratio"] = figure["cpu_ms_per_loop"] / base["cpu_ms_per_loop"]
        figure["added_cpu_ms_per_call"] = (figure["cpu_ms_per_loop"] - base["cpu_ms_per_loop"]) / CALLS_PER_LOOP
        figure["added_wall_ms_per_call"] = (figure["wall_ms_per_loop"] - base["wall_ms_per_loop"]) / CALLS_PER_LOOP
        print(
            f"  {arm:8}: {figure['cpu_ms_per_loop']:7.3f} CPU ms/loop (x{figure['cpu_ratio']:.2f}), "
            f"+{figure['added_cpu_ms_per_call']:.3f} CPU ms and +{figure['added_wall_ms_per_call']:.3f} wall ms a call"
        )
    return {
        "benchmark": "hooks",
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "arms": {arm: {k: round(v, 4) for k, v in figure.items()} for arm, figure in figures.items()},
    }
