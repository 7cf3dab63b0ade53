"""Claude Code's settings files (`settings.json`), read for their hooks and permission rules.

* Sources (`load_settings`): the user's `~/.claude/settings.json`, the project's `.claude/settings.json`,
  the local `.claude/settings.local.json` (both in the working folder), each read only when named in
  `setting_sources`, and `settings`, a JSON file or an inline JSON object (the "flag" source, as the SDK's
  `settings=` and the CLI's `--settings`). Precedence, highest first: flag, local, project, user.
  `setting_sources=None` reads no file at all: a divergence from the SDK (whose None reads all three),
  because the working folder's files are outside input and a project's settings run commands; a host opts in
  by naming the sources it trusts.
* Merging, as Claude Code merges: every source's hooks run (an identical command for the same event and
  matcher in several sources runs once, with the highest source's timeout); permission rule lists add up;
  `defaultMode` comes from the highest source that sets it. Everything is listed lowest source first, so a
  later entry is a higher source's (the last allow's `updatedInput` wins, as configuration order says).
* Hostile input: a missing file is skipped; one that cannot be read, is not a regular file, passes 1 MiB,
  is not UTF-8 JSON, is not an object or has a known key of the wrong type is a `SettingsError` naming the
  file and the key (`hooks.PreToolUse[0].hooks[1].timeout must be a positive number`). Unknown keys are
  ignored (Claude Code has many); hooks for an event the loop never fires (`LOOP_EVENTS`), handlers of
  another type than `command` and `http` (`prompt`, `agent`, `mcp_tool`) and `async` ones are skipped with a
  logged warning, since they cannot be run as written. An http hook's url must be an http(s) url
  (`http_hooks.target_of`) and its headers may not set the request's framing. A handler's `if` (one
  permission rule) filters the tool calls it runs for (`command_hooks.condition_holds`); one that is not a
  rule is a `SettingsError`.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from queryloop.runtime.loop.command_hooks import (
    COMMAND_TIMEOUT_S,
    MATCHER_MARGIN_S,
    command_hook_matcher,
    handler_matcher,
)
from queryloop.runtime.loop.http_hooks import (
    FRAMING_HEADERS,
    HTTP_TIMEOUT_S,
    HttpHookError,
    http_hook,
    target_of,
)
from queryloop.runtime.loop.permissions import PermissionRule, parse_rule
from queryloop.runtime.loop.sdk_hooks import HookMatcher

SettingSource = Literal["user", "project", "local"]
"""A filesystem source of settings, as the SDK's `setting_sources` names them."""

MAX_SETTINGS_BYTES = 1 << 20
"""The largest settings file read (1 MiB); a larger one is refused."""

LOOP_EVENTS = frozenset(
    {
        "PreToolUse",
        "PostToolUse",
        "PostToolUseFailure",
        "PostToolBatch",
        "PermissionRequest",
        "PermissionDenied",
        "UserPromptSubmit",
        "Stop",
        "StopFailure",
        "SubagentStart",
        "SubagentStop",
        "PreCompact",
        "PostCompact",
        "SessionStart",
        "SessionEnd",
        "Notification",
    }
)
"""Claude Code's agent-loop events: their hooks are kept (which of them run is the loop's business). Hooks of
its other events (teammates, worktrees, elicitation, ...) are skipped with a warning."""

PermissionMode = Literal["default", "acceptEdits", "plan", "bypassPermissions", "dontAsk", "auto"]
"""The values of `permissions.defaultMode` Claude Code accepts (any other is refused)."""
_ORDER: tuple[SettingSource, ...] = ("user", "project", "local")


