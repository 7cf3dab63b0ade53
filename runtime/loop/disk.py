"""A full disk under a transcript: which errors mean "no room yet", how long to wait for room, how often to retry.

Owns the policy alone, not the writing (`persistence.TranscriptLog` writes, and keeps what it could not
write first in line for the next write): a write that fails because the disk is full (`is_disk_full`:
ENOSPC, EDQUOT) is tried again after `backoff_delays` (from `FIRST_RETRY_S`, doubling, to `MAX_RETRY_S`
apart), for at most `DISK_FULL_WAIT_S` in all; any other `OSError` is not retried. Both the QueryLoop's
writes and the consumer's `QueryHandle` follow it (docs/design.md, "Durability").
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from pathlib import Path

DISK_FULL_WAIT_S = 60.0
"""How long one write waits for room before its query gives up on the disk: long enough for an operator
(or a log rotation) to free space, short enough that a query still ends with a result on a disk that stays full."""
FIRST_RETRY_S = 0.05
"""The first wait: a disk freed at once (a temp file removed) costs the query next to nothing."""
MAX_RETRY_S = 2.0
"""The longest wait between two tries: a disk freed late is noticed within this."""
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errors that room may end: no space left, a quota reached. Any other (EIO, EBADF, ...) waiting will not end."""


def is_disk_full(error: OSError) -> bool:
    """Whether `error` says the disk (or the user's quota) is full: waiting for room may end it."""
    return error.errno in DISK_FULL_ERRNOS


def backoff_delays(
    bound_s: float = DISK_FULL_WAIT_S, *, first_s: float = FIRST_RETRY_S, cap_s: float = MAX_RETRY_S
) -> Iterator[float]:
    """The waits before each retry: `first_s`, doubling up to `cap_s`; they add up to `bound_s` exactly
    (the last one cut to fit), and there are none when `bound_s` is 0."""
    waited, delay = 0.0, first_s
    while waited < bound_s:
        step = min(delay, bound_s - waited)
        waited += step
        yield step
        delay = min(delay * 2, cap_s)


def disk_error_text(path: Path, error: OSError) -> str:
    """What a query's `result` says when its transcript could not be written: the file, and the OS's words."""
    why = error.strerror or str(error)
    return f"could not write the transcript {path}: {why} (errno {error.errno})"


async def retry_while_full(
    attempt: Callable[[], Awaitable[object]],
    error: OSError,
    *,
    bound_s: float = DISK_FULL_WAIT_S,
    pause: Callable[[float], Awaitable[object]] = trio.sleep,
) -> None:
    """`attempt` failed with `error`: try it again after each of `backoff_delays(bound_s)` while it fails
    for a full disk; return once it succeeds.

    Raises `error` at once if it is not a full disk, a retry's error that is not one at once too, and the
    last full-disk error once the waits add up to `bound_s`. `pause(delay)` is the wait between tries
    (`trio.sleep`); the caller's cancel scope cuts it.
    """
    if not is_disk_full(error):
        raise error
    for delay in backoff_delays(bound_s):
        await pause(delay)
        try:
            await attempt()
        except OSError as failed:
            if not is_disk_full(failed):
                raise
            error = failed
        else:
            return
    raise error
