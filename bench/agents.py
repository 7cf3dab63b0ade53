"""Subagent fan-out: a parent hands K tasks to K subagents at once, on the scripted model, aborted at random.

The parent's first reply calls the `Agent` tool K times in one message; each child makes a tool call
(`read`, `--tool-ms`) and then answers; the parent answers once every child has. Every model call takes
`--model-ms`. For each K of `--k` (1,10,100):

* throughput: `--rounds` fan-outs run whole; `children_per_s` = K / the best round's wall time, and
  `throughput_ratio` = the runtime's over the baseline's;
* aborts: `--aborts` fan-outs each aborted at a moment drawn uniformly from [0, a whole fan-out's
  duration) (seeded); the latency is from the parent's `session.abort()` call to the end of its event
  stream: `abort_p50_ms`, `abort_p99_ms`, and `abort_p99_ratio` = runtime p99 / baseline p99;
* `leftover_tasks`: tasks of the session or of any descendant still running when the parent's stream
  has ended, summed over every run (must be 0), and `violations`: runs whose stream did not end with
  exactly one `result`, whose child groups were not all closed, or whose transcript (sidechains
  included) is not valid.

The baseline is the same fan-out written as a plain trio loop (`bench.baseline.baseline_fan_out`): the
baseline loop whose agent tool runs a baseline loop per child, in one nursery, cancelled by one scope.
The JSON's top-level figures are those of the largest K.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import trio

from bench.baseline import BaselineAbort, baseline_fan_out
from bench.collector import in_turn
from queryloop import AgentDefinition, QueryOptions, Runtime, Session
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.loop.transcript import transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel

PROMPT = "Hand each file to a worker."
CHILD_PROMPT = "You are a worker: read your file, then report."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", default="1,10,100", help="children per fan-out, a list")
    parser.add_argument("--model-ms", type=float, default=5.0)
    parser.add_argument("--tool-ms", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="whole fan-outs per K and side (throughput)")
    parser.add_argument("--aborts", type=int, default=30, help="aborted fan-outs per K and side")
    parser.add_argument("--seed", type=int, default=1)


class FanOutModel:
    """The scripted model of one side of the fan-out: a parent's replies, or a child's, by turn."""

    def __init__(self, replies: list[dict[str, Any]]) -> None:
        self.replies = replies
        self.calls = 0

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        turns = sum(1 for message in request.messages if message.get("role") == "assistant")
        self.calls += 1
        reply = self.replies[min(turns, len(self.replies) - 1)]
        async with aclosing(ScriptedModel([reply], name=f"fan{self.calls}").stream(request)) as events:
            async for event in events:
                yield event


def parent_model(k: int, model_ms: float) -> FanOutModel:
    calls = [
        {
            "type": "tool_use",
            "id": f"toolu_agent_{i}",
            "name": "Agent",
            "input": {"description": f"file {i}", "prompt": f"Read file {i}.", "subagent_type": "worker"},
        }
        for i in range(k)
    ]
    usage = {"input_tokens": 400, "output_tokens": 40}
    return FanOutModel(
        [
            {"content": calls, "stop_reason": "tool_use", "usage": usage, "latency_ms": model_ms},
            {"content": [{"type": "text", "text": "All done."}], "usage": usage, "latency_ms": model_ms},
        ]
    )


def child_model(model_ms: float) -> FanOutModel:
    usage = {"input_tokens": 200, "output_tokens": 20}
    read = {"type": "tool_use", "id": "toolu_read", "name": "read", "input": {"path": "f"}}
    return FanOutModel(
        [
            {"content": [read], "stop_reason": "tool_use", "usage": usage, "latency_ms": model_ms},
            {"content": [{"type": "text", "text": "Read it."}], "usage": usage, "latency_ms": model_ms},
        ]
    )


def read_tool(tool_ms: float) -> Tool:
    async def read(args: Any, ctx: ToolContext) -> ToolOutput:
        await trio.sleep(tool_ms / 1000)
        return "file contents"

    return Tool(name="read", call=read, concurrency_safe=True)


def options(k: int, args: argparse.Namespace) -> QueryOptions:
    worker = AgentDefinition(
        description="Reads one file", prompt=CHILD_PROMPT, tools=["read"], provider=child_model(args.model_ms)
    )
    return QueryOptions(
        provider=parent_model(k, args.model_ms),
        tools=[read_tool(args.tool_ms)],
        agents={"worker": worker},
        max_concurrent_agents=k,
    )


class Tally:
    def __init__(self) -> None:
        self.leftover_tasks = 0
        self.violations = 0
        self.latencies: list[float] = []


async def _runtime_once(runtime: Runtime, k: int, args: argparse.Namespace, delay: float | None, tally: Tally) -> float:
    """One fan-out through the runtime; aborted after `delay` s if given. Its wall time (or abort latency)."""
    session = await runtime.open_session(options(k, args))
    handle = session.query(PROMPT)
    results = 0
    ended = 0.0
    children: list[Any] = []

    async def consume() -> None:
        nonlocal results, ended
        async for event in handle:
            if event.type == "result":
                results += 1
        ended = time.perf_counter()

    started = time.perf_counter()
    asked = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        if delay is not None:
            await trio.sleep(delay)
            children.extend(session.supervisor.children)
            asked = time.perf_counter()
            session.abort_nowait("user")
    await _check(session, results, children, tally)
    if delay is not None and ended and ended < asked:
        return -1.0  # the stream had ended before the abort: no latency to take
    return ended - (asked if delay is not None else started)


async def _check(session: Session, results: int, children: list[Any], tally: Tally) -> None:
    tally.leftover_tasks += session.live_tasks() + sum(child.live_tasks() for child in children)
    problems = transcript_problems(await session.transcript())
    for side in (await session.sidechains()).values():
        problems += transcript_problems(side.messages)
    if results != 1 or problems or session.supervisor.children or not all(c.closed for c in children):
        tally.violations += 1
    await session.close()


async def _baseline_once(k: int, args: argparse.Namespace, delay: float | None, tally: Tally) -> float:
    abort = BaselineAbort()
    results = 0
    ended = 0.0

    async def consume() -> None:
        nonlocal results, ended
        fan_out = baseline_fan_out(
            parent_model(k, args.model_ms), child_model(args.model_ms), read_tool(args.tool_ms), PROMPT, abort
        )
        async with aclosing(fan_out) as events:
            async for event in events:
                if event.label == "result":
                    results += 1
        ended = time.perf_counter()

    started = time.perf_counter()
    asked = 0.0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        if delay is not None:
            await trio.sleep(delay)
            asked = time.perf_counter()
            abort.abort("user")
    if results != 1:
        tally.violations += 1
    if delay is not None and ended < asked:
        return -1.0  # the stream had ended before the abort: no latency to take
    return ended - (asked if delay is not None else started)


async def _side(
    once: Callable[[float | None, Tally], Awaitable[float]], k: int, args: argparse.Namespace
) -> dict[str, Any]:
    tally = Tally()
    whole = [await once(None, tally) for _ in range(args.rounds)]
    rng = random.Random(args.seed * 1000 + k)
    span = statistics.median(whole)
    for _ in range(args.aborts):
        latency = await once(rng.uniform(0, span), tally)
        if latency >= 0:
            tally.latencies.append(latency)
    latencies = sorted(tally.latencies)
    return {
        "children_per_s": round(k / min(whole), 1),
        "fan_out_ms": round(1000 * min(whole), 2),
        "abort_p50_ms": round(1000 * _pct(latencies, 0.5), 3),
        "abort_p99_ms": round(1000 * _pct(latencies, 0.99), 3),
        "leftover_tasks": tally.leftover_tasks,
        "violations": tally.violations,
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    levels: dict[str, Any] = {}
    for index, k in enumerate(int(x) for x in str(args.k).split(",")):
        sides: dict[str, dict[str, Any]] = {}
        for side in in_turn(("baseline", "runtime"), index):  # each side first at every other K
            if side == "runtime":
                async with Runtime.open(tune_gc=True) as runtime:

                    async def runtime_once(
                        delay: float | None, tally: Tally, k: int = k, rt: Runtime = runtime
                    ) -> float:
                        return await _runtime_once(rt, k, args, delay, tally)

                    sides[side] = await _side(runtime_once, k, args)
            else:

                async def baseline_once(delay: float | None, tally: Tally, k: int = k) -> float:
                    return await _baseline_once(k, args, delay, tally)

                sides[side] = await _side(baseline_once, k, args)
        ours, base = sides["runtime"], sides["baseline"]
        level = {**ours, **{f"baseline_{key}": value for key, value in base.items()}}
        level["throughput_ratio"] = round(ours["children_per_s"] / base["children_per_s"], 3)
        level["abort_p99_ratio"] = round(ours["abort_p99_ms"] / max(base["abort_p99_ms"], 1e-6), 3)
        levels[str(k)] = level
        print(f"  K={k:<4} {level}", flush=True)
    top = levels[max(levels, key=int)]
    return {
        "benchmark": "agents",
        "model_ms": args.model_ms,
        "tool_ms": args.tool_ms,
        "levels": levels,
        **{key: top[key] for key in ("throughput_ratio", "abort_p99_ratio", "leftover_tasks", "violations")},
        "abort_p99_ms": top["abort_p99_ms"],
        "baseline_abort_p99_ms": top["baseline_abort_p99_ms"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = trio.run(measure, args)
    return result
