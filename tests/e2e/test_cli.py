"""The `queryloop` command as a person uses it: in a pseudo-terminal, or with its output piped."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import socket
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import queryloop
from queryloop.runtime.cli import main as cli
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.providers.local_api import LocalMessagesAPI
from tests import helpers

REPO = helpers.REPO
COMMAND = [sys.executable, "-m", "queryloop.runtime.cli.main"]


def read_until(fd: int, marker: bytes, seconds: float) -> bytes:
    """Read the terminal until `marker` shows (or the time is up): a bounded wait on output, not a sleep."""
    seen = b""
    deadline = time.monotonic() + seconds
    while marker not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    return seen


def read_to_end(fd: int, seconds: float) -> bytes:
    """Everything the terminal shows until the process closes it (EOF; EIO on Linux)."""
    return read_until(fd, b"\0never printed\0", seconds)


def _own_terminal() -> None:
    # A new session whose controlling terminal is the pty: Ctrl+C then reaches the process as SIGINT.
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _env(**changes: str | None) -> dict[str, str]:
    env = {**os.environ, "COLUMNS": "200", "TERM": "xterm", "PYTHONIOENCODING": "utf-8"}
    for name, value in changes.items():
        env.pop(name, None)
        if value is not None:
            env[name] = value
    return env


def in_terminal(argv: list[str], cwd: Path = REPO) -> tuple[subprocess.Popen[bytes], int]:
    """Start the command with a pseudo-terminal for its stdin, stdout and stderr; returns it and the pty's end."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        argv,
        cwd=cwd,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=_env(),
        preexec_fn=_own_terminal,  # noqa: PLW1509 - the child must own the pty, as under a terminal emulator
    )
    os.close(follower)
    return process, leader


