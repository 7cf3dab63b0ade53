"""Property-based aborts: random scripted queries, aborted (or not) at a random simulated moment.

Each example is one `trio.run` on a `MockClock` that jumps ahead whenever every task
waits (hypothesis cannot drive pytest-trio fixtures per example, so the tests are
sync functions that call `trio.run` themselves). A session runs a random script of
1-5 model replies (text, 1-3 tool uses, `max_tokens` truncations, overloads, cut
connections; then a final text) against tools of random latency, safety and failure;
a second task aborts the query at a random offset (0-10 s) with reason `user` or
`interrupt`, or never. After the query's stream has ended:

- one `result`, last; `handle.terminal` set; no task of the session running; a valid transcript;
- the terminal: `natural_outcome` replays the script through the loop's documented rules
  (retries while nothing was emitted, a response's start being held back until its next event;
  escalate once then three recoveries on `max_tokens`; tools go on to the next turn) and says which
  terminal, `is_error` and request count the query reaches unaborted. Unaborted, or aborted after the
  result: exactly that. Aborted while the loop still had a model call to make: an aborted terminal.
  Otherwise aborted or that. An abort waits
  for nothing (the result comes at the abort's instant); `aborted_tools` exactly when the last
  call's stream had ended before the abort and named tools;
- the interruption message exactly when a `user` abort ended the query (the one matching the
  terminal, last of the user events), never for `interrupt`;
- usage: output tokens never decrease within a call; `result.usage` is the sum, over every call
  whose stream started, of the last usage it streamed (a call cut short keeps what it was billed);
- every tool_use streamed gets one result: its own, or `Interrupted by user` after an abort;
- the session stays usable: a second query (on a spare reply; what the first left unused is
  dropped from the script) completes, with a valid transcript, and its request tells the model
  exactly the tool results the consumer saw.

A tool result emitted between two blocks of its own response (a fast tool, a slow stream) is
counted as a statistic: the transcript must stay valid then too (it once split the response).

With a slow consumer (room for 1-3 events, a pause after each), the stream waits for it at
nearly every step and the abort comes at any of those waits: every tool_use the consumer saw is
answered once, and the conversation holds exactly the messages the consumer saw (it once saw a
tool_use the loop had not, which no abort answered).

Profiles: `ci` (200 examples, the default), `nightly` (2,000) and `dev` (30); the environment
variable `QUERYLOOP_HYPOTHESIS_PROFILE` picks one (`queryloop-abort-properties`, registered in
`conftest.py`). They apply to this module's property tests only, so the other modules' hypothesis
tests keep their own settings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import hypothesis
import trio
import trio.testing
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

from queryloop import Runtime
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.loop.events import (
    AssistantMessage,
    QueryEvent,
    ResultMessage,
    StreamEvent,
    TranscriptMessage,
    UserMessage,
)
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import MAX_OUTPUT_TOKENS_RECOVERY_LIMIT, Terminal
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError, ToolOutput
from queryloop.runtime.loop.transcript import (
    INTERRUPT_MESSAGE,
    INTERRUPT_MESSAGE_FOR_TOOL_USE,
    INTERRUPTED_BY_USER,
    tool_error,
    transcript_problems,
)
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import kept

# -- profiles -------------------------------------------------------------------------------

PROFILE = settings.get_profile("queryloop-abort-properties")  # registered in conftest.py

# -- the generated cases ----------------------------------------------------------------------

TOOL_NAMES = ("alpha", "beta", "gamma")
UNKNOWN_TOOL = "ghost"
"""Named by the model, registered nowhere: answered with an error result, never run."""
ABORTED = frozenset({"aborted_streaming", "aborted_tools"})
INTERRUPTION_TEXTS = frozenset({INTERRUPT_MESSAGE, INTERRUPT_MESSAGE_FOR_TOOL_USE})
SECOND_ANSWER = "the second answer"
MISSING_RESULT = tool_error("Tool result missing")
"""What the history sent to the model says for a tool_use whose result it cannot pair (the known bug)."""
HANG_S = 3600.0
"""Simulated seconds after which a run counts as hung (the clock autojumps: this costs no real time)."""

Failure = Literal["tool_error", "crash"] | None


@dataclass(frozen=True)
class ToolSpec:
    name: str
    latency_s: float
    safe: bool
    failure: Failure


def unsafe_tools(**latency_s: float) -> tuple[ToolSpec, ...]:
    """A spec per name of `TOOL_NAMES`, none of them concurrency-safe or failing, each with its latency (0 unless
    given): the explicit examples' tools."""
    return tuple(
        ToolSpec(name=name, latency_s=latency_s.get(name, 0.0), safe=False, failure=None) for name in TOOL_NAMES
    )


