"""`--profile FILE`: a cProfile of a benchmark's runtime side, written where a reader can open it.

The profiler is switched on around the runtime side's measured phases only (never around the
baseline's), the phases adding up in one profile, and written with `pstats` when the benchmark
ends: open it with `python -m pstats FILE` (`sort cumtime`, `stats 30`) or `snakeviz FILE`.
cProfile slows every Python call several times over: the ratios of a profiled run are not
comparable to an unprofiled one's, and the JSON line says `"profile": FILE`.
"""

from __future__ import annotations

import cProfile
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

HELP = (
    "write a cProfile of the runtime side (its measured phases, never the baseline's) to FILE, a .prof"
    " that `python -m pstats FILE` or `snakeviz FILE` opens; profiling slows the runtime side, so that"
    " run's ratios are not comparable to an unprofiled run's"
)


def add_profile_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", metavar="FILE", default=None, help=HELP)


class RuntimeProfile:
    """One profile for a benchmark's run: `with profile.on(): ...` around each runtime-side phase."""

    def __init__(self, path: str | None) -> None:
        self.path = Path(path) if path is not None else None
        if self.path is not None and not self.path.parent.is_dir():
            sys.exit(f"--profile: no directory {str(self.path.parent)!r} to write {str(self.path)!r} in")
        self._profiler = cProfile.Profile() if self.path is not None else None

    @contextmanager
    def on(self) -> Iterator[None]:
        if self._profiler is None:
            yield
            return
        self._profiler.enable()
        try:
            yield
        finally:
            self._profiler.disable()

    def save(self) -> dict[str, str]:
        """Write the profile (if one was asked for); the JSON figure that says so."""
        if self._profiler is None or self.path is None:
            return {}
        self._profiler.dump_stats(self.path)
        print(f"  profile of the runtime side: {self.path} (python -m pstats {self.path}, or snakeviz)")
        return {"profile": str(self.path)}
