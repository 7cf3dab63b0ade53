"""The collector on both sides of a benchmark: set the same, and measured the same.

`gc_setting(tuned)` puts the process under the runtime's thresholds (`tuned`: what
`Runtime.open(tune_gc=True)` sets, through the same `queryloop.runtime.host._gc`
acquire/release) or leaves Python's own (`tuned=False`) while a block runs: the baseline's
phase runs inside it, so that a ratio compares the two sides under the same settings. The
runtime side opens its runtime with `tune_gc=tuned`, as a host would. The `off` pair runs
both sides under `collector_off(True)`: its ratio is that of the two sides' own code.

Neither side always runs first: `in_turn` gives each the first place in turn, round by round.

`GcMeter` measures what the collector did while a block ran, through `gc.callbacks`:

- collections per generation, the objects they freed (`collected`), and their CPU time
  (`time.process_time` at each collection's start and stop);
- the block's CPU and wall time, so that `gc_share` = CPU time in the collector / CPU time;
- `tracked`: GC-tracked objects allocated, net, as the collector counts them. CPython keeps one
  counter (`gc.get_count()[0]`): +1 for every GC-tracked object allocated, -1 for every one freed
  while the counter is above zero, reset to zero by every collection, and a young collection runs
  when it passes the young threshold. The meter adds the counter's value at the start of every
  collection (read in the `start` callback, before the reset) to its change over the block. That is
  the quantity that paces the collector (young collections = tracked / young threshold): objects
  allocated and freed between two collections cancel out; what counts is how many are alive at once,
  so it falls with objects in flight, not only with allocations. It is path-dependent (the
  thresholds decide where the resets fall), so compare it between sides of one run, under one
  setting. A gross count of allocations is not available from Python (3.11 keeps none).

`in_flight()` counts the tracked objects alive at once, in an untimed census round: the collector
disabled (so the counter is never reset, and is the net count of tracked objects allocated since the
census began, after a `gc.collect()`), the counter sampled by a trio instrument after every task step.
Its peak over the round, divided by the loops at once, is `in_flight_per_loop`: how many tracked
objects each loop holds at its busiest, what every young collection has to walk and promote.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from queryloop.runtime.host import _gc

if TYPE_CHECKING:
    import argparse
    from types import TracebackType

PAIRS = {"both": ("tuned", "untuned"), "tuned": ("tuned",), "untuned": ("untuned",), "off": ("off",)}

T = TypeVar("T")


def in_turn(sides: Sequence[T], index: int) -> list[T]:
    """The sides of a benchmark in the order they run in round `index`: each runs first in turn.

    Running second is an advantage here. With the baseline always first, four runs of `bench loops`
    gave `cpu_ratio` 0.77–0.83; with the runtime always first, 0.72–0.76. Much of that was the
    process's warm-up, paid by whichever side ran the first round (`bench loops` now runs an untimed
    round of each side first). With the sides in turn and that round, the rounds where the runtime went
    second still gave a median round ratio of 0.779, against 0.766 where it went first (six runs).
    """
    turn = index % len(sides)
    return [*sides[turn:], *sides[:turn]]


def add_gc_arguments(parser: argparse.ArgumentParser) -> None:
    """`--gc both|tuned|untuned` (the pairs measured) and `--no-tune-gc` (= `--gc untuned`)."""
    parser.add_argument(
        "--gc",
        choices=sorted(PAIRS),
        default="both",
        help="the collector settings each measured pair runs under, both sides alike: 'tuned' = the runtime's"
        " thresholds (Runtime.open(tune_gc=True); the baseline's phase under the same gc.set_threshold),"
        " 'untuned' = Python's defaults on both sides; 'both' (default) measures the two pairs in one run;"
        " 'off' = the collector disabled on both sides (what the two sides' own code costs, without it)."
        " docs/collector.md",
    )
    parser.add_argument(
        "--no-tune-gc",
        dest="gc",
        action="store_const",
        const="untuned",
        help="the same as --gc untuned: only the pair at Python's defaults",
    )


@contextmanager
def gc_setting(tuned: bool) -> Iterator[tuple[int, int, int]]:
    """The runtime's raised thresholds while the block runs (`tuned`), else the process's own; yields them."""
    if tuned:
        _gc.acquire()
    try:
        yield gc.get_threshold()
    finally:
        if tuned:
            _gc.release()


@contextmanager
def collector_off(off: bool) -> Iterator[None]:
    """The collector disabled while the block runs (`off`: the `off` pair's sides), then as it was."""
    enabled = gc.isenabled()
    if off:
        gc.disable()
    try:
        yield
    finally:
        if off and enabled:
            gc.enable()


@dataclass
class GcMeter:
    """What the collector did while the block ran (see the module's docstring). Reusable: figures add up."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    collected: int = 0
    gc_cpu: float = 0.0
    """CPU seconds inside collections."""
    longest: float = 0.0
    """CPU seconds of the longest collection."""
    cpu: float = 0.0
    wall: float = 0.0
    tracked: int = 0
    thresholds: tuple[int, int, int] = (0, 0, 0)
    """The thresholds in force: noted by `note_thresholds()` inside the block (the runtime side's are set
    only once its runtime is open, and put back when it closes), else when the block ends."""
    _started: float = 0.0
    _cpu0: float = 0.0
    _wall0: float = 0.0
    _count0: int = 0
    _noted: bool = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.tracked += gc.get_count()[0]
            self._started = time.process_time()
        else:
            spent = time.process_time() - self._started
            self.gc_cpu += spent
            self.longest = max(self.longest, spent)
            self.collections[info["generation"]] += 1
            self.collected += info["collected"]

    def note_thresholds(self) -> None:
        """Record the thresholds in force now (call it where the measured code has set them)."""
        self.thresholds = gc.get_threshold()
        self._noted = True

    def __enter__(self) -> GcMeter:
        self._noted = False
        self._count0 = gc.get_count()[0]
        gc.callbacks.append(self._callback)
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.wall += time.perf_counter() - self._wall0
        self.cpu += time.process_time() - self._cpu0
        gc.callbacks.remove(self._callback)
        self.tracked += gc.get_count()[0] - self._count0
        if not self._noted:
            self.note_thresholds()

    @property
    def gc_share(self) -> float:
        return self.gc_cpu / self.cpu if self.cpu else 0.0

    def figures(self, units: int, unit: str = "loop", prefix: str = "") -> dict[str, Any]:
        """The meter's JSON figures, per `unit` where they are counts (`units` of them were run)."""
        return {
            f"{prefix}gc_share": round(self.gc_share, 4),
            f"{prefix}gc_us_per_{unit}": round(self.gc_cpu / units * 1e6, 2),
            f"{prefix}cpu_us_per_{unit}": round(self.cpu / units * 1e6, 2),
            f"{prefix}tracked_per_{unit}": round(self.tracked / units, 1),
            f"{prefix}collections": list(self.collections),
            f"{prefix}gc_collected": self.collected,
            f"{prefix}gc_longest_ms": round(self.longest * 1e3, 2),
        }


class InFlight(trio.abc.Instrument):
    """Samples the collector's counter after every task step (see `in_flight`)."""

    def __init__(self) -> None:
        self.peak = 0
        self.total = 0
        self.steps = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        count = gc.get_count()[0]
        self.peak = max(self.peak, count)
        self.total += count
        self.steps += 1

    @property
    def mean(self) -> float:
        return self.total / self.steps if self.steps else 0.0


@asynccontextmanager
async def in_flight() -> AsyncIterator[InFlight]:
    """A census of tracked objects alive at once while the block runs: the collector off, the counter sampled."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    census = InFlight()
    trio.lowlevel.add_instrument(census)
    try:
        yield census
    finally:
        trio.lowlevel.remove_instrument(census)
        if enabled:
            gc.enable()
