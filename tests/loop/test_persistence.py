"""Durable transcripts: the JSONL log of a session, its loading, resume, and a crash (SIGKILL) mid-turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import trio

from queryloop import Runtime
from queryloop.runtime.host.session import Session
from queryloop.runtime.loop.events import AssistantMessage, StreamEvent, TranscriptMessage, UserMessage
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.persistence import TranscriptLog
from queryloop.runtime.loop.restore import INTERRUPTED_BY_CRASH, load_transcript
from queryloop.runtime.loop.transcript import normalize_messages_for_api, transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel
from tests import helpers
from tests.helpers import (
    FallbackMidStream,
    Ran,
    assert_settled,
    consume,
    hang_guard,
    kept,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)

ROOT = helpers.REPO


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def tool_result_ids(messages: Sequence[TranscriptMessage]) -> list[str]:
    return [
        b["tool_use_id"]
        for m in messages
        if isinstance(m, UserMessage) and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]


async def two_tool_turns(runtime: Runtime, path: Path) -> tuple[Session, Ran, Ran]:
    """A session logging to `path` runs a query of two tool turns and an answer; a second query follows."""
    model = ScriptedModel(
        [
            # The stream outlasts the tool: its result is held until the response's last block.
            tools_reply(tool_use("t1", "read"), tool_use("t2", "read"), text="Reading.", latency_ms=20),
            tools_reply(tool_use("t3", "read")),
            text_reply("Done."),
            text_reply("Again."),
        ]
    )
    session = await runtime.open_session(
        QueryOptions(provider=model, tools=[scripted_tool("read", safe=True)]), transcript=path
    )
    first = await consume(session, session.query("Fix the bug"), model)
    await assert_settled(first)
    assert first.handle.transitions == ["next_turn", "next_turn"]
    second = await consume(session, session.query("And again"), model)
    await assert_settled(second)
    return session, first, second


async def test_a_multi_turn_session_logs_every_conversation_message_in_order(
    transcript_path: Path, runtime: Runtime
) -> None:
    session, first, second = await two_tool_turns(runtime, transcript_path)
    # t1's result was emitted while its response still streamed: the conversation (and the log) took it later.
    t1_result = next(i for i, e in enumerate(first.events) if isinstance(e, UserMessage))
    response_end = next(
        i for i, e in enumerate(first.events) if isinstance(e, StreamEvent) and e.event["type"] == "message_delta"
    )
    assert t1_result < response_end
    transcript = await session.transcript()
    # Flushed before each result: the file is complete while the session is still open.
    loaded = load_transcript(transcript_path)
    assert loaded.messages == transcript
    assert loaded.problems == [] and loaded.repairs == []
    assert loaded.session_id == session.id
    lines = records(transcript_path)
    assert lines[0] == {"type": "session", "session_id": session.id, "version": 2}
    # The file keeps the order of emission (t1's result held until its response is whole, then
    # released); the prompts, which the consumer never receives, where they joined.
    emitted = [e.uuid for e in [*first.events, *second.events] if kept(e)]
    logged = [line["uuid"] for line in lines[1:] if "uuid" in line]
    assert [u for u in logged if u in emitted] == emitted
    assert len(logged) == len(transcript)
    held = [line for line in lines if line.get("held")]
    assert held and lines.index(held[0]) < lines.index({"type": "release"})
    ids = tool_result_ids(transcript)  # t1 and t2 tie: they finish in the order trio runs them
    assert sorted(ids[:2]) == ["t1", "t2"] and ids[2:] == ["t3"]
    await session.close()


async def test_the_prompt_and_each_turn_are_in_the_file_before_the_request_that_carries_them(
    transcript_path: Path, runtime: Runtime
) -> None:
    inner = ScriptedModel([tools_reply(tool_use("t1", "read")), text_reply("Done.")])
    seen: list[list[TranscriptMessage]] = []

    class Peeking:
        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            seen.append(load_transcript(transcript_path).messages)
            async with aclosing(inner.stream(request)) as events:
                async for event in events:
                    yield event

    options = QueryOptions(provider=Peeking(), tools=[scripted_tool("read")])
    session = await runtime.open_session(options, transcript=transcript_path)
    ran = await consume(session, session.query("go"), inner)
    await assert_settled(ran)
    transcript = await session.transcript()
    assert seen[0] == transcript[:1]  # the prompt is written before the first request goes out
    assert seen[1] == transcript[:3]  # prompt, tool_use, its result: flushed at the next_turn site
    await session.close()


async def test_resume_restores_the_conversation_and_the_session_id(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, _, _ = await two_tool_turns(runtime, path)
        before, first_id = await session.transcript(), session.id
        await session.close()
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Resumed.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path)
        assert session.id == first_id
        assert await session.transcript() == before
        ran = await consume(session, session.query("Where were we?"), model)
        await assert_settled(ran)
        prompt = {"role": "user", "content": [{"type": "text", "text": "Where were we?"}]}
        assert model.requests[0].messages == [*normalize_messages_for_api(before), prompt]
        # Appended to the same file, restored messages not written twice.
        after = await session.transcript()
        loaded = load_transcript(path)
        assert loaded.messages == after and loaded.problems == []
        assert [r["type"] for r in records(path)].count("session") == 1
        assert len([r for r in records(path) if "uuid" in r]) == len(after)
        await session.close()


async def test_resuming_into_another_file_writes_the_whole_history_there(tmp_path: Path) -> None:
    path, fork = tmp_path / "t.jsonl", tmp_path / "fork.jsonl"
    async with Runtime.open() as runtime:
        session, _, _ = await two_tool_turns(runtime, path)
        await session.close()
    original = path.read_bytes()
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Forked.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path, transcript=fork)
        await session.query("Fork it").wait()
        assert load_transcript(fork).messages == await session.transcript()
        assert load_transcript(fork).session_id == session.id
        await session.close()
    assert path.read_bytes() == original


async def test_fork_goes_on_as_a_new_session_in_another_file_and_leaves_the_original_as_it_was(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, _, _ = await two_tool_turns(runtime, path)
        before, first_id = await session.transcript(), session.id
        await session.close()
    original = path.read_bytes()
    async with Runtime.open() as runtime:
        # Two forks of one conversation at once: each its own session (a resume would refuse the second).
        forks = []
        for name in ("a", "b"):
            model = ScriptedModel([text_reply(f"Fork {name}.")])
            forked = await runtime.open_session(
                QueryOptions(provider=model), resume=path, transcript=tmp_path / f"{name}.jsonl", fork=True
            )
            assert forked.id != first_id
            assert await forked.transcript() == before
            forks.append((name, forked, model))
        for name, forked, model in forks:
            ran = await consume(forked, forked.query(f"Go on, {name}"), model)
            await assert_settled(ran)
            loaded = load_transcript(tmp_path / f"{name}.jsonl")
            assert loaded.session_id == forked.id and loaded.problems == []
            assert loaded.messages == await forked.transcript()
            assert loaded.messages[: len(before)] == before
            await forked.close()
    assert path.read_bytes() == original


async def test_fork_needs_a_resumed_transcript_and_another_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    options = QueryOptions(provider=ScriptedModel([]))
    cases: tuple[dict[str, Any], ...] = (
        {"transcript": path},
        {"resume": path},
        {"resume": path, "transcript": tmp_path / "." / "t.jsonl"},
    )
    async with Runtime.open() as runtime:
        for kwargs in cases:
            with pytest.raises(ValueError, match="fork=True forks a resumed transcript into another file"):
                await runtime.open_session(options, fork=True, **kwargs)
        assert runtime.groups == {}


async def test_tombstoned_messages_stay_retracted_after_resume(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        inner = ScriptedModel(
            [
                tools_reply(tool_use("t1", "read")),
                tools_reply(tool_use("t2", "read"), text="About to"),  # abandoned after its text block
                text_reply("Answered by the fallback."),
            ]
        )
        options = QueryOptions(
            provider=FallbackMidStream(inner, fail_on=2, events=5),
            model="claude-sonnet-5-5",
            fallback_model="claude-haiku-5-5",
            tools=[scripted_tool("read")],
        )
        session = await runtime.open_session(options, transcript=path)
        ran = await consume(session, session.query("go"), inner)
        await assert_settled(ran)
        abandoned = [e.uuid for e in ran.events if isinstance(e, AssistantMessage) and "About to" in str(e.content)]
        assert len(abandoned) == 1
        tombstones = [r for r in records(path) if r["type"] == "tombstone"]
        assert [(r["type"], r["message_uuid"]) for r in tombstones] == [("tombstone", abandoned[0])]
        before = await session.transcript()
        await session.close()
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Resumed.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path)
        restored = await session.transcript()
        assert restored == before
        assert abandoned[0] not in {m.uuid for m in restored}
        await session.query("More").wait()
        assert "About to" not in json.dumps(model.requests[0].messages)
        await session.close()


async def test_corrupt_and_truncated_lines_are_skipped_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, _, _ = await two_tool_turns(runtime, path)
        transcript = await session.transcript()
        await session.close()
    lines = path.read_bytes().splitlines(keepends=True)
    damaged = [*lines[:3], b'{"type": "user", "content": [{"ty\xff\n', *lines[3:], lines[-1][:25]]
    path.write_bytes(b"".join(damaged))
    loaded = load_transcript(path)
    assert loaded.messages == transcript
    assert loaded.problems == [
        "line 4: corrupt record skipped (not JSON)",
        f"line {len(damaged)}: truncated record skipped (not JSON)",
    ]
    # Resumed, the fragment the crash left is cut off (the load reported it): later loads do not report it again.
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Resumed.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path)
        await session.query("Go on").wait()
        after = await session.transcript()
        await session.close()
    reloaded = load_transcript(path)
    assert reloaded.messages == after
    assert reloaded.problems == ["line 4: corrupt record skipped (not JSON)"]


async def test_invalid_records_are_skipped_and_reported(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps({"type": "session", "session_id": "s-1", "version": 1}),
                json.dumps(UserMessage(content="hi").model_dump(mode="json")),
                json.dumps({"type": "user", "content": 3}),
                json.dumps({"type": "mystery"}),
                "[1, 2]",
            ]
        )
        + "\n"
    )
    loaded = load_transcript(path)
    assert loaded.session_id == "s-1"
    assert [m.content for m in loaded.messages if isinstance(m, UserMessage)] == ["hi"]
    assert loaded.problems == [
        "line 3: corrupt user record skipped (no uuid)",
        "line 4: corrupt record skipped (unknown type 'mystery')",
        "line 5: corrupt record skipped (unknown type None)",
    ]


async def test_a_message_record_without_a_uuid_is_skipped_so_every_load_reads_the_same_conversation(
    tmp_path: Path,
) -> None:
    # Made up at each load, its uuid would differ from one load to the next: a tombstone or a
    # `resume_session_at` naming it would miss it after a resume.
    path = tmp_path / "t.jsonl"
    hi = UserMessage(content="hi").model_dump(mode="json")
    bare = {key: value for key, value in UserMessage(content="again").model_dump(mode="json").items() if key != "uuid"}
    records = [{"type": "session", "session_id": "s-1", "version": 2}, hi, bare, {**bare, "uuid": ""}]
    path.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    first, second = load_transcript(path), load_transcript(path)
    assert [m.uuid for m in first.messages] == [m.uuid for m in second.messages] == [hi["uuid"]]
    assert first.problems == [
        "line 3: corrupt user record skipped (no uuid)",
        "line 4: corrupt user record skipped (no uuid)",
    ]


async def test_a_tool_use_left_open_by_a_cut_write_gets_a_synthetic_result_once(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, _, _ = await two_tool_turns(runtime, path)
        await session.close()
    # Cut mid-way through the t3 result: as a crash in the middle of that write leaves the file.
    lines = path.read_bytes().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if b'"tool_use_id":"t3"' in line)
    path.write_bytes(b"".join(lines[:cut]) + lines[cut][:40])
    loaded = load_transcript(path)
    assert [r.content[0]["tool_use_id"] for r in loaded.repairs] == ["t3"]  # type: ignore[index]
    assert loaded.repairs[0].content[0]["content"] == INTERRUPTED_BY_CRASH  # type: ignore[index]
    assert loaded.messages[-1] == loaded.repairs[0]
    assert transcript_problems(loaded.messages) == []
    assert loaded.problems == [f"line {cut + 1}: truncated record skipped (not JSON)"]
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Resumed.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path)
        ran = await consume(session, session.query("Go on"), model)
        await assert_settled(ran)
        after = await session.transcript()
        await session.close()
    # The repair was written back: the next load finds nothing left to repair.
    reloaded = load_transcript(path)
    assert reloaded.repairs == [] and reloaded.messages == after
    assert transcript_problems(reloaded.messages) == []


async def test_a_runtime_closed_mid_turn_leaves_a_complete_transcript(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    model = ScriptedModel([tools_reply(tool_use("t1", "slow"))])
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=model, tools=[scripted_tool("slow", latency=3600)])
        session = await runtime.open_session(options, transcript=path)
        handle = session.query("go")
        async for event in handle:
            if isinstance(event, AssistantMessage):
                break
        # Leaving the runtime aborts the query, which ends properly and is flushed before the result.
    loaded = load_transcript(path)
    assert loaded.problems == []
    assert loaded.repairs == []  # nothing left open: the abort answered the running tool
    assert [type(m).__name__ for m in loaded.messages] == [
        "UserMessage",
        "AssistantMessage",
        "UserMessage",
        "UserMessage",
    ]
    assert tool_result_ids(loaded.messages) == ["t1"]
    assert loaded.messages[-1].content == [{"type": "text", "text": "[Request interrupted by user for tool use]"}]  # type: ignore[union-attr]
    assert transcript_problems(loaded.messages) == []
    del handle


async def test_a_log_flushes_durably_and_closes_with_what_is_left(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    log = TranscriptLog(path, "s-1")
    first, second = UserMessage(content="one"), UserMessage(content="two")
    log.append(first)
    assert path.read_bytes() == b""  # buffered until flushed
    await log.flush()
    assert load_transcript(path).messages == [first]
    log.append(second)
    log.close()
    log.close()
    assert load_transcript(path).messages == [first, second]


# -- a crash: SIGKILL mid-turn ------------------------------------------------------------

CHILD = """
import sys
from pathlib import Path

