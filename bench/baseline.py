"""The in-run baseline: workload W as a plain trio async-generator loop, no actors.

The baseline is the same work, only the actors gone. It consumes the same `ScriptedModel`
event stream, runs the same tools (concurrency-safe ones in parallel, started as their blocks
complete), builds the same transcript objects and requests (the same system prompt and tool
schemas; each request normalised incrementally, through the same constructors: `stream_event`,
`assistant_message`, `model_request`) and yields the same kinds of events. It also runs Claude Code's
per-turn rules through the functions the QueryLoop calls: before each call the compact boundary and
whether the context pipeline is needed; after each tool round the `max_turns` check, `next_turn` and
whether a collapse may stage; at the end the budget ledger's totals (cost, usage) and the result's
fields. It keeps the Agent SDK's contract as the runtime does: the `init` event with the same data, a
`session_id` on every event, the API time of each request, and the result's Claude Code fields
(`terminal_reason`, `model_usage`, `duration_api_ms`, `api_error_status`, `session_id`), through the same
functions (`sdk_fields`, `decisions`). An abort cancels the current phase and the loop answers every open
`tool_use` before its result event, as the runtime does. What the ratio measures is therefore what the
actors, the supervision and the abort protocol cost.

The loop has no Compactor: a conversation that would need the context pipeline, or a collapse,
is not W's, and raises.

With a `log` (a `BaselineLog`, opened and closed by the caller), the loop logs its conversation
there as the runtime's durable transcript does: each transcript message written (a `write`
syscall) before it is yielded, and an fsync, in a worker thread, after each turn and at the end.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any, TypeVar

import trio

from queryloop.actors.budget_guard import BudgetLedger
from queryloop.actors.compactor import context_config
from queryloop.actors.query_loop import sdk_fields
from queryloop.runtime.loop.context import OversizedResultScan, TokenCountMemo, collapse_may_stage, pipeline_needed
from queryloop.runtime.loop.decisions import (
    abort_terminal,
    claude_code_terminal_reason,
    max_turns_reached,
    result_is_error,
    result_subtype,
)
from queryloop.runtime.loop.events import (
    AssistantMessage,
    Event,
    ResultMessage,
    StreamRequestStart,
    SystemMessage,
    TranscriptMessage,
    Usage,
    UserMessage,
    assistant_message,
    new_uuid,
    stream_event,
)
from queryloop.runtime.loop.model import model_request
from queryloop.runtime.loop.options import DEFAULT_SYSTEM_PROMPT, QueryOptions
from queryloop.runtime.loop.state import TerminalReason, initial_state, next_turn
from queryloop.runtime.loop.stream import ResponseAssembler
from queryloop.runtime.loop.tools import Tool, ToolContext
from queryloop.runtime.loop.transcript import (
    INTERRUPT_MESSAGE,
    INTERRUPTED_BY_USER,
    CompactBoundary,
    IncrementalNormalizer,
    build_system_prompt,
    missing_tool_results,
    response_text,
    tool_result_message,
)
from queryloop.runtime.providers.scripted import ScriptedModel

E = TypeVar("E", bound=Event)

W_OPTIONS = QueryOptions()
"""The settings the runtime's side runs W with (`QueryOptions`' defaults): the baseline's config."""


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


