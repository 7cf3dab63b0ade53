"""Streaming: µs per streamed event through a whole session, against a plain async generator.

A cell is S sessions at once, each streaming one reply of N text deltas (N + 5 raw events:
`message_start`, the block's start, N `text_delta`s, its stop, `message_delta`, `message_stop`,
built by `reply_events` and shared by every call) from a provider of this module, `DeltaStream`:

- paced: one `trio.lowlevel.checkpoint()` before every event, as a network read would;
- burst: no checkpoint, every event ready at once.

Runtime side: a real `Runtime` (`tune_gc=True`), S sessions opened (`open_session`), then, timed,
`session.query(...)` in each and every event of each handle consumed, then the sessions closed
(their open and close are timed apart: `session_open_close_us`). Baseline side: S plain async
generators, each feeding the same raw events to a `ResponseAssembler` and yielding them (and the
completed block), consumed the same way. Both sides run under the same collector thresholds
(`--no-tune-gc`: both at Python's defaults).

µs per event = the cell's wall time / (S × (N + 5)); events/s its inverse, on one thread (one
core). Rounds alternate the two sides; the best of each counts. The JSON's headline figures are at
the largest S and the smallest N (100 and 400 by default): `paced_events_per_s`,
`burst_events_per_s`, their baseline's and `*_throughput_ratio` (runtime events/s over
baseline's), and the same on CPU time (`*_events_per_cpu_s`); `per_event_growth` = runtime CPU µs
per event at the largest N over at the smallest (largest S, paced): 1.0 for a cost linear in a
reply's length, below 1 as a query's fixed cost spreads over more events (`per_event_growth_wall`:
the same on wall time, which other work on a shared machine stretches in the long cells); `cells`
has every cell. A cell streaming fewer than `--min-events` events per round gets more rounds.

The SSE reader of `AnthropicModel` (`queryloop.runtime.providers.sse.SSEReader`), measured apart (no session,
one thread; `--no-sse` skips it): `sse_events_per_s`, the reply of the largest `--deltas` level framed as the
API frames it and read in 16 KiB chunks through an httpx2 response's `aiter_raw`, as the provider reads
it, against httpx2's public `EventSource` over the same chunks (`sse_event_source_events_per_s`,
`sse_reader_speedup`); and the cost of one long line (a data line of each `--sse-line-mb` size, in 64 KiB
chunks, cut before the clock starts, the allocator warmed first: see `sse_figures`): `sse_line_ms_per_mb` per
size, and `sse_line_growth`, the largest line's ms per MB over the smallest's (1.0 for a linear reader; the
reader it replaced took 4 s for one 4 MB line). Sizes alternate within a round; the best of `--sse-rounds`
rounds counts.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import httpx2
import trio

from bench.collector import GcMeter, gc_setting, in_turn
from bench.profiling import RuntimeProfile, add_profile_argument
from bench.report import progress
from queryloop import Runtime
from queryloop.runtime.host.session import Session
from queryloop.runtime.loop.events import ResultMessage, StreamEvent
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.stream import ResponseAssembler
from queryloop.runtime.providers.scripted import TEXT_CHUNK, ScriptedReply, ScriptedUsage, reply_events
from queryloop.runtime.providers.sse import SSEReader

PROMPT = "Write the long answer."
MAX_ROUNDS = 20
MODEL = "claude-sonnet-5-5"
WORDS = "the quick brown fox jumps over the lazy dog, then writes it all down again. "


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deltas", default="400,6400,25600", help="text deltas per reply, a list")
    parser.add_argument("--sessions", default="1,100", help="sessions streaming at once, a list")
    parser.add_argument("--modes", default="paced,burst", help="paced (a checkpoint per event), burst, or both")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per cell, at least; the best counts")
    parser.add_argument(
        "--min-events",
        type=int,
        default=200_000,
        help=f"more rounds (up to {MAX_ROUNDS}) for a small cell, until its rounds stream this many events in all"
        " (0: --rounds everywhere)",
    )
    parser.add_argument(
        "--no-tune-gc",
        dest="tune_gc",
        action="store_false",
        help="both sides at Python's collector thresholds instead of the runtime's tuned ones (docs/collector.md)",
    )
    parser.add_argument("--no-sse", dest="sse", action="store_false", help="skip the SSE reader's measurements")
    parser.add_argument("--sse-line-mb", default="0.5,8", help="sizes of the one long line the SSE reader reads, in MB")
    parser.add_argument("--sse-rounds", type=int, default=15, help="rounds of the SSE reader's measurements")
    add_profile_argument(parser)


def reply(deltas: int) -> list[dict[str, Any]]:
    """The raw events of one reply with `deltas` text deltas of `TEXT_CHUNK` characters."""
    text = (WORDS * (deltas * TEXT_CHUNK // len(WORDS) + 1))[: deltas * TEXT_CHUNK]
    entry = ScriptedReply(
        content=[{"type": "text", "text": text}], usage=ScriptedUsage(input_tokens=12, output_tokens=deltas)
    )
    events = reply_events(entry, model=MODEL, message_id="msg_bench_stream", input_tokens=12)
    if len(events) != deltas + 5:
        msg = f"a reply of {deltas} deltas streams {len(events)} events, not {deltas + 5}"
        raise RuntimeError(msg)
    return events


class DeltaStream:
    """A `ModelProvider` whose every call streams the same raw events (shared, never copied)."""

    def __init__(self, events: list[dict[str, Any]], *, paced: bool) -> None:
        self.events = events
        self.paced = paced

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        if self.paced:
            for event in self.events:
                await trio.lowlevel.checkpoint()  # a network read: the scheduler runs between two events
                yield event
        else:
            for event in self.events:
                yield event


async def assembled(provider: DeltaStream, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
    """The baseline: the raw events through a `ResponseAssembler`, yielded, and each completed block."""
    assembler = ResponseAssembler()
    async with aclosing(provider.stream(request)) as stream:
        async for raw in stream:
            yield raw
            completed = assembler.feed(raw)
            if completed is not None:
                yield completed.block


@dataclass
class Side:
    """One side's rounds in one cell."""

    walls: list[float] = field(default_factory=list)
    """Seconds of each round's timed phase."""
    cpus: list[float] = field(default_factory=list)
    """CPU seconds of each round's timed phase."""
    meter: GcMeter = field(default_factory=GcMeter)
    open_close: list[float] = field(default_factory=list)
    """Runtime side: seconds per session to open and close it, each round (outside the timed phase)."""


