"""Durability: nothing the consumer saw is lost to a crash (docs/design.md, "Durability").

Every message is written to the OS before the consumer receives its event, the prompt before the
first request, and the file is fsynced (off the trio thread) at each continue site and at a
query's end. The last test kills a real session with SIGKILL at random moments.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from queryloop import Runtime
from queryloop.runtime.loop import persistence
from queryloop.runtime.loop.events import AssistantMessage, ResultMessage, TombstoneEvent, UserMessage
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.persistence import TranscriptLog
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.loop.transcript import normalize_messages_for_api, transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel
from tests import helpers
from tests.helpers import (
    assert_settled,
    consume,
    hang_guard,
    kept,
    logged_uuids,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)

ROOT = helpers.REPO


async def test_every_message_is_in_the_file_before_the_consumer_receives_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    model = ScriptedModel(
        [
            # The stream outlasts the tools: their results reach the consumer while it still runs (held).
            tools_reply(tool_use("t1", "read"), tool_use("t2", "read"), text="Reading.", latency_ms=20),
            tools_reply(tool_use("t3", "read")),
            text_reply("Done."),
            tools_reply(tool_use("t4", "slow")),
        ]
    )
    tools = [scripted_tool("read", safe=True), scripted_tool("slow", latency=3600)]
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools), transcript=path)
        received: list[str] = []
        async for event in session.query("Fix the bug"):
            if kept(event):
                assert event.uuid in logged_uuids(path), f"{event!r} reached the consumer before the file"
                received.append(event.uuid)
        assert len(received) == 8  # 3 + 1 + 1 blocks and 3 results (the prompt is not an event)
        # An aborted query: its ending (synthetic results, the interruption) is written before it is received too.
        handle = session.query("Again")
        async for event in handle:
            if kept(event):
                assert event.uuid in logged_uuids(path)
                received.append(event.uuid)
            if isinstance(event, AssistantMessage):
                await session.abort("user")
        assert handle.result is not None
        transcript = await session.transcript()
        assert set(received) <= {m.uuid for m in transcript}
        await session.close()
    assert load_transcript(path).messages == transcript


async def test_every_message_of_a_batch_is_in_the_file_before_the_batch_is_handed_over(
    transcript_path: Path, runtime: Runtime
) -> None:
    """`QueryHandle.next_batch` (how the asyncio facade takes events) keeps the rule as iteration does."""
    model = ScriptedModel([tools_reply(tool_use("t1", "read"), tool_use("t2", "read"), text="Reading."), text_reply()])
    session = await runtime.open_session(
        QueryOptions(provider=model, tools=[scripted_tool("read", safe=True)]), transcript=transcript_path
    )
    handle = session.query("Fix the bug")
    received = 0
    while batch := await handle.next_batch():
        logged = logged_uuids(transcript_path)
        for event in batch:
            if kept(event):
                assert event.uuid in logged, f"{event!r} was handed over before the file had it"
                received += 1
    assert received == 6  # 3 + 1 blocks and 2 results
    await session.close()


async def test_the_prompt_is_in_the_file_before_the_first_request_goes_out(
    transcript_path: Path, runtime: Runtime
) -> None:
    seen: list[list[Any]] = []

    inner = ScriptedModel([text_reply("Hello.")])

    class Peeking:
        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            seen.append(load_transcript(transcript_path).messages)
            async with aclosing(inner.stream(request)) as events:
                async for event in events:
                    yield event

    session = await runtime.open_session(QueryOptions(provider=Peeking()), transcript=transcript_path)
    await session.query("Hi").wait()
    assert [m.content for m in seen[0] if isinstance(m, UserMessage)] == ["Hi"]
    await session.close()


async def test_fsync_runs_off_the_trio_thread_at_each_continue_site_and_at_each_query_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.jsonl"
    synced: list[set[str]] = []  # what the file held at each fsync
    trio_thread = threading.current_thread()
    monkeypatch.setattr(persistence, "INLINE_FSYNC_S", 0.0)  # every fsync counts as slow: never inline

    def fsync(fd: int) -> None:
        assert threading.current_thread() is not trio_thread
        os.fsync(fd)
        synced.append(logged_uuids(path) - {None})

    monkeypatch.setattr(TranscriptLog, "fsync", staticmethod(fsync))
    model = ScriptedModel(
        [
            tools_reply(tool_use("t1", "read"), tool_use("t2", "read")),
            tools_reply(tool_use("t3", "read")),
            text_reply("Done."),
            text_reply("Again."),
        ]
    )
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=model, tools=[scripted_tool("read", safe=True)])
        session = await runtime.open_session(options, transcript=path)
        first = await consume(session, session.query("Fix the bug"), model)
        await assert_settled(first)
        after_first = {m.uuid for m in await session.transcript()}
        second = await consume(session, session.query("And again"), model)
        await assert_settled(second)
        everything = {m.uuid for m in await session.transcript()}
        await session.close()
    uuids = [e.uuid for e in first.events if kept(e)]
    # Opening (the session record), the two continue sites (each after its turn's results), and the end
    # of each query: nothing per event, nothing per model call.
    assert len(synced) == 5
    assert synced[0] == set()
    assert set(uuids[:4]) <= synced[1] and uuids[4] not in synced[1]  # t1, t2 and their results; not t3's block
    assert set(uuids[:6]) <= synced[2] and uuids[6] not in synced[2]
    assert synced[3] == after_first
    assert synced[4] == everything


async def test_an_fsync_faster_than_a_thread_hop_runs_inline_until_one_is_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trio_thread = threading.current_thread()
    inline: list[bool] = []

    def fsync(fd: int) -> None:
        inline.append(threading.current_thread() is trio_thread)

    monkeypatch.setattr(TranscriptLog, "fsync", staticmethod(fsync))
    log = TranscriptLog(tmp_path / "t.jsonl", "s-1")
    monkeypatch.setattr(persistence, "INLINE_FSYNC_S", 3600.0)  # every fsync counts as fast
    await log.flush()  # the session record: nothing measured yet, so in a thread
    log.append(UserMessage(content="one"))
    await log.flush()  # the last one was fast: inline
    monkeypatch.setattr(persistence, "INLINE_FSYNC_S", 0.0)  # from now on every fsync counts as slow
    log.append(UserMessage(content="two"))
    assert log.sync_now()  # still inline (the last one was fast), and measured slow
    log.append(UserMessage(content="three"))
    assert not log.sync_now()  # slow last time: left to flush(), which goes to a thread
    await log.flush()
    await log.flush()  # nothing new: no fsync
    log.close()
    assert inline == [False, True, True, False]
    assert [json.loads(line).get("content") for line in (tmp_path / "t.jsonl").read_bytes().splitlines()][1:] == [
        "one",
        "two",
        "three",
    ]


async def test_an_abort_ends_a_transcribed_query_in_its_own_call_when_its_fsync_runs_inline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the transcript's fsync inline, the abort's own call ends the query: the `result` is in the
    handle's buffer, and its records on disk, before any task runs (no hop to a thread and back)."""
    monkeypatch.setattr(persistence, "INLINE_FSYNC_S", 3600.0)
    path = tmp_path / "t.jsonl"
    model = ScriptedModel([tools_reply(tool_use("t1", "slow"))])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=model, tools=[scripted_tool("slow", latency=3600)]), transcript=path
        )
        handle = session.query("Go")
        async for event in handle:
            if isinstance(event, AssistantMessage):
                break
        await trio.testing.wait_all_tasks_blocked()  # the tool runs
        session.abort_nowait()
        buffered = list(handle._events.items)  # what the consumer would take next, now
        assert any(isinstance(item, ResultMessage) for item in buffered)
        results = [m for m in buffered if isinstance(m, UserMessage)]
        assert results and results[0].uuid in logged_uuids(path)
        await handle.wait()
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        assert session.live_tasks() == 0
        assert transcript_problems(await session.transcript()) == []
        await session.close()


