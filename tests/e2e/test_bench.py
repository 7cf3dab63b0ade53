"""The benchmarks measure what docs/benchmarks.md says: tiny runs of `python -m bench`, and the collector meter."""

from __future__ import annotations

import gc
import json
import pstats
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from bench import tricks, workload
from bench.__main__ import main as bench_main
from bench.baseline import BaselineAbort, baseline_loop
from bench.collector import GcMeter, gc_setting, in_turn
from queryloop import QueryOptions, ResultMessage, Runtime, SystemMessage
from queryloop.runtime.host import _gc


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert bench_main(list(argv)) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return result


def test_the_meter_counts_tracked_objects_kept_alive_and_not_those_freed_between_collections() -> None:
    with GcMeter() as kept:
        alive: list[list[int]] = [[] for _ in range(50_000)]  # a tracked list each, all alive at the end
    with GcMeter() as churned:
        for _ in range(50_000):
            _ = []  # freed at once: the collector's counter goes up and down again
    assert 49_000 <= kept.tracked <= 51_000
    assert sum(kept.collections) >= 1 and kept.cpu > 0
    assert abs(churned.tracked) < 100
    assert len(alive) == 50_000


def test_each_side_of_a_benchmark_goes_first_in_turn() -> None:
    two = [in_turn(("baseline", "runtime"), index) for index in range(4)]
    assert two == [["baseline", "runtime"], ["runtime", "baseline"]] * 2
    three = [in_turn(("baseline", "trio", "asyncio"), index)[0] for index in range(3)]
    assert three == ["baseline", "trio", "asyncio"]


def test_gc_setting_applies_the_runtimes_thresholds_and_puts_the_process_ones_back() -> None:
    before = gc.get_threshold()
    with gc_setting(True) as tuned:
        assert tuned[0] == max(before[0], _gc.YOUNG_THRESHOLD)
        assert tuned[2] == max(before[2], _gc.OLD_THRESHOLD)
    assert gc.get_threshold() == before
    with gc_setting(False) as untuned:
        assert untuned == before


