"""A transcript on a full disk: the write fails, nothing is lost, the writer waits for room, and every query
ends with a result (an error naming the disk when the disk stays full past the bound).

The disk is made full for real: the log's file descriptor is pointed at `/dev/full` (every write fails with
ENOSPC) and back at the file to free the disk. No code of ours is replaced.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio.testing

from queryloop import AgentDefinition, QueryHandle, Runtime, Session
from queryloop.runtime.loop.disk import (
    DISK_FULL_WAIT_S,
    FIRST_RETRY_S,
    MAX_RETRY_S,
    backoff_delays,
    disk_error_text,
    is_disk_full,
    retry_while_full,
)
from queryloop.runtime.loop.events import AssistantMessage, QueryEvent, TranscriptMessage, UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.persistence import TranscriptLog
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import kept, logged_uuids, scripted_tool, text_reply, tool_use, tools_reply

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/full and /proc/self/fd are Linux's")


def descriptors_of(path: Path) -> list[int]:
    """This process's file descriptors open on `path`."""
    real = str(path.resolve())
    fds = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            if os.readlink(f"/proc/self/fd/{name}") == real:
                fds.append(int(name))
    return fds


@contextlib.contextmanager
def disk_full(path: Path) -> Iterator[None]:
    """While inside, every write to `path` (open once in this process) fails with ENOSPC."""
    fds = descriptors_of(path)
    assert len(fds) == 1, f"{path} is open {len(fds)} times"
    saved, full = os.dup(fds[0]), os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, fds[0])
    try:
        yield
    finally:
        os.dup2(saved, fds[0])
        os.close(saved)
        os.close(full)


def assert_in_file(event: QueryEvent, path: Path) -> None:
    if kept(event):
        assert event.uuid in logged_uuids(path), f"{event!r} reached the consumer, its record did not reach the file"


async def next_query_writes_what_was_buffered(session: Session, path: Path) -> list[TranscriptMessage]:
    """With room again, the session's next query completes, its first write takes what a full disk left
    buffered, and the file then holds the whole conversation in order. The session is closed after."""
    third = session.query("Three")
    await consumed(third, path)
    assert third.result is not None
    assert third.result.subtype == "success"
    assert third.result.result == "Second."
    transcript = await session.transcript()
    await session.close()
    loaded = load_transcript(path)
    assert loaded.problems == []
    assert loaded.messages == transcript
    return transcript


def test_the_waits_for_room_start_at_50_ms_double_up_to_2_s_and_add_up_to_the_bound() -> None:
    delays = list(backoff_delays(10.0))
    assert delays[:7] == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0])
    assert max(delays) == MAX_RETRY_S
    assert sum(delays) == pytest.approx(10.0)
    assert list(backoff_delays(0.0)) == []
    assert list(backoff_delays(0.12)) == pytest.approx([0.05, 0.07])


def test_only_no_space_and_a_quota_reached_count_as_a_full_disk() -> None:
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EIO, "Input/output error"))
    assert not is_disk_full(OSError(errno.EBADF, "Bad file descriptor"))
    assert not is_disk_full(OSError("no errno"))


