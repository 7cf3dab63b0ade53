"""Confined file access (`queryloop.runtime.cli.confined`): what it opens, which way it resolves a
path (the kernel's `openat2`, or the walk where the kernel has none), and how little it reads."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queryloop.runtime.cli import confined
from queryloop.runtime.cli.confined import Refused, components, count_newlines, list_names, open_beneath, read_head


@pytest.fixture(params=[True, False], ids=["openat2", "walk"])
def use_openat2(request: pytest.FixtureRequest) -> bool:
    if request.param and not confined.openat2_available():
        pytest.skip("this kernel has no openat2")
    return bool(request.param)


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The paths `open_beneath` walks component by component from now on (not those the kernel resolves)."""
    walked: list[list[str]] = []
    real = confined._walk

    def recording(root_fd: int, names: list[str], flags: int) -> int:
        walked.append(names)
        return real(root_fd, names, flags)

    monkeypatch.setattr(confined, "_walk", recording)
    return walked


def _kernel_answering(code: int) -> Callable[..., int]:
    """A stand-in for libc's `syscall` on a kernel (or behind a seccomp filter) answering `code` to openat2."""

    def syscall(*args: Any) -> int:
        ctypes.set_errno(code)
        return -1

    return syscall


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a\nb\n")
    os.symlink("sub", tmp_path / "sub_link")
    yield tmp_path


def _read(root: Path, relative: str, use_openat2: bool = True) -> str:
    fd = open_beneath(root, relative, use_openat2=use_openat2)
    try:
        return read_head(fd, 100)
    finally:
        os.close(fd)


def test_components_apply_dotdot_by_name_and_refuse_climbing_out() -> None:
    assert components("") == components(".") == components("./") == []
    assert components("a/./b//c/") == ["a", "b", "c"]
    assert components("a/../b") == ["b"]
    for outside in ("..", "../a", "a/../..", "/", "/etc/passwd", "a/../../a"):
        with pytest.raises(Refused, match="is outside the working directory"):
            components(outside)


@pytest.mark.parametrize("path", ["a\0b", "\ud800"])
def test_a_path_no_file_name_can_hold_is_refused(tmp_path: Path, path: str) -> None:
    with pytest.raises(Refused, match=r"is not a valid path"):
        open_beneath(tmp_path, path)


@pytest.mark.skipif(not confined.openat2_available(), reason="this kernel has no openat2")
def test_the_kernel_resolves_the_path_where_it_has_openat2(tree: Path, walks: list[list[str]]) -> None:
    assert _read(tree, "sub/a.txt") == "a\nb\n"
    with pytest.raises(Refused, match="symbolic link"):
        _read(tree, "sub_link/a.txt")
    assert walks == []


@pytest.mark.parametrize("answer", [errno.ENOSYS, errno.EPERM], ids=["no_such_call", "seccomp_refuses"])
def test_without_openat2_the_path_is_walked_following_no_symlink(
    tree: Path, walks: list[list[str]], monkeypatch: pytest.MonkeyPatch, answer: int
) -> None:
    monkeypatch.setattr(confined, "_openat2_syscall", lambda: _kernel_answering(answer))
    assert not confined.openat2_available()
    assert _read(tree, "sub/a.txt") == "a\nb\n"
    with pytest.raises(Refused, match="symbolic link"):
        _read(tree, "sub_link/a.txt")
    assert walks == [["sub", "a.txt"], ["sub_link", "a.txt"]]


def test_asked_to_walk_it_walks_even_where_the_kernel_could_resolve(tree: Path, walks: list[list[str]]) -> None:
    assert _read(tree, "sub/a.txt", use_openat2=False) == "a\nb\n"
    assert walks == [["sub", "a.txt"]]


def test_a_symlink_at_any_component_is_refused(tree: Path, use_openat2: bool) -> None:
    os.symlink("a.txt", tree / "sub" / "last_link")
    for path in ("sub_link/a.txt", "sub/last_link", "sub_link"):
        with pytest.raises(Refused, match="^" + re.escape(f"{path!r} is, or passes through, a symbolic link")):
            _read(tree, path, use_openat2)
    with pytest.raises(Refused, match="symbolic link"):
        open_beneath(tree, "sub_link", directory=True, use_openat2=use_openat2)