def test_bench_loops_reports_both_gc_pairs_with_the_same_settings_on_both_sides(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    profile = tmp_path / "loops.prof"
    result = _run(capsys, "loops", "--concurrency", "5", "--rounds", "1", "--profile", str(profile))
    for name in ("throughput_ratio", "throughput_ratio_untuned", "gc_share", "gc_share_untuned"):
        assert result[name] >= 0, name
    for name in ("tracked_per_loop", "baseline_tracked_per_loop", "in_flight_per_loop", "baseline_in_flight_per_loop"):
        assert name in result, name
    assert result["gc_thresholds"][0] >= _gc.YOUNG_THRESHOLD
    assert result["gc_thresholds_untuned"] == list(gc.get_threshold())
    assert pstats.Stats(str(profile)).get_stats_profile().func_profiles  # a profile pstats opens
    only = _run(capsys, "loops", "--concurrency", "5", "--rounds", "1", "--no-tune-gc")
    assert "throughput_ratio" not in only and only["throughput_ratio_untuned"] > 0


def test_bench_loops_off_pair_runs_both_sides_without_the_collector_and_turns_it_back_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plot = tmp_path / "loops.png"
    result = _run(capsys, "loops", "--concurrency", "5,20", "--rounds", "1", "--gc", "off", "--plot", str(plot))
    assert result["throughput_ratio_off"] > 0 and result["cpu_ratio_off"] > 0
    assert "throughput_ratio" not in result and "throughput_ratio_untuned" not in result
    # Not one collection on either side (at Python's thresholds, 20 loops would have made several).
    assert result["collections_off"] == [0, 0, 0] and result["baseline_collections_off"] == [0, 0, 0]
    assert result["gc_share_off"] == 0 and result["baseline_gc_share_off"] == 0
    assert gc.isenabled()
    assert plot.stat().st_size > 0


@pytest.mark.parametrize("tools", ["trio", "asyncio"])
def test_bench_loops_on_the_asyncio_host_reports_both_hosts_ratios_and_the_cost_of_a_hop(
    capsys: pytest.CaptureFixture[str], tools: str
) -> None:
    result = _run(
        capsys, "loops", "--host", "asyncio", "--concurrency", "5", "--rounds", "1", "--gc", "tuned", "--tools", tools
    )
    assert result["host"] == "asyncio" and result["mode"] == "guest" and result["tools"] == tools
    for name in ("throughput_ratio", "trio_throughput_ratio", "ratio_to_trio", "hops_per_loop", "calls_per_loop"):
        assert result[name] > 0, name
    assert "cpu_us_per_hop" in result and "cpu_us_per_call" in result


def test_bench_abort_runs_both_pairs_without_violations(capsys: pytest.CaptureFixture[str]) -> None:
    load = ["--concurrency", "5", "--model-ms", "2", "--tool-ms", "2", "--loops-per-slot", "2"]
    result = _run(capsys, "abort", *load, "--rounds", "1")
    assert result["violations"] == 0 and result["leftover_tasks"] == 0
    assert "abort_p99_ratio" in result and "abort_p99_ratio_untuned" in result


def test_bench_stream_reports_events_per_second_and_growth(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    profile = tmp_path / "stream.prof"
    cells = ["--deltas", "10,40", "--sessions", "1,3", "--rounds", "1", "--min-events", "0"]
    result = _run(capsys, "stream", *cells, "--profile", str(profile))
    assert result["sessions"] == 3 and result["deltas"] == 10
    for name in ("paced_events_per_s", "burst_events_per_s", "baseline_paced_events_per_s", "paced_events_per_cpu_s"):
        assert result[name] > 0, name
    assert result["per_event_growth"] > 0 and result["growth_deltas"] == [10, 40]
    assert len(result["cells"]) == 8
    assert pstats.Stats(str(profile)).get_stats_profile().func_profiles  # a profile pstats opens


async def test_the_baseline_does_the_runtimes_work_on_w_the_same_requests_events_and_result() -> None:
    """The baseline: the same work, only the actors gone (so the ratio prices the actors alone)."""
    runtime_model, baseline_model = workload.model(0), workload.model(0)
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=runtime_model, tools=workload.tools(0)))
        ours = [event async for event in session.query(workload.PROMPT)]
        await session.close()
    events = baseline_loop(baseline_model, workload.tools(0), workload.PROMPT, BaselineAbort())
    async with aclosing(events):
        theirs = [event async for event in events]

    assert [type(e).__name__ for e in theirs] == [type(e).__name__ for e in ours]
    assert len(baseline_model.requests) == len(runtime_model.requests) == 3
    for mine, other in zip(baseline_model.requests, runtime_model.requests, strict=True):
        assert mine.system == other.system and mine.tools == other.tools and mine.max_tokens == other.max_tokens
        assert [m["content"] for m in mine.messages] == [m["content"] for m in other.messages]
    result, reference = theirs[-1], ours[-1]
    assert isinstance(result, ResultMessage) and isinstance(reference, ResultMessage)
    fields = ("subtype", "is_error", "result", "stop_reason", "total_cost_usd", "usage", "num_turns")
    sdk = ("terminal_reason", "model_usage", "api_error_status", "permission_denials", "errors", "usage_by_agent")
    for field in (*fields, *sdk):
        assert getattr(result, field) == getattr(reference, field), field
    assert reference.total_cost_usd > 0 and reference.num_turns == 3
    # The Agent SDK's contract, kept alike: the init event's data, a session id on every event.
    init, reference_init = theirs[0], ours[0]
    assert isinstance(init, SystemMessage) and isinstance(reference_init, SystemMessage)
    assert init.data.keys() == reference_init.data.keys()
    for side in (ours, theirs):
        ids = {getattr(e, "session_id", None) for e in side}
        assert len(ids) == 1 and init.session_id and reference_init.session_id


@pytest.mark.parametrize("side", ["runtime", "baseline"])
def test_bench_instructions_child_runs_the_loops_asked_in_rounds_of_the_concurrency(
    capsys: pytest.CaptureFixture[str], side: str
) -> None:
    # 5 loops, 2 at once: rounds of 2, 2 and 1, every loop run to its result.
    result = _run(capsys, "instructions", f"--side={side}", "--count=5", "--concurrency=2")
    assert result == {"benchmark": "instructions", "side": side, "loops": 5}


def test_bench_tricks_finds_every_trick_of_the_hot_path_in_place(capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(capsys, "tricks", "--check")
    assert result["benchmark"] == "tricks" and result["lost"] == []
    assert result["held"] == [check.__name__ for check in tricks.TRICKS]


def test_bench_instructions_without_valgrind_says_what_it_needs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no valgrind on it
    with pytest.raises(SystemExit, match="needs valgrind"):
        bench_main(["instructions"])
    assert capsys.readouterr().out == ""


def test_bench_instructions_refuses_loop_counts_it_cannot_difference() -> None:
    with pytest.raises(SystemExit, match="0 < N1 < N2"):
        bench_main(["instructions", "--loops", "2000,1000"])
