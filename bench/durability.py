"""Durability under kills: a process with several tools in flight is SIGKILLed at random moments.

Each kill: a worker process runs one durable session's query (four responses, six tools, three of them
concurrent and finishing while their response still streams, so their results are logged `held`), and
reports the uuid of every transcript event its consumer has received. It is SIGKILLed at a seeded moment
drawn over the query's whole life (and a little past it). Then, in this process:

1. the transcript is resumed (`resume=`), and every event the consumer had received must be in the
   resumed conversation (`lost` counts those that are not);
2. a query continues the session, itself running tools, and the session closes;
3. the file is loaded again: `invalid` counts files that report problems now, or whose conversation is
   not valid to send (`transcript_problems`); `replaced` counts real tool results (the worker's tools
   answer `result of <id>`) that this second load, or the request it would send, has replaced by a
   synthetic one;
4. it is resumed once more, and that conversation must be the one just loaded (`diverged`).

Workers are forked from a process that imported queryloop before anything ran (a fork server), so a
kill costs milliseconds, not an interpreter's start. Linux only (fork, SIGKILL).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from queryloop import Runtime
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    SystemMessage,
    TranscriptMessage,
    UserMessage,
)
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.loop.tools import Tool, ToolContext
from queryloop.runtime.loop.transcript import normalize_messages_for_api, transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel

PROMPT = "Run them"
TRANSCRIPT_TYPES = (UserMessage, AssistantMessage, SystemMessage, AttachmentMessage)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kills", type=int, default=1000, help="processes killed (and resumed twice each)")
    parser.add_argument("--seed", type=int, default=39)
    parser.add_argument("--model-ms", type=float, default=20.0, help="each scripted response's latency")
    parser.add_argument("--check", action="store_true", help="exit with status 1 if anything was lost (for CI)")


def _use(tool_id: str, name: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": name, "input": {}}


async def _fast(args: dict[str, Any], ctx: ToolContext) -> str:
    await trio.sleep(0.001)
    return f"result of {ctx.tool_use_id}"


async def _slow(args: dict[str, Any], ctx: ToolContext) -> str:
    await trio.sleep(0.01)
    return f"result of {ctx.tool_use_id}"


TOOLS = [Tool(name="fast", call=_fast, concurrency_safe=True), Tool(name="slow", call=_slow)]


def _script(prefix: str, model_ms: float) -> list[dict[str, Any]]:
    """Four responses: three concurrent tools, a slow one, text with one more, then the answer."""
    ids = [f"{prefix}{n}" for n in range(6)]
    return [
        {
            "content": [{"type": "text", "text": "Three."}, *(_use(i, "fast") for i in ids[:3])],
            "stop_reason": "tool_use",
            "latency_ms": model_ms,
        },
        {"content": [_use(ids[3], "slow")], "stop_reason": "tool_use", "latency_ms": model_ms},
        {
            "content": [{"type": "text", "text": "More."}, _use(ids[4], "fast"), _use(ids[5], "fast")],
            "stop_reason": "tool_use",
            "latency_ms": model_ms,
        },
        {"content": [{"type": "text", "text": "Done."}], "latency_ms": model_ms},
    ]


# -- the worker: one durable query, reporting what its consumer received -----------------------


async def _work(path: Path, report: int, model_ms: float) -> None:
    model = ScriptedModel(_script("toolu_k", model_ms))
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, tools=TOOLS), transcript=path)
        os.write(report, b"ready\n")
        async for event in session.query(PROMPT):
            # After receiving it: one write, kept by a kill (the `init` notice is the host's, not the conversation's).
            if isinstance(event, TRANSCRIPT_TYPES) and event.label != "system:init":
                os.write(report, f"{event.uuid}\n".encode())
        os.write(report, b"done\n")


def _fork_server(commands: int, pids: int) -> None:
    """The fork server's loop: for each `path model_ms` line, fork a worker and answer its pid."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel: no zombie holds a pid
    with os.fdopen(commands, "r") as lines:
        for line in lines:
            path, model_ms = line.split()
            pid = os.fork()
            if pid == 0:
                report = os.open(f"{path}.seen", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                try:
                    trio.run(_work, Path(path), report, float(model_ms))
                finally:
                    os._exit(0)
            os.write(pids, f"{pid}\n".encode())
    os._exit(0)


class ForkServer:
    """A child forked before this process ran anything, that forks the workers (cheap, and thread-free)."""

    def __init__(self) -> None:
        commands_r, self._commands = os.pipe()
        pids_r, pids_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._commands)
            os.close(pids_r)
            _fork_server(commands_r, pids_w)
        os.close(commands_r)
        os.close(pids_w)
        self._pids = os.fdopen(pids_r, "r")

    def start(self, path: Path, model_ms: float) -> int:
        os.write(self._commands, f"{path} {model_ms}\n".encode())
        return int(self._pids.readline())

    def close(self) -> None:
        os.close(self._commands)
        os.waitpid(self.pid, 0)
        self._pids.close()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


# -- the checks, in this process ----------------------------------------------------------------


def _real_results(messages: list[TranscriptMessage]) -> dict[str, str]:
    """tool_use id -> the real result's text, for the results the worker's tools produced."""
    found = {}
    for message in messages:
        if isinstance(message, UserMessage) and isinstance(message.content, list):
            for block in message.content:
                content = block.get("content")
                if block.get("type") == "tool_result" and isinstance(content, str) and content.startswith("result of "):
                    found[block["tool_use_id"]] = content
    return found


