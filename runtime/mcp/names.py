"""MCP tool names as the model sees them: `mcp__<server>__<tool>`, unique and within the API's rule.

A server's tool names are its own: MCP allows dots, slashes and names of any length, while a client
tool's name must match `^[a-zA-Z0-9_-]{1,128}$` (`queryloop.runtime.loop.tools.TOOL_NAME`). Each part
has what a name cannot hold replaced by `_`, as Claude Code does; two names that clean up alike
(`a.b` and `a_b`), or one that cleaning makes too long, would otherwise give the model one name for
two tools, or a name every request is refused for. `tool_names` settles both, the same way whatever
order the server lists its tools in. Plain functions, importable without the `mcp` SDK.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

MAX_NAME = 128
"""The longest tool name the Messages API takes."""

_UNSAFE = re.compile(r"[^a-zA-Z0-9_-]")
_TAG = 8
"""Hex digits of the original name's digest a renamed tool ends with."""


def clean(part: str) -> str:
    """`part` with every character a tool name cannot hold replaced by `_` (Claude Code's rule)."""
    return _UNSAFE.sub("_", part)


def tool_name(server: str, tool: str) -> str:
    """`mcp__<server>__<tool>`, each part cleaned: the name a tool gets when nothing clashes and it fits."""
    return f"mcp__{clean(server)}__{clean(tool)}"


def tool_names(server: str, tools: Iterable[str]) -> dict[str, str]:
    """Each of the server's tool names (its own, as listed) to the name the model sees.

    Guarantees: every name matches the API's rule (at most `MAX_NAME` characters); no two tools share
    one; and the mapping depends only on the set of names, never on the order they were listed in.
    A tool keeps `tool_name(server, tool)` when that fits and is free. Names already clean are served
    first, then the others in sorted order, so of `a_b` and `a.b` it is `a_b` that keeps
    `mcp__<server>__a_b`; a later one that clashes, or does not fit, ends with `_` and a digest of
    its own name (a second clash, which takes a digest collision, adds a counter).
    """
    order = sorted(set(tools), key=lambda tool: (clean(tool) != tool, tool))
    taken: set[str] = set()
    names: dict[str, str] = {}
    for tool in order:
        full = tool_name(server, tool)
        attempt = 0
        name = _fitted(full, tool, attempt)
        while name in taken:
            attempt += 1
            name = _fitted(full, tool, attempt)
        taken.add(name)
        names[tool] = name
    return names


def _fitted(full: str, tool: str, attempt: int) -> str:
    """`full` itself (attempt 0, when it fits), else cut to leave room for `_<digest of tool>` (and `_<n>`)."""
    if attempt == 0 and len(full) <= MAX_NAME:
        return full
    digest = hashlib.sha256(tool.encode("utf-8", "surrogatepass")).hexdigest()[:_TAG]
    tag = digest if attempt <= 1 else f"{digest}_{attempt}"
    return f"{full[: MAX_NAME - len(tag) - 1]}_{tag}"
