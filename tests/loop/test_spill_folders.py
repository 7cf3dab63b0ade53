"""Spill folders belong to their session: a temporary one the runtime made is removed with its session
(its close, the runtime's exit, a crash), a host's folder is kept, a durable session spills beside its
transcript (kept, and written to again on resume), a subagent spills in its session's folder, and an MCP
server's temporary results folder goes when the runtime closes.

A result is spilled by the session's own budget when it is over `max_tool_result_chars` (50,000 by
default): the model's next request holds `Full output saved to: <path>`, read back here."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import trio

from queryloop import AgentDefinition, McpStdioServer, QueryOptions, Runtime, ScriptedModel
from queryloop.lowlevel import TrioActor
from queryloop.runtime.host.runtime import _session_dir
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.spill import remove_spill_folder, spill_file_name
from queryloop.runtime.mcp.limits import LargeResults
from tests import helpers
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import Ran, assert_settled, consume, scripted_tool, text_reply, tool_use, tools_reply

BIG = "spilled line\n" * 5_000
"""65,000 characters: over the default `max_tool_result_chars`."""
WAIT_S = 30


def saved_in(text: str) -> list[Path]:
    """Every `Full output saved to: <path>` of a text, in order."""
    return [Path(p) for p in re.findall(r"Full output saved to: (\S+)\n", text)]


def saved_paths(request: ModelRequest) -> list[Path]:
    """Every saved result's path the tool results of a request's messages hold, in order."""
    found: list[Path] = []
    for message in request.messages:
        for block in message["content"] if isinstance(message["content"], list) else []:
            if block.get("type") == "tool_result" and isinstance(block.get("content"), str):
                found += saved_in(block["content"])
    return found


async def spill_once(
    runtime: Runtime, tool_use_id: str = "d1", session_dir: Path | None = None, **opened: Any
) -> tuple[Ran, Path]:
    """A session (opened with `opened`) whose one query spills one result; that result's file."""
    model = ScriptedModel([tools_reply(tool_use(tool_use_id, "dump")), text_reply()])
    options = QueryOptions(provider=model, tools=[scripted_tool("dump", result=BIG)], session_dir=session_dir)
    session = await runtime.open_session(options, **opened)
    with trio.fail_after(WAIT_S):
        ran = await consume(session, session.query("Dump it"), model)
    await assert_settled(ran)
    [path] = [p for p in saved_paths(model.requests[1]) if p.name == spill_file_name(tool_use_id)]
    assert path.read_text() == BIG
    return ran, path


async def test_a_sessions_temporary_spill_folder_is_removed_when_the_session_closes() -> None:
    async with Runtime.open() as runtime:
        ran, path = await spill_once(runtime)
        folder = path.parent.parent
        assert path.parent.name == "tool-results" and folder.name.startswith("queryloop-")
        assert folder.is_dir()  # the session is open: its results are there to read
        await ran.session.close()
        assert not folder.exists()


async def test_a_sessions_temporary_spill_folder_is_removed_when_the_runtime_exits_without_closing_it() -> None:
    async with Runtime.open() as runtime:
        _, path = await spill_once(runtime)
        folder = path.parent.parent
        assert folder.is_dir()
    assert not folder.exists()


class Doomed(TrioActor):
    """Crashes at its first message: a tell, so nobody is there to take the error."""

    def on_receive(self, message: Any) -> Any:
        raise RuntimeError("boom")


async def test_a_sessions_temporary_spill_folder_is_removed_when_a_crash_stops_its_actors() -> None:
    async with Runtime.open() as runtime:
        ran, path = await spill_once(runtime)
        group = ran.session.supervisor
        group.spawn(Doomed).tell("go")
        with trio.fail_after(WAIT_S):
            await group.wait_closed()
        assert group.failure is not None
        assert not path.parent.parent.exists()


async def test_a_spill_folder_the_host_gave_is_kept_after_the_session_and_runtime_close(tmp_path: Path) -> None:
    given = tmp_path / "given"
    async with Runtime.open() as runtime:
        ran, path = await spill_once(runtime, session_dir=given)
        await ran.session.close()
    assert path == (given / "tool-results" / spill_file_name("d1")).resolve()
    assert path.read_text() == BIG


async def test_a_durable_session_spills_beside_its_transcript_and_a_resume_spills_there_again(
    tmp_path: Path,
) -> None:
    transcript = tmp_path / "chat.jsonl"
    folder = (tmp_path / "chat" / "tool-results").resolve()
    async with Runtime.open() as runtime:
        ran, first = await spill_once(runtime, "d1", transcript=transcript)
        await ran.session.close()
    assert first == folder / spill_file_name("d1")
    assert first.read_text() == BIG  # kept: the resumed conversation refers to it

    async with Runtime.open() as runtime:
        _, second = await spill_once(runtime, "d2", resume=transcript)
    assert second == folder / spill_file_name("d2")
    assert first.read_text() == BIG and second.read_text() == BIG


