"""One file, one session: a transcript file holds one session's records, and only one open log writes it.

A session holds an OS lock (`flock`) on its file while its log is open: another session, of this runtime
or of another process (a real one, here), is refused with `TranscriptInUse`. A file that holds a session,
open or closed, is refused to a new session (`TranscriptHoldsAnotherSession`): `resume=` goes on with it,
`fork=True` branches it into a new file. Before, such a file was appended to under the first session's id,
and resuming it sent the model both conversations.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import sys
from pathlib import Path

import pytest
import trio

from queryloop import Runtime
from queryloop.runtime.errors import TranscriptHoldsAnotherSession, TranscriptInUse, TranscriptRefused
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.persistence import TranscriptLog
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.providers.scripted import ScriptedModel
from tests import helpers
from tests.helpers import text_reply

ROOT = helpers.REPO

CHILD = """
import sys
from pathlib import Path

import trio

from queryloop import Runtime
from queryloop.runtime.errors import TranscriptRefused
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.providers.scripted import ScriptedModel


async def main(path, how):
    model = ScriptedModel([{"content": [{"type": "text", "text": "Still here."}]}])
    async with Runtime.open() as runtime:
        try:
            session = await runtime.open_session(QueryOptions(provider=model), **{how: path})
        except TranscriptRefused as refused:
            print("refused", type(refused).__name__, refused.session_id)
            return
        result = await session.query("Go on").wait()
        print("opened", session.id, result.result, len(model.requests[0].messages))


trio.run(main, Path(sys.argv[1]), sys.argv[2])
"""


def options(*replies: str) -> QueryOptions:
    return QueryOptions(provider=ScriptedModel([text_reply(text) for text in replies] or [text_reply()]))


def locked(path: Path) -> bool:
    """Whether an open log holds `path`'s lock: a fresh open file description tries to take it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the probe's own lock, if it took it
    return False


async def in_another_process(path: Path, how: str) -> list[str]:
    """A real second process opens a session on `path` (`how`: "transcript" or "resume"); what it reports."""
    done = await trio.run_process(
        [sys.executable, "-c", CHILD, str(path), how], cwd=ROOT, capture_stdout=True, capture_stderr=True, check=False
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return done.stdout.decode().split()


async def closed_session_file(runtime: Runtime, path: Path, prompt: str = "The code is 42.") -> str:
    """A session that ran one query in `path`, then closed; its id."""
    session = await runtime.open_session(options("Noted."), transcript=path)
    await session.query(prompt).wait()
    await session.close()
    return session.id


async def test_a_second_session_of_the_same_runtime_is_refused_the_file_an_open_session_holds(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        first = await runtime.open_session(options(), transcript=path)
        before = path.read_bytes()
        with pytest.raises(TranscriptInUse) as refused:
            await runtime.open_session(options(), transcript=path)
        assert refused.value.session_id == first.id
        assert str(path) in str(refused.value) and repr(first.id) in str(refused.value)
        assert path.read_bytes() == before  # not a byte of the refused session
        assert list(runtime.groups) == [first.id]  # and no group left behind
        await first.close()


async def test_a_second_process_is_refused_while_the_first_holds_the_file_and_resumes_it_once_closed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options("Noted."), transcript=path)
        await session.query("The code is 42.").wait()
        assert await in_another_process(path, "transcript") == ["refused", "TranscriptInUse", session.id]
        assert await in_another_process(path, "resume") == ["refused", "TranscriptInUse", session.id]
        await session.close()
    # Closed: the other process goes on with the same session, and sends its conversation alone.
    assert await in_another_process(path, "resume") == ["opened", session.id, "Still", "here.", "3"]
    assert await in_another_process(path, "transcript") == ["refused", "TranscriptHoldsAnotherSession", session.id]


async def test_transcript_on_a_closed_sessions_file_is_refused_naming_it_and_resume_goes_on_with_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        first = await closed_session_file(runtime, path)
        before = path.read_bytes()
        with pytest.raises(TranscriptHoldsAnotherSession) as refused:
            await runtime.open_session(options(), transcript=path)
        assert refused.value.session_id == first
        message = str(refused.value)
        assert str(path) in message and repr(first) in message
        assert "resume=" in message and "fork=True" in message  # what to do instead
        assert path.read_bytes() == before
        assert dict(runtime.groups) == {}
        model = ScriptedModel([text_reply("It is 42.")])
        resumed = await runtime.open_session(QueryOptions(provider=model), resume=path)
        assert resumed.id == first
        await resumed.query("What is the code?").wait()
        assert len(model.requests[0].messages) == 3  # its own conversation, and nothing else
        await resumed.close()
    loaded = load_transcript(path)
    assert loaded.session_id == first and loaded.problems == []


@pytest.mark.parametrize("fork", [True, False], ids=["fork", "resume_into_another_file"])
async def test_going_on_into_a_file_that_holds_another_session_is_refused(tmp_path: Path, fork: bool) -> None:
    source, other = tmp_path / "source.jsonl", tmp_path / "other.jsonl"
    async with Runtime.open() as runtime:
        await closed_session_file(runtime, source)
        held = await closed_session_file(runtime, other, "Something else.")
        before = other.read_bytes(), source.read_bytes()
        with pytest.raises(TranscriptHoldsAnotherSession) as refused:
            await runtime.open_session(options(), resume=source, transcript=other, fork=fork)
        assert refused.value.session_id == held
        assert (other.read_bytes(), source.read_bytes()) == before
        assert dict(runtime.groups) == {}


async def test_a_fork_into_a_new_file_still_branches_with_an_id_of_its_own(tmp_path: Path) -> None:
    source, branch = tmp_path / "source.jsonl", tmp_path / "branch.jsonl"
    async with Runtime.open() as runtime:
        first = await closed_session_file(runtime, source)
        forked = await runtime.open_session(options(), resume=source, transcript=branch, fork=True)
        assert forked.id != first
        assert locked(branch) and not locked(source)  # the fork holds its own file; it only read the source
        await forked.close()
    assert load_transcript(branch).session_id == forked.id
    assert load_transcript(source).session_id == first


async def test_an_empty_existing_file_is_taken_and_held_as_a_new_sessions_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.touch()
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options(), transcript=path)
        assert locked(path)
        await session.query("Hello").wait()
        await session.close()
    loaded = load_transcript(path)
    assert loaded.session_id == session.id and loaded.problems == []


