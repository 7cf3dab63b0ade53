"""A model provider written for asyncio (`runs_on = "asyncio"`): under `AsyncioRuntime` it streams on the
host's loop, through `host.aio_provider`; the trio `Runtime` refuses it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator
from typing import Any

import pydantic
import pytest
import sniffio
import trio

from queryloop import AgentDefinition, QueryOptions, ResultMessage, Runtime, ScriptedModel, StreamEvent
from queryloop.actors.query_loop.turn import TURN_BUFFER
from queryloop.aio import AsyncioRuntime
from queryloop.runtime.host.aio_bridge import Mode
from queryloop.runtime.host.aio_provider import WINDOW
from queryloop.runtime.loop.model import ModelError, ModelRequest
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolOutput
from queryloop.runtime.providers.scripted import TEXT_CHUNK, ScriptedReply, reply_events
from tests.agent_helpers import agent_call
from tests.helpers import text_reply, tool_use, tools_reply
from tests.hosts.test_aio import MODES, run


class AsyncioModel:
    """Plays `replies` in turn, awaiting asyncio before each event as a network read does (`awaits`);
    `stall_after` events into a reply it waits on an asyncio event nobody sets, as a stalled read."""

    runs_on = "asyncio"

    def __init__(self, replies: list[dict[str, Any]], *, awaits: bool = True, stall_after: int | None = None) -> None:
        self.replies = list(replies)
        self.awaits = awaits
        self.stall_after = stall_after
        self.ran_on: list[tuple[str, bool]] = []
        """(async library, on the host's thread) of each call."""
        self.host_thread = threading.get_ident()
        self.yielded = 0
        self.stalled: asyncio.Event | None = None
        self.closed: asyncio.Event | None = None
        self.cancelled = False

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        self.ran_on.append((sniffio.current_async_library(), threading.get_ident() == self.host_thread))
        self.stalled, self.closed = asyncio.Event(), asyncio.Event()
        reply = ScriptedReply.model_validate(self.replies.pop(0))
        events = reply_events(reply, model=request.model, message_id=f"msg_{len(self.ran_on)}", input_tokens=10)
        try:
            for number, event in enumerate(events):
                if number == self.stall_after:
                    self.stalled.set()
                    await asyncio.Event().wait()
                if self.awaits:
                    await asyncio.sleep(0)
                self.yielded += 1
                yield event
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed.set()


def adding_script() -> list[dict[str, Any]]:
    return [tools_reply(tool_use("t1", "add"), text="Adding."), text_reply("2 + 3 = 5")]


async def add(args: Any, ctx: ToolContext) -> ToolOutput:
    return "5"


@pytest.mark.parametrize("mode", MODES)
def test_an_asyncio_provider_streams_on_the_host_loop_with_the_same_events_as_on_trio(mode: Mode) -> None:
    async def on_trio() -> list[str]:
        async with Runtime.open() as runtime:
            options = QueryOptions(provider=ScriptedModel(adding_script()), tools=[Tool(name="add", call=add)])
            session = await runtime.open_session(options)
            return [event.label async for event in session.query("What is 2 + 3?")]

    async def on_asyncio() -> tuple[list[str], ResultMessage, AsyncioModel, int]:
        model = AsyncioModel(adding_script())
        async with AsyncioRuntime.open(mode=mode) as rt:
            session = await rt.open_session(QueryOptions(provider=model, tools=[Tool(name="add", call=add)]))
            query = session.query("What is 2 + 3?")
            async with query:
                labels = [event.label async for event in query]
            result = await query.wait()
            await session.close()
            return labels, result, model, rt.host_tasks

    expected = trio.run(on_trio)
    labels, result, model, host_tasks = run(on_asyncio)
    assert labels == expected
    assert result.subtype == "success" and result.result == "2 + 3 = 5" and result.num_turns == 2
    assert model.ran_on == [("asyncio", True), ("asyncio", True)]
    assert host_tasks == 0


@pytest.mark.parametrize("mode", MODES)
def test_an_abort_mid_stream_cancels_the_asyncio_providers_task_on_the_host_loop(mode: Mode) -> None:
    async def main() -> None:
        model = AsyncioModel([text_reply("never finished")], stall_after=3)
        async with AsyncioRuntime.open(mode=mode) as rt:
            session = await rt.open_session(QueryOptions(provider=model))
            query = session.query("go")
            async with query:
                async for event in query:
                    if isinstance(event, StreamEvent):  # the stream has begun: wait for it to stall, leave
                        assert model.stalled is not None
                        await model.stalled.wait()
                        break
            assert query.terminal is not None and query.terminal.reason == "aborted_streaming"
            assert model.closed is not None
            await model.closed.wait()  # the provider's own cleanup ran, on this loop
            assert model.cancelled
            result = await query.wait()
            assert result.subtype == "error_during_execution"
            assert session.live_tasks() == 0
            await session.close()

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_an_asyncio_providers_stream_runs_at_most_a_window_ahead_of_its_consumer(mode: Mode) -> None:
    """A provider that never awaits would hand its whole reply over in one step: the window holds it back."""
    deltas = 3000
    text = "".join(f"{i % 10}" for i in range(deltas * TEXT_CHUNK))
    buffer = 16

    async def main() -> None:
        model = AsyncioModel([text_reply(text)], awaits=False)
        consumed = 0
        ahead: list[int] = []
        stream = model.stream

        async def watched(request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            async for event in stream(request):
                ahead.append(model.yielded - consumed)
                yield event

        model.stream = watched  # type: ignore[method-assign]
        async with AsyncioRuntime.open(mode=mode) as rt:
            session = await rt.open_session(QueryOptions(provider=model, event_buffer=buffer))
            query = session.query("go")
            async with query:
                async for event in query:
                    if isinstance(event, StreamEvent):
                        consumed += 1
                        await asyncio.sleep(0)
            result = await query.wait()
        assert result.result == text
        assert model.yielded == consumed > deltas
        # In flight across the bridge, then the ModelCaller's buffer to the loop, the query's and the pump's.
        assert max(ahead) <= WINDOW + TURN_BUFFER + 4 * buffer, max(ahead)

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_an_asyncio_providers_error_ends_the_query_as_on_trio(mode: Mode) -> None:
    class Refusing(AsyncioModel):
        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            await asyncio.sleep(0)
            raise ModelError("invalid_request", "messages: the request is malformed", status=400)
            yield {}  # pragma: no cover - a generator

    async def main() -> ResultMessage:
        async with AsyncioRuntime.open(mode=mode) as rt:
            session = await rt.open_session(QueryOptions(provider=Refusing([])))
            query = session.query("go")
            async with query:
                async for _ in query:
                    pass
            assert query.terminal is not None and query.terminal.reason == "api_error"
            return await query.wait()

    result = run(main)
    assert result.is_error and "the request is malformed" in (result.result or "")


def test_a_subagents_asyncio_provider_streams_on_the_host_loop() -> None:
    async def main() -> None:
        child = AsyncioModel([text_reply("a: fine")])
        parent = ScriptedModel([tools_reply(agent_call("c1", "reviewer", "file a")), text_reply("done")])
        reviewer = AgentDefinition(description="Reviews one file", prompt="You review code.", provider=child)
        async with AsyncioRuntime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=parent, agents={"reviewer": reviewer}))
            result = await session.query("Review").wait()
        assert result.subtype == "success" and result.result == "done"
        assert child.ran_on == [("asyncio", True)]
        tool_results = [b for b in parent.requests[1].messages[-1]["content"] if b.get("type") == "tool_result"]
        assert "a: fine" in str(tool_results[0]["content"])

    run(main)


def test_an_asyncio_provider_under_the_trio_runtime_is_refused_with_where_it_runs() -> None:
    async def main() -> None:
        model = AsyncioModel([])
        async with Runtime.open() as runtime:
            with pytest.raises(ValueError, match="AsyncioRuntime"):
                await runtime.open_session(QueryOptions(provider=model))
            with pytest.raises(ValueError, match="AsyncioRuntime"):
                await runtime.open_session(QueryOptions(provider=ScriptedModel([]), compact_provider=model))
            session = await runtime.open_session(QueryOptions(provider=ScriptedModel([])))
            agent = AgentDefinition(description="d", prompt="p", provider=model)
            with pytest.raises(ValueError, match="AsyncioRuntime"):
                session.query("go", agents={"a": agent})
            await session.close()

    trio.run(main)


def test_a_provider_with_an_unknown_runs_on_is_refused() -> None:
    class Curio(AsyncioModel):
        runs_on = "curio"

    with pytest.raises(pydantic.ValidationError, match="'trio' or 'asyncio', not 'curio'"):
        QueryOptions(provider=Curio([]))
