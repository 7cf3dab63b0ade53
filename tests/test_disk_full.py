"""A transcript on a full disk: the write fails, nothing is lost, and the consumer takes no event the file lacks.

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

from queryloop import QueryHandle, Runtime, Session
from queryloop.actors.query_loop.run import TRANSCRIPT_TYPES
from queryloop.runtime.errors import ActorCrashed
from queryloop.runtime.loop.events import AssistantMessage, QueryEvent, UserMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.persistence import TranscriptLog
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import logged_uuids, scripted_tool, text_reply, tool_use, tools_reply

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
    if isinstance(event, TRANSCRIPT_TYPES):
        assert event.uuid in logged_uuids(path), f"{event!r} reached the consumer, its record did not reach the file"


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


async def test_a_consumer_told_the_disk_is_full_takes_every_event_once_the_disk_has_room(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session, handle = await streamed_and_waiting_on_a_slow_tool(runtime, path)
        with disk_full(path), pytest.raises(OSError) as failed:
            await handle.__anext__()
        assert failed.value.errno == errno.ENOSPC
        received = 0
        async for event in handle:  # the disk has room again: the same events, each with its record written
            assert_in_file(event, path)
            if isinstance(event, AssistantMessage):
                received += 1
                if received == 2:
                    await session.abort("user")  # the slow tool would run for an hour
        assert received == 2
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


async def test_a_loop_whose_own_write_fails_crashes_its_session_and_the_file_resumes_once_the_disk_has_room(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    options = QueryOptions(provider=ScriptedModel([text_reply("First."), text_reply("Second.")]))
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options, transcript=path)
        async for _ in session.query("One"):
            pass
        kept = await session.transcript()
        with disk_full(path), pytest.raises(ActorCrashed) as crashed:
            async for _ in session.query("Two"):  # the prompt's write, before any request, fails
                pass
        assert isinstance(crashed.value.error, OSError)
        assert crashed.value.error.errno == errno.ENOSPC
        await session.close()
        loaded = load_transcript(path)
        assert loaded.problems == []
        assert loaded.messages == kept
        resumed = await runtime.open_session(options, resume=path)
        assert await resumed.transcript() == kept
        handle = resumed.query("Two")
        async for _ in handle:
            pass
        assert handle.result is not None
        assert handle.result.result == "Second."
        await resumed.close()


async def test_a_session_whose_transcript_cannot_be_written_does_not_open_and_leaves_nothing_open() -> None:
    async with Runtime.open() as runtime:
        full = Path("/dev/full")
        before = len(descriptors_of(full))
        with pytest.raises(OSError) as failed:  # a file on a full disk: its first record cannot be written
            await runtime.open_session(QueryOptions(provider=ScriptedModel([])), transcript=full)
        assert failed.value.errno == errno.ENOSPC
        assert len(descriptors_of(full)) == before
        assert dict(runtime.groups) == {}