@dataclass(frozen=True)
class AbortAt:
    offset_s: float
    reason: Literal["user", "interrupt"]


@dataclass(frozen=True)
class Case:
    script: tuple[dict[str, Any], ...]
    """The first query's entries, the last an `end_turn` text; the spare for the second query is added later."""
    tools: tuple[ToolSpec, ...]
    max_retries: int
    abort: AbortAt | None


def _text(text: str, stop_reason: str = "end_turn", latency_ms: int = 0) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "stop_reason": stop_reason, "latency_ms": latency_ms}


def milliseconds(seconds: int, zero_in: int) -> st.SearchStrategy[int]:
    """0 in about one draw of `zero_in` (an instant reply, tool or abort), else up to `seconds` s, in ms.

    Drawn as whole seconds plus milliseconds: hypothesis favours small integers, and one draw of
    0..10,000 would put nearly every abort in the first second.
    """
    spread = st.builds(lambda s, ms: s * 1000 + ms, st.integers(0, seconds - 1), st.integers(0, 1000))
    return st.integers(1, zero_in).flatmap(lambda n: st.just(0) if n == 1 else spread)


latencies_ms = milliseconds(2, 4)


@st.composite
def replies(draw: st.DrawFn, index: int) -> dict[str, Any]:
    kind = draw(
        st.sampled_from(["text", "text_max_tokens", "tools", "tools", "tools", "tools_cut", "overloaded", "connection"])
    )
    latency_ms = draw(latencies_ms)
    if kind == "text":
        return _text(f"answer {index}", latency_ms=latency_ms)
    if kind == "text_max_tokens":
        return _text(f"half an answer {index}", "max_tokens", latency_ms)
    if kind == "overloaded":
        return {"error": "overloaded", "latency_ms": latency_ms}
    if kind == "connection":
        # At most 4 events: message_start, the text block's start, delta and stop; never the message_delta.
        return {"error": "connection", "after_events": draw(st.integers(0, 4)), "latency_ms": latency_ms}
    names = draw(st.lists(st.sampled_from([*TOOL_NAMES, UNKNOWN_TOOL]), min_size=1, max_size=3))
    content: list[dict[str, Any]] = []
    if draw(st.booleans()):
        content.append({"type": "text", "text": f"Using tools ({index})."})
    content.extend(
        {"type": "tool_use", "id": f"toolu_{index}_{j}", "name": name, "input": {"step": index, "n": j}}
        for j, name in enumerate(names)
    )
    if kind == "tools_cut":  # max_tokens inside the last tool_use: its input is cut off, it never runs
        return {"content": content, "stop_reason": "max_tokens", "truncate_last_block": True, "latency_ms": latency_ms}
    return {"content": content, "stop_reason": "tool_use", "latency_ms": latency_ms}


@st.composite
def scripts(draw: st.DrawFn) -> tuple[dict[str, Any], ...]:
    count = draw(st.integers(1, 5))
    entries = [draw(replies(i)) for i in range(count)]
    entries.append(_text("the final answer", latency_ms=draw(latencies_ms)))
    return tuple(entries)


def tool_specs(latency_ms: st.SearchStrategy[int]) -> st.SearchStrategy[tuple[ToolSpec, ...]]:
    """One spec per name of `TOOL_NAMES`: latency, concurrency safety, and how it fails (mostly not)."""
    return st.tuples(
        *(
            st.builds(
                ToolSpec,
                name=st.just(name),
                latency_s=latency_ms.map(lambda ms: ms / 1000),
                safe=st.booleans(),
                failure=st.sampled_from([None, None, "tool_error", "crash"]),
            )
            for name in TOOL_NAMES
        )
    )


