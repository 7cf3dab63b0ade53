"""A settings file's command hook, run as Claude Code runs it: real `/bin/sh` and Python processes, its exit
code and output read as Claude Code reads them, killed with its children on timeout and on cancellation."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from queryloop.runtime.loop import command_hooks
from queryloop.runtime.loop.command_hooks import (
    CAPTURE_BYTES,
    KILL_GRACE_S,
    OUTPUT_CHARS,
    CommandHookError,
    CommandResult,
    command_hook,
    command_hook_matcher,
    hook_output,
    run_command,
)
from queryloop.runtime.loop.event_hooks import QueryHooks
from queryloop.runtime.loop.pre_tool_use import run_pre_tool_use

TOOL_INPUT = {"command": "rm -rf build", "note": "naïve — ünïcode ✓"}


def pre_tool_use_input(tool_input: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "session_id": "s1",
        "transcript_path": "",
        "cwd": "/",
        "permission_mode": "default",
        "hook_event_name": "PreToolUse",
        "tool_name": "Bash",
        "tool_input": TOOL_INPUT if tool_input is None else tool_input,
        "tool_use_id": "t1",
    }


async def call(
    command: str,
    project_dir: Path,
    *,
    event: str = "PreToolUse",
    timeout_s: float = 30.0,
    input_data: dict[str, Any] | None = None,
) -> Any:
    callback = command_hook(command, event=event, timeout_s=timeout_s, project_dir=project_dir)
    data = pre_tool_use_input() if input_data is None else input_data
    return await callback(data, "t1", {"signal": None})  # type: ignore[arg-type]


def python(tmp_path: Path, code: str) -> str:
    """A command that runs `code` as a Python script written into `tmp_path`."""
    script = tmp_path / "hook.py"
    script.write_text(code)
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}"


def is_gone(pid: int) -> bool:
    """Whether `pid` no longer runs (a zombie is dead, only not reaped by its new parent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except FileNotFoundError:
        return True
    return fields[0] == "Z"


async def gone(pid: int) -> bool:
    """Whether `pid` is gone, allowing the kernel the moment a SIGKILL takes to land (polled, bounded: nothing
    signals another process's death to a process that is not its parent)."""
    with trio.move_on_after(5):
        while not is_gone(pid):  # noqa: ASYNC110
            await trio.sleep(0.01)
    return is_gone(pid)


async def wait_for_file(path: Path) -> int:
    """The pid a hook wrote into `path`, once it has (polled: nothing signals a file written by another process)."""
    file = trio.Path(path)
    while not (await file.exists() and (await file.read_text()).strip()):  # noqa: ASYNC110
        await trio.sleep(0.01)
    return int(await file.read_text())


async def test_a_command_hook_exiting_0_with_json_returns_its_json_output(tmp_path: Path) -> None:
    answer = {
        "hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "allow"},
        "continue": False,
        "systemMessage": "checked",
    }
    output = await call(f"cat >/dev/null; echo {shlex.quote(json.dumps(answer))}", tmp_path)
    assert output == {
        "hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "allow"},
        "continue_": False,  # the Python SDK's spelling, as the readers expect it
        "systemMessage": "checked",
    }


async def test_plain_stdout_on_exit_0_is_context_for_user_prompt_submit_and_session_start_only(
    tmp_path: Path,
) -> None:
    for event in ("UserPromptSubmit", "SessionStart"):
        output = await call("echo 'The build is green.'", tmp_path, event=event)
        assert output == {"hookSpecificOutput": {"hookEventName": event, "additionalContext": "The build is green."}}
    assert await call("echo 'The build is green.'", tmp_path, event="PreToolUse") == {}
    assert await call("true", tmp_path, event="UserPromptSubmit") == {}


async def test_invalid_json_on_exit_0_is_a_non_blocking_error(tmp_path: Path) -> None:
    with pytest.raises(CommandHookError, match="printed invalid JSON"):
        await call("echo '{not json'", tmp_path)


async def test_a_command_hook_exiting_2_denies_the_tool_call_with_its_stderr(tmp_path: Path) -> None:
    output = await call("echo 'Destructive commands are not allowed' >&2; exit 2", tmp_path)
    assert output == {
        "hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": "Destructive commands are not allowed",
        }
    }


@pytest.mark.parametrize("event", ["Stop", "SubagentStop", "UserPromptSubmit", "PostToolUse", "PreCompact"])
async def test_a_stop_hook_exiting_2_blocks_with_its_stderr_as_the_reason(tmp_path: Path, event: str) -> None:
    output = await call("echo 'Run the tests first.' >&2; exit 2", tmp_path, event=event)
    assert output == {"decision": "block", "reason": "Run the tests first."}


async def test_exit_2_blocks_even_when_its_json_allows_taking_the_json_reason_over_stderr(tmp_path: Path) -> None:
    answer = {"hookSpecificOutput": {"permissionDecision": "allow", "permissionDecisionReason": "from json"}}
    output = await call(f"echo {shlex.quote(json.dumps(answer))}; echo 'from stderr' >&2; exit 2", tmp_path)
    assert output["hookSpecificOutput"]["permissionDecision"] == "deny"
    assert output["hookSpecificOutput"]["permissionDecisionReason"] == "from json"


async def test_exit_2_is_ignored_for_permission_request_and_a_non_blocking_error_for_notification(
    tmp_path: Path,
) -> None:
    assert await call("exit 2", tmp_path, event="PermissionRequest") == {}
    with pytest.raises(CommandHookError, match="blocks nothing for Notification"):
        await call("echo nope >&2; exit 2", tmp_path, event="Notification")