import trio

from queryloop import Runtime
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.providers.scripted import ScriptedModel
from queryloop.runtime.loop.tools import Tool


async def fast(args, ctx):
    return "fast result"


async def slow(args, ctx):
    print("slow started", flush=True)
    await trio.sleep(3600)
    return "never"


async def main(path):
    model = ScriptedModel([
        {"content": [{"type": "tool_use", "id": "t1", "name": "fast", "input": {}}], "stop_reason": "tool_use"},
        {"content": [{"type": "tool_use", "id": "t2", "name": "slow", "input": {}}], "stop_reason": "tool_use"},
    ])
    tools = [Tool(name="fast", call=fast), Tool(name="slow", call=slow)]
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools), transcript=path)
        await session.query("Run both").wait()


trio.run(main, Path(sys.argv[1]))
"""

RESUME_BOUND_S = 30.0
"""Bound of one resume-and-go-on after a kill (milliseconds, usually): a hang fails the test, naming its attempt.
What kills and resumes cost is measured by `python -m bench durability`, not here."""


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some()
        if not chunk:
            break
        data += chunk
    return data


async def kill_mid_turn(path: Path, stderr: Path) -> None:
    """Run the child until its second turn's slow tool runs, then SIGKILL it."""
    with stderr.open("wb") as errors:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", CHILD, str(path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=errors
        )
    try:
        assert process.stdout is not None
        with trio.move_on_after(20):
            line = await read_line(process.stdout)
        assert line == b"slow started\n", f"the child did not reach its slow tool; see {stderr}"
        # The tool may start before its response's stream has ended; the response is flushed right
        # after. Wait (bounded) for that flush, the condition the kill must follow.
        # The file is another process's: there is no event to wait on, so a bounded poll it is.
        with trio.fail_after(10):
            while b'"t2"' not in await trio.to_thread.run_sync(path.read_bytes):  # noqa: ASYNC110
                await trio.sleep(0.01)
        os.kill(process.pid, signal.SIGKILL)
        with trio.fail_after(10):
            await process.wait()
        assert process.returncode == -signal.SIGKILL
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if process.stdout is not None:
            await process.stdout.aclose()


