"""Which hooks an event runs, and what their permission decisions add up to: pure functions, as Claude
Code decides them (its hooks reference), for the control plane's hooks in the Agent SDK's shape.

* A matcher (`HookMatcher.matcher`, a settings file's `"matcher"`) is read by what it is made of: absent,
  `""` or `"*"` matches everything; only letters, digits, `_`, `-`, spaces, `,` and `|` is an exact name or
  a list of them by `|` or `,` (`"Write|Edit"`, `"Write, Edit"`, `"mcp__my-server__search"`; so the MCP
  server prefix `"mcp__memory"` matches no tool); anything else is a regular expression searched in the
  name, unanchored, as JavaScript's `RegExp.test` is (`"mcp__memory__.*"`, `"^Notebook"`). A matcher that
  is not a valid expression matches nothing (a settings file is outside input: it must not end the query).
* Matching hooks run in parallel; of their PreToolUse `permissionDecision`s deny beats defer, defer beats
  ask, and ask beats allow (`strongest_decision`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Literal

PermissionDecision = Literal["allow", "deny", "ask", "defer"]
"""A PreToolUse hook's `hookSpecificOutput.permissionDecision`."""

_PRECEDENCE: dict[str, int] = {"allow": 0, "ask": 1, "defer": 2, "deny": 3}
_EXACT = re.compile(r"[A-Za-z0-9_\-,| ]+")
_SEPARATORS = re.compile(r"[|,]")


def matcher_matches(matcher: str | None, name: str) -> bool:
    """Whether a hook with `matcher` runs for `name` (a tool's name, or the event's own matched field)."""
    if matcher is None or matcher in ("", "*"):
        return True
    if _EXACT.fullmatch(matcher):
        return name in _names(matcher)
    pattern = _compiled(matcher)
    return pattern is not None and pattern.search(name) is not None


@functools.lru_cache(maxsize=256)
def _names(matcher: str) -> frozenset[str]:
    return frozenset(part.strip() for part in _SEPARATORS.split(matcher))


@functools.lru_cache(maxsize=256)
def _compiled(matcher: str) -> re.Pattern[str] | None:
    try:
        return re.compile(matcher)
    except re.error:
        return None


def strongest_decision(decisions: Iterable[str | None]) -> PermissionDecision | None:
    """The permission decision of several hooks that ran for one tool call: deny, then defer, then ask, then
    allow; None when none decided (or a value is not one of the four: an unknown decision decides nothing)."""
    strongest: PermissionDecision | None = None
    for decision in decisions:
        if decision in _PRECEDENCE and (strongest is None or _PRECEDENCE[decision] > _PRECEDENCE[strongest]):
            strongest = decision  # type: ignore[assignment]  # one of the four, checked above
    return strongest