abort_reasons: st.SearchStrategy[Literal["user", "interrupt"]] = st.sampled_from(("user", "interrupt"))
abort_moments = st.builds(AbortAt, offset_s=milliseconds(10, 10).map(lambda ms: ms / 1000), reason=abort_reasons)
aborts = st.integers(0, 3).flatmap(lambda n: st.none() if n == 0 else abort_moments)
"""Three cases in four abort; the rest run to their end."""

cases = st.builds(
    Case, script=scripts(), tools=tool_specs(milliseconds(5, 4)), max_retries=st.integers(0, 2), abort=aborts
)


@st.composite
def aborts_while_tools_run(draw: st.DrawFn) -> Case:
    """The first reply names registered tools of 3-5 s; the abort comes within 1 s after its stream ended.

    Tools start as their blocks complete, at half the reply's latency (at most 1 s): they all still run.
    """
    first_latency_ms = draw(milliseconds(2, 4))
    names = draw(st.lists(st.sampled_from(TOOL_NAMES), min_size=1, max_size=3))
    first = {
        "content": [
            {"type": "tool_use", "id": f"toolu_first_{j}", "name": name, "input": {"n": j}}
            for j, name in enumerate(names)
        ],
        "stop_reason": "tool_use",
        "latency_ms": first_latency_ms,
    }
    return Case(
        script=(first, *draw(scripts())),
        tools=draw(tool_specs(st.integers(3000, 5000))),
        max_retries=draw(st.integers(0, 2)),
        abort=AbortAt((first_latency_ms + draw(st.integers(1, 999))) / 1000, draw(abort_reasons)),
    )


def _make_tool(spec: ToolSpec) -> Tool:
    async def call(_: Any, ctx: ToolContext) -> ToolOutput:
        await ctx.progress(f"{spec.name} started")
        await trio.sleep(spec.latency_s)
        if spec.failure == "tool_error":
            raise ToolError(f"{spec.name} failed")
        if spec.failure == "crash":
            raise RuntimeError(f"{spec.name} crashed")
        return f"ok:{spec.name}"

    return Tool(name=spec.name, call=call, concurrency_safe=spec.safe)


# -- what the script does when nobody aborts -------------------------------------------------


@dataclass(frozen=True)
class Natural:
    terminal: str
    requests: int
    is_error: bool


def natural_outcome(script: tuple[dict[str, Any], ...], max_retries: int) -> Natural:
    """The terminal and request count the loop reaches without an abort (no fallback model, no hooks)."""
    attempts = 0  # retries of the current call
    escalated, recoveries = False, 0  # max_output_tokens state, reset by a tool turn
    for number, entry in enumerate(script, start=1):
        if "error" in entry:
            # A cut after `message_start` alone is unseen too: the start is held back until the next event.
            unseen = entry["error"] != "connection" or entry.get("after_events", 0) <= 1
            if unseen and attempts < max_retries:  # retried: the next entry answers the same call
                attempts += 1
                continue
            # A cut after its text block completed (4 events) is resumed, under the max-output-tokens cap.
            if (
                entry["error"] == "connection"
                and entry.get("after_events", 0) >= 4
                and recoveries < MAX_OUTPUT_TOKENS_RECOVERY_LIMIT
            ):
                attempts, recoveries = 0, recoveries + 1
                continue
            return Natural("api_error", number, True)
        attempts = 0
        if any(block["type"] == "tool_use" for block in entry["content"]):
            escalated, recoveries = False, 0
            continue
        if entry["stop_reason"] == "end_turn":
            return Natural("completed", number, False)
        if not escalated:
            escalated = True
        elif recoveries < MAX_OUTPUT_TOKENS_RECOVERY_LIMIT:
            recoveries += 1
        else:
            return Natural("completed", number, True)  # the withheld max_tokens error surfaces
    raise AssertionError("a generated script always ends in an end_turn text")


# -- one run ----------------------------------------------------------------------------------


