"""Scenario files (the format is docs/scenarios.md): parse, run on the `ScriptedModel`, judge.

`run_scenario` plays one query end to end in a fresh runtime and returns the
verdict dict that `queryloop scenario FILE` prints. Unknown keys anywhere are
a `ScenarioError` naming the key. Aborts are triggered from a watcher task of
the runner, never from inside the work they abort.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any, Literal

import trio
import trio.testing
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from queryloop.runtime.errors import QueryloopError
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.host.session import Session
from queryloop.runtime.loop.events import QueryEvent, StreamEvent, Usage, UserMessage
from queryloop.runtime.loop.hooks import HookDecision, PostToolUseInput, StopHookInput
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.pricing import Pricing
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError, ToolOutput
from queryloop.runtime.loop.transcript import transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel, ScriptEntry, fixed_reply_model, parse_entry


class ScenarioError(QueryloopError, ValueError):
    """A malformed scenario file (the message names the offending key)."""


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


class ScenarioOptions(_Strict):
    model: str = "claude-sonnet-5-5"
    fallback_model: str | None = None
    max_turns: int | None = None
    max_budget_usd: float | None = None
    token_budget: int | None = None
    auto_compact: bool = True
    context_window: int | None = None
    max_output_tokens: int = 8000
    max_retries: int = 2
    stop_hook_block_cap: int = Field(default=8, ge=0)
    pricing: Pricing | None = None


class ScenarioTool(_Strict):
    name: str
    concurrency_safe: bool = False
    latency_ms: float = 0
    result: str = "ok"
    raises: str | None = None
    progress: list[Any] = Field(default_factory=list)
    timeout_ms: float | None = None


class HookEntry(_Strict):
    pass_: bool = Field(default=False, alias="pass")
    blocking_error: str | None = None
    prevent: str | None = None
    tool: str | None = None


class ScenarioAbort(_Strict):
    phase: Literal["before_start", "streaming", "tools", "compacting", "after_end"] | None = None
    call: int = Field(default=1, ge=1)
    after_ms: float | None = None
    reason: Literal["user", "interrupt"] = "user"

    @model_validator(mode="after")
    def _one_trigger(self) -> ScenarioAbort:
        if (self.phase is None) == (self.after_ms is None):
            msg = "abort: give exactly one of `phase` and `after_ms`"
            raise ValueError(msg)
        return self


class Scenario(_Strict):
    prompt: str
    options: ScenarioOptions = ScenarioOptions()
    tools: list[ScenarioTool] = Field(default_factory=list)
    model: list[dict[str, Any]]
    summarizer_model: list[dict[str, Any]] | None = None
    compact_model: list[dict[str, Any]] | None = None
    stop_hooks: list[HookEntry] = Field(default_factory=list)
    post_tool_use_hooks: list[HookEntry] = Field(default_factory=list)
    abort: ScenarioAbort | None = None

    def entries(self) -> list[ScriptEntry]:
        return [parse_entry(raw) for raw in self.model]


def _scenario_text(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        msg = f"scenario file {str(path)!r} does not exist"
        raise ScenarioError(msg) from None
    except OSError as error:
        msg = f"cannot read scenario file {str(path)!r}: {error.strerror or error}"
        raise ScenarioError(msg) from None


def load_scenario(source: str | Path | dict[str, Any]) -> Scenario:
    """Parse a scenario from a path, JSON text (a string starting with `{`) or a dict; `ScenarioError`
    names what is wrong: a missing file, invalid JSON, or the offending key."""
    try:
        if isinstance(source, dict):
            raw = source
        elif isinstance(source, str) and source.lstrip().startswith("{"):
            raw = json.loads(source)
        else:
            raw = json.loads(_scenario_text(Path(source)))
        scenario = Scenario.model_validate(raw)
        scenario.entries()  # model entries are validated too (unknown keys included)
        for script in (scenario.summarizer_model or [], scenario.compact_model or []):
            for entry in script:
                parse_entry(entry)
    except json.JSONDecodeError as error:
        msg = f"not valid JSON: {error}"
        raise ScenarioError(msg) from error
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: "
            + ("unknown key" if e["type"] == "extra_forbidden" else e["msg"])
            for e in error.errors()
        )
        msg = f"malformed scenario: {problems}"
        raise ScenarioError(msg) from error
    return scenario


class _Script:
    """Scripted hooks and tools, consuming one entry per invocation."""

    def __init__(self, scenario: Scenario, model: ScriptedModel, fire: trio.Event) -> None:
        self.scenario = scenario
        self.model = model
        self.fire = fire
        self.stop_entries = list(scenario.stop_hooks)
        self.post_entries = list(scenario.post_tool_use_hooks)
        self.tools_started_at: set[int] = set()

    async def stop_hook(self, _: StopHookInput) -> HookDecision | None:
        if not self.stop_entries:
            return None
        entry = self.stop_entries.pop(0)
        return HookDecision(blocking_error=entry.blocking_error, prevent=entry.prevent)

    async def post_tool_use(self, hook_input: PostToolUseInput) -> HookDecision | None:
        for index, entry in enumerate(self.post_entries):
            if entry.tool in (None, hook_input.tool_name):
                del self.post_entries[index]
                return HookDecision(blocking_error=entry.blocking_error, prevent=entry.prevent)
        return None

    def tool(self, spec: ScenarioTool) -> Tool:
        abort = self.scenario.abort

        async def call(_: Any, ctx: ToolContext) -> ToolOutput:
            call_number = len(self.model.requests)
            if call_number not in self.tools_started_at:
                self.tools_started_at.add(call_number)
                if abort is not None and abort.phase == "tools" and abort.call == call_number:
                    self.fire.set()
            for step in spec.progress:
                await ctx.progress(step)
            await trio.sleep(spec.latency_ms / 1000)
            if spec.raises is not None:
                raise ToolError(spec.raises)
            return spec.result

        return Tool(
            name=spec.name,
            call=call,
            concurrency_safe=spec.concurrency_safe,
            timeout_s=None if spec.timeout_ms is None else spec.timeout_ms / 1000,
        )


async def run_scenario(scenario: Scenario) -> dict[str, Any]:
    """Run the scenario's query on a fresh runtime; the verdict of docs/scenarios.md."""
    model = ScriptedModel(scenario.entries(), name="model")
    fire = trio.Event()
    abort = scenario.abort
    options = _query_options(scenario, model, fire)
    labels: list[str] = []
    events: list[QueryEvent] = []
    async with Runtime.open(tune_gc=True) as runtime:  # the scenario command owns its process
        session = await runtime.open_session(options)
        handle = session.query(scenario.prompt)
        async with trio.open_nursery() as nursery:
            if abort is not None:
                await _arm_abort(nursery, session, abort, fire)
            async for event in handle:
                events.append(event)
                labels.append(event.label)
                if abort is not None and _fires_while_streaming(abort, event, model):
                    fire.set()
            nursery.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        leftover = session.live_tasks()
        if abort is not None and abort.phase == "after_end":
            await session.abort(abort.reason)
        transcript = await session.transcript()
        await session.close()
    return _verdict(
        terminal=handle.terminal,
        transitions=handle.transitions,
        result=handle.result,
        labels=labels,
        events=events,
        model=model,
        transcript=transcript,
        leftover=leftover,
    )


