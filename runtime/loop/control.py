"""A query's control plane, assembled as Claude Code assembles it before the first turn: the settings files its
options name (`runtime.loop.settings`), their command hooks added to the options' hooks, and the permission
rules and mode (`runtime.loop.permissions`) that decide each tool call before `can_use_tool` is asked.

* Hooks: every settings source's hooks, then `QueryOptions.hooks`, then the older `post_tool_use_hooks` (as
  PostToolUse callbacks, `runtime.loop.post_tool_use`), all of an event running together.
* Rules: `allowed_tools` and `disallowed_tools` (read relative to `cwd`) join the settings files' `allow`
  and `deny`; `ask` comes from the files. The mode is `permission_mode`, else the highest source's
  `defaultMode`, else `default`. `add_dirs` and the files' `additionalDirectories` count as inside.
* `can_use_tool` is called as the Agent SDK calls it, `(tool_name, input, ToolPermissionContext)`; one that
  takes two arguments, the runtime's older form, is called with two.
* An `Allow(updated_permissions=...)` changes the rules and the mode for the rest of the session
  (`Permissions.apply`): every destination is kept in memory, as the SDK's `"session"` is; no settings file
  is written (docs/permissions.md says why).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from queryloop.runtime.loop.permission_paths import resolve_path
from queryloop.runtime.loop.permissions import (
    PermissionMode,
    PermissionRule,
    PermissionRules,
    PermissionVerdict,
    check_mode,
    decide_permission,
    parse_rule,
)
from queryloop.runtime.loop.post_tool_use import legacy_matcher
from queryloop.runtime.loop.settings import RuleText, Settings, load_settings

if TYPE_CHECKING:
    from queryloop.runtime.loop.hook_matching import PermissionDecision
    from queryloop.runtime.loop.options import QueryOptions
    from queryloop.runtime.loop.sdk_hooks import HookMatcher


@dataclass
class PermissionRuleValue:
    """A rule in an SDK `PermissionUpdate`: a tool's name and what it matches within it (None: all of it)."""

    tool_name: str
    rule_content: str | None = None

    def text(self) -> str:
        """The rule as a settings file writes it: `Tool` or `Tool(content)`."""
        return self.tool_name if not self.rule_content else f"{self.tool_name}({self.rule_content})"


PermissionUpdateDestination = Literal["userSettings", "projectSettings", "localSettings", "session"]


@dataclass
class PermissionUpdate:
    """A change to the permissions, as the SDK's `PermissionUpdate` (same fields): rules added, replaced or
    removed for a `behavior`, the mode set, directories added or removed."""

    type: Literal["addRules", "replaceRules", "removeRules", "setMode", "addDirectories", "removeDirectories"]
    rules: list[PermissionRuleValue] | None = None
    behavior: Literal["allow", "deny", "ask"] | None = None
    mode: PermissionMode | None = None
    directories: list[str] | None = None
    destination: PermissionUpdateDestination | None = None


@dataclass
class ToolPermissionContext:
    """`can_use_tool`'s third argument, as the SDK's (same fields): `tool_use_id` names the call, `agent_id` the
    subagent that makes it (None for the session's own), `decision_reason` why it is asked (a PreToolUse
    hook's `permissionDecisionReason`, or the rule that asks). `signal` is reserved (None) and there are no
    `suggestions`, as no permission prompt is drawn here."""

    signal: Any | None = None
    suggestions: list[PermissionUpdate] = field(default_factory=list)
    tool_use_id: str | None = None
    agent_id: str | None = None
    blocked_path: str | None = None
    decision_reason: str | None = None
    title: str | None = None
    display_name: str | None = None
    description: str | None = None


PermissionAsker = Callable[[str, dict[str, Any], ToolPermissionContext], Awaitable[object]]
"""`can_use_tool` as the executor calls it: always with the context."""


def permission_asker(can_use_tool: Callable[..., Awaitable[object]] | None) -> PermissionAsker | None:
    """`can_use_tool` called with three arguments (the SDK's form), or wrapped to drop the context (a callback
    that takes two: the runtime's older form)."""
    if can_use_tool is None:
        return None
    if _takes_context(can_use_tool):
        return can_use_tool
    older = can_use_tool

    async def without_context(name: str, tool_input: dict[str, Any], context: ToolPermissionContext) -> object:
        return await older(name, tool_input)

    return without_context


def _takes_context(fn: Callable[..., Any]) -> bool:
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): the SDK's form
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in parameters)


