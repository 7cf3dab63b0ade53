"""The collector's thresholds: the host's unless it asks (`tune_gc=True`), and always put back."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from queryloop import BlockingRuntime, Runtime
from queryloop.runtime.host import _gc

HOST = (700, 10, 10)
"""CPython's defaults, set explicitly so that the tests do not depend on the process they run in."""
TUNED = (_gc.YOUNG_THRESHOLD, _gc.MIDDLE_THRESHOLD, _gc.OLD_THRESHOLD)


@pytest.fixture(autouse=True)
def host_thresholds() -> Iterator[None]:
    saved = gc.get_threshold()
    gc.set_threshold(*HOST)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


async def test_a_runtime_opened_by_default_leaves_the_collector_as_the_host_set_it() -> None:
    async with Runtime.open() as _:
        assert gc.get_threshold() == HOST
        async with Runtime.open(tune_gc=False) as _:
            assert gc.get_threshold() == HOST
    assert gc.get_threshold() == HOST


async def test_tune_gc_raises_the_thresholds_while_open_and_the_last_to_close_puts_them_back() -> None:
    async with Runtime.open(tune_gc=True) as _:
        assert gc.get_threshold() == TUNED
        async with Runtime.open(tune_gc=True) as _:
            assert gc.get_threshold() == TUNED
        assert gc.get_threshold() == TUNED  # another tuned runtime is still open
        async with Runtime.open() as _:
            assert gc.get_threshold() == TUNED  # an untuned one neither raises nor lowers them
        assert gc.get_threshold() == TUNED
    assert gc.get_threshold() == HOST


async def test_tune_gc_puts_the_thresholds_back_when_the_block_raises() -> None:
    with pytest.raises(ValueError, match="inside"):  # what the block raised leaves as itself
        async with Runtime.open(tune_gc=True) as _:
            assert gc.get_threshold() == TUNED
            raise ValueError("inside")
    assert gc.get_threshold() == HOST


async def test_tune_gc_never_lowers_thresholds_the_host_raised_itself() -> None:
    gc.set_threshold(50_000, 20, 500)
    async with Runtime.open(tune_gc=True) as _:
        assert gc.get_threshold() == (50_000, 20, 500)
    assert gc.get_threshold() == (50_000, 20, 500)


async def test_a_change_the_host_made_while_a_tuned_runtime_was_open_is_kept() -> None:
    async with Runtime.open(tune_gc=True) as _:
        gc.set_threshold(2_000, 10, 10)
    assert gc.get_threshold() == (2_000, 10, 10)


def test_the_blocking_runtime_tunes_the_collector_only_when_asked() -> None:
    with BlockingRuntime() as _:
        assert gc.get_threshold() == HOST
    with BlockingRuntime(tune_gc=True) as _:
        assert gc.get_threshold() == TUNED  # set on the runtime's thread before start() returned
    assert gc.get_threshold() == HOST
