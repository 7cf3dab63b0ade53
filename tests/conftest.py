"""What many test modules need, made in one place.

Fixtures:

- `runtime`: an open `Runtime` (the defaults of `Runtime.open()`), closed when the test ends. For a test
  that opens one runtime, keeps its checks inside it, and needs nothing of `Runtime.open`'s options; a
  test that checks what closing does, or what is left after it, opens its own (`async with Runtime.open()`).
- `transcript_path`: where a test's transcript file goes (`t.jsonl` in the test's `tmp_path`), not
  created: a session's `transcript=` makes it.

From pytest-trio, not redefined here: `autojump_clock`, a `trio.testing.MockClock` that jumps to the next
deadline as soon as every task waits (time-based behaviour checked on simulated time, never slept for).
A module that needs another threshold defines its own `clock`-named fixture, as `test_stream_watchdog` does.

Hypothesis profiles for the property tests, registered once here (the environment variable
`QUERYLOOP_HYPOTHESIS_PROFILE` picks `ci`, the default, `nightly` or `dev`); nothing is loaded globally,
so a module's hypothesis tests that use neither keep hypothesis's defaults and their own settings:

- `queryloop-properties`: 100 examples in `ci`, 2,000 in `nightly`, 20 in `dev` (the hostile-stream
  and transcript-damage properties);
- `queryloop-abort-properties`: 200, 2,000 and 30 (the abort properties: their search space is larger).

Both have no deadline and let a slow example be (`HealthCheck.too_slow`): an example is a whole query,
not a function call. A module takes one with `settings.get_profile("queryloop-properties")`.
"""

from __future__ import annotations

import os

# Read once, when Ray is first imported (by whichever test module imports `queryloop.ray` first): the node
# then takes the loopback address, and every Ray server of the tests' clusters binds to it
# (tests/hosts/test_ray.py checks that nothing listens beyond loopback).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from queryloop import Runtime

HYPOTHESIS_PROFILE_VARIABLE = "QUERYLOOP_HYPOTHESIS_PROFILE"
_EXAMPLES = {
    "queryloop-properties": {"ci": 100, "nightly": 2000, "dev": 20},
    "queryloop-abort-properties": {"ci": 200, "nightly": 2000, "dev": 30},
}


def _register_hypothesis_profiles() -> None:
    chosen = os.environ.get(HYPOTHESIS_PROFILE_VARIABLE, "ci")
    for profile, examples in _EXAMPLES.items():
        if chosen not in examples:
            msg = f"{HYPOTHESIS_PROFILE_VARIABLE}={chosen!r}: choose one of {', '.join(examples)}"
            raise pytest.UsageError(msg)
        settings.register_profile(
            profile, max_examples=examples[chosen], deadline=None, suppress_health_check=[HealthCheck.too_slow]
        )


_register_hypothesis_profiles()


@pytest.fixture
async def runtime() -> AsyncIterator[Runtime]:
    """An open `Runtime` with `Runtime.open()`'s defaults, closed (every session with it) after the test."""
    async with Runtime.open() as opened:
        yield opened


@pytest.fixture
def transcript_path(tmp_path: Path) -> Path:
    """Where the test's transcript file goes: `t.jsonl` in its own `tmp_path`, not created yet."""
    return tmp_path / "t.jsonl"