@dataclass
class Permissions:
    """A session's permission rules, mode and directories as they are now: the control plane's, then every
    update an `Allow(updated_permissions=...)` made (shared by the session's queries)."""

    rules: PermissionRules
    mode: PermissionMode
    cwd: Path
    additional_directories: tuple[Path, ...] = ()
    applied: list[PermissionUpdate] = field(default_factory=list)
    """Every update applied so far: the session keeps this list, and its next query's permissions replay it."""

    def decide(
        self,
        tool_name: str,
        tool_input: dict[str, Any],
        hook_decision: PermissionDecision | None = None,
        hook_reason: str | None = None,
    ) -> PermissionVerdict:
        """The rules' and the mode's verdict on one call (`decide_permission`)."""
        return decide_permission(
            tool_name,
            tool_input,
            rules=self.rules,
            mode=self.mode,
            cwd=self.cwd,
            additional_directories=self.additional_directories,
            hook_decision=hook_decision,
            hook_reason=hook_reason,
        )

    def apply(self, updates: list[PermissionUpdate], *, replayed: bool = False) -> None:
        """Each update, in order (ValueError or TypeError for one that is not a `PermissionUpdate` or lacks what
        its type needs: none is applied then); kept in `applied` unless `replayed` from it."""
        rules, mode, directories = self.rules, self.mode, list(self.additional_directories)
        for update in updates:
            if not isinstance(update, PermissionUpdate):
                msg = f"updated_permissions holds {type(update).__name__}, not a PermissionUpdate"
                raise TypeError(msg)
            if update.type == "setMode":
                mode = check_mode(_needed(update.mode, update, "mode"))
            elif update.type in ("addDirectories", "removeDirectories"):
                named = [
                    resolve_path(d, self.cwd, Path.home()) for d in _needed(update.directories, update, "directories")
                ]
                if update.type == "addDirectories":
                    directories.extend(Path(d) for d in named if Path(d) not in directories)
                else:
                    directories = [d for d in directories if str(d) not in named]
            else:
                rules = _updated_rules(rules, update, self.cwd)
        self.rules, self.mode, self.additional_directories = rules, mode, tuple(directories)
        if not replayed:
            self.applied.extend(updates)


def _needed(value: Any, update: PermissionUpdate, name: str) -> Any:
    if value is None:
        msg = f"PermissionUpdate(type={update.type!r}) has no {name}"
        raise ValueError(msg)
    return value


def _updated_rules(rules: PermissionRules, update: PermissionUpdate, cwd: Path) -> PermissionRules:
    behavior = _needed(update.behavior, update, "behavior")
    given = [parse_rule(rule.text(), cwd=cwd) for rule in _needed(update.rules, update, "rules")]
    current: tuple[PermissionRule, ...] = getattr(rules, behavior)
    if update.type == "addRules":
        changed = (*current, *(rule for rule in given if rule not in current))
    elif update.type == "replaceRules":
        changed = tuple(given)
    else:  # removeRules
        changed = tuple(rule for rule in current if rule not in given)
    parts = {"allow": rules.allow, "deny": rules.deny, "ask": rules.ask, behavior: changed}
    return PermissionRules(allow=parts["allow"], deny=parts["deny"], ask=parts["ask"])


@dataclass(frozen=True)
class ControlPlane:
    """A query's hooks by event and its session's permissions (module docstring)."""

    matchers: dict[str, tuple[HookMatcher, ...]]
    permissions: Permissions
    governs: bool
    """Whether rules or a mode decide anything (else, without hooks or `can_use_tool`, every call runs)."""


_NO_SETTINGS = Settings()


def control_plane(options: QueryOptions, *, home: Path | None = None) -> ControlPlane:
    """The control plane of a query with `options` (module docstring): `SettingsError` for a settings source that
    cannot be used, ValueError for a rule or a mode that is not Claude Code's."""
    home = home if home is not None else Path.home()
    cwd = Path(resolve_path(str(options.cwd), Path.cwd(), home)) if options.cwd is not None else Path.cwd()
    settings = _NO_SETTINGS
    if options.settings is not None or options.setting_sources:
        settings = load_settings(
            settings=options.settings,
            setting_sources=options.setting_sources,
            cwd=cwd,
            home=home,
        )
    matchers = _matchers(options, settings)
    granted = settings.permissions
    rules = PermissionRules(
        allow=_parsed([*(RuleText(t, None) for t in options.allowed_tools), *granted.allow], cwd),
        deny=_parsed([*(RuleText(t, None) for t in options.disallowed_tools), *granted.deny], cwd),
        ask=_parsed(list(granted.ask), cwd),
    )
    mode = check_mode(options.permission_mode or granted.default_mode or "default")
    directories = (*granted.additional_directories, *(Path(resolve_path(str(d), cwd, home)) for d in options.add_dirs))
    governs = bool(rules.allow or rules.deny or rules.ask) or mode != "default"
    return ControlPlane(matchers, Permissions(rules, mode, cwd, tuple(dict.fromkeys(directories))), governs)


def _matchers(options: QueryOptions, settings: Settings) -> dict[str, tuple[HookMatcher, ...]]:
    """Every source's hooks by event: the settings files', the options', then the older `post_tool_use_hooks`."""
    matchers: dict[str, tuple[HookMatcher, ...]] = {}
    for event, listed in [*settings.hooks.items(), *options.hooks.items()]:
        if listed:
            matchers[event] = (*matchers.get(event, ()), *listed)
    if options.post_tool_use_hooks:
        matchers["PostToolUse"] = (*matchers.get("PostToolUse", ()), legacy_matcher(options.post_tool_use_hooks))
    return matchers


def _parsed(texts: list[RuleText], cwd: Path) -> tuple[PermissionRule, ...]:
    return tuple(parse_rule(t.text, settings_dir=t.settings_dir, cwd=cwd) for t in texts)
