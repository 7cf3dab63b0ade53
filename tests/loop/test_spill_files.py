"""A tool result over the budget is saved to a file whose name the project makes: a server's tool_use
id (`../../x`, `/tmp/x`) or a session id read from a transcript never becomes a path on disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from queryloop import QueryOptions, Runtime
from queryloop.runtime.loop.spill import (
    MAX_STEM,
    UnsafeSpillPath,
    safe_file_stem,
    spill_file_name,
    spill_path,
    write_spilled,
)
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import assert_settled, consume, scripted_tool, text_reply, tool_use, tools_reply

HOSTILE_IDS = ["../../escaped", "/tmp/queryloop-escaped", "..", "a/../../b", "toolu_\x00nul", ""]


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("tool_use_id", HOSTILE_IDS)
async def test_a_spilled_tool_result_is_saved_inside_the_session_folder_whatever_its_tool_use_id(
    tmp_path: Path, tool_use_id: str
) -> None:
    session_dir = tmp_path / "deep" / "session"
    big = "x" * 60_000
    model = ScriptedModel([tools_reply(tool_use(tool_use_id, "dump")), text_reply()])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=model, tools=[scripted_tool("dump", result=big)], session_dir=session_dir)
        )
        ran = await consume(session, session.query("Dump it"), model)
        await assert_settled(ran)
    saved = session_dir / "tool-results" / spill_file_name(tool_use_id)
    assert saved.read_text() == big
    assert _files_under(tmp_path) == {
        "deep",
        "deep/session",
        "deep/session/tool-results",
        f"deep/session/{saved.parent.name}/{saved.name}",
    }
    sent = model.requests[1].messages[-1]["content"][0]
    assert str(saved) in sent["content"] and big not in sent["content"]
    assert not _escaped_to_tmp()


def _escaped_to_tmp() -> bool:
    """Whether the absolute id's file was written where it names (the old code wrote it there)."""
    return Path("/tmp/queryloop-escaped.txt").exists()


def test_spill_file_names_are_made_by_the_project_and_differ_for_different_ids() -> None:
    names = {spill_file_name(i) for i in [*HOSTILE_IDS, "toolu_01", "toolu_02"]}
    assert len(names) == len(HOSTILE_IDS) + 2
    assert all(n.startswith("tool-result-") and n.endswith(".txt") and "/" not in n for n in names)
    assert spill_file_name("toolu_01") == spill_file_name("toolu_01")


def test_a_session_id_read_from_a_file_is_cleaned_before_it_names_a_folder() -> None:
    assert safe_file_stem("session-1_ok") == "session-1_ok"
    cleaned = {safe_file_stem(s) for s in ["../../x", "a/b", "a_b", "/etc/passwd", "", "é" * 300]}
    assert len(cleaned) == 6  # `a/b` and `a_b` stay apart
    for stem in cleaned:
        assert stem and len(stem) <= MAX_STEM and all(c.isascii() and (c.isalnum() or c in "_-") for c in stem)


def test_a_spill_path_through_a_symlink_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "tool-results"
    folder.mkdir()
    outside = tmp_path / "outside.txt"
    (folder / "planted.txt").symlink_to(outside)
    with pytest.raises(UnsafeSpillPath):
        spill_path(folder, "planted.txt")
    with pytest.raises(UnsafeSpillPath):
        spill_path(folder, "../outside.txt")
    # Even handed the symlink's own path, the write refuses to follow it.
    with pytest.raises(OSError):
        write_spilled(folder / "planted.txt", "secret")
    assert not outside.exists()
    assert spill_path(folder, "fine.txt") == folder.resolve() / "fine.txt"
    write_spilled(folder / "fine.txt", "ok")
    assert (folder / "fine.txt").read_text() == "ok" and (os.stat(folder / "fine.txt").st_mode & 0o077) == 0
