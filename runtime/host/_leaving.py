"""What leaves `Runtime.open()` when its block or its tasks fail (`what_leaves`): the rule of `Runtime.open`'s
docstring, as pure functions of the nursery's exception group."""

from __future__ import annotations

import traceback

import trio


def what_leaves(group: BaseExceptionGroup[BaseException], host_error: BaseException | None) -> BaseException:
    """What leaves `Runtime.open()` for the group its nursery raised (the rule: `Runtime.open`'s docstring).

    `host_error` is what the block raised; it counts only if the nursery holds it as is. A block that was
    cancelled because a task of the runtime failed raised the nursery's own `Cancelled`, which the nursery
    absorbs: the failure is then the runtime's alone.
    """
    failures = _runtime_failures(group, host_error)
    if host_error is not None and any(error is host_error for error in group.exceptions):
        leaving = _with_host_error(group, host_error, failures)
        if leaving is not None:
            return leaving
    if failures:
        return _failed(group, failures)
    # Only cancellations, all of one enclosing scope (the nursery absorbs its own): one stands for them all.
    cancelled: BaseException = group
    while isinstance(cancelled, BaseExceptionGroup):
        cancelled = cancelled.exceptions[0]
    return cancelled


def _runtime_failures(
    group: BaseExceptionGroup[BaseException], host_error: BaseException | None
) -> list[BaseException]:
    """What the runtime's own tasks raised, their cancellations left out (the block's error is not one)."""
    failures: list[BaseException] = []
    for error in group.exceptions:
        if error is host_error:
            continue
        rest = error.split(trio.Cancelled)[1] if isinstance(error, BaseExceptionGroup) else error
        if rest is not None and not isinstance(rest, trio.Cancelled):
            failures.append(rest)
    return failures


def _with_host_error(
    group: BaseExceptionGroup[BaseException], host_error: BaseException, failures: list[BaseException]
) -> BaseException | None:
    """What leaves when the block raised `host_error` itself; None where the failures alone decide (the block
    was only cancelled, by an enclosing scope that would swallow it, while tasks failed)."""
    if isinstance(host_error, trio.Cancelled):
        return host_error if not failures else None
    if all(isinstance(failure, Exception) for failure in failures):
        for failure in failures:
            attach(host_error, failure, "a task of the runtime failed meanwhile")
        return host_error
    # An interrupt in a task of the runtime goes on, and the block's exception with it.
    leaving = _failed(group, failures)
    attach(leaving, host_error, "the block raised meanwhile")
    return leaving


def _failed(group: BaseExceptionGroup[BaseException], failures: list[BaseException]) -> BaseException:
    """The runtime's tasks' failures: one as itself, several (independent of each other) as a group of them."""
    return failures[0] if len(failures) == 1 else group.derive(failures)


def attach(error: BaseException, failure: BaseException, what: str) -> None:
    """Keep `failure` on the `error` that leaves instead, as a note with its traceback (not its `__context__`,
    which is `error` itself when the failure happened while `error` propagated)."""
    told = "".join(traceback.format_exception(failure, chain=False)).rstrip()
    error.add_note(f"{what}:\n{told}")