async def test_a_fork_spills_beside_its_own_transcript_the_results_it_copied_too(tmp_path: Path) -> None:
    original = tmp_path / "chat.jsonl"
    async with Runtime.open() as runtime:
        await spill_once(runtime, "d1", transcript=original)
        forked = tmp_path / "fork.jsonl"
        _, path = await spill_once(runtime, "d2", resume=original, transcript=forked, fork=True)
    fork_folder = (tmp_path / "fork" / "tool-results").resolve()
    assert path == fork_folder / spill_file_name("d2")
    assert not (tmp_path / "chat" / "tool-results" / spill_file_name("d2")).exists()
    # The result it copied is saved there again: the conversation keeps it whole, the path is made per request.
    assert (fork_folder / spill_file_name("d1")).read_text() == BIG


async def test_a_subagents_spills_go_in_its_sessions_folder_and_are_removed_with_the_session() -> None:
    provider = ByPrompt(
        {
            "Review": [tools_reply(agent_call("a1", "reviewer", "file a")), text_reply("Reviewed.")],
            "file a": [tools_reply(tool_use("d1", "dump")), text_reply("a: fine")],
        }
    )
    reviewer = AgentDefinition(description="Reviews one file", prompt="You review code.")
    options = QueryOptions(provider=provider, tools=[scripted_tool("dump", result=BIG)], agents={"reviewer": reviewer})
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options)
        with trio.fail_after(WAIT_S):
            result = await session.query("Review").wait()
        assert result.result == "Reviewed."
        [path] = saved_paths(provider.requests_of("file a")[1])
        folder = path.parent.parent
        # The subagent has ended, its session has not: what it saved is still there to read.
        assert path.read_text() == BIG and folder.name.startswith(f"queryloop-{session.id}-")
        await session.close()
        assert not folder.exists()


def test_a_transcript_without_a_suffix_gets_a_spill_folder_of_its_own() -> None:
    assert _session_dir(None, Path("logs/chat.jsonl")) == Path("logs/chat")
    assert _session_dir(None, Path("logs/chat")) == Path("logs/chat.d")
    assert _session_dir(Path("given"), Path("logs/chat.jsonl")) == Path("given")
    assert _session_dir(None, None) is None


async def test_an_mcp_servers_temporary_results_folder_is_removed_when_the_runtime_closes() -> None:
    server = helpers.TESTS / "mcp" / "server.py"
    command = [sys.executable, str(server), "stdio", "--hostile"]
    model = ScriptedModel([tools_reply(tool_use("f1", "mcp__fx__flood", {"chars": 60_000})), text_reply()])
    async with Runtime.open() as runtime:
        tools = await runtime.open_mcp("fx", McpStdioServer(command=command))
        flood = [t for t in tools if t.name == "mcp__fx__flood"]
        session = await runtime.open_session(QueryOptions(provider=model, tools=flood))
        with trio.fail_after(WAIT_S):
            await session.query("Flood").wait()
        [path] = saved_paths(model.requests[1])
        folder = path.parent.parent
        assert len(path.read_text()) == 60_000 and folder.name.startswith("queryloop-mcp-fx-")
        await session.close()
        assert path.exists()  # the runtime's folder, not the session's: it outlives the session
    assert not folder.exists()


async def test_mcp_large_results_closed_hand_over_their_temporary_folder_and_save_nothing_more() -> None:
    results = LargeResults("fx", None)
    saved = await results.capped("x" * 60_000, "t1", None)
    assert isinstance(saved, str)
    [path] = saved_in(saved)
    folder = results.close()
    assert folder == path.parent.parent and path.exists()
    await remove_spill_folder(folder)
    assert not folder.exists()
    # Saved after the close, a result is cut, as one that cannot be saved: no new folder is made.
    after = await results.capped("y" * 200_000, "t2", None)
    assert isinstance(after, str) and "Full output saved to" not in after and "OUTPUT TRUNCATED" in after
    assert results.close() is None


async def test_mcp_large_results_in_a_servers_results_dir_are_never_handed_over(tmp_path: Path) -> None:
    results = LargeResults("fx", tmp_path)
    await results.capped("x" * 60_000, "t1", None)
    assert results.close() is None
    assert [p.parent for p in (tmp_path / "tool-results").iterdir()] == [(tmp_path / "tool-results")]
