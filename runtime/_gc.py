"""The collector's young-generation threshold while runtimes are open.

CPython 3.11 collects its youngest generation every 700 net allocations. A runtime
hosting a thousand loops has tens of thousands of short-lived objects in flight
(events, messages, futures) at any moment; collected that often, many are caught
alive and promoted, the old generations grow, and each full collection then walks
every live session: measured with `bench loops --concurrency 1000`, six full
collections took about 1 s of a 2.2 s round. At 10,000 allocations per young
collection the in-flight objects die first and the round takes 1.3 s. The baseline
loop is left at Python's default, so the benchmark ratio counts this as ours.

Only the first threshold is raised, only when it is lower, and it is put back when
the last open runtime closes (unless someone changed it meanwhile).
"""

from __future__ import annotations

import gc
import threading

YOUNG_THRESHOLD = 10_000

_lock = threading.Lock()
_holders = 0
_saved: tuple[int, int, int] | None = None


def acquire() -> None:
    """One more runtime wants the raised threshold."""
    global _holders, _saved  # noqa: PLW0603 - process-wide by nature, like the collector itself
    with _lock:
        _holders += 1
        if _holders == 1:
            current = gc.get_threshold()
            if 0 < current[0] < YOUNG_THRESHOLD:
                _saved = current
                gc.set_threshold(YOUNG_THRESHOLD, current[1], current[2])


def release() -> None:
    """A runtime that called `acquire` has closed."""
    global _holders, _saved  # noqa: PLW0603
    with _lock:
        _holders -= 1
        if _holders == 0 and _saved is not None:
            if gc.get_threshold() == (YOUNG_THRESHOLD, _saved[1], _saved[2]):
                gc.set_threshold(*_saved)
            _saved = None
