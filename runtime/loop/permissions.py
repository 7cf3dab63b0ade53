"""Claude Code's permission rules and modes, as pure functions: whether a tool call runs, is refused, or is
left to the host to ask about. No actors, no trio, no I/O: paths are only computed, never read.

Rules (`parse_rule`, `permission_rules`) are written as in a settings file's `permissions.allow`,
`deny` and `ask` lists, or the Agent SDK's `allowed_tools` (allow rules) and `disallowed_tools` (deny
rules), read relative to the working directory:

* `Tool`, `Tool()` or `Tool(*)`: every call of the tool. `mcp__server` and `mcp__server__*`: every tool
  of that MCP server; `mcp__server__tool`: that tool.
* `Bash(specifier)`: a glob over the command, where `*` matches any run of characters; a trailing `:*`
  is a trailing ` *`, and a trailing ` *` as the only wildcard also matches the bare command (`git *`
  matches `git`). Without a wildcard the match is exact (`Bash(npm test)`). `\\*` is a literal star.
* `Read(pattern)`, `Edit(pattern)` (and `Write`, `MultiEdit`, `NotebookEdit`, `Glob`, `Grep`): a
  gitignore-style pattern over the call's path (`file_path`, `notebook_path` or `path`): `//abs` is
  absolute, `~/p` is under the home directory, `/p` is under the settings file's directory, `p` and
  `./p` under the working directory. `Read` rules apply to Read, Glob and Grep; `Edit` rules to every
  edit tool. `Write(p)` and the others apply to their own tool only (Claude Code warns they are unused).
* `WebFetch(domain:host)`: the host of the call's `url` (`*` may stand for a part, `*.example.com`).
* A specifier on any other tool matches nothing: a rule this module cannot read never widens anything.

The decision (`decide_permission`) follows the Agent SDK's order: hooks, deny rules, ask rules, the
permission mode, allow rules; what none of them settles is `ask` — the caller then asks `can_use_tool`
(what happens with no `can_use_tool` is the caller's business, not this module's).

Imports only `queryloop.runtime.loop.hook_matching`, `permission_paths` and `shell_commands`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from queryloop.runtime.loop.hook_matching import PermissionDecision
from queryloop.runtime.loop.permission_paths import (
    check_path_pattern,
    is_protected,
    is_within_any,
    path_pattern_matches,
    resolve_path,
)
from queryloop.runtime.loop.shell_commands import (
    command_forms,
    command_matches,
    is_critical_removal,
    is_working_directory_file_command,
    subcommands,
)

PermissionMode = Literal["default", "acceptEdits", "plan", "bypassPermissions", "dontAsk"]
"""The Agent SDK's permission modes but `"auto"` (a classifier model decides), which is refused."""

PERMISSION_MODES: tuple[PermissionMode, ...] = get_args(PermissionMode)

EDIT_TOOLS = frozenset({"Edit", "Write", "MultiEdit", "NotebookEdit"})
"""The tools `Edit(...)` rules apply to, that `acceptEdits` approves and `plan` refuses."""

READ_TOOLS = frozenset({"Read", "Glob", "Grep"})
"""The tools `Read(...)` rules apply to, run without asking inside the working directories."""

_PATH_KEYS = ("file_path", "notebook_path", "path")
_PATH_TOOLS = EDIT_TOOLS | READ_TOOLS
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]+(?:__\*)?")


@dataclass(frozen=True, slots=True)
class PermissionRule:
    """One rule: a tool name, what it says about the call (None: every call), and for a path rule the
    directory its pattern is read from with the pattern relative to it (anchored when it starts with `/`)."""

    tool_name: str
    specifier: str | None = None
    root: Path | None = None
    path_pattern: str | None = None

    def __str__(self) -> str:
        return self.tool_name if self.specifier is None else f"{self.tool_name}({self.specifier})"