async def test_the_lock_is_held_while_the_session_is_open_and_released_on_close_and_on_runtime_exit(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options(), transcript=path)
        assert locked(path)
        await session.close()
        assert not locked(path)
        resumed = await runtime.open_session(options(), resume=path)
        assert resumed.id == session.id
        assert locked(path)
        # Left open: the runtime's exit closes it.
    assert not locked(path)
    async with Runtime.open() as runtime:
        again = await runtime.open_session(options(), resume=path)
        assert again.id == session.id
        await again.close()


def test_two_logs_opening_one_new_file_cannot_both_take_it(tmp_path: Path) -> None:
    """The first takes the lock before it looks: the second is refused though the file is still empty."""
    path = tmp_path / "t.jsonl"
    first = TranscriptLog(path, "s-1")
    assert path.read_bytes() == b""  # nothing written yet: only the lock says the file is taken
    with pytest.raises(TranscriptInUse):
        TranscriptLog(path, "s-2")
    first.close()
    assert load_transcript(path).session_id == "s-1"


@pytest.mark.parametrize(
    "head",
    [
        b"\xff\xfe\x00 not text\n",
        b"[" * 3000 + b"\n",  # nested past the JSON parser's depth
        b"x" * 10_000,  # one long line, no newline
        b'{"type":"user","content":"no session record first"}\n',
        b'{"type":"session","session_id":42,"version":2}\n',
        b'"a string"\n',
        b"\n",
    ],
    ids=["bytes", "deep", "long", "message_first", "id_not_a_string", "not_a_record", "blank"],
)
async def test_a_file_whose_first_line_is_no_session_record_is_refused_to_a_new_session(
    tmp_path: Path, head: bytes
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(head + b'{"type":"user","content":"hello"}\n')
    before = path.read_bytes()
    async with Runtime.open() as runtime:
        with pytest.raises(TranscriptHoldsAnotherSession) as refused:
            await runtime.open_session(options(), transcript=path)
        assert refused.value.session_id is None
        assert "could not be read" in str(refused.value)
        assert dict(runtime.groups) == {}
    assert path.read_bytes() == before
    assert not locked(path)


@pytest.mark.parametrize("error", [TranscriptInUse("t.jsonl", "ab-1"), TranscriptHoldsAnotherSession("t.jsonl", None)])
def test_a_refusal_crosses_a_process_boundary_whole(error: TranscriptRefused) -> None:
    """A Ray shard's refusal reaches the driver as itself: its type, file, session id and message."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error)
    assert (again.path, again.session_id, str(again)) == (error.path, error.session_id, str(error))