def piped(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `queryloop ARGS` with its output captured (not a terminal)."""
    return subprocess.run(
        [*COMMAND, *args],
        cwd=cwd,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


# -- Ctrl+C ---------------------------------------------------------------------------------


def test_ctrl_c_mid_tool_aborts_the_query_shows_aborted_tools_and_exits_130() -> None:
    process, leader = in_terminal([*COMMAND, "run", "--demo-tool-delay", "8"])
    try:
        # Progress reaches 25 % two seconds into the tools: the model's stream has ended, the tools run on.
        before = read_until(leader, b"listing . 25%", 60)
        assert b"listing . 25%" in before, before[-500:]
        os.write(leader, b"\x03")  # Ctrl+C, through the terminal's line discipline
        after = read_until(leader, b"terminal: aborted_tools", 30)
        assert b"terminal: aborted_tools" in after, after[-800:]
        assert process.wait(timeout=30) == 130
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)


# A `run` whose only tool does not end when the abort cancels it, so the process is certainly still
# running when the second Ctrl+C comes: one tool needs a while to unwind, the other waits in a thread
# (a blocking read of a pipe nobody writes to), which no cancellation can end.
STUBBORN_RUN = """
import os, sys
import trio
from pydantic import BaseModel
from queryloop import ScriptedModel, ToolContext, tool
from queryloop.runtime.cli import main as cli

class NoArgs(BaseModel):
    pass

@tool(description="a tool slow to stop")
async def stubborn(args: NoArgs, ctx: ToolContext) -> str:
    await ctx.progress("stubborn tool running")
    if sys.argv[1] == "slow_to_unwind":
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(3)
    read_end, _ = os.pipe()
    await trio.to_thread.run_sync(os.read, read_end, 1)
    return "unreachable"

reply = {"content": [{"type": "tool_use", "id": "toolu_1", "name": "stubborn", "input": {}}], "stop_reason": "tool_use"}
cli.demo_model = lambda: ScriptedModel([reply])
cli.demo_tools = lambda root, delay_s=0.0: [stubborn]
sys.exit(cli.main(["run"]))
"""


@pytest.mark.parametrize("tool", ["slow_to_unwind", "stuck_in_a_thread"])
def test_second_ctrl_c_exits_130_quietly(tool: str) -> None:
    process, leader = in_terminal([sys.executable, "-c", STUBBORN_RUN, tool])
    try:
        shown = read_until(leader, b"stubborn tool running", 60)
        assert b"stubborn tool running" in shown, shown[-500:]
        os.write(leader, b"\x03")
        # The first Ctrl+C aborts: the query's end (its result) is shown while the tool still unwinds.
        shown += read_until(leader, b"error_during_execution", 30)
        assert b"error_during_execution" in shown, shown[-800:]
        assert process.poll() is None
        os.write(leader, b"\x03")
        shown += read_to_end(leader, 30)
        assert process.wait(timeout=30) == 130
        assert b"Traceback" not in shown and b"KeyboardInterrupt" not in shown, shown[-1500:]
        folder = re.search(rb"files of its own, in (\S+)\)", shown)
        assert folder is not None, shown[-1500:]
        assert not Path(folder.group(1).decode()).exists()  # even a forced exit removes the demo's folder
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)


# -- exit status and errors ---------------------------------------------------------------------


def test_model_without_an_api_key_says_what_is_missing() -> None:
    done = piped("run", "hi", "--model", "claude-sonnet-5-5", env=_env(ANTHROPIC_API_KEY=None))
    assert done.returncode == 2
    assert "ANTHROPIC_API_KEY" in done.stderr
    assert "Traceback" not in done.stderr


def test_unknown_model_is_a_usage_error_in_one_line() -> None:
    done = piped("run", "hi", "--model", "gpt-4o", env=_env(ANTHROPIC_API_KEY="sk-test"))
    assert done.returncode == 2
    assert done.stderr.startswith("queryloop: unknown model 'gpt-4o': ")
    assert done.stderr.count("\n") == 1 and done.stderr.endswith("\n")
    assert "claude-sonnet-5-5" in done.stderr  # it names the models it knows


@pytest.mark.parametrize("flag", [["--max-turns", "0"], ["--max-turns", "x"], ["--demo-tool-delay", "-1"], ["--nope"]])
def test_bad_flags_exit_2_without_a_traceback(flag: list[str]) -> None:
    done = piped("run", *flag)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "error:" in done.stderr


def test_connection_failure_reports_the_error_and_exits_1(tmp_path: Path) -> None:
    base_url = f"http://127.0.0.1:{closed_port()}"
    env = _env(ANTHROPIC_API_KEY="sk-never-shown")
    done = piped("run", "hi", "--model", "claude-sonnet-5-5", "--base-url", base_url, cwd=tmp_path, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "API Error: Connection error." in done.stdout
    assert "terminal: api_error" in done.stdout
    assert "success" not in done.stdout
    assert "queryloop: the query ended in error (api_error): API Error: Connection error." in done.stderr
    assert "sk-never-shown" not in done.stdout + done.stderr


def test_max_turns_ends_the_query_in_error_and_exits_1() -> None:
    done = piped("run", "--max-turns", "1")
    assert done.returncode == 1, done.stderr
    assert "terminal: max_turns" in done.stdout
    assert "Reached maximum number of turns (1)" in done.stderr
    assert "Done" not in done.stdout


def test_help_documents_the_exit_statuses_and_the_flags() -> None:
    for args in (["--help"], ["run", "--help"], ["demo", "--help"]):
        done = piped(*args)
        assert done.returncode == 0
        status = done.stdout[done.stdout.index("exit status of run and demo:") :]
        for code in ("0", "1", "2", "130"):
            assert f"\n  {code} " in status, status
    run_help = piped("run", "--help").stdout
    for flag in ("--model", "--max-turns", "--system", "--base-url", "--demo-tool-delay"):
        assert flag in run_help
    assert "--version" in piped("--help").stdout


def test_version_prints_the_package_version() -> None:
    done = piped("--version")
    assert done.returncode == 0
    assert done.stdout == f"queryloop {queryloop.__version__}\n"


# -- the offline demo ----------------------------------------------------------------------------


def test_demo_runs_offline_to_completion() -> None:
    done = piped("demo", "--demo-tool-delay", "0")
    assert done.returncode == 0, done.stderr
    assert "terminal: completed" in done.stdout
    assert "count_lines" in done.stdout


def test_demo_is_self_contained_in_an_empty_folder(tmp_path: Path) -> None:
    done = piped("demo", "--demo-tool-delay", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("list_files", "read_file", "count_lines"):
        assert f"✓ {name}(" in done.stdout, done.stdout
    assert "✗" not in done.stdout
    assert "Done: the project holds 3 entries" in done.stdout
    assert list(tmp_path.iterdir()) == []  # it worked in a folder of its own, and wrote nothing here


# The demo with its files missing (its folder left empty): its file tools fail.
DEMO_WITHOUT_FILES = """
import sys
from queryloop.runtime.cli import demo, main as cli
demo.write_demo_files = lambda folder: None
sys.exit(cli.main(["demo", "--demo-tool-delay", "0"]))
"""


def test_a_demo_whose_tools_fail_never_says_done_with_exit_0(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DEMO_WITHOUT_FILES],
        cwd=tmp_path,  # an empty folder: no README.md here either
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "✗ read_file(" in done.stdout, done.stdout + done.stderr
    assert not ("Done" in done.stdout and done.returncode == 0), done.stdout
    assert "The demo's tools failed" in done.stdout


def test_run_without_model_says_on_stderr_that_it_replays_the_demo() -> None:
    done = piped("run", "Fix the failing test")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    note = lines[0]
    assert "no --model" in note and "replays the demo" in note and "ignores your prompt" in note
    assert "--model" in note and "ANTHROPIC_API_KEY" in note
    assert "Done:" in done.stdout
    assert piped("demo", "--demo-tool-delay", "0").stderr == ""  # the demo is what `demo` asks for


@pytest.mark.parametrize("args", [["demo", "--demo-tool-delay", "0"], ["run", "--max-turns", "1"]])
def test_output_ends_with_a_newline(args: list[str]) -> None:
    done = piped(*args)
    assert done.stdout.endswith("\n"), repr(done.stdout[-80:])
    assert done.stderr == "" or done.stderr.endswith("\n")


def test_the_command_opens_its_runtime_with_the_collector_tuned(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opened: list[dict[str, Any]] = []
    original = Runtime.open

    def recording_open(**kwargs: Any) -> Any:
        opened.append(kwargs)
        return original(**kwargs)

    monkeypatch.setattr(Runtime, "open", recording_open)
    assert cli.main(["demo", "--demo-tool-delay", "0"]) == 0
    assert opened == [{"tune_gc": True}]
    assert "terminal: completed" in capsys.readouterr().out


# -- the Messages API, served on the loopback --------------------------------------------------


async def _run_against(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[bytes]:
    """`queryloop ARGS` in a subprocess, while this test's trio run serves the loopback API."""
    with trio.fail_after(60):
        return await trio.run_process(
            [*COMMAND, *args], cwd=cwd, env=env, capture_stdout=True, capture_stderr=True, check=False
        )


async def test_base_url_and_system_prompt_reach_the_messages_api(tmp_path: Path) -> None:
    async with LocalMessagesAPI([{"content": [{"type": "text", "text": "Hello from the loopback."}]}]) as api:
        env = _env(ANTHROPIC_API_KEY="sk-local-test", ANTHROPIC_BASE_URL=None)
        args = ["run", "Say hi", "--model", "claude-sonnet-5-5", "--base-url", api.base_url, "--system", "Be brief."]
        done = await _run_against(*args, env=env, cwd=tmp_path)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, out + err
    assert "Hello from the loopback." in out and "terminal: completed" in out
    [request] = api.requests
    assert request.body["system"] == [{"type": "text", "text": "Be brief."}]
    assert request.body["model"] == "claude-sonnet-5-5"
    assert "Say hi" in json.dumps(request.body["messages"])
    assert "sk-local-test" not in out + err


async def test_base_url_defaults_to_the_environment(tmp_path: Path) -> None:
    async with LocalMessagesAPI([{"content": [{"type": "text", "text": "Hello from the env URL."}]}]) as api:
        env = _env(ANTHROPIC_API_KEY="sk-local-test", ANTHROPIC_BASE_URL=api.base_url)
        done = await _run_against("run", "hi", "--model", "claude-sonnet-5-5", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Hello from the env URL." in done.stdout.decode()
    assert len(api.requests) == 1


def test_the_installed_command_runs_the_benchmarks_from_any_directory(tmp_path: Path) -> None:
    command = Path(sys.executable).parent / "queryloop"  # installed beside the interpreter by `pip install -e .`
    assert command.exists()
    done = subprocess.run(
        [str(command), "bench", "kernel", "--asks", "200", "--rounds", "1", "--sessions", "10,20", "--cycles", "5"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "kernel" and result["live_tasks_before_close"] == 0