async def runtime_round(
    events: list[dict[str, Any]], sessions: int, *, paced: bool, tuned: bool, side: Side, profile: RuntimeProfile
) -> None:
    """S sessions open, then (timed) one query in each, every event of its handle consumed; then closed."""
    seen: list[int] = []

    async def consume(session: Session) -> None:
        streamed = 0
        result = None
        async for event in session.query(PROMPT):
            if isinstance(event, StreamEvent):
                streamed += 1
            elif isinstance(event, ResultMessage):
                result = event
        if result is None or result.subtype != "success":
            msg = f"a streamed query ended with {result!r}"
            raise RuntimeError(msg)
        seen.append(streamed)

    async with Runtime.open(tune_gc=tuned) as runtime:
        began = time.perf_counter()
        provider = DeltaStream(events, paced=paced)
        opened = [await runtime.open_session(QueryOptions(provider=provider)) for _ in range(sessions)]
        opening = time.perf_counter() - began
        with side.meter, profile.on():
            side.meter.note_thresholds()
            began, cpu = time.perf_counter(), time.process_time()
            async with trio.open_nursery() as nursery:
                for session in opened:
                    nursery.start_soon(consume, session)
            side.walls.append(time.perf_counter() - began)
            side.cpus.append(time.process_time() - cpu)
        began = time.perf_counter()
        for session in opened:
            await session.close()
        side.open_close.append((opening + time.perf_counter() - began) / sessions)
    if seen != [len(events)] * sessions:
        msg = f"the handles yielded {sorted(set(seen))} stream events per query, not {len(events)}"
        raise RuntimeError(msg)


async def baseline_round(events: list[dict[str, Any]], sessions: int, *, paced: bool, side: Side) -> None:
    """S plain async generators at once, each assembling the same raw events, consumed to their end."""
    request = ModelRequest(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8000)
    provider = DeltaStream(events, paced=paced)
    seen: list[int] = []

    async def consume() -> None:
        count = 0
        async with aclosing(assembled(provider, request)) as stream:
            async for _ in stream:
                count += 1
        seen.append(count)

    with side.meter:
        began, cpu = time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for _ in range(sessions):
                nursery.start_soon(consume)
        side.walls.append(time.perf_counter() - began)
        side.cpus.append(time.process_time() - cpu)
    if seen != [len(events) + 1] * sessions:  # every raw event, and the one completed block
        msg = f"the baseline yielded {sorted(set(seen))} items per reply, not {len(events) + 1}"
        raise RuntimeError(msg)


