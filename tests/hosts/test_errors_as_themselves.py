"""Errors leave every host's runtime block as themselves: what the host's code raised (the same object, its
traceback kept), Ctrl+C as `KeyboardInterrupt`, an enclosing scope's cancellation as `trio.Cancelled`,
queryloop's errors as their classes; never an `ExceptionGroup` of the runtime's nursery. The trio `Runtime`,
`AsyncioRuntime` (both modes) and `BlockingRuntime` behave alike, and each closes its sessions first."""

from __future__ import annotations

import asyncio
import signal
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import pytest
import trio
import trio.testing

from queryloop import Runtime
from queryloop.aio import AsyncioRuntime
from queryloop.runtime.errors import SessionClosed
from queryloop.runtime.host.aio_bridge import Mode
from queryloop.runtime.host.blocking import BlockingRuntime
from queryloop.runtime.host.session import Session
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import text_reply

MODES: list[Mode] = ["guest", "thread"]
LIMIT_S = 30.0


def options() -> QueryOptions:
    return QueryOptions(provider=ScriptedModel([text_reply()]))


def fail(error: BaseException) -> NoReturn:
    """The host's own code failing, one frame down: the traceback that leaves must end here."""
    raise error


def raised_in_fail(error: BaseException) -> bool:
    """Whether `error`'s traceback ends at the `raise` line of `fail` (not in the runtime's machinery)."""
    last = traceback.extract_tb(error.__traceback__)[-1]
    return last.name == "fail" and last.line == "raise error"


def run_asyncio(main: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(LIMIT_S):
            return await main()

    return asyncio.run(bounded())


# -- trio: Runtime.open ----------------------------------------------------------------------------


async def test_an_exception_of_the_block_leaves_as_that_very_exception_with_its_traceback() -> None:
    error = ValueError("the host's own")
    cause = KeyError("why")
    error.__cause__ = cause
    with pytest.raises(ValueError) as caught:
        async with Runtime.open() as rt:
            session = await rt.open_session(options())
            fail(error)
    assert caught.value is error
    assert raised_in_fail(caught.value)
    assert caught.value.__cause__ is cause  # the host's own chain is left as it was
    assert not getattr(caught.value, "__notes__", None)  # nothing failed besides: nothing noted
    assert session.supervisor.closed  # the runtime's close ran before it left


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit, GeneratorExit])
async def test_a_base_exception_of_the_block_leaves_bare(kind: type[BaseException]) -> None:
    error = kind()
    with pytest.raises(kind) as caught:
        async with Runtime.open() as rt:
            session = await rt.open_session(options())
            fail(error)
    assert caught.value is error
    assert session.supervisor.closed


def test_ctrl_c_while_the_block_waits_leaves_trio_run_as_keyboard_interrupt() -> None:
    sessions: list[Session] = []

    async def main() -> None:
        async with Runtime.open() as rt:
            sessions.append(await rt.open_session(options()))
            # Delivered as trio delivers a real Ctrl+C: the signal is handled in the run loop (KI-protected),
            # and the main task, waiting in the block, gets the KeyboardInterrupt.
            trio.lowlevel.current_trio_token().run_sync_soon(signal.raise_signal, signal.SIGINT)
            await trio.sleep_forever()

    with pytest.raises(KeyboardInterrupt):
        trio.run(main)
    assert sessions[0].supervisor.closed


async def test_an_enclosing_cancel_scope_cancels_the_block_with_a_bare_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[BaseException] = []
    with trio.move_on_after(1) as scope:
        try:
            async with Runtime.open() as rt:
                session = await rt.open_session(options())
                await trio.sleep_forever()
        except BaseException as leaving:
            seen.append(leaving)
            raise
    assert scope.cancelled_caught
    assert [type(error) for error in seen] == [trio.Cancelled]
    assert session.supervisor.closed
    assert trio.current_time() == 1  # cut at the deadline; closing took no (simulated) time


async def test_a_queryloop_error_of_the_block_leaves_as_its_class() -> None:
    with pytest.raises(SessionClosed):
        async with Runtime.open() as rt:
            closed = await rt.open_session(options())
            still_open = await rt.open_session(options())
            await closed.close()
            closed.query("after its close")
    assert still_open.supervisor.closed


async def test_a_failed_close_is_noted_on_the_blocks_exception_and_the_rest_still_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = ValueError("the host's own")

    async def failing_close() -> None:
        raise RuntimeError("closing the session failed")

    with pytest.raises(ValueError) as caught:
        async with Runtime.open() as rt:
            session = await rt.open_session(options())
            monkeypatch.setattr(session, "close", failing_close)
            fail(error)
    assert caught.value is error
    assert raised_in_fail(caught.value)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "closing the runtime failed meanwhile" in notes
    assert "RuntimeError: closing the session failed" in notes
    assert "failing_close" in notes  # the failure's traceback is kept in the note
    assert session.supervisor.closed  # cut with the rest although its close failed


async def test_a_failed_close_after_a_clean_block_leaves_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    async def failing_close() -> None:
        raise RuntimeError("closing the session failed")

    with pytest.raises(RuntimeError, match="closing the session failed"):
        async with Runtime.open() as rt:
            session = await rt.open_session(options())
            monkeypatch.setattr(session, "close", failing_close)
    assert session.supervisor.closed