def _query_options(scenario: Scenario, model: ScriptedModel, fire: trio.Event) -> QueryOptions:
    """The options of the scenario's session: its own, its scripted tools and hooks, and the scripted models
    (the compactor's first call fires the abort trigger when the abort's phase is `compacting`)."""
    script = _Script(scenario, model, fire)
    o = scenario.options
    abort = scenario.abort
    summarizer = _side_model(scenario.summarizer_model, "Ran the tools", name="summarizer")
    compactor = _side_model(scenario.compact_model, "Summary of the conversation so far.", name="compactor")
    compacting = abort is not None and abort.phase == "compacting"
    return QueryOptions(
        model=o.model,
        fallback_model=o.fallback_model,
        max_turns=o.max_turns,
        max_budget_usd=o.max_budget_usd,
        token_budget=o.token_budget,
        auto_compact=o.auto_compact,
        context_window=o.context_window,
        max_output_tokens=o.max_output_tokens,
        max_retries=o.max_retries,
        stop_hook_block_cap=o.stop_hook_block_cap,
        pricing=o.pricing,
        tools=[script.tool(t) for t in scenario.tools],
        stop_hooks=[script.stop_hook] if scenario.stop_hooks else [],
        post_tool_use_hooks=[script.post_tool_use] if scenario.post_tool_use_hooks else [],
        provider=model,
        tool_use_summaries=True,
        summary_provider=summarizer,
        compact_provider=_Watched(compactor, fire if compacting else None),
    )


