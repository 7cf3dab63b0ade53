"""A real full disk: sessions whose transcripts live on a small tmpfs that a filler file has filled.

Needs root to mount the tmpfs (CI runs as root); skipped, saying why, where it cannot mount one. Runs on
trio's real clock (the kernel's ENOSPC, not a mock), every wait bounded by `trio.fail_after`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from queryloop import Runtime, Session
from queryloop.runtime.loop.events import ResultMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import text_reply

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mounts a Linux tmpfs")

QUERIES = 3
PROMPT_BYTES = 6000
"""Longer than a page: its record needs pages the full tmpfs does not have (not only the tail of one)."""


@contextlib.contextmanager
def small_tmpfs(directory: Path) -> Iterator[Path]:
    """`directory`, a fresh 64 KiB tmpfs while inside."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the tests as root)")
    directory.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(directory)], capture_output=True, text=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], check=True)  # still busy (a failed test): detach it


def fill(path: Path) -> None:
    """Write `path` until its disk is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                os.write(fd, b"\0" * 4096)
            except OSError as error:
                if error.errno == errno.ENOSPC:
                    return
                raise
    finally:
        os.close(fd)


async def test_queries_on_a_full_tmpfs_all_end_with_a_result_once_there_is_room_and_their_transcripts_load_whole(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "disk") as disk, trio.fail_after(30):
        paths = [disk / "a.jsonl", disk / "b.jsonl"]
        results: dict[tuple[int, int], ResultMessage] = {}

        async def run_queries(n: int, session: Session) -> None:
            for i in range(QUERIES):
                results[n, i] = await session.query(f"{i} " + "x" * PROMPT_BYTES).wait()

        async with Runtime.open() as runtime:
            sessions = []
            for path in paths:
                replies = ScriptedModel([text_reply(f"Reply {i}.") for i in range(QUERIES)])
                sessions.append(await runtime.open_session(QueryOptions(provider=replies), transcript=path))
            filler = disk / "filler"
            fill(filler)
            async with trio.open_nursery() as nursery:
                for n, session in enumerate(sessions):
                    nursery.start_soon(run_queries, n, session)
                await trio.sleep(0.3)
                assert results == {}  # every first prompt waits for room
                filler.unlink()  # room
            assert all(session.failure is None for session in sessions)
            transcripts = [await session.transcript() for session in sessions]
            for session in sessions:
                await session.close()
        assert sorted(results) == [(n, i) for n in range(len(paths)) for i in range(QUERIES)]
        for (_, i), result in results.items():
            assert result.subtype == "success"
            assert result.result == f"Reply {i}."
        for path, transcript in zip(paths, transcripts, strict=True):
            loaded = load_transcript(path)
            assert loaded.problems == []
            assert loaded.messages == transcript
            assert len(transcript) == 2 * QUERIES