async def baseline_loop(  # noqa: PLR0915 - one loop, written out whole as Claude Code's is
    model: ScriptedModel,
    tools: list[Tool],
    prompt: str,
    abort: BaselineAbort,
    *,
    options: QueryOptions = W_OPTIONS,
    log: BaselineLog | None = None,
) -> AsyncGenerator[Event, None]:
    by_name = {t.name: t for t in tools}
    # The query's config snapshot, as the QueryLoop takes it (`intake.new_run`).
    started = time.monotonic()
    system = build_system_prompt(
        DEFAULT_SYSTEM_PROMPT,
        custom=options.system_prompt,
        append=options.append_system_prompt,
        system_context=options.system_context,
    )
    tool_schemas = [t.api_schema() for t in tools]
    context = context_config(options)
    ledger = BudgetLedger()
    ledger.begin_query(
        max_budget_usd=options.max_budget_usd,
        token_budget=options.token_budget,
        model=options.model,
        pricing=options.pricing,
    )
    boundary, scan, count = CompactBoundary(), OversizedResultScan(), TokenCountMemo()
    normalizer = IncrementalNormalizer()
    first = UserMessage(content=prompt)
    if log is not None:
        log.write(first)
    state = initial_state([first])
    # The query's `init` notice, as the QueryLoop opens it (`sdk_fields.init_message`), and the session's id on
    # every event, as the consumer's handle sets it (`_stamped`).
    session_id = new_uuid()
    cwd = options.cwd if options.cwd is not None else os.getcwd()
    data = {
        "type": "system",
        "subtype": "init",
        "session_id": session_id,
        "cwd": str(cwd),
        "model": options.model,
        "tools": [t.name for t in tools],
        "mcp_servers": [{"name": name, "status": "connected"} for name in options.mcp_servers],
        "permissionMode": options.permission_mode or "default",
    }
    init = SystemMessage(subtype="init", data=data, session_id=session_id)
    data["uuid"] = init.uuid
    yield init
    api_s = 0.0
    unsettled: list[tuple[str, Usage]] = []
    text, message_id = "", ""
    stop_reason = None
    while True:
        messages = boundary.after(state.messages)
        if pipeline_needed(
            messages,
            context.limits,
            max_tool_result_chars=context.max_tool_result_chars,
            snip_max_rounds=context.snip_max_rounds,
            scan=scan,
            count=count,
        ):
            raise NotImplementedError(_NOT_W)
        yield _stamped(StreamRequestStart(), session_id)
        request = model_request(
            model=options.model,
            system=system,
            messages=normalizer.normalize(messages),
            tools=tool_schemas,
            max_tokens=state.max_output_tokens_override or options.max_output_tokens,
            thinking=options.thinking,
            task_budget=None if options.task_budget is None else {"total": options.task_budget},
            purpose="main",
        )
        assistant: list[AssistantMessage] = []
        results: list[TranscriptMessage] = []
        # Not `open_memory_channel[UserMessage](16)`: subscripting it at run time costs a typing lookup per turn.
        send: trio.MemorySendChannel[UserMessage]
        receive: trio.MemoryReceiveChannel[UserMessage]
        send, receive = trio.open_memory_channel(16)
        pending = tool_uses = 0
        streamed = False
        with trio.CancelScope() as scope:
            abort.scope = scope
            if abort.reason is not None:
                scope.cancel()
            async with trio.open_nursery() as nursery:
                assembler = ResponseAssembler()
                sent = trio.current_time()
                async with aclosing(model.stream(request)) as stream:
                    async for raw in stream:
                        yield stream_event(raw, session_id)
                        completed = assembler.feed(raw)
                        if completed is None:
                            continue
                        block = completed.block
                        message = assistant_message(
                            new_uuid(), assembler.message_id, request.model, [block], assembler.usage
                        )
                        assistant.append(message)
                        if log is not None:
                            log.write(message)
                        yield _stamped(message, session_id)
                        message_id, text = response_text(message_id, text, message)
                        if block.get("type") == "tool_use":
                            tool_uses += 1
                            pending += 1
                            nursery.start_soon(_run_tool, by_name, block, send)
                api_s += trio.current_time() - sent
                streamed = True
                unsettled.append((options.model, assembler.usage))
                stop_reason = assembler.stop_reason
                while pending:
                    result = await receive.receive()
                    pending -= 1
                    results.append(result)
                    if log is not None:
                        log.write(result)
                    yield _stamped(result, session_id)
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
                yield _stamped(synthetic, session_id)
            if abort.reason != "interrupt":
                interruption = UserMessage(content=[{"type": "text", "text": INTERRUPT_MESSAGE}])
                if log is not None:
                    log.write(interruption)
                yield _stamped(interruption, session_id)
            if log is not None:
                await log.sync()
            reason: TerminalReason = abort_terminal(streamed, bool(tool_uses))
            break
        if log is not None:
            await log.sync()  # a turn's end, or the query's
        if not tool_uses:
            reason = "completed"
            break
        if max_turns_reached(state.turn_count, options.max_turns):
            raise NotImplementedError(_NOT_W)
        state = next_turn(state, [*messages, *assistant, *results])
        if options.context_collapse and collapse_may_stage(state.messages, context.limits, count):
            raise NotImplementedError(_NOT_W)
    yield _result(
        reason,
        ledger,
        unsettled,
        options,
        started=started,
        text=text,
        stop_reason=stop_reason,
        turns=state.turn_count,
        sdk={"session_id": session_id, "api_s": api_s, "prompt_uuid": first.uuid},
    )


_set = object.__setattr__


def _stamped(event: E, session_id: str) -> E:
    """The event with its session's id, as `QueryHandle.__anext__` sets it on every event it hands out."""
    _set(event, "session_id", session_id)
    return event


_NOT_W = "the baseline runs workload W, whose context needs no compaction and whose turns are not limited"


async def _run_tool(by_name: dict[str, Tool], block: dict[str, Any], send: trio.MemorySendChannel[UserMessage]) -> None:
    tool = by_name[block["name"]]

    async def report(tool_use_id: str, data: Any) -> None:
        return None

    output = await tool.run(block.get("input", {}), ToolContext(block["id"], report))
    await send.send(tool_result_message(block["id"], output, is_error=False))


def _result(
    reason: TerminalReason,
    ledger: BudgetLedger,
    unsettled: list[tuple[str, Usage]],
    options: QueryOptions,
    *,
    started: float,
    text: str,
    stop_reason: str | None,
    turns: int,
    sdk: dict[str, Any],
) -> ResultMessage:
    """The query's totals from the ledger, its calls accounted in one go, as the runtime's `ending.settle` does,
    and the result's fields as `ending.send_outcome` fills them."""
    for model, usage in unsettled:
        ledger.account(model, usage)
    totals = ledger.status(models=True)
    claude_code_reason = claude_code_terminal_reason(reason)
    prompt_uuid = sdk["prompt_uuid"]
    return ResultMessage(
        subtype=result_subtype(reason),
        is_error=result_is_error(reason, api_error_surfaced=False),
        duration_ms=int((time.monotonic() - started) * 1000),
        result=text,
        stop_reason=stop_reason,
        total_cost_usd=totals.query_cost_usd,
        usage=totals.query_usage,
        num_turns=turns,
        errors=[],
        usage_by_agent={},
        user_message_uuid=prompt_uuid,
        user_message_uuids=[prompt_uuid],
        permission_denials=[],
        terminal_reason=claude_code_reason,
        model_usage=sdk_fields.model_usage(options, totals.models),
        duration_api_ms=int(sdk["api_s"] * 1000),
        api_error_status=None,
        session_id=sdk["session_id"],
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