def test_the_disk_error_names_the_file_and_the_os_error() -> None:
    text = disk_error_text(Path("/var/t.jsonl"), OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert "/var/t.jsonl" in text
    assert "No space left on device" in text


class Writes:
    """An attempt that fails with each of `errors` in turn, then succeeds."""

    def __init__(self, *errors: OSError) -> None:
        self.errors = list(errors)
        self.tries = 0

    async def __call__(self) -> None:
        self.tries += 1
        if self.errors:
            raise self.errors.pop(0)


FULL = OSError(errno.ENOSPC, "No space left on device")


async def test_a_retry_while_full_returns_as_soon_as_a_try_succeeds(autojump_clock: trio.testing.MockClock) -> None:
    attempt = Writes(FULL, FULL)
    await retry_while_full(attempt, FULL, bound_s=60.0)
    assert attempt.tries == 3
    assert trio.current_time() == pytest.approx(0.05 + 0.1 + 0.2)


async def test_a_retry_while_full_raises_the_full_disk_once_the_waits_reach_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    attempt = Writes(*[FULL] * 1000)
    with pytest.raises(OSError) as failed:
        await retry_while_full(attempt, FULL, bound_s=5.0)
    assert failed.value.errno == errno.ENOSPC
    assert trio.current_time() == pytest.approx(5.0)
    assert attempt.tries == len(list(backoff_delays(5.0)))


async def test_a_retry_while_full_raises_any_other_error_at_once(autojump_clock: trio.testing.MockClock) -> None:
    attempt = Writes()
    with pytest.raises(OSError) as failed:
        await retry_while_full(attempt, OSError(errno.EIO, "Input/output error"))
    assert failed.value.errno == errno.EIO
    assert attempt.tries == 0
    attempt = Writes(FULL, OSError(errno.EBADF, "Bad file descriptor"))
    with pytest.raises(OSError) as failed:
        await retry_while_full(attempt, FULL)
    assert failed.value.errno == errno.EBADF
    assert attempt.tries == 2
    assert trio.current_time() == pytest.approx(0.05 + 0.1)


def test_a_failed_write_keeps_its_records_for_the_next_write(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    log = TranscriptLog(path, "s1")
    log.write()
    log.append(prompt := UserMessage(content="Fix the bug"))
    with disk_full(path), pytest.raises(OSError, match="No space left") as failed:
        log.write()
    assert failed.value.errno == errno.ENOSPC
    log.write()  # the disk has room again
    log.close()
    assert load_transcript(path).messages == [prompt]
    assert load_transcript(path).problems == []


async def streamed_and_waiting_on_a_slow_tool(runtime: Runtime, path: Path) -> tuple[Session, QueryHandle]:
    """A query whose response is streamed, its blocks' events waiting for the consumer and their records in
    the log's buffer, while the loop waits on a tool that would run for an hour."""
    model = ScriptedModel([tools_reply(tool_use("t1", "slow"), text="Reading.")])
    session = await runtime.open_session(
        QueryOptions(provider=model, tools=[scripted_tool("slow", latency=3600)]), transcript=path
    )
    handle = session.query("Fix the bug")
    await trio.testing.wait_all_tasks_blocked()
    return session, handle


async def test_a_consumer_on_a_full_disk_waits_for_room_then_takes_every_event_with_its_record_in_the_file(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, handle = await streamed_and_waiting_on_a_slow_tool(runtime, path)
        received: list[QueryEvent] = []

        async def consume() -> None:
            async for event in handle:
                assert_in_file(event, path)
                received.append(event)
                if sum(isinstance(e, AssistantMessage) for e in received) == 2:
                    await session.abort("user")  # the slow tool would run for an hour

        async with trio.open_nursery() as nursery:
            with disk_full(path):
                nursery.start_soon(consume)
                await trio.sleep(10)  # the consumer's write fails all along: it waits, and takes nothing
                assert received == []
            # the disk has room again: the same events, each with its record written
        assert sum(isinstance(e, AssistantMessage) for e in received) == 2
        assert handle.result is not None
        transcript = await session.transcript()
        await session.close()
    loaded = load_transcript(path)
    assert loaded.problems == []
    assert loaded.messages == transcript


async def test_a_log_closed_on_a_full_disk_hands_the_consumer_no_event_whose_record_is_lost(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, handle = await streamed_and_waiting_on_a_slow_tool(runtime, path)
        with disk_full(path):
            await session.close()  # the log's last write fails: it closes with those records unwritten
        received: list[QueryEvent] = []
        with pytest.raises(OSError, match="could not write") as failed:
            async for event in handle:
                assert_in_file(event, path)
                received.append(event)
        assert failed.value.errno == errno.EIO
        assert isinstance(failed.value.__cause__, OSError)
        assert failed.value.__cause__.errno == errno.ENOSPC
        assert not any(isinstance(event, AssistantMessage) for event in received)
    assert load_transcript(path).problems == []


def two_replies() -> QueryOptions:
    return QueryOptions(provider=ScriptedModel([text_reply("First."), text_reply("Second.")]))


async def first_query_done(runtime: Runtime, path: Path) -> Session:
    session = await runtime.open_session(two_replies(), transcript=path)
    async for _ in session.query("One"):
        pass
    return session


async def consumed(handle: QueryHandle, path: Path | None = None) -> list[QueryEvent]:
    """Every event of `handle`, each checked to be in the file when it arrives (if `path`)."""
    received = []
    async for event in handle:
        if path is not None:
            assert_in_file(event, path)
        received.append(event)
    return received


def names_the_full_disk(errors: list[str], path: Path) -> bool:
    return any(str(path) in error and "No space left on device" in error for error in errors)


async def test_a_loop_whose_disk_has_room_again_within_the_bound_completes_its_query_with_every_event_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session = await first_query_done(runtime, path)
        handle = session.query("Two")
        received: list[QueryEvent] = []

        async def consume() -> None:
            received.extend(await consumed(handle, path))

        async with trio.open_nursery() as nursery:
            with disk_full(path):  # the prompt's write, before any request, fails: the loop waits for room
                nursery.start_soon(consume)
                await trio.sleep(DISK_FULL_WAIT_S / 2)
                assert received == []
                assert handle.result is None
        assert session.failure is None
        assert handle.result is not None
        assert handle.result.subtype == "success"
        assert handle.result.result == "Second."
        uuids = [event.uuid for event in received if kept(event)]
        assert len(uuids) == len(set(uuids)) == 1  # the reply, once
        transcript = await session.transcript()
        await session.close()
    loaded = load_transcript(path)
    assert loaded.problems == []
    assert loaded.messages == transcript
    assert [m.content for m in transcript if isinstance(m, UserMessage)] == ["One", "Two"]


async def test_a_disk_full_past_the_bound_ends_the_query_with_an_error_naming_the_disk_and_the_next_query_works(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session = await first_query_done(runtime, path)
        conversation = await session.transcript()
        started = trio.current_time()
        with disk_full(path):
            handle = session.query("Two")
            await consumed(handle)  # its events and its result, though the disk stays full
            assert trio.current_time() - started >= DISK_FULL_WAIT_S
            assert session.failure is None  # never ActorCrashed
        result = handle.result
        assert result is not None
        assert result.subtype == "error_during_execution"
        assert result.is_error
        assert names_the_full_disk(result.errors, path)
        assert handle.abort_reason is None
        assert load_transcript(path).messages == conversation  # its prompt is not in the file: it is still buffered
        transcript = await next_query_writes_what_was_buffered(session, path)  # room again
    assert [m.content for m in transcript if isinstance(m, UserMessage)] == ["One", "Two", "Three"]


async def test_an_abort_while_the_loop_waits_for_room_ends_the_query_aborted_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session = await first_query_done(runtime, path)
        with disk_full(path):
            handle = session.query("Two")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(consumed, handle)
                await trio.sleep(DISK_FULL_WAIT_S / 2)
                assert handle.result is None
                aborted = trio.current_time()
                await session.abort("user")
            assert trio.current_time() - aborted < FIRST_RETRY_S  # no retry waited for: the abort cut the wait
        result = handle.result
        assert result is not None
        assert result.subtype == "error_during_execution"
        assert handle.abort_reason == "user"
        assert handle.terminal is not None
        assert handle.terminal.reason == "aborted_streaming"
        assert names_the_full_disk(result.errors, path)  # its records are not in the file yet: it says so
        assert session.failure is None
        await next_query_writes_what_was_buffered(session, path)


async def test_an_abort_that_ends_its_query_in_its_own_call_on_a_full_disk_keeps_the_records_for_the_next_write(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, handle = await streamed_and_waiting_on_a_slow_tool(runtime, path)
        with disk_full(path):
            await session.abort("user")  # the loop waits on its turn: the abort ends the query in its own call
            received = await consumed(handle)
            assert session.failure is None
        assert sum(isinstance(e, AssistantMessage) for e in received) == 2
        assert handle.result is not None
        assert handle.result.subtype == "error_during_execution"
        assert handle.abort_reason == "user"
        assert names_the_full_disk(handle.result.errors, path)
        transcript = await session.transcript()
        await session.close()  # room again: its last write takes what the abort could not write
    loaded = load_transcript(path)
    assert loaded.problems == []
    assert loaded.messages == transcript


async def test_a_subagent_whose_disk_fills_mid_query_ends_with_its_parent_on_error_results_and_crashes_nothing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "t.jsonl"
    provider = ByPrompt(
        {
            "Review": [tools_reply(agent_call("call_a", "reviewer", "file a")), text_reply("Next.")],
            "file a": [text_reply("a: fine", latency_ms=1000)],
        }
    )
    reviewer = AgentDefinition(description="Reviews one file", prompt="You review code.")
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, agents={"reviewer": reviewer})
        session = await runtime.open_session(options, transcript=path)
        handle = session.query("Review")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumed, handle)
            await trio.sleep(0.5)  # the child's request is out: its answer, and every write after it, find no room
            with disk_full(path):
                await trio.sleep(4 * DISK_FULL_WAIT_S)
                assert handle.result is not None  # the child, then its parent, gave up on the disk
        assert session.failure is None
        assert handle.result.subtype == "error_during_execution"
        assert names_the_full_disk(handle.result.errors, path)
        again = session.query("Again")
        await consumed(again, path)
        assert again.result is not None
        assert again.result.result == "Next."
        transcript = await session.transcript()
        sidechains = await session.sidechains()
        await session.close()
    loaded = load_transcript(path)
    assert loaded.problems == []
    assert loaded.messages == transcript
    assert len(sidechains) == 1
    assert [[m.uuid for m in side.messages] for side in loaded.sidechains.values()] == [
        [m.uuid for m in side.messages] for side in sidechains.values()
    ]  # the child's records too, whole, once room came


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """While inside, every write to `path` (open once in this process) fails with EBADF: no room will end it."""
    fds = descriptors_of(path)
    assert len(fds) == 1, f"{path} is open {len(fds)} times"
    saved, reading = os.dup(fds[0]), os.open(path, os.O_RDONLY)
    os.dup2(reading, fds[0])
    try:
        yield
    finally:
        os.dup2(saved, fds[0])
        os.close(saved)
        os.close(reading)


async def test_a_write_failing_for_a_reason_room_cannot_end_ends_the_query_at_once_with_an_error_result(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session = await first_query_done(runtime, path)
        started = trio.current_time()
        with read_only(path):
            handle = session.query("Two")
            await consumed(handle)
        assert trio.current_time() == started  # not retried
        assert session.failure is None
        assert handle.result is not None
        assert handle.result.subtype == "error_during_execution"
        assert any(str(path) in error and "Bad file descriptor" in error for error in handle.result.errors)
        await next_query_writes_what_was_buffered(session, path)


async def test_a_session_whose_transcript_cannot_be_written_does_not_open_and_leaves_nothing_open() -> None:
    async with Runtime.open() as runtime:
        full = Path("/dev/full")
        before = len(descriptors_of(full))
        with pytest.raises(OSError) as failed:  # a file on a full disk: its first record cannot be written
            await runtime.open_session(QueryOptions(provider=ScriptedModel([])), transcript=full)
        assert failed.value.errno == errno.ENOSPC
        assert len(descriptors_of(full)) == before
        assert dict(runtime.groups) == {}
