"""The in-run baseline: workload W as a plain trio async-generator loop, no actors.

It consumes the same `ScriptedModel` event stream, runs the same tools (concurrency-safe
ones in parallel, started as their blocks complete), builds the same transcript objects
(the same messages, each request normalised incrementally as the runtime's are, through the
same constructors: `stream_event`, `assistant_message`, `model_request`) and yields the same
kinds of events. An abort cancels the current phase and the loop answers every
open `tool_use` before its result event, as the runtime does. What the ratio measures is
therefore what the actors, the supervision and the abort protocol cost.

With a `log` (a `BaselineLog`, opened and closed by the caller), the loop logs its conversation
there as the runtime's durable transcript does: each transcript message written (a `write`
syscall) before it is yielded, and an fsync, in a worker thread, after each turn and at the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import trio

from queryloop.runtime.loop.events import (
    AssistantMessage,
    Event,
    ResultMessage,
    StreamRequestStart,
    TranscriptMessage,
    Usage,
    UserMessage,
    assistant_message,
    new_uuid,
    stream_event,
)
from queryloop.runtime.loop.model import model_request
from queryloop.runtime.loop.stream import ResponseAssembler
from queryloop.runtime.loop.tools import Tool, ToolContext
from queryloop.runtime.loop.transcript import (
    INTERRUPT_MESSAGE,
    INTERRUPTED_BY_USER,
    IncrementalNormalizer,
    missing_tool_results,
    tool_result_message,
)
from queryloop.runtime.providers.scripted import ScriptedModel


class BaselineAbort:
    """The baseline's abort signal: a reason and the scope of the phase in flight."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.scope: trio.CancelScope | None = None

    def abort(self, reason: str = "user") -> None:
        if self.reason is None:
            self.reason = reason
        if self.scope is not None:
            self.scope.cancel()


class BaselineLog:
    """The baseline's transcript file: one JSON line a message, written at once; `sync` fsyncs off the trio thread."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._fd, b'{"type":"session","session_id":"baseline","version":1}\n')

    def write(self, message: TranscriptMessage) -> None:
        line = json.dumps(message.model_dump(mode="json"), ensure_ascii=False, separators=(",", ":")) + "\n"
        os.write(self._fd, line.encode())

    async def sync(self) -> None:
        await trio.to_thread.run_sync(os.fsync, self._fd)

    def close(self) -> None:
        os.close(self._fd)


async def baseline_loop(  # noqa: PLR0915 - one loop, written out whole as the reference's is
    model: ScriptedModel, tools: list[Tool], prompt: str, abort: BaselineAbort, *, log: BaselineLog | None = None
) -> AsyncGenerator[Event, None]:
    by_name = {t.name: t for t in tools}
    messages: list[TranscriptMessage] = [UserMessage(content=prompt)]
    if log is not None:
        log.write(messages[0])
    normalizer = IncrementalNormalizer()
    usage = Usage()
    turns = 1
    while True:
        yield StreamRequestStart()
        request = model_request(
            model="claude-sonnet-5-5",
            system=[],
            messages=normalizer.normalize(messages),
            tools=[],
            max_tokens=8000,
            thinking=None,
            task_budget=None,
            purpose="main",
        )
        assistant: list[AssistantMessage] = []
        results: list[TranscriptMessage] = []
        send, receive = trio.open_memory_channel[UserMessage](16)
        pending = 0
        stop_reason = None
        with trio.CancelScope() as scope:
            abort.scope = scope
            if abort.reason is not None:
                scope.cancel()
            async with trio.open_nursery() as nursery:
                assembler = ResponseAssembler()
                async with aclosing(model.stream(request)) as stream:
                    async for raw in stream:
                        yield stream_event(raw)
                        completed = assembler.feed(raw)
                        if completed is None:
                            continue
                        message = assistant_message(
                            new_uuid(), assembler.message_id, request.model, [completed.block], assembler.usage
                        )
                        assistant.append(message)
                        if log is not None:
                            log.write(message)
                        yield message
                        if completed.block.get("type") == "tool_use":
                            pending += 1
                            nursery.start_soon(_run_tool, by_name, completed.block, send)
                usage = usage + assembler.usage
                stop_reason = assembler.stop_reason
                while pending:
                    result = await receive.receive()
                    pending -= 1
                    results.append(result)
                    if log is not None:
                        log.write(result)
                    yield result
        abort.scope = None
        if abort.reason is not None:
            while True:
                try:
                    results.append(receive.receive_nowait())
                except trio.WouldBlock:
                    break
            for synthetic in missing_tool_results(assistant, results, INTERRUPTED_BY_USER):
                if log is not None:
                    log.write(synthetic)
                yield synthetic
            if abort.reason != "interrupt":
                interruption = UserMessage(content=[{"type": "text", "text": INTERRUPT_MESSAGE}])
                if log is not None:
                    log.write(interruption)
                yield interruption
            if log is not None:
                await log.sync()
            yield _result("error_during_execution", usage, turns, stop_reason)
            return
        if log is not None:
            await log.sync()  # a turn's end, or the query's
        if not any(b.get("type") == "tool_use" for m in assistant for b in m.content):
            yield _result("success", usage, turns, stop_reason)
            return
        messages = [*messages, *assistant, *results]
        turns += 1


async def _run_tool(by_name: dict[str, Tool], block: dict[str, Any], send: trio.MemorySendChannel[UserMessage]) -> None:
    tool = by_name[block["name"]]

    async def report(tool_use_id: str, data: Any) -> None:
        return None

    output = await tool.run(block.get("input", {}), ToolContext(block["id"], report))
    await send.send(tool_result_message(block["id"], output, is_error=False))


def _result(subtype: Any, usage: Usage, turns: int, stop_reason: str | None) -> ResultMessage:
    return ResultMessage(
        subtype=subtype,
        is_error=subtype != "success",
        duration_ms=0,
        stop_reason=stop_reason,
        total_cost_usd=0.0,
        usage=usage,
        num_turns=turns,
    )


async def baseline_fan_out(
    parent: Any, child: Any, read: Tool, prompt: str, abort: BaselineAbort
) -> AsyncGenerator[Event, None]:
    """`bench agents`' baseline: the baseline loop whose `Agent` tool runs a baseline loop per child.

    The children run as the parent's tool tasks (one nursery), their events dropped, each one's last
    text its result; the parent's abort cancels its phase's scope, and with it every child."""

    async def agent(args: Any, ctx: ToolContext) -> str:
        text = ""
        async with aclosing(baseline_loop(child, [read], args["prompt"], BaselineAbort())) as events:
            async for event in events:
                if isinstance(event, AssistantMessage):
                    text = "".join(b.get("text", "") for b in event.content if b.get("type") == "text") or text
        return text

    tools = [Tool(name="Agent", call=agent, concurrency_safe=True)]
    async with aclosing(baseline_loop(parent, tools, prompt, abort)) as events:
        async for event in events:
            yield event
