"""Closing a runtime answers every consumer: each blocked (or later) consumer gets its query's remaining events and
its aborted `result`; only what would start after the close began is refused, with `RuntimeClosed`.

The queries' model never answers on its own (a reply scripted with a latency no test outlives): the close is the
only thing that ends them. Real threads for the blocking host, real asyncio tasks for the asyncio one.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

import pytest

from queryloop.aio import AsyncioQuery, AsyncioRuntime
from queryloop.runtime.errors import RuntimeClosed
from queryloop.runtime.host.blocking import BlockingQuery, BlockingRuntime
from queryloop.runtime.loop.events import ResultMessage
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import text_reply

if TYPE_CHECKING:
    from queryloop.runtime.host.aio_bridge import Mode

CONSUMERS = 1_000
"""As many as the issue measured: the answers must not depend on how the consumers race the run's end."""

NEVER_MS = 1e9
"""A reply's latency (11 days): the model answers only if the query is never aborted."""


def never_answers() -> ScriptedModel:
    return ScriptedModel([{**text_reply("never"), "latency_ms": NEVER_MS}], repeat=True)


def assert_aborted_by_the_close(outcome: object) -> None:
    assert isinstance(outcome, ResultMessage), f"a consumer got {outcome!r} instead of its result"
    assert outcome.subtype == "error_during_execution"


def test_closing_the_blocking_runtime_answers_every_blocked_consumer_with_its_aborted_result() -> None:
    rt = BlockingRuntime().start()
    try:
        model = never_answers()
        queries = [rt.open_session(QueryOptions(provider=model)).query("wait") for _ in range(CONSUMERS)]
        unread = rt.open_session(QueryOptions(provider=model)).query("nobody reads me before the close")
        answered = rt.open_session(QueryOptions(provider=ScriptedModel([text_reply("in time")])))
        finished = answered.query("answered before the close")
        # Ended (its result in its channel), none of it read yet: waited for on the runtime's side.
        rt.call(finished._handle._control.wait_ended)  # the query's own end, not its events
        outcomes: list[object] = [None] * CONSUMERS
        all_running = threading.Barrier(CONSUMERS + 1)
        closed = threading.Event()

        def consume(index: int) -> None:
            query = queries[index]
            try:
                first = next(query)  # the query runs: its `init`, then the model's event, which never comes
                if first.label == "system:init":
                    first = next(query)
                all_running.wait()
                if first.label != "stream_request_start":
                    outcomes[index] = first
                elif index % 2:
                    outcomes[index] = query.wait()  # blocked in it when the close comes
                else:
                    # Busy with the close's first event (the interruption message) until the close has
                    # returned: it reads the rest once the runtime's thread is gone.
                    events = [event for event in query if event.label != "user" or closed.wait()]
                    outcomes[index] = events[-1]
            except BaseException as error:  # what a consumer got is the verdict
                outcomes[index] = error

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(CONSUMERS)]
        for thread in threads:
            thread.start()
        all_running.wait()  # every consumer is past its first event, on its way to block for the next
    finally:
        rt.close()
        closed.set()
    for thread in threads:
        thread.join()
    for outcome in outcomes:
        assert_aborted_by_the_close(outcome)
    assert {query.terminal.reason for query in queries if query.terminal is not None} == {"aborted_streaming"}
    # A consumer that comes after the run has ended is served from the channel as well.
    late_labels = [event.label for event in unread]
    assert late_labels[-1] == "result"
    assert_aborted_by_the_close(unread.result)
    finished_events = list(finished)
    assert [e.label for e in finished_events[:2]] == ["system:init", "stream_request_start"]
    assert isinstance(finished_events[-1], ResultMessage) and finished_events[-1].result == "in time"
    assert list(finished) == []  # the stream has ended: iterating again gives nothing, raises nothing
    finished.close()  # nothing runs any more: closing it is a no-op, not an error
    with pytest.raises(RuntimeClosed):
        answered.query("after the close")
    with pytest.raises(RuntimeClosed):
        rt.open_session(QueryOptions(provider=model))


def test_a_query_started_while_the_blocking_runtime_closes_is_answered_or_refused_never_left_hanging() -> None:
    rt = BlockingRuntime().start()
    model = never_answers()
    sessions = [rt.open_session(QueryOptions(provider=model)) for _ in range(50)]
    outcomes: list[object] = [None] * len(sessions)
    all_started = threading.Barrier(len(sessions) + 1)

    def start_then_wait(index: int) -> None:
        all_started.wait()
        try:
            query: BlockingQuery = sessions[index].query("racing the close")
            outcomes[index] = query.wait()
        except BaseException as error:  # what a consumer got is the verdict
            outcomes[index] = error

    threads = [threading.Thread(target=start_then_wait, args=(i,)) for i in range(len(sessions))]
    for thread in threads:
        thread.start()
    all_started.wait()
    rt.close()
    for thread in threads:
        thread.join()
    for outcome in outcomes:
        if not isinstance(outcome, RuntimeClosed):  # refused: its start lost the race with the close
            assert_aborted_by_the_close(outcome)


@pytest.mark.parametrize("mode", ["guest", "thread"])
def test_closing_the_asyncio_runtime_answers_every_waiting_task_with_its_aborted_result(mode: Mode) -> None:
    async def main() -> None:
        rt = await AsyncioRuntime.start(mode=mode)
        model = never_answers()
        queries = [(await rt.open_session(QueryOptions(provider=model))).query("wait") for _ in range(CONSUMERS)]
        unread = (await rt.open_session(QueryOptions(provider=model))).query("nobody reads me before the close")
        answered = await rt.open_session(QueryOptions(provider=ScriptedModel([text_reply("in time")])))
        finished = answered.query("answered before the close")
        await finished._stream.wait_ended()  # ended, its events buffered, none read yet
        running = asyncio.Event()

        async def consume(index: int, query: AsyncioQuery) -> Any:
            try:
                if index % 2:
                    return await query.wait()
                last = None
                async for event in query:
                    running.set()
                    last = event
                return last
            except BaseException as error:  # what a consumer got is the verdict
                return error

        tasks = [asyncio.create_task(consume(i, query)) for i, query in enumerate(queries)]
        await running.wait()  # the consumers are in their loops, waiting for events that only the close brings
        await rt.aclose()
        for outcome in await asyncio.gather(*tasks):
            assert_aborted_by_the_close(outcome)
        late = [event async for event in unread]
        assert late[-1].label == "result"
        assert_aborted_by_the_close(late[-1])
        finished_events = [event async for event in finished]
        assert [e.label for e in finished_events[:2]] == ["system:init", "stream_request_start"]
        assert isinstance(finished_events[-1], ResultMessage) and finished_events[-1].result == "in time"
        assert (await finished.wait()).result == "in time"
        with pytest.raises(RuntimeClosed):
            answered.query("after the close")
        with pytest.raises(RuntimeClosed):
            await rt.open_session(QueryOptions(provider=model))

    asyncio.run(main())