class _Chunks(httpx2.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncGenerator[bytes, None]:
        for chunk in self.chunks:
            yield chunk


def _response(chunks: list[bytes]) -> httpx2.Response:
    request = httpx2.Request("POST", "http://bench/v1/messages")
    return httpx2.Response(200, headers={"content-type": "text/event-stream"}, stream=_Chunks(chunks), request=request)


async def _ours(chunks: list[bytes]) -> int:
    reader, count = SSEReader(), 0
    async for chunk in _response(chunks).aiter_raw():
        count += len(reader.feed(chunk))
    return count + len(reader.finish())


async def _event_source(chunks: list[bytes]) -> int:
    count = 0
    async for _ in httpx2.EventSource(_response(chunks), max_event_size=None):
        count += 1
    return count


def _in_pieces(data: bytes, size: int) -> list[bytes]:
    return [data[at : at + size] for at in range(0, len(data), size)]


async def sse_figures(args: argparse.Namespace, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The SSE reader's figures (the module docstring says which)."""
    chunks = _in_pieces(b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events), 16384)
    try:
        sizes = sorted({float(mb) for mb in args.sse_line_mb.split(",")})
    except ValueError:
        sys.exit(f"--sse-line-mb takes a list of sizes in MB (e.g. 0.5,8), not {args.sse_line_mb!r}")
    if sizes[0] <= 0 or args.sse_rounds < 1:
        sys.exit("--sse-line-mb sizes must be above 0 and --sse-rounds at least 1")
    lines = {mb: _in_pieces(b"data: " + b"x" * int(mb * 1_000_000), 65536) for mb in sizes}
    # Warm the allocator: glibc maps a block over its mmap threshold (128 KiB at first) afresh from the kernel
    # at each allocation and unmaps it at each free, until a large block freed raises the threshold (to 32 MiB
    # at most), as in any process that has once freed a large block. Without it each long line's result is
    # faulted in page by page at each round (about 1 ms per MB here): the kernel's cost, not the reader's.
    warm = b"x" * 30_000_000
    del warm
    reads: dict[str, list[float]] = {"ours": [], "event_source": []}
    per_mb: dict[float, list[float]] = {mb: [] for mb in sizes}
    for index in range(args.sse_rounds):
        for side in in_turn(("ours", "event_source"), index):
            began = time.perf_counter()
            count = await (_ours(chunks) if side == "ours" else _event_source(chunks))
            reads[side].append(time.perf_counter() - began)
            if count != len(events):
                msg = f"the {side} reader read {count} events of {len(events)}"
                raise RuntimeError(msg)
        for mb in sizes if index % 2 == 0 else sizes[::-1]:
            reader = SSEReader(max_event_bytes=sum(map(len, lines[mb])) + 16)
            began = time.perf_counter()
            for piece in lines[mb]:
                reader.feed(piece)
            if len(reader.feed(b"\n\n")) != 1:
                raise RuntimeError("the long line was not read as one event")
            per_mb[mb].append((time.perf_counter() - began) * 1000 / mb)
    ours, theirs = len(events) / min(reads["ours"]), len(events) / min(reads["event_source"])
    growth = min(per_mb[sizes[-1]]) / min(per_mb[sizes[0]])
    print(
        f"  SSE reader: {ours:,.0f} events/s (httpx2 EventSource {theirs:,.0f}/s, x{ours / theirs:.2f});"
        f" one long line: {', '.join(f'{mb:g} MB {min(t):.2f} ms/MB' for mb, t in per_mb.items())},"
        f" growth {growth:.2f}"
    )
    return {
        "sse_events_per_s": round(ours),
        "sse_event_source_events_per_s": round(theirs),
        "sse_reader_speedup": round(ours / theirs, 3),
        "sse_line_ms_per_mb": {f"{mb:g}": round(min(t), 3) for mb, t in per_mb.items()},
        "sse_line_growth": round(growth, 3),
    }


def cell_figures(sessions: int, deltas: int, mode: str, ours: Side, base: Side) -> dict[str, Any]:
    events = sessions * (deltas + 5)
    us, base_us = min(ours.walls) / events * 1e6, min(base.walls) / events * 1e6
    cpu_us, base_cpu_us = min(ours.cpus) / events * 1e6, min(base.cpus) / events * 1e6
    print(
        f"  {sessions:>4} sessions x {deltas:>6} deltas, {mode:5} ({len(ours.walls):>2} rounds):"
        f" runtime {us:6.2f} us/event ({1e6 / us:7.0f}/s; cpu {cpu_us:5.2f} us, gc {ours.meter.gc_share:5.1%}),"
        f" baseline {base_us:5.2f} us ({1e6 / base_us:7.0f}/s; cpu {base_cpu_us:5.2f} us); ratio {base_us / us:.2f}"
    )
    return {
        "sessions": sessions,
        "deltas": deltas,
        "mode": mode,
        "us_per_event": round(us, 3),
        "events_per_s": round(1e6 / us),
        "baseline_us_per_event": round(base_us, 3),
        "baseline_events_per_s": round(1e6 / base_us),
        "throughput_ratio": round(base_us / us, 3),
        "cpu_us_per_event": round(cpu_us, 3),
        "baseline_cpu_us_per_event": round(base_cpu_us, 3),
        "cpu_ratio": round(base_cpu_us / cpu_us, 3),
        "gc_share": round(ours.meter.gc_share, 4),
        "baseline_gc_share": round(base.meter.gc_share, 4),
        "session_open_close_us": round(min(ours.open_close) * 1e6, 1),
        "rounds": [round(w, 4) for w in ours.walls],
        "baseline_rounds": [round(w, 4) for w in base.walls],
    }


def cell_rounds(args: argparse.Namespace, sessions: int, deltas: int) -> int:
    """`--rounds`, or more for a small cell (up to `MAX_ROUNDS`), so that its rounds stream `--min-events`."""
    wanted: int = -(-args.min_events // (sessions * (deltas + 5)))
    rounds: int = args.rounds
    return max(rounds, min(MAX_ROUNDS, wanted))


def _levels(text: str, name: str) -> list[int]:
    try:
        levels = sorted({int(n) for n in text.split(",")})
    except ValueError:
        sys.exit(f"--{name} takes a list of whole numbers (e.g. 400,6400), not {text!r}")
    if not levels or levels[0] < 1:
        sys.exit(f"--{name}: every level must be at least 1, not {text!r}")
    return levels


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    deltas, sessions = _levels(args.deltas, "deltas"), _levels(args.sessions, "sessions")
    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or set(modes) - {"paced", "burst"}:
        sys.exit(f"--modes: paced, burst or both (paced,burst), not {args.modes!r}")
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    profile = RuntimeProfile(args.profile)
    replies = {n: reply(n) for n in deltas}
    cells: dict[tuple[int, int, str], dict[str, Any]] = {}
    thresholds: list[int] = []
    grid = list(itertools.product(sessions, deltas, modes))
    print("streaming: µs per raw event, best round of each side (wall time and CPU time, one thread)")
    with progress(sum(cell_rounds(args, s, n) for s, n, _ in grid), "stream rounds") as advance:
        for s, n, mode in grid:
            ours, base = Side(), Side()
            paced = mode == "paced"
            for index in range(cell_rounds(args, s, n)):
                for side in in_turn(("baseline", "runtime"), index):
                    gc.collect()
                    if side == "baseline":
                        with gc_setting(args.tune_gc):
                            await baseline_round(replies[n], s, paced=paced, side=base)
                    else:
                        await runtime_round(replies[n], s, paced=paced, tuned=args.tune_gc, side=ours, profile=profile)
                if ours.meter.thresholds != base.meter.thresholds:
                    msg = f"the two sides ran under different thresholds ({ours.meter}, {base.meter})"
                    raise RuntimeError(msg)
                advance()
            cells[s, n, mode] = cell_figures(s, n, mode, ours, base)
            thresholds = list(ours.meter.thresholds)
    top, small, large = sessions[-1], deltas[0], deltas[-1]
    result: dict[str, Any] = {"benchmark": "stream", "sessions": top, "deltas": small, "gc_thresholds": thresholds}
    for mode in modes:
        cell = cells[top, small, mode]
        result[f"{mode}_events_per_s"] = cell["events_per_s"]
        result[f"baseline_{mode}_events_per_s"] = cell["baseline_events_per_s"]
        result[f"{mode}_throughput_ratio"] = cell["throughput_ratio"]
        result[f"{mode}_cpu_us_per_event"] = cell["cpu_us_per_event"]
        result[f"{mode}_events_per_cpu_s"] = round(1e6 / cell["cpu_us_per_event"])
        result[f"baseline_{mode}_events_per_cpu_s"] = round(1e6 / cell["baseline_cpu_us_per_event"])
        result[f"{mode}_gc_share"] = cell["gc_share"]
    growth_mode = modes[0]
    first, last = cells[top, small, growth_mode], cells[top, large, growth_mode]
    # Growth on CPU time: the big cells run for tens of seconds, long enough for other work on a shared
    # machine to stretch their wall time (on an idle one the two agree: one thread, nothing blocks).
    result["per_event_growth"] = round(last["cpu_us_per_event"] / first["cpu_us_per_event"], 3)
    result["baseline_per_event_growth"] = round(
        last["baseline_cpu_us_per_event"] / first["baseline_cpu_us_per_event"], 3
    )
    result["per_event_growth_wall"] = round(last["us_per_event"] / first["us_per_event"], 3)
    result["growth_deltas"] = [small, large]
    result["growth_mode"] = growth_mode
    print(
        f"  headline ({top} sessions, {small} deltas): "
        + ", ".join(f"{mode} {result[f'{mode}_events_per_s']:.0f} events/s" for mode in modes)
        + f"; per_event_growth ({large} / {small} deltas, {growth_mode}, CPU) {result['per_event_growth']:.2f}"
        f" (wall {result['per_event_growth_wall']:.2f}; baseline {result['baseline_per_event_growth']:.2f})"
    )
    if args.sse:
        result.update(await sse_figures(args, replies[large]))
    return {**result, "cells": list(cells.values()), **profile.save()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return trio.run(measure, args)