def held_response_log(path: Path) -> tuple[list[Any], UserMessage]:
    """A log as a crash can leave it: a response whose tool's result came before its last block, no release."""
    log = TranscriptLog(path, "s-1")
    prompt = UserMessage(content="go")
    first = AssistantMessage(message_id="msg_1", model="claude-sonnet-5-5", content=[tool_use("t1", "read")])
    result = UserMessage(content=[{"type": "tool_result", "tool_use_id": "t1", "content": "ok", "is_error": False}])
    second = AssistantMessage(
        message_id="msg_1", model="claude-sonnet-5-5", content=[{"type": "text", "text": "Reading."}]
    )
    log.append(prompt)
    log.append(first)
    log.append(result, held=True)
    log.append(second)
    log.write()
    log.close()  # nothing is left buffered: the file is as the crash left it, and its lock went with the process
    return [prompt, first, second], result


def test_a_held_result_follows_its_response_even_when_a_crash_cut_the_response(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    response, result = held_response_log(path)
    loaded = load_transcript(path)
    assert loaded.messages == [*response, result]
    assert loaded.problems == [] and loaded.repairs == []
    assert transcript_problems(loaded.messages) == []


def test_a_released_result_joins_where_its_response_ended_and_a_retracted_one_never(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    response, result = held_response_log(path)
    retracted = UserMessage(content=[{"type": "tool_result", "tool_use_id": "t9", "content": "x", "is_error": False}])
    after = UserMessage(content="and then")
    log = TranscriptLog(path, "s-1", resumes=path)  # the same session goes on in its own file
    log.append(retracted, held=True)
    log.append(TombstoneEvent(message_uuid=retracted.uuid))
    log.release()
    log.append(after)
    log.close()
    assert load_transcript(path).messages == [*response, result, after]


def test_a_closed_log_refuses_a_release_as_it_refuses_a_message(tmp_path: Path) -> None:
    log = TranscriptLog(tmp_path / "t.jsonl", "s-1")
    log.append(UserMessage(content="hello"))
    log.close()
    for late in (log.release, lambda: log.append(UserMessage(content="late"))):
        with pytest.raises(ValueError, match="is closed"):
            late()
    log.write()  # nothing was buffered after the close: nothing to write, nothing raised
    assert [m.model_dump()["content"] for m in load_transcript(tmp_path / "t.jsonl").messages] == ["hello"]


# -- a crash: SIGKILL at random moments ---------------------------------------------------

CHILD = """
import os
import sys
from contextlib import aclosing
from pathlib import Path

import trio
import trio.testing

from queryloop import Runtime
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.tools import Tool
from queryloop.runtime.providers.scripted import ScriptedModel


def report(line):
    os.write(1, (line + "\\n").encode())  # one unbuffered write: the parent has it even if a kill follows


def use(tool_id, name):
    return {"type": "tool_use", "id": tool_id, "name": name, "input": {}}


class Announced:
    def __init__(self, inner):
        self.inner = inner

    async def stream(self, request):
        report("request")
        async with aclosing(self.inner.stream(request)) as events:
            async for event in events:
                yield event


async def fast(args, ctx):
    return "fast result"


async def slow(args, ctx):
    await trio.sleep(0.015)
    return "slow result"


async def main(path):
    model = ScriptedModel([
        {"content": [{"type": "text", "text": "Both."}, use("a", "fast"), use("b", "fast")],
         "stop_reason": "tool_use", "latency_ms": 20},
        {"content": [use("c", "slow")], "stop_reason": "tool_use", "latency_ms": 20},
        {"content": [{"type": "text", "text": "One more."}, use("d", "fast")], "stop_reason": "tool_use",
         "latency_ms": 10},
        {"content": [{"type": "text", "text": "Done."}], "latency_ms": 10},
    ])
    tools = [Tool(name="fast", call=fast, concurrency_safe=True), Tool(name="slow", call=slow)]
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=Announced(model), tools=tools), transcript=path)
        report("ready")
        async for event in session.query("Run them"):
            if event.type in ("user", "assistant", "system", "attachment") and event.label != "system:init":
                report(event.uuid)  # after receiving it (the `init` notice is not the conversation's)
        report("done")


trio.run(main, Path(sys.argv[1]))
"""

PROMPT = "Run them"
RESUME_BOUND_S = 30.0
"""Bound of one resume-and-go-on after a kill (milliseconds, usually): a hang fails the test, naming its attempt.
What kills and resumes cost is measured by `python -m bench durability`, not here."""


async def run_and_kill(path: Path, stderr: Path, after: bytes, delay: float) -> list[str]:
    """Start the child; `delay` s after it reports `after`, SIGKILL it. Its complete report lines."""
    reported = bytearray()
    with stderr.open("wb") as errors:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", CHILD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=errors
        )
    try:
        assert process.stdout is not None
        with trio.fail_after(20):
            while after + b"\n" not in reported:
                chunk = await process.stdout.receive_some()
                assert chunk, f"the child ended before it reported {after!r}; see {stderr}"
                reported += chunk
        await trio.sleep(delay)  # the moment of the kill, relative to the child's report
        with contextlib.suppress(ProcessLookupError):  # it may have ended on its own already
            os.kill(process.pid, signal.SIGKILL)
        with trio.fail_after(10):
            await process.wait()
            # What the child wrote before it died is still in the pipe.
            while chunk := await process.stdout.receive_some():
                reported += chunk
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()
    *lines, _ = reported.decode().split("\n")  # a report cut by the kill has no newline: not received
    return lines


async def test_sigkill_at_random_moments_loses_nothing_the_consumer_received_20_times(tmp_path: Path) -> None:
    rng = random.Random(14)
    cut_mid_query = 0
    for attempt in range(20):
        path = tmp_path / f"killed-{attempt}.jsonl"
        if attempt % 2 == 0:  # in the first response: its first milliseconds (no block yet), then its blocks
            first_ms = [0.0, 0.0005, 0.001, 0.002, 0.005]
            after, delay = b"request", first_ms[attempt // 2] if attempt < 10 else rng.uniform(0.008, 0.025)
        else:  # anywhere in the query (about 90 ms), or just after it
            after, delay = b"ready", rng.uniform(0, 0.1)
        lines = await run_and_kill(path, tmp_path / f"stderr-{attempt}.txt", after, delay)
        received = [line for line in lines if line not in ("ready", "request", "done")]
        cut_mid_query += bool(received) and "done" not in lines
        loaded = load_transcript(path)
        assert loaded.problems == [], (attempt, loaded.problems)
        with hang_guard(RESUME_BOUND_S, f"attempt {attempt}: resuming the killed session and going on"):
            async with Runtime.open() as runtime:
                model = ScriptedModel([text_reply("Recovered.")])
                session = await runtime.open_session(QueryOptions(provider=model), resume=path)
                resumed = await session.transcript()
                # Everything the consumer received is in the resumed conversation, and the prompt once a
                # request went out.
                kept = {m.uuid for m in resumed}
                missing = [uuid for uuid in received if uuid not in kept]
                assert missing == [], f"attempt {attempt}: received but lost: {missing}"
                prompts = [m for m in resumed if isinstance(m, UserMessage) and m.content == PROMPT]
                assert len(prompts) == 1 if "request" in lines else len(prompts) <= 1, attempt
                # ...and it is valid to send: paired and alternating as it is, and sent so.
                assert transcript_problems(resumed) == [], attempt
                ran = await consume(session, session.query("Go on"), model)
                await assert_settled(ran)
                assert ran.reason == "completed"
                expected = normalize_messages_for_api([*resumed, UserMessage(content="Go on")])
                assert model.requests[0].messages == expected
                await session.close()
    assert cut_mid_query >= 3  # not only before the first message or after the end
