"""Bash commands as the permission checks read them: pure string functions, no shell is run.

This is operator splitting, not a shell parser, and it errs on the side of asking:

* `subcommands`: a command cut at every shell operator (`&&`, `||`, `;`, `|`, `|&`, a background `&`,
  newlines, `$(`, backticks, `<(`, `>(`, parentheses and braces), quotes or not. A quoted `;` therefore
  cuts too: for an allow rule that only makes the command harder to allow (each piece must be allowed),
  and for a deny rule it only gives it more pieces to match. `${NAME}` is kept whole.
* `command_matches`: a `Bash(specifier)` rule's glob against one command.
* `command_forms`: a piece as written, then with its leading `NAME=value` assignments and wrappers
  (`env`, `sudo`, `nohup`, `nice`, `timeout`, `time`, `command`, `exec`, `builtin`) removed, whitespace
  collapsed and quotes read: what a deny or ask rule is matched against (an allow rule only sees the piece
  as written).
* `is_critical_removal`: an `rm` or `rmdir` of the file system root, a top-level directory, the home
  directory, the working directory or one of its parents, a glob directly under an additional directory
  (or its parents), or a glob or trailing slash directly under an unguarded shell variable (`"$DIR"/*`).
* `is_working_directory_file_command`: `mkdir`, `touch`, `rm`, `rmdir`, `mv`, `cp` or `sed` (optionally
  behind safe environment variables or `timeout`, `nice`, `nohup`) whose every path is inside the working
  directories and not protected: what `acceptEdits` approves. A `sed` script must be one plain `s`
  substitution (no `e` or `w` flag, no script file); anything with `$`, `<` or `>` is not approved.

Imports only `queryloop.runtime.loop.permission_paths`.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from queryloop.runtime.loop.permission_paths import is_protected, is_within, is_within_any, resolve_path

FILE_COMMANDS = frozenset({"mkdir", "touch", "rm", "rmdir", "mv", "cp", "sed"})
"""The filesystem commands `acceptEdits` approves on paths inside the working directories."""

_SPLIT = re.compile(r"(\$\{[^}]*\})|&&|\|\||\|&|;;|\$\(|<\(|>\(|[;|`\n\r(){}]|(?<![<>&])&(?![>&])")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_WRAPPERS = frozenset({"env", "sudo", "nohup", "nice", "timeout", "time", "command", "exec", "builtin"})
_SAFE_WRAPPERS = frozenset({"nohup", "nice", "timeout"})
_SAFE_VARIABLES = frozenset({"LANG", "LANGUAGE", "TZ", "NO_COLOR", "FORCE_COLOR", "TERM", "COLUMNS"})
_DURATION = re.compile(r"\d+(?:\.\d+)?[smhd]?")
_SED_SCRIPT = re.compile(r"s([^\w\s\\])(?:\\.|(?!\1).)*\1(?:\\.|(?!\1).)*\1[gpiImM0-9]*", re.DOTALL)
_VARIABLE_THEN_SLASH = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_]\w*)(?P<guard>:\?[^}]*)?\}|[A-Za-z_]\w*)/")
_HOME_VARIABLE = re.compile(r"\$(?:HOME|PWD|\{HOME\}|\{PWD\})/?")
_GLOB = re.compile(r"[*?\[]")


def subcommands(command: str) -> list[str]:
    """The pieces of `command` between shell operators, stripped, empty ones dropped."""
    pieces: list[str] = []
    start = 0
    for match in _SPLIT.finditer(command):
        if match.group(1):  # ${NAME}: part of a word, not an operator
            continue
        pieces.append(command[start : match.start()])
        start = match.end()
    pieces.append(command[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


def command_matches(specifier: str, command: str) -> bool:
    """Whether a `Bash(specifier)` rule matches one `command` (already cut at its operators, or not): `*`
    matches any run of characters, a trailing `:*` is a trailing ` *`, and a trailing ` *` that is the only
    wildcard also matches the bare command; `\\*` is a literal star."""
    return _bash_regex(specifier).fullmatch(command.strip()) is not None


def _bash_regex(specifier: str) -> re.Pattern[str]:
    if specifier.endswith(":*"):
        specifier = specifier[:-2] + " *"
    parts = re.split(r"(\\\\|\\\*|\*)", specifier)
    stars = parts[1::2].count("*")
    optional_tail = stars == 1 and specifier.endswith(" *") and not specifier.endswith("\\ *")
    if optional_tail:
        parts = re.split(r"(\\\\|\\\*|\*)", specifier[:-2])
    regex = "".join(
        ".*" if part == "*" else re.escape(part[1]) if part in ("\\*", "\\\\") else re.escape(part) for part in parts
    )
    return re.compile(regex + ("(?: .*)?" if optional_tail else ""), re.DOTALL)


def words(piece: str) -> list[str] | None:
    """`piece` split as the shell splits words (quotes read), or None when its quotes do not close."""
    try:
        return shlex.split(piece)
    except ValueError:
        return None


def command_forms(piece: str) -> list[str]:
    """`piece` as written, then each shorter form left when its assignments and wrappers are removed."""
    forms = [piece]
    for split in (piece.split(), words(piece)):
        if split is None:
            continue
        tokens = [token.removeprefix("\\") for token in split]
        forms.append(" ".join(tokens))
        while tokens and (_ASSIGNMENT.match(tokens[0]) or tokens[0] in _WRAPPERS):
            tokens = _drop_wrapper(tokens)
            forms.append(" ".join(tokens))
    return list(dict.fromkeys(form for form in forms if form))


def _drop_wrapper(tokens: list[str]) -> list[str]:
    """`tokens` without their first assignment or wrapper (and the wrapper's options and duration)."""
    first, rest = tokens[0], tokens[1:]
    if _ASSIGNMENT.match(first):
        return rest
    while rest and (rest[0].startswith("-") or (first == "timeout" and _DURATION.fullmatch(rest[0]))):
        option = rest.pop(0)
        if option in ("-n", "-u", "-g", "-k", "-s", "--signal", "--kill-after", "--adjustment") and rest:
            rest.pop(0)  # the option's value
        if first == "timeout" and option[:1] != "-":
            break  # the duration is the last thing before the command
    return rest


def _removal_targets(piece: str) -> list[str]:
    """The operands of an `rm` or `rmdir` piece (its words after assignments and wrappers), else []."""
    tokens = words(piece) or piece.split()
    while tokens and (_ASSIGNMENT.match(tokens[0]) or tokens[0] in _WRAPPERS):
        tokens = _drop_wrapper(tokens)
    if not tokens or tokens[0].removeprefix("\\").rsplit("/", 1)[-1] not in ("rm", "rmdir"):
        return []
    targets: list[str] = []
    options_done = False
    for token in tokens[1:]:
        if token == "--" and not options_done:
            options_done = True
        elif options_done or not token.startswith("-"):
            targets.append(token)
    return targets


def is_critical_removal(piece: str, cwd: Path, additional: Sequence[Path], home: Path) -> bool:
    """Whether `piece` is an `rm` or `rmdir` that targets a critical path (see the module's docstring)."""
    return any(_is_critical_target(target, cwd, additional, home) for target in _removal_targets(piece))


def _is_critical_target(target: str, cwd: Path, additional: Sequence[Path], home: Path) -> bool:
    if "$" in target:
        return _is_critical_variable(target)
    head, _, last = target.rstrip("/").rpartition("/") if _GLOB.search(target) else ("", "", "")
    globbed = bool(last) and bool(_GLOB.search(last)) and not _GLOB.search(head)
    base = resolve_path((head or ("/" if target.startswith("/") else ".")) if globbed else target, cwd, home)
    top_level = base.rsplit("/", 1)[0] == ""  # the root, or a directory right under it
    if top_level or base == os.path.normpath(str(home)) or is_within(os.path.normpath(str(cwd)), base):
        return True
    return globbed and any(is_within(os.path.normpath(str(directory)), base) for directory in additional)


def _is_critical_variable(target: str) -> bool:
    """Whether a target with a `$` is `$HOME` or `$PWD`, or a glob or trailing slash right under an
    unguarded variable (`$DIR/*`, `${DIR}/`; `${DIR:?}/*` is guarded)."""
    if _HOME_VARIABLE.fullmatch(target):
        return True
    return any(
        not match.group("guard") and not _GLOB.sub("", target[match.end() :]).strip("/")
        for match in _VARIABLE_THEN_SLASH.finditer(target)
    )


def is_working_directory_file_command(piece: str, directories: Sequence[str], cwd: Path, home: Path) -> bool:
    """Whether `acceptEdits` approves `piece`: a filesystem command on paths inside `directories` only."""
    if any(char in piece for char in "$<>"):
        return False
    tokens = _without_safe_prefix(words(piece) or [])
    if not tokens or tokens[0] not in FILE_COMMANDS:
        return False
    operands = _sed_paths(tokens[1:]) if tokens[0] == "sed" else tokens[1:]
    if operands is None or any(operand.startswith("-") and "/" in operand for operand in operands):
        return False  # an option carrying a path (`-t/etc`, `--target-directory=/etc`) is not read
    paths = [operand for operand in operands if not operand.startswith("-")]
    return all(_is_working_path(path, directories, cwd, home) for path in paths)


def _without_safe_prefix(tokens: list[str]) -> list[str]:
    """`tokens` without leading safe assignments (`LANG=C`, `LC_*`, `NO_COLOR=1`) and `timeout`, `nice`,
    `nohup`; [] when another assignment comes first."""
    while tokens and (_ASSIGNMENT.match(tokens[0]) or tokens[0] in _SAFE_WRAPPERS):
        name = tokens[0].split("=", 1)[0]
        if _ASSIGNMENT.match(tokens[0]) and name not in _SAFE_VARIABLES and not name.startswith("LC_"):
            return []
        tokens = _drop_wrapper(tokens)
    return tokens


def _is_working_path(operand: str, directories: Sequence[str], cwd: Path, home: Path) -> bool:
    if any(segment.startswith(".") and _GLOB.search(segment) for segment in operand.split("/")):
        return False  # `.*` can name `..`
    resolved = resolve_path(operand, cwd, home)
    return is_within_any(resolved, directories) and not is_protected(resolved)


def _sed_paths(arguments: list[str]) -> list[str] | None:
    """The file operands of a `sed` call whose scripts are all plain substitutions, else None."""
    split = _sed_scripts(arguments)
    if split is None:
        return None
    scripts, operands = split
    if not scripts:
        first = next((index for index, operand in enumerate(operands) if not operand.startswith("-")), None)
        if first is None:
            return None
        scripts.append(operands.pop(first))
    return operands if all(_SED_SCRIPT.fullmatch(script) for script in scripts) else None


def _sed_scripts(arguments: list[str]) -> tuple[list[str], list[str]] | None:
    """A `sed` call's `-e` scripts and its other arguments; None for a script file or a dangling `-e`."""
    scripts: list[str] = []
    operands: list[str] = []
    pending_script = False
    for argument in arguments:
        if pending_script:
            scripts.append(argument)
            pending_script = False
        elif argument in ("-e", "--expression"):
            pending_script = True
        elif argument.startswith("--expression="):
            scripts.append(argument.split("=", 1)[1])
        elif argument.startswith("-e") and not argument.startswith("--"):
            scripts.append(argument[2:])
        elif argument.startswith(("-f", "--file")):
            return None  # a script file: not read
        else:
            operands.append(argument)
    return None if pending_script else (scripts, operands)
