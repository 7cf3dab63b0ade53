"""The demo tools stay inside their root and survive a hostile folder: traversal, absolute paths and
symlinks (even one swapped in while a tool runs) are refused, so are hard links and FIFOs; a huge file
costs what is shown, an abort abandons a stuck tool, and no result names the root's absolute path.

Each test runs twice: with the kernel resolving paths (`openat2`, where this kernel has it) and with
the component-by-component walk that stands in for it elsewhere. No sleeps: a test that a regression
would hang on a blocked thread has a guard that unblocks it later, so the regression fails instead.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from queryloop import Runtime
from queryloop.runtime.cli import confined, demo
from queryloop.runtime.cli.demo import READ_CHARS, demo_tools
from queryloop.runtime.loop.events import QueryEvent
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import open_session, run_query, text_reply, tool_use, tools_reply

FILE_TOOLS = ("read_file", "count_lines", "list_files")
GUARD_S = 30.0
"""How long a guard lets a regression block before it unblocks it (never reached when the code is right)."""


@pytest.fixture(params=[True, False], ids=["openat2", "walk"])
def use_openat2(request: pytest.FixtureRequest) -> bool:
    if request.param and not confined.openat2_available():
        pytest.skip("this kernel has no openat2")
    return bool(request.param)


async def _noop(tool_use_id: str, data: object) -> None:
    return None


def _tool(root: Path, name: str, use_openat2: bool = True) -> Tool:
    return next(t for t in demo_tools(root, use_openat2=use_openat2) if t.name == name)


async def _call(
    root: Path,
    name: str,
    path: str,
    use_openat2: bool = True,
    report: Callable[[str, Any], Awaitable[None]] = _noop,
) -> str:
    tool = _tool(root, name, use_openat2)
    output = await tool.run(tool.parse_input({"path": path}), ToolContext("t", report))
    assert isinstance(output, str)
    return output


async def test_a_file_inside_the_root_is_read(tmp_path: Path, use_openat2: bool) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("hello\nworld\n")
    assert await _call(tmp_path, "read_file", "sub/a.txt", use_openat2) == "hello\nworld\n"
    assert await _call(tmp_path, "read_file", "./sub/../sub/a.txt", use_openat2) == "hello\nworld\n"
    assert await _call(tmp_path, "count_lines", "sub/a.txt", use_openat2) == "2"
    assert await _call(tmp_path, "list_files", ".", use_openat2) == "sub"
    assert await _call(tmp_path, "list_files", "sub", use_openat2) == "a.txt"


@pytest.mark.parametrize("escape", ["../secret.txt", "sub/../../secret.txt", "/etc/passwd", ".."])
async def test_paths_outside_the_root_are_refused(tmp_path: Path, escape: str, use_openat2: bool) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("do not read")
    for name in FILE_TOOLS:
        with pytest.raises(ToolError, match="^" + re.escape(f"{escape!r} is outside the working directory") + "$"):
            await _call(root, name, escape, use_openat2)


async def test_a_symlink_is_never_followed_even_one_pointing_inside(tmp_path: Path, use_openat2: bool) -> None:
    root = tmp_path / "root"
    (root / "real").mkdir(parents=True)
    (root / "real" / "notes.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("do not read")
    os.symlink(tmp_path / "secret.txt", root / "innocent.txt")
    os.symlink(tmp_path, root / "dir_link")
    os.symlink("real/notes.txt", root / "alias.txt")
    os.symlink("real", root / "alias_dir")
    for path in ("innocent.txt", "dir_link/secret.txt", "alias.txt", "alias_dir/notes.txt"):
        for name in ("read_file", "count_lines"):
            with pytest.raises(ToolError, match="symbolic link"):
                await _call(root, name, path, use_openat2)
    for path in ("dir_link", "alias_dir"):
        with pytest.raises(ToolError, match="symbolic link"):
            await _call(root, "list_files", path, use_openat2)


def _plant(root: Path, outside: Path) -> None:
    """`root/sub/notes.txt` and `root/notes.txt`, beside an `outside` folder holding a secret of the same name."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "notes.txt").write_text("inside\n")
    (root / "notes.txt").write_text("inside\n")
    outside.mkdir(exist_ok=True)
    (outside / "notes.txt").write_text("the secret\n")