def parse_rule(text: str, *, settings_dir: Path | None = None, cwd: Path) -> PermissionRule:
    """The rule `text` says, its relative paths read from `cwd` (`/p` from `settings_dir`, else `cwd`).

    Raises TypeError for something other than a string, and ValueError for text that is not a rule: empty,
    a tool name that is not letters, digits, `_` and `-` (an MCP name may end in `__*`), unbalanced
    parentheses, or a path pattern that is not a glob."""
    if not isinstance(text, str):
        raise TypeError(f"a permission rule is a string, not {type(text).__name__}")
    stripped = text.strip()
    name, opening, rest = stripped.partition("(")
    if not name:
        raise ValueError(f"permission rule {text!r} has no tool name")
    if not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"permission rule {text!r}: {name!r} is not a tool name")
    if not opening:
        if ")" in name:
            raise ValueError(f"permission rule {text!r} has unbalanced parentheses")
        return PermissionRule(_whole_tool(name))
    if not rest.endswith(")") or not _balanced(rest[:-1]):
        raise ValueError(f"permission rule {text!r} has unbalanced parentheses")
    specifier = rest[:-1]
    if specifier in ("", "*"):
        return PermissionRule(_whole_tool(name))
    if name.endswith("__*"):
        raise ValueError(f"permission rule {text!r}: a server-wide MCP rule takes no specifier")
    if name not in _PATH_TOOLS:
        return PermissionRule(name, specifier)
    root, pattern = _path_root(specifier, settings_dir, cwd)
    check_path_pattern(pattern)
    return PermissionRule(name, specifier, root, pattern)


def _whole_tool(name: str) -> str:
    return name.removesuffix("__*") if name.startswith("mcp__") else name


def _balanced(specifier: str) -> bool:
    depth = 0
    escaped = False
    for char in specifier:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "()":
            depth += 1 if char == "(" else -1
            if depth < 0:
                return False
    return depth == 0


def _path_root(specifier: str, settings_dir: Path | None, cwd: Path) -> tuple[Path, str]:
    """Where a path rule's pattern is read from, and the pattern relative to it (`/` first: anchored)."""
    if specifier.startswith("//"):
        return Path("/"), "/" + specifier.lstrip("/")
    if specifier == "~" or specifier.startswith("~/"):
        return Path.home(), "/" + specifier[2:]
    if specifier.startswith("/"):
        return settings_dir if settings_dir is not None else cwd, specifier
    if specifier.startswith("./"):
        return cwd, "/" + specifier[2:]
    return cwd, specifier


@dataclass(frozen=True, slots=True)
class PermissionRules:
    """A query's rules by behavior, each list in the order written (the first match names the verdict)."""

    allow: tuple[PermissionRule, ...] = ()
    deny: tuple[PermissionRule, ...] = ()
    ask: tuple[PermissionRule, ...] = ()


def permission_rules(
    allow: Iterable[str] = (),
    deny: Iterable[str] = (),
    ask: Iterable[str] = (),
    *,
    cwd: Path,
    settings_dir: Path | None = None,
) -> PermissionRules:
    """Rules from their texts (`parse_rule`; ValueError for the first malformed one).

    The Agent SDK's `allowed_tools` are allow rules and its `disallowed_tools` deny rules, read relative to
    the working directory: `permission_rules(allow=allowed_tools, deny=disallowed_tools, cwd=cwd)`."""

    def parsed(texts: Iterable[str]) -> tuple[PermissionRule, ...]:
        return tuple(parse_rule(text, settings_dir=settings_dir, cwd=cwd) for text in texts)

    return PermissionRules(allow=parsed(allow), deny=parsed(deny), ask=parsed(ask))


def rule_matches(
    rule: PermissionRule, tool_name: str, tool_input: Mapping[str, Any], *, cwd: Path | None = None
) -> bool:
    """Whether `rule` matches the call, its Bash command taken as one command as written, and a relative
    path in its input read from `cwd` (with no `cwd`, a relative input path matches no path rule).

    This is the matching primitive and does not split commands: `decide_permission` splits a Bash command
    at its shell operators and matches each piece, so that `Bash(git diff *)` does not allow
    `git diff && rm -rf /`. Use `decide_permission` to decide."""
    if not _names_match(rule, tool_name):
        return False
    if rule.specifier is None:
        return True
    if rule.path_pattern is not None and rule.root is not None:
        path = input_path(tool_name, tool_input, cwd=cwd)
        return path is not None and path_pattern_matches(rule.path_pattern, str(rule.root), path)
    command = tool_input.get("command")
    if rule.tool_name == "Bash":
        return isinstance(command, str) and command_matches(rule.specifier, command)
    if rule.tool_name == "WebFetch":
        return _domain_matches(rule.specifier, tool_input.get("url"))
    return False


