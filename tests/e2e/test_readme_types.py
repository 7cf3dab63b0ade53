"""The README's and docs/' examples type-check as a user's program: `mypy --strict` finds nothing in them.

The examples are the ones tests/e2e/test_readme.py runs. Each is written to a file of its own in a temporary
folder and all are checked in one mypy run, with the project's mypy options (`[tool.mypy]` of
pyproject.toml) and `queryloop` resolved where this environment imports it from. Errors inside the
library itself are not reported here (mypy checks it on its own), only the examples' own.
"""

from __future__ import annotations

import importlib.util
import os
import re
import site
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from tests.e2e.test_readme import RUNNABLE
from tests.markdown import REPO, Block

MYPY_TIMEOUT_S = 300
MYPY_LINE = re.compile(r"^(?P<file>[\w.]+\.py):(?P<line>\d+): (?P<message>.*)$")


def module_name(block: Block) -> str:
    """A module name of its own for each example: page, line of its fence, section."""
    slug = re.sub(r"[^a-z0-9]+", "_", block.heading.lower()).strip("_") or "top"
    page = re.sub(r"\W+", "_", block.page.stem.lower())
    return f"{page}_{block.line}_{slug}"


def ini_value(value: object) -> str:
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, list):
        return ", ".join(str(item) for item in value)
    return str(value)


def package_folder() -> Path | None:
    """The folder to put on mypy's path for `queryloop` to resolve as Python imports it here.

    None when it is installed in site-packages (mypy finds an installed typed package by itself); an
    editable install's import hook is invisible to mypy, so its folder is named.
    """
    spec = importlib.util.find_spec("queryloop")
    assert spec is not None and spec.submodule_search_locations, "queryloop is not installed"
    folder = Path(next(iter(spec.submodule_search_locations))).resolve().parent
    installed = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")} | set(site.getsitepackages())
    return None if any(folder == Path(path).resolve() for path in installed) else folder


def mypy_config(folder: Path | None) -> str:
    """The project's `[tool.mypy]` options (not its `files`, nor the overrides for the tests), as a mypy.ini."""
    options = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"]
    lines = ["[mypy]"]
    lines += [f"{key} = {ini_value(value)}" for key, value in options.items() if key not in {"files", "overrides"}]
    if folder is not None:
        lines.append(f"mypy_path = {folder}")
    lines += ["[mypy-queryloop.*]", "follow_imports = silent"]  # the library is checked, its errors not shown
    return "\n".join(lines) + "\n"


def where(block: Block, example_line: int) -> str:
    """`README.md:59 (Quick start)`: the page's line for a line of the example (line 1 follows the fence)."""
    return f"{block.page.name}:{block.line + example_line} ({block.heading})"


def test_every_runnable_example_type_checks_under_mypy_strict(tmp_path: Path) -> None:
    assert RUNNABLE, "no runnable example found"
    examples = tmp_path / "examples"
    examples.mkdir()
    by_file: dict[str, Block] = {}
    for block in RUNNABLE:
        name = f"{module_name(block)}.py"
        assert name not in by_file, f"two examples would share {name}"
        (examples / name).write_text(block.code, encoding="utf-8")
        by_file[name] = block
    config = tmp_path / "mypy.ini"
    config.write_text(mypy_config(package_folder()), encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if not key.startswith("MYPY")}
    command = [sys.executable, "-m", "mypy", "--config-file", str(config), "--cache-dir", str(tmp_path / "cache")]
    outcome = subprocess.run(
        [*command, "--no-pretty", "--no-color-output", *sorted(by_file)],
        cwd=examples,
        env=env,
        capture_output=True,
        text=True,
        timeout=MYPY_TIMEOUT_S,
        check=False,
    )
    order = {name: index for index, name in enumerate(by_file)}
    located: list[tuple[int, int, str]] = []  # (example, line, problem): shown in the pages' order
    for line in outcome.stdout.splitlines():
        match = MYPY_LINE.match(line)
        if match is not None and match["file"] in by_file:
            block, number = by_file[match["file"]], int(match["line"])
            located.append((order[match["file"]], number, f"{where(block, number)}: {match['message']}"))
        elif match is not None or line.startswith(("mypy:", "Traceback")):
            located.append((len(order), 0, line))
    problems = [problem for _, _, problem in sorted(located)]
    assert not problems, "the examples do not type-check under mypy --strict:\n" + "\n".join(problems)
    assert outcome.returncode == 0, f"mypy failed:\n{outcome.stdout}\n{outcome.stderr}"
    assert f"no issues found in {len(by_file)} source files" in outcome.stdout, outcome.stdout
