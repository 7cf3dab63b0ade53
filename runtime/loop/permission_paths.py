"""File paths as Claude Code's permission rules read them: pure path arithmetic, no file system access.

* `resolve_path`: a tool input's path made absolute against the working directory, `~/` expanded and
  `..` collapsed (`os.path.normpath`). Symlinks are not followed: the file system is never read, so a
  link inside the working directory that points outside it counts as inside.
* `path_pattern_matches`: a rule's gitignore-style pattern against a resolved path. `**` spans any
  number of directories, `*` and `?` stay within one, `[...]` is a character class; a pattern with no
  slash but a trailing one matches at any depth (`.env`, `*.pem`); one with a slash is anchored to its
  root. A pattern that matches a directory matches everything below it, as gitignore ignores a folder's
  contents with the folder.
* `is_within`, `is_protected`: whether a path is inside a directory, and whether it is one of Claude
  Code's protected paths (repository state and tool configuration), whose writes no mode but
  `bypassPermissions` approves without asking.

Imports nothing of ours.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from pathlib import Path

PROTECTED_DIRECTORIES = frozenset(
    {".git", ".vscode", ".idea", ".husky", ".cargo", ".devcontainer", ".yarn", ".mvn", ".claude"}
)
"""Directories whose contents are protected wherever they are (`.claude/worktrees` excepted; `.config/git`
is protected too)."""

PROTECTED_FILES = frozenset(
    {
        ".gitconfig", ".gitmodules", ".bashrc", ".bash_profile", ".bash_login", ".bash_aliases",
        ".bash_logout", ".zshrc", ".zprofile", ".zshenv", ".zlogin", ".zlogout", ".profile", ".envrc",
        ".npmrc", ".yarnrc", ".yarnrc.yml", ".pnp.cjs", ".pnp.loader.mjs", ".pnpmfile.cjs", "bunfig.toml",
        ".bunfig.toml", ".bazelrc", ".bazelversion", ".bazeliskrc", ".pre-commit-config.yaml", "lefthook.yml",
        "lefthook.yaml", ".lefthook.yml", ".lefthook.yaml", "gradle-wrapper.properties",
        "maven-wrapper.properties", ".devcontainer.json", ".ripgreprc", "pyrightconfig.json", ".mcp.json",
        ".claude.json",
    }
)  # fmt: skip
"""File names protected in any directory."""


def resolve_path(path: str, cwd: Path, home: Path) -> str:
    """`path` as an absolute, normalized path: `~` and `~/…` are read from `home`, anything else not
    absolute from `cwd`; `..` and `.` are collapsed without reading the file system."""
    if path == "~" or path.startswith("~/"):
        path = str(home) + path[1:]
    joined = os.path.normpath(os.path.join(str(cwd), path))
    return "/" + joined.lstrip("/") if joined.startswith("//") else joined


def is_within(path: str, directory: str) -> bool:
    """Whether the resolved `path` is `directory` or below it (both absolute and normalized)."""
    return directory in ("/", path) or path.startswith(directory.rstrip("/") + "/")


def is_within_any(path: str, directories: Iterable[str]) -> bool:
    """Whether the resolved `path` is inside one of `directories`."""
    return any(is_within(path, directory) for directory in directories)


def is_protected(path: str) -> bool:
    """Whether writing the resolved `path` writes one of Claude Code's protected paths."""
    parts = [part for part in path.split("/") if part]
    for index, part in enumerate(parts[:-1]):
        following = parts[index + 1]
        if part == ".claude" and following == "worktrees":
            continue
        if part in PROTECTED_DIRECTORIES or (part == ".config" and following == "git"):
            return True
    return bool(parts) and (parts[-1] in PROTECTED_FILES or parts[-1] in PROTECTED_DIRECTORIES)


def path_pattern_matches(pattern: str, root: str, path: str) -> bool:
    """Whether a rule's `pattern` (relative to `root`; anchored when it starts with `/`) matches the resolved
    `path`: the path itself or one of its ancestors below `root` matches the pattern."""
    if not is_within(path, root) or path == root:
        return False
    relative = path[len(root.rstrip("/")) + 1 :]
    regex = _compiled(pattern)
    parts = relative.split("/")
    return any(regex.fullmatch("/".join(parts[:depth])) for depth in range(1, len(parts) + 1))


@functools.lru_cache(maxsize=512)
def _compiled(pattern: str) -> re.Pattern[str]:
    anchored = pattern.startswith("/")
    body = pattern.lstrip("/").rstrip("/")
    if not anchored and "/" in body:
        anchored = True  # gitignore: a slash inside the pattern anchors it too
    regex = _translate(body)
    try:
        return re.compile(regex if anchored else f"(?:.*/)?{regex}", re.DOTALL)
    except re.error as error:  # a character class such as [z-a]
        raise ValueError(f"path pattern {pattern!r} is not a valid glob ({error})") from None


def check_path_pattern(pattern: str) -> None:
    """Raise ValueError when `pattern` cannot be read as a glob (a character class such as `[z-a]`)."""
    _compiled(pattern)


def _translate(glob: str) -> str:
    """A gitignore glob as a regular expression over a `/`-separated relative path."""
    out: list[str] = []
    index = 0
    while index < len(glob):
        char = glob[index]
        if glob.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
        elif glob.startswith("**", index):
            out.append(".*")
            index += 2
        elif char == "*":
            out.append("[^/]*")
            index += 1
        elif char == "?":
            out.append("[^/]")
            index += 1
        elif char == "[" and (end := glob.find("]", index + 2)) != -1:
            members = glob[index + 1 : end]
            negate = members[:1] in ("!", "^")
            members = members[1:] if negate else members
            out.append(("[^/" if negate else "[") + members.replace("\\", "\\\\") + "]")
            index = end + 1
        elif char == "\\" and index + 1 < len(glob):
            out.append(re.escape(glob[index + 1]))
            index += 2
        else:
            out.append(re.escape(char))
            index += 1
    return "".join(out)