def _names_match(rule: PermissionRule, tool_name: str) -> bool:
    if rule.tool_name == tool_name:
        return True
    if rule.tool_name == "Edit":
        return tool_name in EDIT_TOOLS
    if rule.tool_name == "Read":
        return tool_name in READ_TOOLS
    server = rule.tool_name.split("__")
    return len(server) == 2 and server[0] == "mcp" and tool_name.startswith(rule.tool_name + "__")


def input_path(tool_name: str, tool_input: Mapping[str, Any], *, cwd: Path | None = None) -> str | None:
    """The call's path (`file_path`, `notebook_path` or `path`) resolved against `cwd`
    (`permission_paths.resolve_path`); None when it names none, names it with something other than a
    non-empty string, or names a relative path with no `cwd` given. Glob and Grep without a `path`
    search `cwd`."""
    for key in _PATH_KEYS:
        value = tool_input.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value or "\0" in value:
            return None
        if cwd is None and not (value.startswith("/") or value == "~" or value.startswith("~/")):
            return None
        return resolve_path(value, cwd or Path("/"), Path.home())
    if cwd is not None and tool_name in ("Glob", "Grep"):
        return resolve_path(".", cwd, Path.home())
    return None


def _domain_matches(specifier: str, url: object) -> bool:
    if not specifier.startswith("domain:") or not isinstance(url, str):
        return False
    try:
        host = urlsplit(url.strip()).hostname
    except ValueError:
        return False
    pattern = specifier.removeprefix("domain:").strip().lower().rstrip(".")
    if not host or not pattern:
        return False
    regex = ".*".join(re.escape(piece) for piece in pattern.split("*"))
    return re.fullmatch(regex, host.rstrip(".")) is not None


@dataclass(frozen=True, slots=True)
class PermissionVerdict:
    """What the rules and the mode decided: `allow` runs the tool, `deny` answers the model with `reason` as
    the tool's error, `ask` leaves the call to the host (`can_use_tool`). `rule` is the rule that decided,
    as written (several, comma-separated, when each piece of a Bash command was allowed by its own)."""

    behavior: Literal["allow", "deny", "ask"]
    reason: str
    rule: str | None = None
    undecided: bool = False
    """An `ask` because nothing decided (no rule, hook, safety check or mode): without a `can_use_tool` to ask,
    the caller runs such a call, where an ask that something made is refused."""


def check_mode(mode: str) -> PermissionMode:
    """`mode` when it is one of `PERMISSION_MODES`; ValueError otherwise (`"auto"` with why)."""
    if mode == "auto":
        raise ValueError(
            "permission mode 'auto' is not supported: in Claude Code a classifier model decides each call, "
            "which queryloop does not run; use 'default' with can_use_tool, or 'dontAsk' with allow rules"
        )
    if mode not in PERMISSION_MODES:
        raise ValueError(f"unknown permission mode {mode!r}: expected one of {', '.join(PERMISSION_MODES)}")
    return mode


@dataclass(frozen=True, slots=True)
class _Call:
    """One call and everything its decision reads."""

    tool_name: str
    tool_input: Mapping[str, Any]
    rules: PermissionRules
    mode: PermissionMode
    cwd: Path
    additional: tuple[Path, ...]
    hook_decision: PermissionDecision | None
    hook_reason: str | None
    edit_tools: Collection[str]
    read_tools: Collection[str]
    home: Path = field(default_factory=Path.home)

    @property
    def directories(self) -> tuple[str, ...]:
        """The working directory and the additional ones, resolved."""
        return tuple(resolve_path(str(path), self.cwd, self.home) for path in (self.cwd, *self.additional))

    @property
    def command(self) -> str | None:
        """A Bash call's command, None for another tool or a command that is not a string."""
        command = self.tool_input.get("command")
        return command if self.tool_name == "Bash" and isinstance(command, str) else None

    @property
    def pieces(self) -> list[str]:
        """The command's pieces between shell operators (none for other tools)."""
        return subcommands(self.command) if self.command is not None else []

    @property
    def path(self) -> str | None:
        """The call's resolved path, if it names one."""
        return input_path(self.tool_name, self.tool_input, cwd=self.cwd)

    def described(self) -> str:
        """The call in a verdict's words: `Bash with command …`, `Edit on /path`, `WebFetch for url`."""
        if self.command is not None:
            return f"{self.tool_name} with command {_shortened(self.command)}"
        if self.path is not None:
            return f"{self.tool_name} on {_shortened(self.path)}"
        url = self.tool_input.get("url")
        if self.tool_name == "WebFetch" and isinstance(url, str):
            return f"{self.tool_name} for {_shortened(url)}"
        return self.tool_name