async def test_sigkill_mid_turn_keeps_every_flushed_turn_and_resumes_20_times(tmp_path: Path) -> None:
    for attempt in range(20):
        path = tmp_path / f"killed-{attempt}.jsonl"
        await kill_mid_turn(path, tmp_path / f"stderr-{attempt}.txt")
        loaded = load_transcript(path)
        assert loaded.problems == []
        # Every completed message is kept: the first turn, and the second response (flushed when its
        # stream ended); its tool was running when the process died, so its tool_use is left open...
        assert [type(m).__name__ for m in loaded.messages] == [
            "UserMessage",
            "AssistantMessage",
            "UserMessage",
            "AssistantMessage",
            "UserMessage",
        ]
        assert loaded.messages[1].content == [tool_use("t1", "fast")]  # type: ignore[union-attr]
        assert loaded.messages[3].content == [tool_use("t2", "slow")]  # type: ignore[union-attr]
        # ...and resume pairs it with a synthetic result.
        assert tool_result_ids(loaded.messages) == ["t1", "t2"]
        assert len(loaded.repairs) == 1
        assert transcript_problems(loaded.messages) == []
        with hang_guard(RESUME_BOUND_S, f"attempt {attempt}: resuming the killed session and going on"):
            async with Runtime.open() as runtime:
                model = ScriptedModel([text_reply("Recovered.")])
                session = await runtime.open_session(QueryOptions(provider=model), resume=path)
                assert session.id == loaded.session_id
                ran = await consume(session, session.query("Go on"), model)
                await assert_settled(ran)
                assert ran.reason == "completed"
                # The prompt joins the user message of the restored tool result: the roles still alternate.
                expected = normalize_messages_for_api([*loaded.messages, UserMessage(content="Go on")])
                assert model.requests[0].messages == expected
                assert load_transcript(path).messages == await session.transcript()
                await session.close()
