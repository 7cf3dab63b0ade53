"""The demo tools stay inside their root: traversal, absolute paths and symlinks out are refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from queryloop.runtime.cli.demo import confined, demo_tools
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError


async def _noop(tool_use_id: str, data: object) -> None:
    return None


def _tool(root: Path, name: str) -> Tool:
    return next(t for t in demo_tools(root) if t.name == name)


async def _call(root: Path, name: str, path: str) -> str:
    tool = _tool(root, name)
    output = await tool.run(tool.parse_input({"path": path}), ToolContext("t", _noop))
    assert isinstance(output, str)
    return output


async def test_a_file_inside_the_root_is_read(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("hello\nworld\n")
    assert await _call(tmp_path, "read_file", "a.txt") == "hello\nworld\n"
    assert await _call(tmp_path, "count_lines", "a.txt") == "2"
    assert await _call(tmp_path, "list_files", ".") == "a.txt"


@pytest.mark.parametrize("escape", ["../secret.txt", "sub/../../secret.txt", "/etc/passwd"])
async def test_paths_outside_the_root_are_refused(tmp_path: Path, escape: str) -> None:
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "secret.txt").write_text("do not read")
    for name in ("read_file", "count_lines", "list_files"):
        with pytest.raises(ToolError, match="outside the working directory"):
            await _call(root, name, escape)


async def test_a_symlink_pointing_outside_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("do not read")
    os.symlink(tmp_path / "secret.txt", root / "innocent.txt")
    os.symlink(tmp_path, root / "dir_link")
    with pytest.raises(ToolError):
        await _call(root, "read_file", "innocent.txt")
    with pytest.raises(ToolError):
        await _call(root, "read_file", "dir_link/secret.txt")


def test_a_symlink_inside_the_root_is_allowed(tmp_path: Path) -> None:
    (tmp_path / "real.txt").write_text("x")
    os.symlink(tmp_path / "real.txt", tmp_path / "alias.txt")
    assert confined(tmp_path, "alias.txt") == (tmp_path / "real.txt").resolve()