async def test_a_command_hook_exiting_1_is_a_non_blocking_error_naming_the_command_and_stderr(tmp_path: Path) -> None:
    with pytest.raises(CommandHookError) as raised:
        await call("echo 'lint failed' >&2; echo 'more' 'detail' >&2; exit 1", tmp_path)
    text = str(raised.value)
    assert "exited 1" in text and text.endswith(": lint failed") and "echo 'lint failed'" in text
    assert "more detail" not in text  # the first line of stderr only


def test_a_hook_killed_by_a_signal_is_a_non_blocking_error() -> None:
    with pytest.raises(CommandHookError, match="killed by signal 9"):
        hook_output("PreToolUse", CommandResult(-9, "", ""), "x")


async def test_the_hook_receives_its_input_as_json_on_stdin_intact(tmp_path: Path) -> None:
    command = python(
        tmp_path,
        "import json, sys\n"
        "data = json.load(sys.stdin)\n"
        "context = json.dumps(data, ensure_ascii=False)\n"
        'print(json.dumps({"hookSpecificOutput": {"hookEventName": "PreToolUse", "additionalContext": context}}))\n',
    )
    output = await call(command, tmp_path)
    assert json.loads(output["hookSpecificOutput"]["additionalContext"]) == pre_tool_use_input()


async def test_the_hook_runs_in_the_project_folder_with_claude_project_dir_set(tmp_path: Path) -> None:
    project = tmp_path / "my project"
    project.mkdir()
    output = await call('cat >/dev/null; echo "$CLAUDE_PROJECT_DIR|$(pwd)" >&2; exit 2', project)
    assert output["hookSpecificOutput"]["permissionDecisionReason"] == f"{project}|{project}"


async def test_a_hook_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    command = f"sleep 30 & echo $! > {shlex.quote(str(pidfile))}; wait"
    # The timeout leaves the shell time to start its child even on a loaded machine (it is never waited out
    # otherwise: the child sleeps far longer).
    with pytest.raises(CommandHookError, match="timed out after 5 s"):
        await call(command, tmp_path, timeout_s=5.0)
    assert await gone(int(pidfile.read_text()))


async def test_a_hook_that_ignores_sigterm_is_killed_after_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(command_hooks, "KILL_GRACE_S", 0.2)
    pidfile = tmp_path / "child.pid"
    command = f"trap '' TERM; sleep 30 & echo $! > {shlex.quote(str(pidfile))}; wait; wait"
    with pytest.raises(CommandHookError, match="timed out"):
        await call(command, tmp_path, timeout_s=5.0)
    assert await gone(int(pidfile.read_text()))


async def test_cancelling_the_caller_kills_the_hook_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    command = f"sleep 30 & echo $! > {shlex.quote(str(pidfile))}; wait"
    finished = False
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def run_hook() -> None:
                nonlocal finished
                await call(command, tmp_path, timeout_s=60.0)
                finished = True

            nursery.start_soon(run_hook)
            await wait_for_file(pidfile)
            scope.cancel()
    assert scope.cancelled_caught and not finished
    assert await gone(int(pidfile.read_text()))


async def test_a_hook_printing_megabytes_is_read_with_a_bound(tmp_path: Path) -> None:
    command = python(
        tmp_path,
        "import sys\n"
        "sys.stdin.read()\n"
        "for _ in range(80):\n"
        "    sys.stdout.write('x' * 65536)\n"
        "    sys.stderr.write('y' * 65536)\n"
        "sys.exit(2)\n",
    )
    result = await run_command(command, b"{}", timeout_s=60.0, project_dir=tmp_path)
    assert result.returncode == 2 and result.overflowed
    assert len(result.stdout) == CAPTURE_BYTES and len(result.stderr) == CAPTURE_BYTES
    output = hook_output("Stop", result, command)
    assert output["decision"] == "block" and len(output["reason"]) <= OUTPUT_CHARS + 1


async def test_a_hook_that_closes_stdin_without_reading_still_answers(tmp_path: Path) -> None:
    big_input = pre_tool_use_input({"content": "z" * (4 * 1024 * 1024)})
    output = await call("exec 0<&-; echo 'not today' >&2; exit 2", tmp_path, input_data=big_input)
    assert output["hookSpecificOutput"]["permissionDecisionReason"] == "not today"


async def test_a_command_that_cannot_start_is_a_non_blocking_error(tmp_path: Path) -> None:
    with pytest.raises(CommandHookError, match="could not start"):
        await call("true", tmp_path / "missing")


def test_the_matcher_deadline_leaves_room_for_the_command_s_own_timeout_and_kill(tmp_path: Path) -> None:
    matcher = command_hook_matcher("Bash", "true", event="PreToolUse", timeout_s=5.0, project_dir=tmp_path)
    assert matcher.matcher == "Bash" and len(matcher.hooks) == 1
    assert matcher.timeout_s > 5.0 + KILL_GRACE_S
    with pytest.raises(ValueError, match="timeout"):
        command_hook("true", event="PreToolUse", timeout_s=0, project_dir=tmp_path)


async def test_command_hooks_plug_into_the_pre_tool_use_machinery_unchanged(tmp_path: Path) -> None:
    def matcher(command: str) -> Any:
        return command_hook_matcher("Bash", command, event="PreToolUse", timeout_s=30.0, project_dir=tmp_path)

    hooks = QueryHooks(
        matchers={
            "PreToolUse": (matcher("echo 'no deleting' >&2; exit 2"), matcher("exit 1"), matcher("cat >/dev/null"))
        },
        session_id="s1",
        transcript_path="",
    )
    verdict = await run_pre_tool_use(hooks, "Bash", "t1", dict(TOOL_INPUT))
    assert verdict.decision == "deny" and verdict.reason == "no deleting"
    assert len(verdict.failures) == 1 and isinstance(verdict.failures[0][1], CommandHookError)