@dataclass
class Observed:
    events: list[QueryEvent] = field(default_factory=list)
    terminal: Terminal | None = None
    result: ResultMessage | None = None
    live_tasks_at_end: int = -1
    transcript: list[TranscriptMessage] = field(default_factory=list)
    requests: int = 0
    times: list[float] = field(default_factory=list)
    """When each event was received (simulated seconds; the clock moves only when every task waits)."""
    abort_time: float | None = None
    finished_before_abort: bool = False
    """The result was received, or the loop had finished, before `session.abort` was called."""
    requests_before_abort: int = 0
    second_events: list[QueryEvent] = field(default_factory=list)
    second_terminal: Terminal | None = None
    second_result: ResultMessage | None = None
    second_live_tasks: int = -1
    second_transcript: list[TranscriptMessage] = field(default_factory=list)
    second_request: list[dict[str, Any]] = field(default_factory=list)
    """The `messages` the second query sent to the model: the history as the model is told it."""


async def _drain(session: Session, handle: QueryHandle, into: list[QueryEvent], times: list[float]) -> int:
    async for event in handle:
        into.append(event)
        times.append(trio.current_time())
    return session.live_tasks()  # read the moment the stream has ended


async def _run(case: Case) -> Observed:
    model = ScriptedModel([*case.script, _text(SECOND_ANSWER)])
    observed = Observed()
    with trio.fail_after(HANG_S):
        async with Runtime.open() as runtime:
            options = QueryOptions(
                provider=model, tools=[_make_tool(spec) for spec in case.tools], max_retries=case.max_retries
            )
            session = await runtime.open_session(options)
            handle = session.query("first")

            async def consume() -> None:
                observed.live_tasks_at_end = await _drain(session, handle, observed.events, observed.times)

            async def abort(at: AbortAt) -> None:
                await trio.sleep(at.offset_s)
                observed.abort_time = trio.current_time()
                observed.finished_before_abort = handle.result is not None or handle._control.finished
                observed.requests_before_abort = len(model.requests)
                await session.abort(at.reason)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                if case.abort is not None:
                    nursery.start_soon(abort, case.abort)
            observed.terminal, observed.result = handle.terminal, handle.result
            observed.transcript = await session.transcript()
            observed.requests = len(model.requests)

            # The second query gets the spare reply, whatever the first one left unused.
            del model.entries[len(model.requests) : -1]
            second = session.query("second")
            observed.second_live_tasks = await _drain(session, second, observed.second_events, [])
            observed.second_terminal, observed.second_result = second.terminal, second.result
            observed.second_transcript = await session.transcript()
            observed.second_request = model.requests[-1].messages
    return observed


# -- the invariants -----------------------------------------------------------------------------


def _user_texts(events: list[QueryEvent]) -> list[str]:
    texts: list[str] = []
    for event in events:
        if isinstance(event, UserMessage):
            if isinstance(event.content, str):
                texts.append(event.content)
            else:
                texts.extend(b.get("text", "") for b in event.content if b.get("type") == "text")
    return texts


def _tool_results(events: list[QueryEvent]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, UserMessage) and isinstance(event.content, list):
            for block in event.content:
                if block.get("type") == "tool_result":
                    assert block["tool_use_id"] not in found, f"two results for {block['tool_use_id']}"
                    found[block["tool_use_id"]] = block
    return found


@dataclass
class _Call:
    input_tokens: int
    outputs: list[int]


def _calls(events: list[QueryEvent]) -> list[_Call]:
    """The model calls as streamed: a `message_start` opens one, its `message_delta` completes it."""
    calls: list[_Call] = []
    for event in events:
        if not isinstance(event, StreamEvent):
            continue
        raw = event.event
        if raw["type"] == "message_start":
            usage = raw["message"]["usage"]
            calls.append(_Call(usage["input_tokens"], [usage["output_tokens"]]))
        elif raw["type"] == "message_delta":
            calls[-1].outputs.append(raw["usage"]["output_tokens"])
    return calls


def _check_usage(observed: Observed) -> None:
    calls = _calls(observed.events)
    for call in calls:
        assert call.outputs == sorted(call.outputs), f"output_tokens decreased within a call: {call.outputs}"
    by_message: dict[str, list[int]] = {}
    for event in observed.events:
        if isinstance(event, AssistantMessage) and event.usage is not None:
            by_message.setdefault(event.message_id, []).append(event.usage.output_tokens)
    for message_id, outputs in by_message.items():
        assert outputs == sorted(outputs), f"assistant usage decreased within {message_id}: {outputs}"

    # Every call the stream started counts, with the last usage its stream reported: a call cut short
    # (an abort, a cut connection) was billed for what it had streamed, and that spend is kept.
    assert observed.result is not None
    usage = observed.result.usage
    billed = (sum(c.input_tokens for c in calls), sum(c.outputs[-1] for c in calls))
    assert (usage.input_tokens, usage.output_tokens) == billed, (usage, billed)


