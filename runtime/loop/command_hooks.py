"""A settings file's command hook (`{"type": "command", "command": "...", "timeout": N}`) as a callback in the
Agent SDK's shape (`runtime.loop.sdk_hooks.HookCallback`), so it runs through the same machinery as a host's
Python callbacks (`HookMatcher`, `runtime.loop.pre_tool_use`).

* How it runs (`run_command`): `/bin/sh -c COMMAND` in the project folder, with the event's `input_data` as
  JSON on its stdin and the process's environment plus `CLAUDE_PROJECT_DIR`, in a process group of its own.
  Its stdout and stderr are read to their end, each keeping at most `CAPTURE_BYTES` (the rest is read and
  dropped: a hook that floods its output costs no memory); texts passed on are cut to `OUTPUT_CHARS`, Claude
  Code's cap. A hook that closes its stdin without reading it is not an error.
* What ends it early: its timeout (600 s by default) or the caller's cancellation (a query's abort, the
  matcher's deadline) sends SIGTERM to the whole group, then SIGKILL after `KILL_GRACE_S` to what is left, so a
  child it started (`sleep 30 &`) does not outlive it. A timeout is a `CommandHookError` (non-blocking: the
  call goes on); a cancellation stays a cancellation.
* What its exit says (`hook_output`, pure), as Claude Code reads it, turned into the SDK's JSON output so the
  existing readers apply: exit 0 with stdout starting with `{` is its JSON output (`continue` and `async`
  renamed `continue_` and `async_`, as the Python SDK spells them); plain stdout is `additionalContext` for
  UserPromptSubmit and SessionStart and ignored elsewhere. Exit 2 blocks, with the JSON's reason or else
  stderr: a deny for PreToolUse, `decision: "block"` for the events that take one (`BLOCKING_EVENTS`), nothing
  for PermissionRequest, a non-blocking error for the rest. Any other exit is a non-blocking error
  (`CommandHookError`, which the machinery reports as a `hook_error`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from queryloop.runtime.loop.permissions import PermissionRule, rule_matches
from queryloop.runtime.loop.sdk_hooks import HookCallback, HookContext, HookInput, HookJSONOutput, HookMatcher
from queryloop.runtime.loop.shell_commands import subcommands

COMMAND_TIMEOUT_S = 600.0
"""How long a command hook may run when its settings give no `timeout` (Claude Code's default)."""

KILL_GRACE_S = 2.0
"""Between the SIGTERM and the SIGKILL sent to a hook's process group when it is stopped early."""

MATCHER_MARGIN_S = 1.0
"""What a command hook's `HookMatcher.timeout` adds to its own timeout and grace: the matcher's deadline must
never cut the command before its own kill-and-report path has run."""

OUTPUT_CHARS = 10_000
"""Claude Code's cap on a hook's output: the longest text (context, reason, error) passed on."""

CAPTURE_BYTES = 1 << 20
"""The most of each of stdout and stderr kept (1 MiB: room for a JSON output's `updatedInput`)."""

BLOCKING_EVENTS = frozenset(
    {"UserPromptSubmit", "Stop", "SubagentStop", "PostToolUse", "PostToolUseFailure", "PreCompact"}
)
"""The events whose exit 2 is `{"decision": "block", "reason": ...}`."""

CONTEXT_EVENTS = frozenset({"UserPromptSubmit", "SessionStart"})
"""The events whose plain stdout (exit 0) is context for the model (`additionalContext`)."""

_READ_CHUNK = 64 * 1024
_POLL_S = 0.02


class CommandHookError(Exception):
    """A command hook failed without blocking: an exit code other than 0 and 2, a timeout, JSON that does not
    parse. The message names the command and says what happened (with the first line of its stderr)."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    """How a hook's command ended: its exit code (negative: the signal that ended it) and its output, decoded
    (invalid UTF-8 replaced), each at most `CAPTURE_BYTES`; `overflowed` when stdout had more."""

    returncode: int
    stdout: str
    stderr: str
    overflowed: bool = False


def _cut(text: str, limit: int = OUTPUT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _named(command: str) -> str:
    return repr(_cut(command, 200))


def _first_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    return _cut(lines[0], 500) if lines else "(no stderr)"


class _Capture:
    """One output stream read to its end, keeping at most `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()
        self.overflowed = False

    async def drain(self, stream: trio.abc.ReceiveStream) -> None:
        while chunk := await stream.receive_some(_READ_CHUNK):
            room = self.limit - len(self.data)
            if room > 0:
                self.data += chunk[:room]
            if len(chunk) > room:
                self.overflowed = True

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


async def _feed(stream: trio.abc.SendStream, data: bytes) -> None:
    async with stream:
        try:
            await stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the hook closed its stdin without reading it all: not an error


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left in the group (a pid reused since belongs to someone else)


def _group_has_live_members(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie does not: it is dead, only not yet reaped)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return True  # cannot tell: the grace is waited out
    for name in names:
        if not name.isdigit():
            continue
        try:
            fields = Path("/proc", name, "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 2 and fields[0] != "Z" and fields[2] == str(pgid):
            return True
    return False


async def _end_group(process: trio.Process) -> None:
    """SIGTERM to the hook's process group, SIGKILL to what is left after the grace; the shell reaped."""
    _signal_group(process.pid, signal.SIGTERM)
    with trio.move_on_after(KILL_GRACE_S):
        await process.wait()
        while _group_has_live_members(process.pid):  # noqa: ASYNC110 - no event says a group's last process ended
            await trio.sleep(_POLL_S)
    _signal_group(process.pid, signal.SIGKILL)
    await process.wait()


async def run_command(command: str, stdin: bytes, *, timeout_s: float, project_dir: Path) -> CommandResult:
    """Run `command` through `/bin/sh -c` (module docstring); `CommandHookError` if it cannot start or runs
    past `timeout_s`. Cancelled, it ends the hook's process group before the cancellation goes on."""
    env = {**os.environ, "CLAUDE_PROJECT_DIR": str(project_dir)}
    try:
        process = await trio.lowlevel.open_process(
            ["/bin/sh", "-c", command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=project_dir,
            env=env,
            start_new_session=True,
        )
    except OSError as error:
        msg = f"hook command {_named(command)} could not start: {error}"
        raise CommandHookError(msg) from error
    out, err = _Capture(CAPTURE_BYTES), _Capture(CAPTURE_BYTES)
    finished = False
    try:
        with trio.move_on_after(timeout_s):
            async with trio.open_nursery() as nursery:
                assert process.stdin is not None and process.stdout is not None and process.stderr is not None
                nursery.start_soon(_feed, process.stdin, stdin)
                nursery.start_soon(out.drain, process.stdout)
                nursery.start_soon(err.drain, process.stderr)
                await process.wait()
            finished = True
    finally:
        with trio.CancelScope(shield=True):
            if not finished:
                await _end_group(process)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    await stream.aclose()
            await process.wait()
    if not finished:
        msg = f"hook command {_named(command)} timed out after {timeout_s:g} s"
        raise CommandHookError(msg)
    assert process.returncode is not None
    return CommandResult(process.returncode, out.text(), err.text(), out.overflowed)


def _json_output(result: CommandResult, command: str) -> dict[str, Any] | None:
    """Stdout as the hook's JSON output when it starts with `{`; None when it is plain text."""
    if not result.stdout.lstrip().startswith("{"):
        return None
    if result.overflowed:
        msg = f"hook command {_named(command)} printed more than {CAPTURE_BYTES} bytes of JSON"
        raise CommandHookError(msg)
    try:
        return json_object(result.stdout)
    except ValueError as error:
        msg = f"hook command {_named(command)} printed {error}"
        raise CommandHookError(msg) from None


def json_object(text: str) -> dict[str, Any]:
    """A hook's JSON output, read from its text (`continue` and `async` renamed `continue_` and `async_`, as the
    Python SDK spells them); `ValueError` saying what is wrong when it is not a JSON object."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as error:
        msg = f"invalid JSON: {_cut(str(error), 200)}"
        raise ValueError(msg) from None
    if not isinstance(value, dict):
        msg = "JSON that is not an object"
        raise ValueError(msg)  # noqa: TRY004 - a text of the wrong shape is a bad value, as invalid JSON is
    for cli_name, sdk_name in (("continue", "continue_"), ("async", "async_")):
        if cli_name in value:
            value[sdk_name] = value.pop(cli_name)
    return value


def _json_reason(output: dict[str, Any] | None) -> str | None:
    if output is None:
        return None
    specific = output.get("hookSpecificOutput")
    reasons = [specific.get("permissionDecisionReason") if isinstance(specific, dict) else None]
    reasons.append(output.get("reason"))
    return next((reason for reason in reasons if isinstance(reason, str) and reason.strip()), None)


def _success(event: str, result: CommandResult, command: str) -> dict[str, Any]:
    output = _json_output(result, command)
    if output is not None:
        return output
    text = result.stdout.strip()
    if event in CONTEXT_EVENTS and text:
        return {"hookSpecificOutput": {"hookEventName": event, "additionalContext": _cut(text)}}
    return {}


def _blocked(event: str, result: CommandResult, command: str) -> dict[str, Any]:
    try:
        output = _json_output(result, command)
    except CommandHookError:
        output = None  # exit 2 blocks whatever stdout says: only a reason is taken from it
    reason = _json_reason(output) or result.stderr.strip()
    if event == "PreToolUse":
        specific: dict[str, Any] = {"hookEventName": "PreToolUse", "permissionDecision": "deny"}
        if reason:
            specific["permissionDecisionReason"] = _cut(reason)
        return {"hookSpecificOutput": specific}
    if event in BLOCKING_EVENTS:
        return {"decision": "block", "reason": _cut(reason)} if reason else {"decision": "block"}
    if event == "PermissionRequest":
        return {}  # Claude Code ignores exit 2 here
    msg = f"hook command {_named(command)} exited 2, which blocks nothing for {event}: {_first_line(result.stderr)}"
    raise CommandHookError(msg)


def hook_output(event: str, result: CommandResult, command: str) -> dict[str, Any]:
    """What a finished command says for `event`, as the SDK's JSON output (module docstring); raises
    `CommandHookError` for a non-blocking error."""
    if result.returncode == 0:
        return _success(event, result, command)
    if result.returncode == 2:
        return _blocked(event, result, command)
    code = result.returncode
    ended = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
    msg = f"hook command {_named(command)} {ended}: {_first_line(result.stderr)}"
    raise CommandHookError(msg)


def command_hook(command: str, *, event: str, timeout_s: float = COMMAND_TIMEOUT_S, project_dir: Path) -> HookCallback:
    """A callback in the SDK's shape that runs `command` for `event` (module docstring)."""
    if not timeout_s > 0:
        msg = f"a command hook's timeout must be > 0 seconds, not {timeout_s!r}"
        raise ValueError(msg)

    async def run(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        data = json.dumps(input_data, ensure_ascii=False).encode()
        result = await run_command(command, data, timeout_s=timeout_s, project_dir=project_dir)
        return hook_output(event, result, command)  # type: ignore[return-value]  # the SDK's shape, unchecked

    run.__name__ = run.__qualname__ = f"command_hook({_cut(command, 80)!r})"
    return run


def command_hook_matcher(
    matcher: str | None,
    command: str,
    *,
    event: str,
    timeout_s: float = COMMAND_TIMEOUT_S,
    project_dir: Path,
    condition: PermissionRule | None = None,
) -> HookMatcher:
    """A `HookMatcher` holding one command hook, with a matcher deadline past the command's own timeout and
    kill grace (`MATCHER_MARGIN_S`). With a `condition` (the handler's `if`, one permission rule), a tool
    event's hook runs only for the calls the rule matches (`condition_holds`)."""
    callback = command_hook(command, event=event, timeout_s=timeout_s, project_dir=project_dir)
    deadline_s = timeout_s + KILL_GRACE_S + MATCHER_MARGIN_S
    return handler_matcher(matcher, callback, deadline_s=deadline_s, condition=condition, cwd=project_dir)


def handler_matcher(
    matcher: str | None, callback: HookCallback, *, deadline_s: float, condition: PermissionRule | None, cwd: Path
) -> HookMatcher:
    """A settings handler's callback (a command's, an http hook's) in a `HookMatcher` of its own, whose deadline
    (`deadline_s`) the caller sets past the handler's own timeout, so the handler's own error is the one reported.
    With a `condition` (the handler's `if`), a tool event's hook runs only for the calls it matches."""
    if condition is not None:
        callback = _when(condition, callback, cwd)
    return HookMatcher(matcher=matcher, hooks=[callback], timeout=deadline_s)


def condition_holds(rule: PermissionRule, input_data: dict[str, Any], cwd: Path) -> bool:
    """Whether a handler's `if` lets it run, as Claude Code reads it: only tool events are filtered (others run);
    a Bash command matches when it, or any piece between its operators, matches the rule; a call whose input
    cannot be read (no command string) runs the hook (it fails open)."""
    tool_name, tool_input = input_data.get("tool_name"), input_data.get("tool_input")
    if not isinstance(tool_name, str) or not isinstance(tool_input, dict):
        return True
    if tool_name == "Bash" and rule.tool_name == "Bash" and rule.specifier is not None:
        command = tool_input.get("command")
        if not isinstance(command, str):
            return True
        pieces = [command, *subcommands(command)]
        return any(rule_matches(rule, tool_name, {**tool_input, "command": p}, cwd=cwd) for p in pieces)
    return rule_matches(rule, tool_name, tool_input, cwd=cwd)


def _when(rule: PermissionRule, callback: HookCallback, cwd: Path) -> HookCallback:
    async def conditional(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        if not condition_holds(rule, dict(input_data), cwd):
            return {}
        return await callback(input_data, tool_use_id, context)

    conditional.__qualname__ = getattr(callback, "__qualname__", "hook")
    return conditional
