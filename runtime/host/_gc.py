"""The collector's thresholds while runtimes opened with `tune_gc=True` are open.

Off by default: the thresholds are the host process's, and a library does not change its host's
process settings unasked. `Runtime.open(tune_gc=True)` is for a host that owns its process (as
`python -m bench` does for the runtime side of every benchmark); a host may instead set
`gc.set_threshold(10_000, 100, 100)` itself. docs/collector.md has the measured difference.

CPython 3.11 collects its youngest generation every 700 net allocations. A runtime
hosting a thousand loops has tens of thousands of short-lived objects in flight
(events, messages, futures) at any moment; collected that often, many are caught
alive and promoted, the old generations grow, and each full collection then walks
every live session: measured with `bench loops --concurrency 1000`, six full
collections took about 1 s of a 2.2 s round. At 10,000 allocations per young
collection the in-flight objects die first and the round takes 1.3 s.

Middle collections come after 100 young ones instead of 10. What survives a young collection in a
runtime is nearly all in flight, alive for the rest of its loop, and freed by reference counting
when the loop ends (a closed session leaves no cycle: tested); a middle collection walks all of it
(some 100,000 objects at a thousand loops) to find nothing. `bench loops --concurrency 1000`:
collections 97/6/0 (young/middle/full) became 105/0/0, the collector's share of the runtime's CPU
0.13-0.19 became 0.10, the baseline's (same thresholds) 0.12 became 0.09. Garbage cycles that do
arise (a traceback's, say) die at the next middle collection, ten times later than before.

Full collections are also considered ten times less often (after 100 middle
collections instead of 10; CPython's own rule, that the old generation must have
grown by a quarter, still applies). A closed session is freed by reference counting
alone (no cycles: tested), so what a full collection finds in a runtime is mostly
live sessions: a pause of 100–260 ms at a thousand sessions (`bench abort
--concurrency 1000`: two such pauses in eight rounds set that run's p99), for
little garbage.

The benchmarks open their runtimes with `tune_gc=True` and run their baselines under the same
thresholds (and report the pair at Python's defaults too), so their ratios compare like with like.
The young threshold is raised only when it is lower, the old one only when it is lower;
both are put back when the last runtime that asked for them closes (unless someone changed
them meanwhile).
"""

from __future__ import annotations

import gc
import threading

YOUNG_THRESHOLD = 10_000
MIDDLE_THRESHOLD = 100
OLD_THRESHOLD = 100

_lock = threading.Lock()
_holders = 0
_saved: tuple[int, int, int] | None = None


def acquire() -> None:
    """One more runtime (opened with `tune_gc=True`) wants the raised thresholds."""
    global _holders, _saved  # noqa: PLW0603 - process-wide by nature, like the collector itself
    with _lock:
        _holders += 1
        if _holders == 1:
            current = gc.get_threshold()
            if 0 < current[0] < YOUNG_THRESHOLD:
                _saved = current
                gc.set_threshold(YOUNG_THRESHOLD, max(current[1], MIDDLE_THRESHOLD), max(current[2], OLD_THRESHOLD))


def release() -> None:
    """A runtime that called `acquire` has closed."""
    global _holders, _saved  # noqa: PLW0603
    with _lock:
        _holders -= 1
        if _holders == 0 and _saved is not None:
            if gc.get_threshold() == (
                YOUNG_THRESHOLD,
                max(_saved[1], MIDDLE_THRESHOLD),
                max(_saved[2], OLD_THRESHOLD),
            ):
                gc.set_threshold(*_saved)
            _saved = None
