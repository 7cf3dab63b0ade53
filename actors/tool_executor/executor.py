"""StreamingToolExecutor: runs the current turn's tools as their blocks complete.

Scheduling follows Claude Code's: tools are queued in block order; a tool
starts when nothing runs, or when it and everything running are
concurrency-safe; a queued unsafe tool blocks the queue behind it, so unsafe
tools run alone and in order. Each tool is abortable work of this actor, under
its own cancel scope (for `Discard`) and its own timeout.

Results (and progress) go to the turn channel as they complete: a result at
once, past the channel's bound (one per tool: it never waits, so a finished
tool's result is always in the channel), progress with backpressure. Every path
answers a `tool_use` exactly once: an unknown tool, input that fails
validation or was cut off, a denied permission, an exception, a timeout, and an
output that is neither a string nor a JSON-serializable list of blocks (named with
the tool: the request carrying it could not be sent) each give an `is_error` result
wrapped in `<tool_use_error>`. An abort cancels every
unfinished tool; the loop answers those with synthetic errors itself.

A sync tool (a plain `def`) runs in a worker thread (`Tool.run`): the same
cancellation answers it at once and abandons its thread, whose late result is
dropped with this work's scope and whose progress is dropped by its context.

What a call passes before and after its tool (hooks, permissions) is `calls`'s.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from queryloop.actors.tool_executor.calls import admitted, after_call, as_json
from queryloop.actors.tool_executor.messages import (
    AddTool,
    BeginTurn,
    CallEntry,
    Discard,
    ToolResult,
    failed,
    tool_result,
    with_stop,
)
from queryloop.runtime import telemetry
from queryloop.runtime.kernel.actor import TrioActor
from queryloop.runtime.loop.hooks import failure_text
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError, ToolOutput
from queryloop.runtime.loop.transcript import tool_error, tool_result_message


class StreamingToolExecutor(TrioActor):
    actor_name = "StreamingToolExecutor"

    def __init__(self) -> None:
        super().__init__()
        self._turn: BeginTurn | None = None
        self._entries: list[CallEntry] = []
        self._executing = 0
        """How many of `_entries` are executing."""
        self._executing_unsafe = 0
        """How many of those are not concurrency-safe (at most one, running alone)."""

    def on_receive(self, message: Any) -> Any:
        if isinstance(message, AddTool):
            return self._add(message)
        if isinstance(message, Discard):
            return self._discard()
        return super().on_receive(message)

    # -- scheduling ---------------------------------------------------------------------

    def _add(self, message: AddTool) -> None:
        turn = message.turn
        if turn is not self._turn:
            self._discard()
            self._turn = turn
        tool = turn.tools.get(message.block.get("name", ""))
        safe = tool is not None and tool.concurrency_safe
        self._entries.append(CallEntry(message.block, message.input_error, safe))
        self._process_queue()

    def _can_execute(self, safe: bool) -> bool:
        return not self._executing or (safe and not self._executing_unsafe)

    def _count_executing(self, entry: CallEntry, change: int) -> None:
        """`change` (+1, -1) the executing tools' counts by `entry`, which starts or has delivered."""
        self._executing += change
        if not entry.safe:
            self._executing_unsafe += change

    def _process_queue(self) -> None:
        control = self._turn.control if self._turn is not None else None
        if control is not None and control.abort_reason is not None:
            # The query is being aborted. A block that completed while the abort unwound this actor's work
            # (its `AddTool` waited behind the abort) must not start a tool once the abort is acked: the
            # query's end answers it with a synthetic result, and nothing of the query may run after it.
            return
        for entry in self._entries:
            if entry.status != "queued":
                continue
            if self._can_execute(entry.safe):
                entry.status = "executing"
                self._count_executing(entry, 1)
                entry.scope = self.start_work(self._execute, entry, self._turn)
            elif not entry.safe:
                break  # an unsafe tool keeps its place: nothing behind it starts first

    def _discard(self) -> None:
        for entry in self._entries:
            if entry.status in ("queued", "executing"):
                entry.status = "discarded"
                if entry.scope is not None:
                    entry.scope.cancel()
        self._entries = []
        self._executing = self._executing_unsafe = 0  # a discarded tool no longer holds the queue back

    # -- running one tool -------------------------------------------------------------------

    async def _execute(self, entry: CallEntry, turn: BeginTurn) -> None:
        run = self._run(entry, turn)  # in its query's context while telemetry is on (its hooks' spans nest there)
        result = await (run if telemetry.active is None else telemetry.active.in_query(turn.control, run))
        if entry.status != "executing":
            return  # discarded meanwhile
        entry.status = "delivered"
        self._count_executing(entry, -1)
        turn.sink.push(result)
        self._process_queue()

    async def _run(self, entry: CallEntry, turn: BeginTurn) -> ToolResult:
        name = entry.block.get("name", "")
        tool = turn.tools.get(name)
        if entry.input_error is not None:
            return failed(entry, entry.input_error)
        if tool is None:
            return failed(entry, f"Error: No such tool available: {name}")
        call = await admitted(self, entry, tool, turn)
        if isinstance(call, ToolResult):
            return call
        raw_input, args = call
        started = time.monotonic()
        call_work = self._call(entry, tool, args, turn)  # in its `execute_tool` span while telemetry is on
        output, is_error = await (
            call_work if telemetry.active is None else telemetry.active.tool(tool, entry.id, call_work)
        )
        tool_use_id = entry.id
        hooks = turn.hooks
        if hooks is not None and hooks.has("PostToolUseFailure" if is_error else "PostToolUse"):
            duration_ms = int((time.monotonic() - started) * 1000)
            output = await after_call(
                self,
                entry,
                tool,
                hooks,
                tool_input=raw_input,
                output=output,
                is_error=is_error,
                duration_ms=duration_ms,
            )
        if entry.hook_messages is None and entry.stop is None and entry.host_error is None:
            message = tool_result_message(tool_use_id, output, is_error=is_error)
            return tool_result(tool_use_id=tool_use_id, message=message)
        return ToolResult(
            tool_use_id=tool_use_id,
            message=tool_result_message(tool_use_id, output, is_error=is_error),
            hook_messages=with_stop(entry),
            prevent_continuation=entry.stop is not None,
            host_errors=(entry.host_error,) if entry.host_error else (),
        )

    async def _call(self, entry: CallEntry, tool: Tool, args: Any, turn: BeginTurn) -> tuple[ToolOutput, bool]:
        """The tool's output for `args` and whether it is an error: a timeout, an exception, or an output that
        is neither a string nor plain JSON."""
        name = entry.block.get("name", "")
        output: ToolOutput
        is_error = False
        context = ToolContext(entry.id, turn.report)
        try:
            if tool.timeout_s is None:  # no deadline, no cancel scope to pay for
                output = await tool.run(args, context)
            else:
                with trio.move_on_after(tool.timeout_s) as deadline:
                    output = await tool.run(args, context)
                if deadline.cancelled_caught:
                    output, is_error = tool_error(f"Error: {name} timed out after {tool.timeout_s:g}s"), True
        except Exception as error:  # noqa: BLE001 - a failing tool is an error result, never a dead session
            # A `ToolError` is the tool's own report (its message says it all); anything else is a bug: its traceback.
            trace = None if isinstance(error, ToolError) else error
            self.log.opt(exception=trace).warning("tool {} ({}) raised {}", name, entry.id, failure_text(error))
            output, is_error = tool_error(f"Error: {error}"), True
        if output.__class__ is not str and not is_error:
            output, is_error = as_json(self, name, output)
        return output, is_error
