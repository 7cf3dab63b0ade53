"""The `queryloop` command as a person uses it, in a pseudo-terminal."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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


def _own_terminal() -> None:
    # A new session whose controlling terminal is the pty: Ctrl+C then reaches the process as SIGINT.
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def test_ctrl_c_mid_tool_aborts_the_query_and_shows_aborted_tools() -> None:
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "queryloop.runtime.cli.main", "run", "--demo-tool-delay", "8"],
        cwd=REPO,
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env={**os.environ, "COLUMNS": "120", "TERM": "xterm"},
        preexec_fn=_own_terminal,  # noqa: PLW1509 - the child must own the pty, as under a terminal emulator
    )
    os.close(follower)
    try:
        # Progress reaches 25 % two seconds into the tools: the model's stream has ended, the tools run on.
        before = read_until(leader, b"listing . 25%", 60)
        assert b"listing . 25%" in before, before[-500:]
        os.write(leader, b"\x03")  # Ctrl+C, through the terminal's line discipline
        after = read_until(leader, b"terminal: aborted_tools", 30)
        assert b"terminal: aborted_tools" in after, after[-800:]
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)


def test_model_without_an_api_key_says_what_is_missing() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    done = subprocess.run(
        [sys.executable, "-m", "queryloop.runtime.cli.main", "run", "hi", "--model", "claude-sonnet-5-5"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "ANTHROPIC_API_KEY" in done.stdout


def test_demo_runs_offline_to_completion() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "queryloop.runtime.cli.main", "demo", "--demo-tool-delay", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "terminal: completed" in done.stdout
    assert "count_lines" in done.stdout


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