def _shortened(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def decide_permission(
    tool_name: str,
    tool_input: Mapping[str, Any],
    *,
    rules: PermissionRules,
    mode: PermissionMode,
    cwd: Path,
    additional_directories: Iterable[Path] = (),
    hook_decision: PermissionDecision | None = None,
    hook_reason: str | None = None,
    edit_tools: Collection[str] = EDIT_TOOLS,
    read_tools: Collection[str] = READ_TOOLS,
) -> PermissionVerdict:
    """Whether the call runs, as Claude Code decides it before asking, in the Agent SDK's order:

    1. The PreToolUse hooks' combined `hook_decision`: `deny` denies (with `hook_reason`). An `allow` does
       not skip deny or ask rules; `ask` asks. A `defer` decides nothing here: the executor honours it before
       the rules (the call is deferred), and one it ignores goes through the rules as if no hook had decided.
    2. Deny rules, in every mode (`bypassPermissions` too). A Bash command is denied when the whole command,
       or any piece between its operators, matches (as written, or without leading assignments and
       wrappers such as `sudo` or `env`).
    3. Ask rules (and a hook's ask), in every mode; `dontAsk` denies instead of asking. A Bash command asks
       when any piece matches.
    4. Safety checks no rule or hook allow passes: `rm`/`rmdir` of a critical path asks (denied in
       `dontAsk`), in `bypassPermissions` too; a write to a protected path (`.git`, `.claude`, `.bashrc`, …)
       asks in every mode but `bypassPermissions` (denied in `dontAsk`).
    5. The mode: `bypassPermissions` allows; `plan` denies `edit_tools`; `acceptEdits` allows `edit_tools`
       and `mkdir touch rm rmdir mv cp sed` commands on paths inside `cwd` or `additional_directories`;
       in every mode, `read_tools` on a path inside them (Glob and Grep without a path search `cwd`) are
       allowed.
    6. Allow rules allow, and so does a hook's `allow`. A Bash command is allowed only when every piece
       between its operators matches an allow rule as written (`Bash` alone allows any command).
    7. Otherwise `dontAsk` denies, and every other mode answers `ask`: the caller asks `can_use_tool`.

    `mode` "auto" and unknown modes raise ValueError (`check_mode`)."""
    check_mode(mode)
    call = _Call(
        tool_name, tool_input, rules, mode, cwd, tuple(additional_directories), hook_decision, hook_reason,
        edit_tools, read_tools,
    )  # fmt: skip
    for step in (_hooks_and_deny_rules, _ask_rules, _safety, _mode, _allow_rules):
        verdict = step(call)
        if verdict is not None:
            return verdict
    if mode == "dontAsk":
        return PermissionVerdict("deny", f"Permission to use {call.described()} has been denied: no rule allows it.")
    return PermissionVerdict("ask", f"No rule decides {call.described()}: ask.", undecided=True)


def _hooks_and_deny_rules(call: _Call) -> PermissionVerdict | None:
    if call.hook_decision == "deny":
        return PermissionVerdict("deny", call.hook_reason or f"Hook PreToolUse:{call.tool_name} denied this tool")
    rule = _first_restrictive(call.rules.deny, call)
    if rule is None:
        return None
    return PermissionVerdict(
        "deny", f"Permission to use {call.described()} has been denied by the rule {rule}.", str(rule)
    )


def _ask_rules(call: _Call) -> PermissionVerdict | None:
    rule = _first_restrictive(call.rules.ask, call)
    hook_asks = call.hook_decision == "ask"
    if rule is None and not hook_asks:
        return None
    who = f"the rule {rule}" if rule is not None else "a PreToolUse hook"
    if call.mode == "dontAsk":
        reason = f"Permission to use {call.described()} has been denied: {who} asks, and dontAsk mode never asks."
        return PermissionVerdict("deny", reason, _text(rule))
    if rule is None and call.hook_reason:
        return PermissionVerdict("ask", call.hook_reason)
    return PermissionVerdict("ask", f"{who[0].upper()}{who[1:]} asks before {call.described()}.", _text(rule))


def _safety(call: _Call) -> PermissionVerdict | None:
    if any(is_critical_removal(piece, call.cwd, call.additional, call.home) for piece in call.pieces):
        why = "it removes a critical path (the root, a top-level directory, home, or the working directory)"
    elif call.mode not in ("bypassPermissions", "plan") and call.tool_name in call.edit_tools:
        path = call.path
        if path is None or not is_protected(path):
            return None
        why = "it writes a protected path"
    else:
        return None
    if call.mode == "dontAsk":
        return PermissionVerdict("deny", f"Permission to use {call.described()} has been denied: {why}.")
    return PermissionVerdict("ask", f"{call.described()} needs approval: {why}.")


def _mode(call: _Call) -> PermissionVerdict | None:
    if call.mode == "bypassPermissions":
        return PermissionVerdict("allow", "bypassPermissions mode allows what no deny or ask rule stops.")
    editing = call.tool_name in call.edit_tools
    if call.mode == "plan" and editing:
        reason = f"Permission to use {call.described()} has been denied: plan mode does not modify files."
        return PermissionVerdict("deny", reason)
    path = call.path
    inside = path is not None and is_within_any(path, call.directories)
    if call.mode == "acceptEdits" and editing and inside:
        return PermissionVerdict("allow", "acceptEdits mode allows file edits inside the working directories.")
    if call.mode == "acceptEdits" and call.pieces:
        directories = call.directories
        if all(is_working_directory_file_command(p, directories, call.cwd, call.home) for p in call.pieces):
            return PermissionVerdict(
                "allow", "acceptEdits mode allows filesystem commands inside the working directories."
            )
    if call.tool_name in call.read_tools and inside:
        return PermissionVerdict("allow", "Reading inside the working directories needs no approval.")
    return None


def _allow_rules(call: _Call) -> PermissionVerdict | None:
    matched = _allowing_rules(call)
    if matched:
        texts = ", ".join(dict.fromkeys(str(rule) for rule in matched))
        return PermissionVerdict("allow", f"Allowed by the rule {texts}.", texts)
    if call.hook_decision == "allow":
        return PermissionVerdict("allow", "Allowed by a PreToolUse hook.")
    return None


def _allowing_rules(call: _Call) -> list[PermissionRule]:
    """The allow rules that together allow the call: one, or for a Bash command one per piece; [] if none."""
    if call.tool_name == "Bash":
        return _allowing_bash_rules(call)
    for rule in call.rules.allow:
        if rule_matches(rule, call.tool_name, call.tool_input, cwd=call.cwd):
            return [rule]
    return []


def _allowing_bash_rules(call: _Call) -> list[PermissionRule]:
    """`Bash` alone, else one rule per piece of the command (each piece as written); [] if a piece has none."""
    whole = [rule for rule in call.rules.allow if rule.tool_name == "Bash" and rule.specifier is None]
    if whole or call.command is None:
        return whole[:1]
    specific = [rule for rule in call.rules.allow if rule.tool_name == "Bash" and rule.specifier is not None]
    matched: list[PermissionRule] = []
    for piece in call.pieces:
        rule = next((rule for rule in specific if command_matches(rule.specifier or "", piece)), None)
        if rule is None:
            return []
        matched.append(rule)
    return matched


def _first_restrictive(rules: Iterable[PermissionRule], call: _Call) -> PermissionRule | None:
    """The first deny or ask rule that matches the call: for Bash, the whole command or any form of any
    piece of it."""
    for rule in rules:
        if rule.tool_name == "Bash" and rule.specifier is not None and call.command is not None:
            candidates = [call.command, *(form for piece in call.pieces for form in command_forms(piece))]
            if any(command_matches(rule.specifier, candidate) for candidate in candidates):
                return rule
        elif rule_matches(rule, call.tool_name, call.tool_input, cwd=call.cwd):
            return rule
    return None


def _text(rule: PermissionRule | None) -> str | None:
    return None if rule is None else str(rule)
