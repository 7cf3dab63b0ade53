"""The README and docs/ as a user reads them: their examples run as written and print what they say.

Every python block of README.md and docs/*.md is run as a program (in its own empty folder, with this
environment's python) unless it is marked `<!-- readme-test: not run (...) -->`; a block followed
by a text block must print exactly that text. The other checks keep the pages honest about names:
the public API only, links and module paths that exist, no path of one machine.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.markdown import PAGES, README, REPO, Block, blocks, python_blocks, quick_start

RUNNABLE = [block for page in PAGES for block in python_blocks(page) if block.runs]
BLOCK_TIMEOUT_S = 120
PUBLIC_MODULES = {"queryloop.aio", "queryloop.lowlevel", "queryloop.ray"}
"""Public modules besides `queryloop` itself: the asyncio facade, the kernel for hosts that write actors, Ray
shards (tests/e2e/test_exports.py checks each)."""
ALLOWED_IMPORTS = {"queryloop", "trio", "asyncio", "pydantic", "loguru", "pathlib", "typing"}


def offline_env() -> dict[str, str]:
    """This environment without any Anthropic credential or endpoint: the examples must not need them.

    `queryloop` is this checkout's (first on the path), as it is for the tests themselves: a shared
    environment's install may be another checkout's (a worktree's examples run against its own code)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("ANTHROPIC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    """Every runnable block, run at once (each in its own folder); their outcomes by block name."""
    started: dict[str, tuple[subprocess.Popen[str], str]] = {}
    try:
        for block in RUNNABLE:
            folder = tmp_path_factory.mktemp("example")
            (folder / "example.py").write_text(block.code, encoding="utf-8")
            script = str(folder / "example.py")
            process = subprocess.Popen(
                [sys.executable, script],
                cwd=folder,
                env=offline_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            started[block.name] = (process, script)
        outcomes: dict[str, subprocess.CompletedProcess[str]] = {}
        for name, (process, script) in started.items():
            stdout, stderr = process.communicate(timeout=BLOCK_TIMEOUT_S)
            outcomes[name] = subprocess.CompletedProcess([script], process.returncode, stdout, stderr)
        yield outcomes
    finally:
        for process, _ in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_example_runs_and_prints_what_the_page_says(
    block: Block, runs: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    outcome = runs[block.name]
    assert outcome.returncode == 0, f"{block.name} failed:\n{outcome.stderr[-3000:]}"
    if block.output is not None:
        assert outcome.stdout == block.output, f"{block.name} printed:\n{outcome.stdout}"


def test_the_first_screen_is_the_set_up_then_the_quick_start() -> None:
    first = blocks(README)[0]
    assert first.lang == "sh"
    commands = [line.split("#")[0].strip() for line in first.code.splitlines()]
    assert commands == ["make demo", "make test"]
    start = quick_start()
    assert start.heading == "Quick start"
    assert start.runs
    assert start.output is not None
    assert "completed success" in start.output
    assert len(start.code.splitlines()) <= 40, "the quick start is meant to be short"


def imported_modules(code: str) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_examples_import_only_the_public_api() -> None:
    for page in PAGES:
        for block in python_blocks(page):
            modules = imported_modules(block.code) if block.runs else set()
            outside = {module for module in modules if module.split(".")[0] not in ALLOWED_IMPORTS}
            deep = {module for module in modules if module.startswith("queryloop.") and module not in PUBLIC_MODULES}
            assert not outside, f"{block.name} imports {sorted(outside)}"
            assert not deep, (
                f"{block.name} imports {sorted(deep)}: everything public is in `queryloop` and {sorted(PUBLIC_MODULES)}"
            )
    assert imported_modules(quick_start().code) <= {"queryloop", "trio", "pydantic"}


def test_blocks_that_are_not_run_still_compile() -> None:
    fragments = [block for page in PAGES for block in python_blocks(page) if not block.runs]
    assert fragments, "the API block needs a key: it is expected to be marked, and compiled here"
    for block in fragments:
        compile(block.code, block.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_and_their_anchors_exist() -> None:
    checked = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path_part, _, anchor = target.partition("#")
            linked = (page.parent / path_part).resolve() if path_part else page
            assert linked.is_file(), f"{page.name} links to {target}, which does not exist"
            if anchor:
                headings = re.findall(r"^#{1,6}\s+(.+)$", linked.read_text(encoding="utf-8"), re.MULTILINE)
                assert anchor in {github_anchor(h) for h in headings}, f"{page.name}: no heading for #{anchor}"
            checked += 1
    assert checked >= 10


def test_module_paths_and_repository_paths_named_in_the_pages_exist() -> None:
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for dotted in set(re.findall(r"`(queryloop(?:\.\w+)+)", text)):
            assert resolves(dotted), f"{page.name} names `{dotted}`, which does not exist"
        for path in set(re.findall(r"`((?:runtime|actors|tests|bench|docs|queryloop)/[\w./-]*)`", text)):
            assert (REPO / path).exists(), f"{page.name} names `{path}`, which does not exist"


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(target, attribute):
                return False
            target = getattr(target, attribute)
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=[page.name for page in PAGES])
def test_pages_use_the_new_names_and_no_machine_paths(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"(?<![\w.])/(?:work|home|tmp|root|opt|Users)/", text), "a path of one machine"
    assert not re.search(r"^\s*(?:from|import) (?:runtime|actors)\b", text, re.MULTILINE), "the old package names"
    assert 'enable("runtime")' not in text
    assert 'enable("actors")' not in text
    assert not re.search(r"`runtime/\w+\.py`", text), "a module of the old flat layout"
