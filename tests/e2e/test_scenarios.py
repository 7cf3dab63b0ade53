"""Every scenario under tests/scenarios/ through `queryloop scenario`, judged against its expected verdict.

`NAME.json` is a scenario in the format of docs/scenarios.md; `NAME.expected.json` lists what its
verdict must say. Keys there: any verdict key (compared exactly; `result` and `tool_results`
as subsets), plus `events_contain` (a subsequence of `events`) and `events_end` (a suffix).
Whatever the scenario, a verdict must report a valid transcript, no leftover task and
exactly one `result` event, last.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from queryloop.runtime.cli.main import main
from tests import helpers

SCENARIOS = helpers.TESTS / "scenarios"
NAMES = sorted(p.name.removesuffix(".json") for p in SCENARIOS.glob("*.json") if not p.name.endswith(".expected.json"))


def run_cli(path: Path) -> tuple[int, dict[str, Any]]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["scenario", str(path)])
    return code, json.loads(out.getvalue())


def is_subsequence(wanted: list[str], events: list[str]) -> bool:
    remaining = iter(events)
    return all(any(label == want for label in remaining) for want in wanted)


def test_every_scenario_has_an_expected_verdict() -> None:
    assert len(NAMES) >= 20
    for name in NAMES:
        assert (SCENARIOS / f"{name}.expected.json").exists(), name


@pytest.mark.parametrize("name", NAMES)
def test_scenario(name: str) -> None:
    code, verdict = run_cli(SCENARIOS / f"{name}.json")
    expected = json.loads((SCENARIOS / f"{name}.expected.json").read_text())
    assert code == 0
    assert verdict["transcript_valid"] is True
    assert verdict["leftover_tasks"] == 0
    assert verdict["events"].count("result") == 1 and verdict["events"][-1] == "result"
    for key, want in expected.items():
        if key == "result":
            for field, value in want.items():
                got = verdict["result"][field]
                assert got == (pytest.approx(value) if isinstance(value, float) else value), (field, got)
        elif key == "tool_results":
            assert verdict["tool_results"].keys() == want.keys()
            for tool_id, fields in want.items():
                for field, value in fields.items():
                    assert verdict["tool_results"][tool_id][field] == value, (tool_id, field)
        elif key == "events_contain":
            assert is_subsequence(want, verdict["events"]), verdict["events"]
        elif key == "events_end":
            assert verdict["events"][-len(want) :] == want, verdict["events"]
        else:
            assert verdict[key] == want, key


def test_the_console_script_prints_one_json_verdict_and_exits_0() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "queryloop.runtime.cli.main", "scenario", str(SCENARIOS / "stop_hook_blocking.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["terminal"] == "completed"


@pytest.mark.parametrize(
    ("document", "named"),
    [
        ({"prompt": "x", "model": [], "bogus": 1}, "bogus"),
        ({"prompt": "x", "model": [{"content": [], "stop_reason": "end_turn", "colour": "red"}]}, "colour"),
        ({"prompt": "x", "model": [], "tools": [{"name": "t", "speed": 3}]}, "speed"),
        ({"prompt": "x", "model": [], "abort": {"phase": "tools", "after_ms": 3}}, "exactly one"),
        ({"model": []}, "prompt"),
    ],
)
def test_malformed_scenario_exits_2_naming_the_key(tmp_path: Path, document: dict[str, Any], named: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    done = subprocess.run(
        [sys.executable, "-m", "queryloop.runtime.cli.main", "scenario", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert named in done.stderr
    assert done.stdout == ""