@pytest.mark.parametrize("path", ["sub/notes.txt", "notes.txt"])
async def test_a_name_swapped_for_a_symlink_while_the_tool_runs_is_refused(
    tmp_path: Path, use_openat2: bool, path: str
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    swapped = root / path.split("/", maxsplit=1)[0]  # the folder `sub`, or the file itself

    async def swap_while_pacing(tool_use_id: str, data: object) -> None:
        # The tool's pacing reports progress after it has looked at the path and before it reads:
        # the race a hostile folder would try to win, won here every time.
        if not swapped.is_symlink():
            (shutil.rmtree if swapped.is_dir() else os.remove)(swapped)
            os.symlink(outside / "notes.txt" if swapped.name == "notes.txt" else outside, swapped)

    for name in FILE_TOOLS:
        _plant(root, outside)
        target = "sub" if name == "list_files" and path.startswith("sub/") else path
        with pytest.raises(ToolError, match="symbolic link"):
            await _call(root, name, target, use_openat2, report=swap_while_pacing)
        assert swapped.is_symlink()  # the swap did happen, and it was refused


async def test_a_hard_link_is_refused(tmp_path: Path, use_openat2: bool) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("do not read\n")
    os.link(tmp_path / "secret.txt", root / "linked.txt")  # inside the folder, the same file as outside it
    for name in ("read_file", "count_lines"):
        with pytest.raises(ToolError, match=r"^'linked\.txt' has more than one hard link$"):
            await _call(root, name, "linked.txt", use_openat2)


@pytest.fixture
def fifo_guard(tmp_path: Path) -> Iterator[list[str]]:
    """A FIFO `tmp_path/fifo`, and a guard that comes as its writer every `GUARD_S` until the test ends:
    a tool blocked on opening it (the old behaviour) is released then, and the guard says so."""
    os.mkfifo(tmp_path / "fifo")
    found_a_reader_waiting: list[str] = []
    stop = threading.Event()

    def write_now_and_then() -> None:
        while not stop.wait(GUARD_S):
            try:
                # Non-blocking: this open succeeds only when a reader is in the FIFO, e.g. blocked opening it.
                os.close(os.open(tmp_path / "fifo", os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                continue
            found_a_reader_waiting.append("a reader was waiting for a writer")

    guard = threading.Thread(target=write_now_and_then, daemon=True)
    guard.start()
    yield found_a_reader_waiting
    stop.set()
    guard.join()


async def test_a_fifo_is_refused_without_waiting_for_a_writer(
    tmp_path: Path, use_openat2: bool, fifo_guard: list[str]
) -> None:
    model = ScriptedModel(
        [
            tools_reply(*(tool_use(f"t_{name}", name, {"path": "fifo"}) for name in FILE_TOOLS)),
            text_reply("Done."),
        ]
    )
    async with Runtime.open() as runtime:
        session = await open_session(runtime, model, tools=demo_tools(tmp_path, use_openat2=use_openat2))
        handle = session.query("read the fifo")
        events: list[QueryEvent] = [event async for event in handle]
        await session.close()
    assert fifo_guard == []  # no tool waited for a writer
    assert handle.terminal is not None and handle.terminal.reason == "completed", events[-1]
    results = {name: _results(events)[f"t_{name}"] for name in FILE_TOOLS}
    assert "'fifo' is not a regular file" in results["read_file"]
    assert "'fifo' is not a regular file" in results["count_lines"]
    assert "'fifo' is not a directory" in results["list_files"]


def _results(events: list[QueryEvent]) -> dict[str, str]:
    found: dict[str, str] = {}
    for event in events:
        content = getattr(event, "content", None)
        if getattr(event, "type", "") == "user" and isinstance(content, list):
            found.update({b["tool_use_id"]: str(b["content"]) for b in content if b.get("type") == "tool_result"})
    return found


async def test_a_huge_file_costs_what_is_shown(tmp_path: Path, use_openat2: bool) -> None:
    big = tmp_path / "big.txt"
    with big.open("wb") as file:
        file.write(b"first line\n" * 1000)
        file.truncate(64 * 1024 * 1024)  # sparse: 64 MiB on the file system's word, little on its disk
    tracemalloc.start()
    try:
        shown = await _call(tmp_path, "read_file", "big.txt", use_openat2)
        counted = await _call(tmp_path, "count_lines", "big.txt", use_openat2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(shown) == READ_CHARS and shown.startswith("first line\n")
    assert counted == "1000"
    assert peak < 4 * 1024 * 1024, f"{peak:,} bytes allocated at the peak, to read a 64 MiB file"


async def test_an_abort_abandons_a_file_tool_stuck_in_its_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a.txt").write_text("a\n")
    started, release = threading.Event(), threading.Event()

    def stuck(fd: int, chars: int) -> str:  # a read that blocks, as one of a hung network file system would
        started.set()
        release.wait()
        return "late"

    monkeypatch.setattr(confined, "read_head", stuck)
    guard = threading.Timer(GUARD_S, release.set)  # a regression (waiting for the thread) fails, not hangs
    guard.start()
    try:
        async with Runtime.open() as runtime:
            model = ScriptedModel([tools_reply(tool_use("t1", "read_file", {"path": "a.txt"})), text_reply("no")])
            session = await open_session(runtime, model, tools=demo_tools(tmp_path))
            handle = session.query("read it")
            events: list[QueryEvent] = []

            async def consume() -> None:
                events.extend([event async for event in handle])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                assert await trio.to_thread.run_sync(started.wait, GUARD_S)
                session.abort_nowait("user")
            await session.close()
            closed_while_stuck = not release.is_set()
    finally:
        release.set()
        guard.cancel()
    assert closed_while_stuck, "the abort waited for the tool's thread"
    assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"


async def test_no_result_shows_the_working_directory(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, use_openat2: bool, fifo_guard: list[str]
) -> None:
    root, outside = tmp_path, tmp_path_factory.mktemp("outside")  # the fixture's FIFO is in the root
    (root / "sub").mkdir()
    (root / "sub" / "a.txt").write_text("a\n")
    (outside / "secret.txt").write_text("do not read\n")
    os.link(outside / "secret.txt", root / "linked.txt")
    os.symlink(outside, root / "up")
    paths = ["missing.txt", "sub/missing/a.txt", "sub/a.txt/x", "sub", "fifo", "linked.txt", "up/secret.txt"]
    paths += ["../secret.txt", "/etc/passwd", "a\0b", "\udcff", "x" * 300]
    uses = [tool_use(f"t{i}_{name}", name, {"path": p}) for i, p in enumerate(paths) for name in FILE_TOOLS]
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime, [tools_reply(*uses), text_reply()], tools=demo_tools(root, use_openat2=use_openat2)
        )
    results = ran.tool_results()
    assert len(results) == len(uses)
    for block in results.values():
        for shown in {str(root), str(root.resolve()), str(outside), str(outside.resolve())}:
            assert shown not in str(block["content"]), block
    assert {key for key, block in results.items() if not block["is_error"]} == {"t3_list_files"}
    assert "'missing.txt' does not exist" in results["t0_read_file"]["content"]
    assert "'sub' is a directory, not a file" in results["t3_read_file"]["content"]
    assert fifo_guard == []


async def test_a_name_that_would_pass_for_two_entries_is_listed_as_one(tmp_path: Path, use_openat2: bool) -> None:
    (tmp_path / "plain.txt").touch()
    (tmp_path / "two\nentries").touch()
    (tmp_path / os.fsdecode(b"stray\xff")).touch()  # a byte that is no UTF-8: a lone surrogate in Python
    listed = (await _call(tmp_path, "list_files", ".", use_openat2)).splitlines()
    assert sorted(listed) == sorted(["plain.txt", "'two\\nentries'", "'stray\\udcff'"])
    "\n".join(listed).encode("utf-8")  # sendable: a lone surrogate would raise here


async def test_a_count_cut_short_by_its_limit_says_so(
    tmp_path: Path, use_openat2: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "long.txt").write_text("line\n" * 100)
    monkeypatch.setattr(demo, "COUNT_BYTES", 50)
    counted = await _call(tmp_path, "count_lines", "long.txt", use_openat2)
    assert counted == "at least 10 (counted in its first 50 bytes only)"
