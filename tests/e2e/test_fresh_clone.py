"""A clone of the repository, alone in an empty folder, runs its demo and its tests: nothing in it
reads a path outside it, and the first hour of a new user's trial (the command line, the package's
namespace) gives clear answers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import queryloop
from queryloop.runtime.cli import main as cli
from queryloop.runtime.cli.scenario import load_scenario
from tests.helpers import FIXTURES, REPO

CHECKED = ("tests", "bench", "examples", "docs", "runtime", "actors", "queryloop", ".ci")
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".toml", ".json", ""}

# A relative path with a `..` step in it, as code or a Markdown link spells one.
RELATIVE_UP = re.compile(r"[\w.\-/]*\.\./[\w.\-/]*")
# `Path(__file__)` followed by `.parents[N]`, or by a run of `.parent`.
PARENTS_INDEX = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?\.parents\[(\d+)\]")
PARENT_RUN = re.compile(r"Path\(__file__\)(?:\.resolve\(\))?((?:\.parent\b)+)")
# Not paths the repository reads: where pip says a wheel put its command (relative to site-packages),
# and the hostile inputs of the tests that check such a path is refused (a model's or a server's).
NOT_READ = {"../../../bin/queryloop", "../../x", "../../escaped"}
# Folders of one machine, which no clone elsewhere has.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home|Users)/")
# The specification material the project was built from lives beside the repository, not in it.
OUTSIDE_MATERIAL = re.compile(r"\.\./shared\b|shared/(?:fixtures|research|seeds|peers)\b|SCENARIOS\.md|API_FACTS")


def _text_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml"]
    for top in CHECKED:
        for path in sorted((REPO / top).rglob("*")):
            inside_fixtures = path.is_relative_to(FIXTURES)
            this_checker = path == Path(__file__).resolve()  # its own probes name outside paths on purpose
            if path.is_file() and path.suffix in TEXT_SUFFIXES and not (inside_fixtures or this_checker):
                files.append(path)
    return files


def _escapes(path: Path, relative: str) -> bool:
    target = os.path.normpath(path.parent / relative)
    return not Path(target).is_relative_to(REPO)


def _outside_references(path: Path, text: str) -> list[str]:
    relative_up = (m for m in RELATIVE_UP.findall(text) if "://" not in m and m not in NOT_READ)
    found = [m for m in relative_up if _escapes(path, m)]
    depth = len(path.relative_to(REPO).parts)  # parents[depth - 1] is the repository root
    found += [f"parents[{n}]" for n in PARENTS_INDEX.findall(text) if int(n) >= depth]
    found += [f"{'.parent' * r.count('.parent')}" for r in PARENT_RUN.findall(text) if r.count(".parent") > depth]
    found += MACHINE_PATH.findall(text) + OUTSIDE_MATERIAL.findall(text)
    return found


def test_no_file_of_the_repository_names_a_path_above_its_root() -> None:
    files = _text_files()
    assert len(files) > 150 and REPO / "docs" / "scenarios.md" in files
    offenders = {
        str(p.relative_to(REPO)): refs for p in files if (refs := _outside_references(p, p.read_text(errors="replace")))
    }
    assert offenders == {}


def test_the_outside_path_check_catches_each_way_of_naming_one() -> None:
    probe = REPO / "tests" / "probe.py"  # never written: only its place in the tree matters
    # Spelled in pieces: this file names no outside path itself, so tools that scan for them pass it too.
    up, above, shared, machine = "../", "parents[" + "2]", "sha" + "red", "/" + "work" + "/"
    outside = f"{up}{up}{shared}/fixtures/sse"
    three_up = ".parent" * 3
    text = (
        f'A = Path(__file__).resolve().{above} / "x"\n'
        f"B = Path(__file__){three_up}\n"
        f'C = "{outside}"\n'
        f'D = "{machine}main/tests"\n'
        'E = Path(__file__).resolve().parents[1] / "docs/../README.md"\n'
    )
    found = _outside_references(probe, text)
    assert found == [outside, above, three_up, machine, up + shared]


def test_every_recorded_fixture_is_in_the_repository_with_its_source() -> None:
    sources = (FIXTURES / "SOURCES.md").read_text()
    recorded = sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.name != "SOURCES.md")
    assert len(recorded) >= 40
    streams = [p for p in recorded if p.suffix == ".sse"]
    assert streams and all(p.read_bytes().lstrip().startswith(b"event:") for p in streams)
    unlisted = [p.name for p in recorded if p.name.removesuffix(".request.json").removesuffix(".sse") not in sources]
    assert unlisted == []


def test_the_scenario_format_is_documented_in_the_repository_with_an_example_that_parses() -> None:
    page = (REPO / "docs" / "scenarios.md").read_text()
    example = re.search(r"## Input\n```json\n(.*?)```", page, re.DOTALL)
    assert example is not None
    scenario = load_scenario(json.loads(example.group(1)))
    assert scenario.prompt == "Fix the bug" and len(scenario.model) == 4 and scenario.abort is not None


def test_a_scenario_file_that_does_not_exist_is_a_usage_error_saying_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "MISSING.json"
    assert cli.main(["scenario", str(missing)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "does not exist" in err and "MISSING.json" in err and "JSON" not in err


def test_run_with_a_model_and_no_prompt_is_a_usage_error_not_a_default_prompt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-not-a-key")
    # An address nothing listens on: a request sent would fail as a connection error (exit 1), not 2.
    for argv in (["run", "--model", "claude-sonnet-5-5"], ["run", "--model", "claude-sonnet-5-5", "  "]):
        code = cli.main([*argv, "--base-url", "http://127.0.0.1:9"])
        assert code == cli.EXIT_USAGE
        assert "--model needs a prompt" in capsys.readouterr().err


def test_import_queryloop_ray_without_the_extra_says_which_extra_to_install() -> None:
    code = "import sys; sys.modules['ray'] = None; import queryloop.ray"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO)
    assert done.returncode == 1
    assert "pip install 'queryloop[ray]'" in done.stderr.splitlines()[-1]


def test_help_lists_bench_only_where_the_checkout_has_the_benchmarks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (REPO / "bench" / "__main__.py").is_file()
    assert "bench" in cli._parser().format_help()
    monkeypatch.setattr(cli, "_checkout_with_bench", lambda: None)
    assert "bench" not in cli._parser().format_help()
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "kernel"])
    assert exit_.value.code == cli.EXIT_USAGE


def test_the_package_namespace_shows_its_public_names_and_subpackages_only() -> None:
    public = {name for name in dir(queryloop) if not name.startswith("_")}
    subpackages = {name for name in public if isinstance(getattr(queryloop, name), types.ModuleType)}
    assert all(getattr(queryloop, name).__name__ == f"queryloop.{name}" for name in subpackages)
    assert public - subpackages == set(queryloop.__all__) - {"__version__"}
    assert {"version", "logger", "PackageNotFoundError"}.isdisjoint(public)