def _check_tool_results(case: Case, observed: Observed, aborted: bool) -> None:
    specs = {spec.name: spec for spec in case.tools}
    cut_ids = {
        entry["content"][-1]["id"] for entry in case.script if "error" not in entry and entry.get("truncate_last_block")
    }
    uses = [
        block
        for event in observed.events
        if isinstance(event, AssistantMessage)
        for block in event.content
        if block.get("type") == "tool_use"
    ]
    results = _tool_results(observed.events)
    assert {u["id"] for u in uses} == results.keys(), "every tool_use streamed gets exactly one result"
    for use in uses:
        result = results[use["id"]]
        if aborted and result["content"] == INTERRUPTED_BY_USER:
            assert result["is_error"]
            continue
        spec = specs.get(use["name"])
        if use["id"] in cut_ids or spec is None or spec.failure is not None:
            assert result["is_error"], result
            if spec is not None and use["id"] not in cut_ids:
                assert spec.name in result["content"], result
        else:
            assert result == {
                "type": "tool_result",
                "tool_use_id": use["id"],
                "content": f"ok:{spec.name}",
                "is_error": False,
            }


def _history_results(messages: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        block["tool_use_id"]: block
        for message in messages
        if message["role"] == "user" and isinstance(message["content"], list)
        for block in message["content"]
        if block.get("type") == "tool_result"
    }


def split_responses(events: list[QueryEvent]) -> set[str]:
    """The tool_use ids of every response a tool result was emitted in the middle of.

    The consumer sees such a result between two blocks of the response; the conversation must
    still keep the response whole, followed by its results (it once split it).
    """
    owner: dict[str, str] = {}
    last_block: dict[str, int] = {}
    for index, event in enumerate(events):
        if isinstance(event, AssistantMessage) and not event.is_api_error:
            last_block[event.message_id] = index
            owner.update((b["id"], event.message_id) for b in event.content if b.get("type") == "tool_use")
    split: set[str] = set()
    for index, event in enumerate(events):
        if isinstance(event, UserMessage) and isinstance(event.content, list):
            for block in event.content:
                message_id = owner.get(block.get("tool_use_id", ""))
                if message_id is not None and last_block[message_id] > index:
                    split.add(message_id)
    return {tool_id for tool_id, message_id in owner.items() if message_id in split}


_UNANSWERED = re.compile(r"message \d+: tool_use (\S+) has no tool_result")
_ORPHAN = re.compile(r"message \d+: tool_result (\S+) answers no tool_use")


def check_transcript(transcript: list[TranscriptMessage], tolerated: set[str]) -> None:
    """No problem, except the known bug's two kinds on the tool_uses of a split response (`tolerated`)."""
    problems = transcript_problems(transcript)
    for problem in problems:
        match = _UNANSWERED.fullmatch(problem) or _ORPHAN.fullmatch(problem)
        assert match is not None and match.group(1) in tolerated, problem
    if problems:
        hypothesis.event("the known bug broke the transcript (excused)")


def check_history_keeps_results(observed: Observed, tolerated: set[str]) -> None:
    """The next query tells the model exactly the tool results the consumer saw: none lost, none replaced.

    For a `tolerated` tool_use (of a split response) the known bug may send "Tool result missing" instead.
    """
    sent = _history_results(observed.second_request)
    for tool_use_id, result in _tool_results(observed.events).items():
        told = sent.get(tool_use_id)
        if tool_use_id in tolerated and told == {**result, "content": MISSING_RESULT, "is_error": True}:
            continue
        assert told == result, (tool_use_id, result, told)


def _is_raw(event: QueryEvent, kind: str) -> bool:
    return isinstance(event, StreamEvent) and event.event["type"] == kind