def _sent_results(messages: list[TranscriptMessage]) -> dict[str, Any]:
    """tool_use id -> the result content a request built from `messages` would carry."""
    return {
        block["tool_use_id"]: block.get("content")
        for message in normalize_messages_for_api(messages)
        if message["role"] == "user"
        for block in message["content"]
        if block.get("type") == "tool_result"
    }


async def _check(path: Path, seen: list[str], model_ms: float) -> dict[str, int]:
    """Resume, continue, close, load, resume again; what went wrong, counted."""
    found = {"lost": 0, "invalid": 0, "replaced": 0, "diverged": 0}
    async with Runtime.open() as runtime:
        model = ScriptedModel(_script("toolu_r", model_ms / 4))
        session = await runtime.open_session(QueryOptions(provider=model, tools=TOOLS), resume=path)
        resumed = await session.transcript()
        kept = {m.uuid for m in resumed}
        found["lost"] = sum(uuid not in kept for uuid in seen)
        before = _real_results(resumed)
        async for _ in session.query("Go on"):
            pass
        await session.close()
    loaded = load_transcript(path)
    if loaded.problems or transcript_problems(loaded.messages):
        found["invalid"] = 1
    sent = _sent_results(loaded.messages)
    found["replaced"] = sum(sent.get(tool_id) != text for tool_id, text in before.items())
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=ScriptedModel([])), resume=path)
        again = await session.transcript()
        found["diverged"] = int([m.uuid for m in again] != [m.uuid for m in loaded.messages])
        await session.close()
    return found


def _seen(path: Path) -> tuple[list[str], bool, bool]:
    """The uuids the worker's consumer received, whether it was ready, and whether its query had ended."""
    report = Path(f"{path}.seen")
    text = report.read_text() if report.exists() else ""
    *lines, _ = text.split("\n")  # a report the kill cut has no newline: not received
    uuids = [line for line in lines if line not in ("ready", "done")]
    return uuids, "ready" in lines, "done" in lines


def _query_life(server: ForkServer, folder: Path, model_ms: float) -> float:
    """How long one unkilled worker takes from its start to its query's end (the window kills are drawn in)."""
    lives = []
    for n in range(3):
        path = folder / f"calibrate-{n}.jsonl"
        started = time.monotonic()
        pid = server.start(path, model_ms)
        if not _wait_gone(pid, 60):
            msg = "a calibration worker did not end within 60 s"
            raise RuntimeError(msg)
        lives.append(time.monotonic() - started)
        if not _seen(path)[2]:
            msg = f"a calibration worker ended without finishing its query; see {path}"
            raise RuntimeError(msg)
    return sorted(lives)[1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    if not sys.platform.startswith("linux"):
        msg = "bench durability forks and SIGKILLs workers: Linux only"
        raise SystemExit(msg)
    server = ForkServer()  # before anything runs here: the workers are forked from a clean process
    rng = random.Random(args.seed)
    totals = {"lost": 0, "invalid": 0, "replaced": 0, "diverged": 0}
    kills = mid_query = before_file = after_end = 0
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="queryloop-durability-") as scratch:
            folder = Path(scratch)
            life = _query_life(server, folder, args.model_ms)
            for n in range(args.kills):
                path = folder / f"killed-{n}.jsonl"
                pid = server.start(path, args.model_ms)
                time.sleep(rng.uniform(0, life * 1.1))
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                if not _wait_gone(pid, 30):
                    msg = f"worker {pid} outlived its SIGKILL by 30 s"
                    raise RuntimeError(msg)
                kills += 1
                seen, ready, done = _seen(path)
                if not ready or not path.exists() or path.stat().st_size == 0:
                    before_file += 1
                    continue
                after_end += done
                mid_query += bool(seen) and not done
                for key, value in trio.run(_check, path, seen, args.model_ms).items():
                    totals[key] += value
                    if value:
                        print(f"kill {n}: {key} {value} ({path.name})", file=sys.stderr)
                if (n + 1) % 100 == 0:
                    print(f"{n + 1} kills: {totals}", file=sys.stderr)
                for leftover in folder.glob(f"killed-{n}*"):  # the transcript, its report, any spill folder
                    if leftover.is_dir():
                        shutil.rmtree(leftover)
                    else:
                        leftover.unlink()
    finally:
        server.close()
    elapsed = time.monotonic() - started
    print(
        f"durability: {kills} kills ({mid_query} mid-query, {after_end} after the query's end, {before_file} before "
        f"the transcript was open) in {elapsed:.0f} s; query life {life * 1000:.0f} ms\n"
        f"  transcripts invalid {totals['invalid']}, real results replaced {totals['replaced']}, "
        f"seen events lost {totals['lost']}, second resume diverged {totals['diverged']}"
    )
    if args.check and any(totals.values()):
        msg = f"durability: something was lost or damaged: {totals}"
        raise SystemExit(msg)
    return {
        "benchmark": "durability",
        "kills": kills,
        "kills_mid_query": mid_query,
        "kills_after_end": after_end,
        "kills_before_file": before_file,
        "query_life_ms": round(life * 1000, 1),
        "elapsed_s": round(elapsed, 1),
        **totals,
    }