class SettingsError(ValueError):
    """A settings source that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class RuleText:
    """A permission rule as written (`"Bash(git *)"`) and the directory of the settings file it came from
    (`<project>/.claude`, `~/.claude`, the flag file's folder; None for inline JSON): a `/p` path in the rule
    is relative to its settings file's source."""

    text: str
    settings_dir: Path | None


@dataclass(frozen=True, slots=True)
class PermissionSettings:
    """`permissions` of every source, merged: the rule lists added up (each rule once), `default_mode` from
    the highest source that sets it, `additional_directories` absolute (`~/` against the home folder, a
    relative one against the working folder, as the CLI's `--add-dir` reads it)."""

    allow: tuple[RuleText, ...] = ()
    deny: tuple[RuleText, ...] = ()
    ask: tuple[RuleText, ...] = ()
    default_mode: str | None = None
    additional_directories: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Settings:
    """What the chosen sources say: hooks by event (command and http hooks as `HookMatcher`s), permissions, and the
    sources read (lowest first; `"inline"` for inline JSON)."""

    hooks: dict[str, list[HookMatcher]] = field(default_factory=dict)
    permissions: PermissionSettings = field(default_factory=PermissionSettings)
    sources: tuple[Path | Literal["inline"], ...] = ()


# The file's schema: what crosses the boundary is checked here, then turned into the dataclasses above.
_NonEmpty = Annotated[str, Field(min_length=1)]


class _Handler(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    type: Literal["command", "http", "prompt", "agent", "mcp_tool"]
    command: str | None = None
    url: str | None = None
    headers: dict[str, str] = {}
    allowedEnvVars: list[str] = []
    timeout: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    if_: str | None = Field(default=None, alias="if")
    async_: bool = Field(default=False, alias="async")

    @model_validator(mode="after")
    def _what_its_type_needs(self) -> _Handler:
        if self.type == "command" and not (self.command or "").strip():
            msg = "a command hook needs a non-empty command"
            raise ValueError(msg)
        if self.type == "http":
            if not (self.url or "").strip():
                msg = "an http hook needs a non-empty url"
                raise ValueError(msg)
            try:
                target_of(self.url or "")
            except HttpHookError as error:
                raise ValueError(str(error)) from None
            framing = sorted(name for name in self.headers if name.lower() in FRAMING_HEADERS)
            if framing:
                msg = f"an http hook may not set the header {framing[0]!r}: the request's framing sets it"
                raise ValueError(msg)
        return self

    @property
    def identity(self) -> str:
        """What makes two handlers of an event and matcher the same one (run once): the command or the url."""
        return (self.command if self.type == "command" else self.url) or ""


class _MatcherGroup(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    matcher: str | None = None
    hooks: list[_Handler]


class _Permissions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    allow: list[_NonEmpty] = []
    deny: list[_NonEmpty] = []
    ask: list[_NonEmpty] = []
    defaultMode: PermissionMode | None = None
    additionalDirectories: list[_NonEmpty] = []


class _File(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    hooks: dict[str, list[_MatcherGroup]] = {}
    permissions: _Permissions | None = None


@dataclass(frozen=True, slots=True)
class _Layer:
    origin: Path | Literal["inline"]
    settings_dir: Path | None
    shown: str
    content: _File


def _key_path(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _message(error: Any) -> str:
    kind, msg = error["type"], str(error["msg"])
    if kind in ("greater_than", "finite_number"):
        return "must be a positive number"
    if kind == "missing":
        return "is required"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == "string_too_short":
        return "must not be empty"
    return msg.replace("Input should be", "must be", 1)


def _validated(raw: object, shown: str) -> _File:
    if not isinstance(raw, dict):
        msg = f"{shown}: must be a JSON object, not {type(raw).__name__}"
        raise SettingsError(msg)
    try:
        return _File.model_validate(raw)
    except ValidationError as error:
        errors = error.errors()
        first = errors[0]
        where = _key_path(tuple(first["loc"]))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        msg = f"{shown}: {where + ' ' if where else ''}{_message(first)}{more}"
        raise SettingsError(msg) from None


def _parsed(data: bytes, shown: str) -> object:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        msg = f"{shown}: is not UTF-8 text"
        raise SettingsError(msg) from None
    if not text.strip():
        return {}  # an empty file says nothing
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        msg = f"{shown}: is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        raise SettingsError(msg) from None
    except (ValueError, RecursionError) as error:  # a number past Python's digit limit, nesting past the stack
        msg = f"{shown}: is not valid JSON: {type(error).__name__}"
        raise SettingsError(msg) from None


def _read_at_most(fd: int, limit: int) -> bytes:
    data = bytearray()
    while len(data) < limit and (chunk := os.read(fd, limit - len(data))):
        data += chunk
    return bytes(data)


def _read(path: Path, *, required: bool) -> object | None:
    """The JSON in `path`, None when there is none (unless `required`); `SettingsError` for anything else.
    Opened without blocking (a FIFO put there does not hang the query) and read to 1 MiB at most."""
    shown = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        if required:
            msg = f"{shown}: does not exist"
            raise SettingsError(msg) from None
        return None
    except OSError as error:
        msg = f"{shown}: cannot be read ({error.strerror})"
        raise SettingsError(msg) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            msg = f"{shown}: is not a regular file"
            raise SettingsError(msg)
        data = _read_at_most(fd, MAX_SETTINGS_BYTES + 1)
    except OSError as error:
        msg = f"{shown}: cannot be read ({error.strerror})"
        raise SettingsError(msg) from None
    finally:
        os.close(fd)
    if len(data) > MAX_SETTINGS_BYTES:
        msg = f"{shown}: is larger than {MAX_SETTINGS_BYTES} bytes"
        raise SettingsError(msg)
    return _parsed(data, shown)


def _source_path(source: SettingSource, cwd: Path, home: Path) -> Path:
    if source == "user":
        return home / ".claude" / "settings.json"
    return cwd / ".claude" / ("settings.json" if source == "project" else "settings.local.json")


def _chosen(setting_sources: Sequence[SettingSource] | None) -> list[SettingSource]:
    names = list(setting_sources or ())
    unknown = [name for name in names if name not in _ORDER]
    if unknown:
        msg = f"setting_sources: {unknown[0]!r} is not one of {', '.join(_ORDER)}"
        raise SettingsError(msg)
    return [source for source in _ORDER if source in names]


def _flag_layer(settings: str | Path, cwd: Path) -> _Layer:
    if isinstance(settings, str) and settings.lstrip().startswith("{"):
        shown = "inline settings"
        return _Layer("inline", None, shown, _validated(_parsed(settings.encode(), shown), shown))
    path = Path(settings)
    path = path if path.is_absolute() else cwd / path
    return _Layer(path, path.parent, str(path), _validated(_read(path, required=True), str(path)))


def _runnable(handler: _Handler, event: str, shown: str) -> bool:
    """Whether a handler can run here; the reason it cannot is logged."""
    why = None
    if handler.type not in ("command", "http"):
        why = f"{handler.type!r} hooks are not supported (only 'command' and 'http')"
    elif handler.async_:
        why = "'async' hooks are not supported yet"
    if why is not None:
        logger.warning("{}: a {} hook is skipped: {}", shown, event, why)
    return why is None


def _layer_hooks(
    layer: _Layer, seen: set[tuple[str, str, str]], cwd: Path
) -> list[tuple[str, str | None, _Handler, PermissionRule | None]]:
    entries = []
    for event, groups in layer.content.hooks.items():
        if event not in LOOP_EVENTS:
            logger.warning("{}: hooks for {!r} are skipped: not an agent-loop event", layer.shown, event)
            continue
        for group in groups:
            for handler in group.hooks:
                if not _runnable(handler, event, layer.shown):
                    continue
                key = (event, group.matcher or "*", handler.identity)
                if key not in seen:
                    seen.add(key)
                    entries.append((event, group.matcher, handler, _condition(handler, layer, event, cwd)))
    return entries


def _hooks(layers: Sequence[_Layer], project_dir: Path) -> dict[str, list[HookMatcher]]:
    seen: set[tuple[str, str, str]] = set()
    per_layer = [_layer_hooks(layer, seen, project_dir) for layer in reversed(layers)]  # highest first: kept
    hooks: dict[str, list[HookMatcher]] = {}
    for entries in reversed(per_layer):
        for event, matcher, handler, condition in entries:
            hooks.setdefault(event, []).append(_matcher(event, matcher, handler, condition, project_dir))
    return hooks


def _matcher(
    event: str, matcher: str | None, handler: _Handler, condition: PermissionRule | None, project_dir: Path
) -> HookMatcher:
    if handler.type == "http":
        timeout_s = handler.timeout or HTTP_TIMEOUT_S
        callback = http_hook(
            handler.url or "", headers=handler.headers, allowed_env_vars=handler.allowedEnvVars, timeout_s=timeout_s
        )
        deadline_s = timeout_s + MATCHER_MARGIN_S
        return handler_matcher(matcher, callback, deadline_s=deadline_s, condition=condition, cwd=project_dir)
    return command_hook_matcher(
        matcher,
        handler.command or "",
        event=event,
        timeout_s=handler.timeout or COMMAND_TIMEOUT_S,
        project_dir=project_dir,
        condition=condition,
    )


def _condition(handler: _Handler, layer: _Layer, event: str, cwd: Path) -> PermissionRule | None:
    """A handler's `if` as a permission rule (`SettingsError` for one that is not a rule)."""
    if handler.if_ is None:
        return None
    try:
        return parse_rule(handler.if_, settings_dir=layer.settings_dir, cwd=cwd)
    except (TypeError, ValueError) as error:
        msg = f"{layer.shown}: hooks.{event}: 'if' {handler.if_!r} is not a permission rule: {error}"
        raise SettingsError(msg) from None


def _directory(text: str, cwd: Path, home: Path) -> Path:
    if text == "~" or text.startswith("~/"):
        return Path(os.path.normpath(home / text[2:]))
    path = Path(text)
    return Path(os.path.normpath(path if path.is_absolute() else cwd / path))


def _added(items: list[Any], new: Any) -> None:
    if new not in items:
        items.append(new)


def _permissions(layers: Sequence[_Layer], cwd: Path, home: Path) -> PermissionSettings:
    rules: dict[str, list[RuleText]] = {"allow": [], "deny": [], "ask": []}
    default_mode = None
    directories: list[Path] = []
    for layer in layers:  # lowest first: a higher source's defaultMode replaces a lower one's
        permissions = layer.content.permissions
        if permissions is None:
            continue
        for kind, texts in (("allow", permissions.allow), ("deny", permissions.deny), ("ask", permissions.ask)):
            for text in texts:
                _added(rules[kind], RuleText(text, layer.settings_dir))
        default_mode = permissions.defaultMode or default_mode
        for text in permissions.additionalDirectories:
            _added(directories, _directory(text, cwd, home))
    return PermissionSettings(
        tuple(rules["allow"]), tuple(rules["deny"]), tuple(rules["ask"]), default_mode, tuple(directories)
    )


def load_settings(
    *, settings: str | Path | None, setting_sources: Sequence[SettingSource] | None, cwd: Path, home: Path
) -> Settings:
    """The settings of the named sources and of `settings` (a path, relative to `cwd`, or inline JSON),
    merged (module docstring); command hooks run in `cwd`. `SettingsError` for a source that cannot be used."""
    layers: list[_Layer] = []
    for source in _chosen(setting_sources):
        path = _source_path(source, cwd, home)
        raw = _read(path, required=False)
        if raw is not None:
            layers.append(_Layer(path, path.parent, str(path), _validated(raw, str(path))))
    if settings is not None:
        layers.append(_flag_layer(settings, cwd))
    return Settings(
        hooks=_hooks(layers, cwd),
        permissions=_permissions(layers, cwd, home),
        sources=tuple(layer.origin for layer in layers),
    )
