"""The wheel as `pip install queryloop` delivers it: one package, typed, beside a host's own packages.

One wheel is built and installed into one fresh virtual environment for the whole module (about half
a minute with mypy's pass). The wheel is built from a copy of the working tree without its build
leftovers (a stale `build/` folder would leak deleted modules into it); its dependencies resolve
through pip as configured here (package index, or local wheels through `PIP_FIND_LINKS`).
Marked `packaging`: `pytest -m "not packaging"` leaves it out of a quick run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.markdown import REPO, quick_start

pytestmark = pytest.mark.packaging

LEFTOVERS = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
    ".hypothesis",
)  # fmt: skip
HOST_PACKAGE = 'WHO = "host"\n'


@dataclass(frozen=True)
class Installed:
    python: Path
    """The fresh environment's interpreter."""
    site_packages: Path
    wheel: Path
    host: Path
    """A host's project folder, with packages of its own named `runtime` and `actors`."""


def run(*command: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    argv = [str(part) for part in command]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=LEFTOVERS)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", root / "wheels", source)
    (wheel,) = (root / "wheels").glob("queryloop-*.whl")
    # A fresh environment; this environment's pip installs into it (`--python`), which spares
    # bootstrapping a pip of its own there.
    run(sys.executable, "-m", "venv", "--without-pip", root / "venv")
    python = root / "venv" / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile", wheel)
    site_packages = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    host = root / "host"
    for name in ("runtime", "actors"):
        (host / name).mkdir(parents=True)
        (host / name / "__init__.py").write_text(HOST_PACKAGE)
    return Installed(python=python, site_packages=site_packages, wheel=wheel, host=host)


IMPORTS = """
import json, sys
{first}
leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("runtime", "actors"))
{second}
from queryloop import Runtime, QueryOptions, ScriptedModel
print(json.dumps({{
    "leaked_before_host_import": leaked,
    "runtime": [runtime.WHO, runtime.__file__],
    "actors": [actors.WHO, actors.__file__],
    "queryloop": queryloop.__file__,
    "queryloop.runtime": queryloop.runtime.__file__,
    "queryloop.actors": queryloop.actors.__file__,
    "Runtime": Runtime.__module__,
    "version": queryloop.__version__,
    "public": [name for name in queryloop.__all__ if not hasattr(queryloop, name)],
}}))
"""


@pytest.mark.parametrize("queryloop_first", [True, False], ids=["queryloop-first", "host-first"])
def test_a_hosts_own_runtime_and_actors_packages_stay_the_hosts(installed: Installed, queryloop_first: bool) -> None:
    ours, theirs = "import queryloop", "import runtime, actors"
    first, second = (ours, theirs) if queryloop_first else (theirs, ours)
    code = IMPORTS.format(first=first, second=second)
    seen = json.loads(run(installed.python, "-c", code, cwd=installed.host).stdout)
    site = str(installed.site_packages)
    host = str(installed.host)
    assert seen["runtime"] == ["host", str(installed.host / "runtime" / "__init__.py")]
    assert seen["actors"] == ["host", str(installed.host / "actors" / "__init__.py")]
    for name in ("queryloop", "queryloop.runtime", "queryloop.actors"):
        assert seen[name].startswith(site + "/queryloop/"), (name, seen[name])
        assert not seen[name].startswith(host)
    assert seen["Runtime"] == "queryloop"  # the public module's name, not its home's (tests/e2e/test_exports.py)
    assert seen["version"] == installed.wheel.name.split("-")[1]
    assert seen["public"] == []
    if queryloop_first:
        assert seen["leaked_before_host_import"] == [], "importing queryloop imported top-level packages"


def test_the_readme_quick_start_runs_from_the_wheel_beside_the_hosts_packages(installed: Installed) -> None:
    start = quick_start()
    script = installed.host / "quick_start.py"
    script.write_text(start.code, encoding="utf-8")
    done = run(installed.python, script, cwd=installed.host)
    assert done.stdout == start.output


def installed_files(installed: Installed) -> list[str]:
    shown = run(sys.executable, "-m", "pip", "--python", installed.python, "show", "-f", "queryloop").stdout
    lines = shown.splitlines()
    return [line.strip() for line in lines[lines.index("Files:") + 1 :] if line.startswith(" ")]


def test_the_wheel_installs_the_queryloop_package_only(installed: Installed) -> None:
    files = installed_files(installed)
    version = installed.wheel.name.split("-")[1]
    ours = ("queryloop/", f"queryloop-{version}.dist-info/")
    outside = [f for f in files if not f.startswith(ours) and f != "../../../bin/queryloop"]
    assert outside == [], "files installed outside the queryloop package"
    assert "queryloop/py.typed" in files
    assert "queryloop/runtime/__init__.py" in files
    assert "queryloop/actors/__init__.py" in files
    # Every module of the source tree is shipped, as a file of its own (the links are followed).
    for folder in ("runtime", "actors"):
        for module in (REPO / folder).rglob("*.py"):
            shipped = f"queryloop/{module.relative_to(REPO).as_posix()}"
            assert shipped in files, f"{shipped} is not in the wheel"
    assert not (installed.site_packages / "queryloop" / "runtime").is_symlink()
    with zipfile.ZipFile(installed.wheel) as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
    assert tops == {"queryloop", f"queryloop-{version}.dist-info"}


def test_the_console_script_starts(installed: Installed) -> None:
    done = run(installed.python.parent / "queryloop", "--help", cwd=installed.host)
    assert "demo" in done.stdout
    assert "scenario" in done.stdout


# `mypy.api.run` in a process of its own, which ends without freeing mypy's graph (seconds of teardown).
RUN_MYPY = """
import json, os, sys
import mypy.api
print(json.dumps(mypy.api.run(sys.argv[1:])), flush=True)
os._exit(0)
"""
# The `anthropic` SDK is skipped: queryloop's own names are what is checked, and the SDK's modules
# would be two thirds of mypy's time here.
MYPY_CONFIG = "[mypy]\n[mypy-anthropic.*]\nfollow_imports = skip\n"


def test_mypy_reads_the_installed_package_as_typed(installed: Installed, tmp_path: Path) -> None:
    """Without `py.typed`, strict mypy refuses the import and every name is `Any`."""
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    snippet = "import queryloop\nreveal_type(queryloop.QueryOptions)\n"
    arguments = ["--strict", "--config-file", "mypy.ini", "--python-executable", str(installed.python), "-c", snippet]
    # From an empty folder: no configuration and no `queryloop/` folder of the checkout in sight.
    done = run(sys.executable, "-c", RUN_MYPY, *arguments, cwd=tmp_path)
    stdout, stderr, status = json.loads(done.stdout)
    assert status == 0, stdout + stderr
    revealed = stdout.split('Revealed type is "', 1)[1].split('"\n', 1)[0]
    assert revealed.startswith("def (")
    assert revealed.endswith(") -> queryloop.runtime.loop.options.QueryOptions")
