"""Builders for scripted replies and tools, and the end-of-query checks every loop test makes."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from loguru import logger

from queryloop import Runtime
from queryloop.actors.query_loop.run import TRANSCRIPT_TYPES
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.loop.events import QueryEvent, UserMessage
from queryloop.runtime.loop.model import FallbackTriggered, ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError, ToolOutput
from queryloop.runtime.loop.transcript import transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel

TESTS = Path(__file__).resolve().parent
"""The tests' root: their shared helpers, fixtures, scenarios and MCP server live here."""
REPO = TESTS.parent
"""The checkout's root."""
FIXTURES = TESTS / "fixtures"
"""The recorded Messages API streams (`sse/`) and error bodies (`errors/`); `SOURCES.md` says where
each one was recorded."""


def text_reply(text: str = "Done.", stop_reason: str = "end_turn", **extra: Any) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "stop_reason": stop_reason, **extra}


def tool_use(tool_id: str, name: str, tool_input: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_id, "name": name, "input": tool_input or {}}


def tools_reply(*uses: dict[str, Any], text: str | None = None, **extra: Any) -> dict[str, Any]:
    content = ([{"type": "text", "text": text}] if text else []) + list(uses)
    return {"content": content, "stop_reason": "tool_use", **extra}


@dataclass
class ToolLog:
    """Start and end times (trio clock) of every scripted tool run."""

    starts: dict[str, float] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


def scripted_tool(
    name: str,
    *,
    result: str = "ok",
    latency: float = 0.0,
    safe: bool = False,
    raises: str | None = None,
    progress: tuple[Any, ...] = (),
    log: ToolLog | None = None,
    timeout_s: float | None = None,
) -> Tool:
    async def call(_: Any, ctx: ToolContext) -> ToolOutput:
        if log is not None:
            log.starts[ctx.tool_use_id] = trio.current_time()
            log.order.append(ctx.tool_use_id)
        for step in progress:
            await ctx.progress(step)
        await trio.sleep(latency)
        if log is not None:
            log.ends[ctx.tool_use_id] = trio.current_time()
        if raises is not None:
            raise ToolError(raises)
        return result

    return Tool(name=name, call=call, concurrency_safe=safe, timeout_s=timeout_s)


@dataclass
class Ran:
    session: Session
    handle: QueryHandle
    events: list[QueryEvent]
    model: ScriptedModel

    @property
    def labels(self) -> list[str]:
        return [e.label for e in self.events]

    @property
    def reason(self) -> str:
        assert self.handle.terminal is not None
        return self.handle.terminal.reason

    def tool_results(self) -> dict[str, dict[str, Any]]:
        found = {}
        for event in self.events:
            if isinstance(event, UserMessage) and isinstance(event.content, list):
                for block in event.content:
                    if block.get("type") == "tool_result":
                        found[block["tool_use_id"]] = block
        return found

    def texts_of_user_events(self) -> list[str]:
        texts = []
        for event in self.events:
            if isinstance(event, UserMessage):
                content = event.content
                if isinstance(content, str):
                    texts.append(content)
                else:
                    texts.extend(b.get("text", "") for b in content if b.get("type") == "text")
        return texts


async def open_session(runtime: Runtime, provider: ScriptedModel, **options: Any) -> Session:
    return await runtime.open_session(QueryOptions(provider=provider, **options))


async def consume(session: Session, handle: QueryHandle, model: ScriptedModel) -> Ran:
    events = [event async for event in handle]
    return Ran(session, handle, events, model)


async def run_query(
    runtime: Runtime, entries: list[dict[str, Any]], prompt: str = "Fix the bug", **options: Any
) -> Ran:
    scripted = ScriptedModel(entries)
    session = await open_session(runtime, scripted, **options)
    return await consume(session, session.query(prompt), scripted)


async def assert_settled(ran: Ran) -> None:
    """What every query guarantees at its end: one result last, nothing running, a valid transcript."""
    assert ran.session.live_tasks() == 0, "a task of the session outlived the query's event stream"
    assert ran.labels.count("result") == 1 and ran.labels[-1] == "result"
    assert ran.handle.result is not None and ran.handle.terminal is not None
    assert transcript_problems(await ran.session.transcript()) == []


class FallbackMidStream:
    """Streams the first `events` events of the `fail_on`th reply, then asks for the fallback model."""

    def __init__(self, inner: ScriptedModel, fail_on: int, events: int) -> None:
        self.inner, self.fail_on, self.events = inner, fail_on, events
        self.requests: list[ModelRequest] = inner.requests

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        number = len(self.inner.requests) + 1
        async with aclosing(self.inner.stream(request)) as events:
            count = 0
            async for event in events:
                if number == self.fail_on and count == self.events:
                    raise FallbackTriggered("primary overloaded")
                count += 1
                yield event


@contextmanager
def log_records() -> Iterator[list[dict[str, Any]]]:
    """Every record the library logs meanwhile (level name, message, exception)."""
    records: list[dict[str, Any]] = []

    def sink(message: Any) -> None:
        record = message.record
        records.append({"level": record["level"].name, "message": record["message"], "exception": record["exception"]})

    logger.enable("queryloop")
    sink_id = logger.add(sink, level="DEBUG")
    try:
        yield records
    finally:
        logger.remove(sink_id)
        logger.disable("queryloop")


@contextmanager
def hang_guard(seconds: float, what: str) -> Iterator[None]:
    """Fail the test, naming `what`, if the block has not finished after `seconds` of trio's clock.

    A bound against a hang, far above the block's usual time so that a loaded machine never trips it;
    never a measure of speed (that is `bench/`'s). The block is cancelled at the bound; on a `MockClock`
    the seconds are simulated."""
    with trio.move_on_after(seconds) as scope:
        yield
    if scope.cancelled_caught:
        pytest.fail(f"{what} had not finished after {seconds:g} s: a hang", pytrace=False)


def logged_uuids(path: Path) -> set[str]:
    """The uuids of the message records a transcript file holds now (every write is whole lines)."""
    return {json.loads(line).get("uuid") for line in path.read_bytes().splitlines()}


def kept(event: object) -> bool:
    """A transcript message the session keeps: in its conversation and its file (the `system` `init` notice each
    query opens with, for the host only, is neither)."""
    return isinstance(event, TRANSCRIPT_TYPES) and getattr(event, "subtype", None) != "init"