def _check_terminal(case: Case, observed: Observed, natural: Natural) -> None:
    """The terminal agrees with when the abort came; the result with the terminal."""
    assert observed.terminal is not None and observed.result is not None
    reason = observed.terminal.reason
    abort = case.abort
    aborted = reason in ABORTED
    if abort is None or observed.finished_before_abort:
        assert reason == natural.terminal, (reason, natural)
    elif observed.requests_before_abort < natural.requests:
        # The loop still had a model call to make: it cannot have reached its own end.
        assert aborted, (reason, natural, observed.requests_before_abort)
    else:
        assert aborted or reason == natural.terminal, (reason, natural)
    if not aborted:
        assert observed.requests == natural.requests, (observed.requests, natural)
        assert (observed.result.subtype, observed.result.is_error) == ("success", natural.is_error)
    else:
        assert observed.requests <= natural.requests, (observed.requests, natural)
        assert (observed.result.subtype, observed.result.is_error) == ("error_during_execution", True)
    if abort is None or observed.finished_before_abort:
        return
    # An abort waits for nothing: the result comes at the very instant the abort was asked for.
    assert observed.times[-1] == observed.abort_time, (observed.times[-1], observed.abort_time)
    # Which abort: the last call's stream had ended (its message_stop came earlier) and it named tools.
    starts = [i for i, e in enumerate(observed.events) if e.label == "stream_request_start"]
    last_call = observed.events[starts[-1] :] if starts else []
    last_times = observed.times[starts[-1] :] if starts else []
    stopped_at = [t for e, t in zip(last_call, last_times, strict=True) if _is_raw(e, "message_stop")]
    used_tools = any(
        b.get("type") == "tool_use" for e in last_call if isinstance(e, AssistantMessage) for b in e.content
    )
    if reason == "aborted_tools":
        assert stopped_at and used_tools, "aborted_tools, but the last call's stream never ended or named no tool"
    elif reason == "aborted_streaming" and stopped_at and used_tools:
        assert observed.abort_time is not None and stopped_at[0] >= observed.abort_time, (
            "aborted_streaming, but the stream had ended and its tools were running before the abort"
        )


def _check_interruption(case: Case, observed: Observed) -> None:
    assert observed.terminal is not None
    reason = observed.terminal.reason
    abort = case.abort
    aborted = reason in ABORTED
    # The interruption message: exactly when a `user` abort ended the query, and last of the user events.
    texts = _user_texts(observed.events)
    interruptions = [t for t in texts if t in INTERRUPTION_TEXTS]
    if aborted and abort is not None and abort.reason == "user":
        expected = INTERRUPT_MESSAGE_FOR_TOOL_USE if reason == "aborted_tools" else INTERRUPT_MESSAGE
        assert texts[-1] == expected, texts
        assert interruptions == [expected], texts
    else:
        assert interruptions == [], texts


def check(case: Case, observed: Observed) -> None:
    """Every invariant, with nothing excused."""
    natural = natural_outcome(case.script, case.max_retries)
    labels = [e.label for e in observed.events]
    tolerated: set[str] = set()
    mid_response_results = split_responses(observed.events)

    # One result, last; the handle settled; nothing of the session still running; a valid transcript.
    assert labels.count("result") == 1 and labels[-1] == "result", labels
    assert observed.terminal is not None and observed.result is not None
    assert observed.live_tasks_at_end == 0, "a task of the session outlived the query's event stream"
    check_transcript(observed.transcript, tolerated)

    reason = observed.terminal.reason
    abort = case.abort
    aborted = reason in ABORTED
    _check_terminal(case, observed, natural)
    _check_interruption(case, observed)
    _check_usage(observed)
    _check_tool_results(case, observed, aborted)

    # The session stays usable: the next query completes on the spare reply.
    second_labels = [e.label for e in observed.second_events]
    assert second_labels.count("result") == 1 and second_labels[-1] == "result", second_labels
    assert observed.second_terminal is not None and observed.second_terminal.reason == "completed"
    assert observed.second_result is not None and observed.second_result.result == SECOND_ANSWER
    assert not observed.second_result.is_error
    assert observed.second_live_tasks == 0
    check_transcript(observed.second_transcript, tolerated)
    check_history_keeps_results(observed, tolerated)

    hypothesis.event(f"terminal: {reason}")
    if abort is None:
        hypothesis.event("abort: none")
    elif observed.finished_before_abort:
        hypothesis.event("abort: after the end")
    else:
        hypothesis.event(f"abort: during the query ({abort.reason})")
        if not aborted:
            hypothesis.event("abort: during the query, too late to change its end")
    if mid_response_results:
        hypothesis.event("a tool result emitted inside its own response")