def test_only_a_regular_file_or_a_directory_is_opened(tree: Path, use_openat2: bool) -> None:
    os.mkfifo(tree / "fifo")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(tree / "socket"))
        for path in ("fifo", "socket"):
            with pytest.raises(Refused, match="^" + re.escape(f"{path!r} is not a regular file") + "$"):
                open_beneath(tree, path, use_openat2=use_openat2)
            with pytest.raises(Refused, match="^" + re.escape(f"{path!r} is not a directory") + "$"):
                open_beneath(tree, path, directory=True, use_openat2=use_openat2)
    with pytest.raises(Refused, match=r"^'sub' is a directory, not a file$"):
        open_beneath(tree, "sub", use_openat2=use_openat2)
    fd = open_beneath(tree, "sub", directory=True, use_openat2=use_openat2)
    try:
        assert list_names(fd, 10) == (["a.txt"], False)
    finally:
        os.close(fd)


def test_a_file_with_a_second_hard_link_is_refused(tree: Path, use_openat2: bool) -> None:
    os.link(tree / "sub" / "a.txt", tree / "b.txt")
    for path in ("b.txt", "sub/a.txt"):
        with pytest.raises(Refused, match="^" + re.escape(f"{path!r} has more than one hard link") + "$"):
            open_beneath(tree, path, use_openat2=use_openat2)


def test_reading_the_head_of_a_huge_file_reads_four_bytes_a_character_at_most(tmp_path: Path) -> None:
    with (tmp_path / "big").open("wb") as file:
        file.write("é".encode() * 10)
        file.truncate(64 * 1024 * 1024)
    fd = open_beneath(tmp_path, "big")
    try:
        head = read_head(fd, 2000)
        read = os.lseek(fd, 0, os.SEEK_CUR)
    finally:
        os.close(fd)
    assert head == "é" * 10 + "\0" * 1990
    assert read <= 4 * 2000


def test_a_character_cut_by_the_reading_budget_is_held_back_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "euros").write_text("a" + "€" * 10)  # the budget (4 bytes a character) ends inside a €
    fd = open_beneath(tmp_path, "euros")
    try:
        assert read_head(fd, 3) == "a€€"
        assert os.lseek(fd, 0, os.SEEK_CUR) == 12  # a, three €, and two bytes of the fourth: held back
    finally:
        os.close(fd)


def test_undecodable_bytes_are_shown_as_replacement_characters(tmp_path: Path) -> None:
    (tmp_path / "bytes").write_bytes(b"ok \xff\xfe end")
    assert _read(tmp_path, "bytes") == "ok \ufffd\ufffd end"


def test_counting_stops_at_its_limit_and_says_the_count_is_partial(tmp_path: Path) -> None:
    (tmp_path / "lines").write_bytes(b"\n" * (3 * confined.COUNT_CHUNK))
    fd = open_beneath(tmp_path, "lines")
    try:
        assert count_newlines(fd, 10) == (10, False)
        os.lseek(fd, 0, os.SEEK_SET)
        assert count_newlines(fd, 3 * confined.COUNT_CHUNK) == (3 * confined.COUNT_CHUNK, True)
    finally:
        os.close(fd)


def test_an_abandoned_count_stops_at_its_next_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "lines").write_bytes(b"\n" * (8 * confined.COUNT_CHUNK))
    checkpoints: list[int] = []

    class Abandoned(Exception):
        pass

    def abandoned_after_the_first_chunk() -> None:
        checkpoints.append(1)
        if len(checkpoints) > 1:
            raise Abandoned

    fd = open_beneath(tmp_path, "lines")
    try:
        with pytest.raises(Abandoned):
            count_newlines(fd, 1 << 30, abandoned_after_the_first_chunk)
        assert os.lseek(fd, 0, os.SEEK_CUR) == confined.COUNT_CHUNK  # one chunk read, no more
    finally:
        os.close(fd)


def test_a_listing_reads_at_most_one_entry_more_than_it_shows(tmp_path: Path) -> None:
    for number in range(50):
        (tmp_path / f"f{number:02}").touch()
    fd = open_beneath(tmp_path, ".", directory=True)
    try:
        names, more = list_names(fd, 10)
    finally:
        os.close(fd)
    assert more and len(names) == 10 and names == sorted(names)
    assert set(names) <= {f"f{number:02}" for number in range(50)}