def failing(error: BaseException) -> Callable[[], Awaitable[None]]:
    """A task of the runtime's own (a detached run) that fails at its first step."""

    async def run() -> None:
        raise error

    return run


async def test_a_failed_task_of_the_runtime_leaves_as_itself_and_several_as_a_group_of_them() -> None:
    alone = LookupError("one task failed")
    with pytest.raises(LookupError) as caught:
        async with Runtime.open() as rt:
            rt._detach(failing(alone))
            await trio.sleep_forever()  # cancelled by the failure: that Cancelled is the nursery's, absorbed
    assert caught.value is alone

    first, second = LookupError("one"), OSError("two")
    with pytest.raises(ExceptionGroup) as grouped:
        async with Runtime.open() as rt:
            rt._detach(failing(first))
            rt._detach(failing(second))
            await trio.sleep_forever()
    assert sorted(map(id, grouped.value.exceptions)) == sorted(map(id, (first, second)))  # no Cancelled among them


async def test_a_task_failing_while_the_blocks_exception_propagates_is_noted_on_it() -> None:
    error = ValueError("the host's own")
    with pytest.raises(ValueError) as caught:
        async with Runtime.open() as rt:
            rt._detach(failing(LookupError("a task failed meanwhile")))  # runs while the runtime closes
            fail(error)
    assert caught.value is error
    assert raised_in_fail(caught.value)
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "a task of the runtime failed meanwhile" in notes
    assert "LookupError: a task failed meanwhile" in notes


async def test_ctrl_c_in_a_task_while_the_blocks_exception_propagates_goes_on_with_it_noted() -> None:
    interrupt = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as caught:
        async with Runtime.open() as rt:
            rt._detach(failing(interrupt))
            fail(ValueError("the host's own"))
    assert caught.value is interrupt  # not swallowed by a host that catches its ValueError
    notes = "\n".join(getattr(caught.value, "__notes__", []))
    assert "the block raised meanwhile" in notes
    assert "ValueError: the host's own" in notes


async def test_ctrl_c_in_a_task_of_the_runtime_leaves_bare() -> None:
    async def interrupted() -> None:
        raise KeyboardInterrupt  # as trio raises it in whatever unprotected code runs at the moment

    with pytest.raises(KeyboardInterrupt):
        async with Runtime.open() as rt:
            session = await rt.open_session(options())
            rt._detach(interrupted)
            await trio.sleep_forever()
    assert session.supervisor.closed


# -- asyncio: AsyncioRuntime.open, both modes ------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_asyncio_an_exception_of_the_block_leaves_as_itself(mode: Mode) -> None:
    error = ValueError("the host's own")

    async def main() -> None:
        with pytest.raises(ValueError) as caught:
            async with AsyncioRuntime.open(mode=mode) as rt:
                session = await rt.open_session(options())
                fail(error)
        assert caught.value is error
        assert raised_in_fail(caught.value)
        assert session.session.supervisor.closed

    run_asyncio(main)


@pytest.mark.parametrize("mode", MODES)
def test_asyncio_keyboard_interrupt_of_the_block_leaves_bare(mode: Mode) -> None:
    error = KeyboardInterrupt()

    async def main() -> None:
        with pytest.raises(KeyboardInterrupt) as caught:
            async with AsyncioRuntime.open(mode=mode) as rt:
                session = await rt.open_session(options())
                fail(error)
        assert caught.value is error
        assert session.session.supervisor.closed

    run_asyncio(main)


@pytest.mark.parametrize("mode", MODES)
def test_asyncio_an_enclosing_timeout_cancels_the_block_cleanly(mode: Mode) -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(None) as deadline:
                async with AsyncioRuntime.open(mode=mode) as rt:
                    session = await rt.open_session(options())
                    deadline.reschedule(asyncio.get_running_loop().time())  # due now: it cancels the wait below
                    await asyncio.Event().wait()
        assert session.session.supervisor.closed

    run_asyncio(main)


@pytest.mark.parametrize("mode", MODES)
def test_asyncio_a_queryloop_error_of_the_block_leaves_as_its_class(mode: Mode) -> None:
    async def main() -> None:
        with pytest.raises(SessionClosed):
            async with AsyncioRuntime.open(mode=mode) as rt:
                closed = await rt.open_session(options())
                still_open = await rt.open_session(options())
                await closed.close()
                closed.query("after its close")
        assert still_open.session.supervisor.closed

    run_asyncio(main)


# -- threads: BlockingRuntime ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", [ValueError, KeyboardInterrupt])
def test_blocking_an_exception_of_the_block_leaves_as_itself(kind: type[BaseException]) -> None:
    error = kind("the host's own")
    with pytest.raises(kind) as caught, BlockingRuntime() as rt:
        session = rt.open_session(options())
        fail(error)
    assert caught.value is error
    assert raised_in_fail(caught.value)
    assert session.session.supervisor.closed


def test_blocking_a_queryloop_error_of_the_block_leaves_as_its_class() -> None:
    with pytest.raises(SessionClosed), BlockingRuntime() as rt:
        closed = rt.open_session(options())
        still_open = rt.open_session(options())
        closed.close()
        closed.query("after its close")
    assert still_open.session.supervisor.closed