def run_and_check(case: Case) -> Observed:
    observed = trio.run(_run, case, clock=trio.testing.MockClock(autojump_threshold=0))
    check(case, observed)
    return observed


# -- the tests -----------------------------------------------------------------------------------


# Found by this test: an abort landing exactly as one queued unsafe tool ended, while the ending
# tool's own last step started the next one (the abort once waited for that tool's whole run).
ABORT_AS_A_QUEUED_TOOL_STARTS = Case(
    script=(
        {
            "content": [
                {"type": "tool_use", "id": "toolu_0_0", "name": "gamma", "input": {"step": 0, "n": 0}},
                {"type": "tool_use", "id": "toolu_0_1", "name": "ghost", "input": {"step": 0, "n": 1}},
                {"type": "tool_use", "id": "toolu_0_2", "name": "gamma", "input": {"step": 0, "n": 2}},
            ],
            "stop_reason": "tool_use",
            "latency_ms": 0,
        },
        {"content": [{"type": "text", "text": "the final answer"}], "stop_reason": "end_turn", "latency_ms": 0},
    ),
    tools=unsafe_tools(gamma=2.0),
    max_retries=0,
    abort=AbortAt(offset_s=2.0, reason="user"),
)


@PROFILE
@example(case=ABORT_AS_A_QUEUED_TOOL_STARTS)
@given(case=cases)
def test_random_queries_aborted_at_random_moments_keep_every_invariant(case: Case) -> None:
    run_and_check(case)


@PROFILE
@given(case=aborts_while_tools_run())
def test_aborts_while_tools_run_keep_every_invariant(case: Case) -> None:
    """Aimed at `aborted_tools`, which random moments reach only now and then."""
    observed = run_and_check(case)
    assert observed.terminal is not None and observed.terminal.reason == "aborted_tools"


@PROFILE
@given(
    case=st.builds(
        Case, script=scripts(), tools=tool_specs(milliseconds(5, 4)), max_retries=st.integers(0, 2), abort=st.none()
    )
)
def test_unaborted_random_queries_reach_their_natural_end(case: Case) -> None:
    """The oracle `natural_outcome` itself, checked where no abort can excuse a difference."""
    run_and_check(case)


# -- a bug hypothesis found ------------------------------------------------------------------------

# Smallest input hypothesis found: unsafe `alpha` (0 s) and `gamma` (1 ms); the response names alpha,
# gamma, then a third tool_use cut off by max_tokens, whose block completes only when the stream ends.
SHRUNK = Case(
    script=(
        {
            "content": [
                {"type": "tool_use", "id": "toolu_0_0", "name": "alpha", "input": {"step": 0, "n": 0}},
                {"type": "tool_use", "id": "toolu_0_1", "name": "gamma", "input": {"step": 0, "n": 1}},
                {"type": "tool_use", "id": "toolu_0_2", "name": "alpha", "input": {"step": 0, "n": 2}},
            ],
            "stop_reason": "max_tokens",
            "truncate_last_block": True,
            "latency_ms": 1,
        },
        _text("the final answer"),
    ),
    tools=unsafe_tools(gamma=0.001),
    max_retries=0,
    abort=None,
)
# The same, spelled out on round numbers: blocks a and b complete at 1 s, a's result arrives at 1.5 s,
# the cut block c completes with the stream at 2 s, b's result at 3.5 s.
READABLE = Case(
    script=(
        {
            "content": [
                {"type": "tool_use", "id": "a", "name": "alpha", "input": {}},
                {"type": "tool_use", "id": "b", "name": "gamma", "input": {}},
                {"type": "tool_use", "id": "c", "name": "alpha", "input": {"n": 1}},
            ],
            "stop_reason": "max_tokens",
            "truncate_last_block": True,
            "latency_ms": 2000,
        },
        _text("the final answer"),
    ),
    tools=unsafe_tools(alpha=0.5, gamma=2.0),
    max_retries=0,
    abort=None,
)