def _side_model(entries: list[dict[str, Any]] | None, reply: str, *, name: str) -> ScriptedModel:
    """The summarizer's or compactor's model: the scenario's script for it, else one fixed reply."""
    if entries is None:
        return fixed_reply_model(reply, name=name)
    return ScriptedModel([parse_entry(e) for e in entries], name=name)


async def _arm_abort(nursery: trio.Nursery, session: Session, abort: ScenarioAbort, fire: trio.Event) -> None:
    """Abort now (`before_start`), or start the watcher that aborts after `after_ms` or once the trigger fires
    (`after_end` is the runner's, once the query has ended)."""
    if abort.phase == "before_start":
        await session.abort(abort.reason)
        return
    if abort.phase == "after_end":
        return

    async def watcher() -> None:
        if abort.after_ms is not None:
            await trio.sleep(abort.after_ms / 1000)
        else:
            await fire.wait()
        await session.abort(abort.reason)

    nursery.start_soon(watcher)


def _fires_while_streaming(abort: ScenarioAbort, event: QueryEvent, model: ScriptedModel) -> bool:
    """Whether this event fires a `streaming` abort: a stream event of the model call the abort names."""
    return abort.phase == "streaming" and isinstance(event, StreamEvent) and len(model.requests) == abort.call


class _Watched:
    """A provider that fires the abort trigger when its first call starts (the `compacting` phase)."""

    def __init__(self, inner: ScriptedModel, fire: trio.Event | None) -> None:
        self.inner = inner
        self.fire = fire

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        if self.fire is not None:
            self.fire.set()
        async with aclosing(self.inner.stream(request)) as events:
            async for event in events:
                yield event


def _verdict(
    *,
    terminal: Any,
    transitions: Sequence[str],
    result: Any,
    labels: list[str],
    events: list[QueryEvent],
    model: ScriptedModel,
    transcript: list[Any],
    leftover: int,
) -> dict[str, Any]:
    tool_results: dict[str, Any] = {}
    for event in events:
        if isinstance(event, UserMessage) and isinstance(event.content, list):
            for block in event.content:
                if block.get("type") == "tool_result":
                    tool_results[block["tool_use_id"]] = {
                        "is_error": bool(block.get("is_error")),
                        "content": block.get("content"),
                    }
    verdict: dict[str, Any] = {
        "terminal": terminal.reason if terminal is not None else None,
        "transitions": list(transitions),
        "result": None
        if result is None
        else {
            "subtype": result.subtype,
            "is_error": result.is_error,
            "num_turns": result.num_turns,
            "total_cost_usd": round(result.total_cost_usd, 6),
            "usage": _verdict_usage(result.usage),
        },
        "events": labels,
        "model_calls": len(model.requests),
        "tool_results": tool_results,
        "transcript_valid": not transcript_problems(transcript),
        "leftover_tasks": leftover,
    }
    if model.exhausted:
        verdict["error"] = f"the scripted model ran out of replies at request {len(model.requests)}"
    return verdict


def run_scenario_file(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """Parse and run a scenario in its own trio run (what the CLI calls)."""
    scenario = load_scenario(source)
    return trio.run(run_scenario, scenario)


def _verdict_usage(usage: Usage) -> dict[str, Any]:
    """The result's usage as docs/scenarios.md spells it (its four counts), and the one-hour cache writes when any."""
    dumped = usage.model_dump()
    if not dumped["cache_creation_1h_input_tokens"]:
        del dumped["cache_creation_1h_input_tokens"]
    return dumped