@settings(phases=[Phase.explicit], deadline=None)
@example(case=SHRUNK)
@example(case=READABLE)
@given(case=cases)
def test_results_arriving_between_blocks_of_one_response_keep_the_transcript_valid(case: Case) -> None:
    observed = trio.run(_run, case, clock=trio.testing.MockClock(autojump_threshold=0))
    assert observed.terminal is not None and observed.terminal.reason == "completed"
    check_history_keeps_results(observed, tolerated=set())  # gamma's "ok:gamma" reaches the next query
    assert transcript_problems(observed.transcript) == []
    check(case, observed)


# -- a slow consumer --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlowConsumerCase:
    case: Case
    event_buffer: int
    """Room for this many events: the stream waits for the consumer at nearly every step."""
    read_delay_ms: int
    """The consumer's pause after each event it takes."""


slow_consumer_cases = st.builds(
    SlowConsumerCase, case=cases, event_buffer=st.integers(1, 3), read_delay_ms=milliseconds(1, 3)
)


async def _run_slow(slow: SlowConsumerCase) -> tuple[Observed, set[str]]:
    case = slow.case
    observed = Observed()
    model = ScriptedModel(list(case.script))
    with trio.fail_after(HANG_S):
        async with Runtime.open() as runtime:
            options = QueryOptions(
                provider=model,
                tools=[_make_tool(spec) for spec in case.tools],
                max_retries=case.max_retries,
                event_buffer=slow.event_buffer,
            )
            session = await runtime.open_session(options)
            handle = session.query("first")

            async def consume() -> None:
                async for event in handle:
                    observed.events.append(event)
                    await trio.sleep(slow.read_delay_ms / 1000)
                observed.live_tasks_at_end = session.live_tasks()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                if case.abort is not None:
                    await trio.sleep(case.abort.offset_s)
                    await session.abort(case.abort.reason)
            observed.terminal, observed.result = handle.terminal, handle.result
            observed.transcript = await session.transcript()
    prompt_uuid = observed.transcript[0].uuid if observed.transcript else ""
    return observed, {m.uuid for m in observed.transcript} - {prompt_uuid}


# Found by the nightly profile: the abort came while a retry's `system:api_retry` waited for the slow consumer,
# which took it after the query's ending had drained the turn; the conversation never did.
ABORT_WHILE_A_RETRY_IS_ANNOUNCED = SlowConsumerCase(
    case=Case(
        script=(
            {
                "content": [
                    {"type": "text", "text": "Using tools (0)."},
                    {"type": "tool_use", "id": "toolu_0_0", "name": "alpha", "input": {"step": 0, "n": 0}},
                    {"type": "tool_use", "id": "toolu_0_1", "name": "alpha", "input": {"step": 0, "n": 1}},
                ],
                "stop_reason": "tool_use",
                "latency_ms": 0,
            },
            {"error": "overloaded", "latency_ms": 430},
            _text("the final answer"),
        ),
        tools=unsafe_tools(),
        max_retries=1,
        abort=AbortAt(offset_s=9.0, reason="user"),
    ),
    event_buffer=1,
    read_delay_ms=429,
)


@PROFILE
@example(slow=ABORT_WHILE_A_RETRY_IS_ANNOUNCED)
@given(slow=slow_consumer_cases)
def test_a_slow_consumer_sees_what_the_conversation_holds_whenever_the_abort_comes(slow: SlowConsumerCase) -> None:
    """Backpressure everywhere: the stream waits for the consumer, the abort comes at any of those waits."""
    observed, conversation = trio.run(_run_slow, slow, clock=trio.testing.MockClock(autojump_threshold=0))
    labels = [e.label for e in observed.events]
    assert labels.count("result") == 1 and labels[-1] == "result", labels
    assert observed.live_tasks_at_end == 0, "a task of the session outlived the query's event stream"
    uses = {
        block["id"]
        for event in observed.events
        if isinstance(event, AssistantMessage)
        for block in event.content
        if block.get("type") == "tool_use"
    }
    assert uses == _tool_results(observed.events).keys(), "every tool_use the consumer saw, answered once"
    seen = {e.uuid for e in observed.events if kept(e)}  # the `init` notice is the host's, not the conversation's
    assert seen == conversation, "the conversation is what the consumer saw"
    assert transcript_problems(observed.transcript) == []
