"""Whatever a server sends and whatever a host's callbacks do, every query ends with exactly one
`result`: random malformed event sequences (events dropped, cut, garbled; usage counts negative,
strings, floats; tool_use ids repeated) and random host-callback failures (raising, returning the
wrong type) through whole queries give 0 `ActorCrashed`, 0 negative costs and 0 leftover tasks.

Bounded in CI (`QUERYLOOP_HYPOTHESIS_PROFILE`: `ci`, the default, 100 examples; `nightly` 2,000;
`dev` 20: the `queryloop-properties` profile of `conftest.py`), as the abort properties are.
"""

from __future__ import annotations

import copy
import math
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, field_validator

from queryloop import Allow, Deny, HookDecision, QueryOptions, Runtime, Tool, ToolContext
from queryloop.runtime.loop.events import QueryEvent, ResultMessage
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.transcript import transcript_problems
from queryloop.runtime.providers.scripted import ScriptedReply, reply_events

PROPERTIES = settings.get_profile("queryloop-properties")  # registered in conftest.py
HANG_S = 3600.0
"""A query must end long before this (on the mock clock: retries' backoffs and timeouts jump it)."""

Events = list[Any]

# -- the server ----------------------------------------------------------------------------------

BAD_VALUES: list[Any] = [-1, -(10**12), "12", 1.5, True, None, [], {"n": 1}]
USAGE_KEYS = ["input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens"]


def _reply(kind: str, ids: list[str]) -> ScriptedReply:
    if kind == "text":
        return ScriptedReply(content=[{"type": "text", "text": "An answer."}])
    uses = [{"type": "tool_use", "id": i, "name": "act", "input": {"n": n}} for n, i in enumerate(ids)]
    return ScriptedReply(content=[{"type": "text", "text": "Acting."}, *uses], stop_reason="tool_use")


@st.composite
def mutated(draw: st.DrawFn, events: Events) -> Events:
    """`events` with zero or more of the ways a hostile server breaks a stream."""
    events = copy.deepcopy(events)
    for _ in range(draw(st.integers(0, 3))):
        how = draw(
            st.sampled_from(
                ["drop", "cut", "usage_start", "usage_delta", "garble", "insert_stop", "no_start", "iterations"]
            )
        )
        if not events:
            break
        at = draw(st.integers(0, len(events) - 1))
        if how == "drop":
            del events[at]
        elif how == "cut":
            del events[at:]
        elif how == "usage_start" and isinstance(events[0], dict) and isinstance(events[0].get("message"), dict):
            events[0]["message"]["usage"] = {draw(st.sampled_from(USAGE_KEYS)): draw(st.sampled_from(BAD_VALUES))}
        elif how == "usage_delta":
            for event in events:
                if isinstance(event, dict) and event.get("type") == "message_delta":
                    event["usage"] = {draw(st.sampled_from(USAGE_KEYS)): draw(st.sampled_from(BAD_VALUES))}
        elif how == "garble":
            events[at] = draw(
                st.sampled_from(
                    [
                        {"no": "type"},
                        {"type": 7},
                        {"type": "message_start", "message": "not an object"},
                        {"type": "content_block_delta", "index": "x", "delta": None},
                        {"type": "content_block_start", "index": 0},
                        {"type": "message_delta", "delta": "end", "usage": "lots"},
                        {"type": "mystery_event"},
                        {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}},
                    ]
                )
            )
        elif how == "insert_stop":
            events.insert(at, {"type": "message_stop"})
        elif how == "no_start":
            events = [e for e in events if not (isinstance(e, dict) and e.get("type") == "message_start")]
        elif how == "iterations":
            for event in events:
                if isinstance(event, dict) and event.get("type") == "message_delta":
                    bad = draw(st.sampled_from(BAD_VALUES))
                    event["usage"] = {"output_tokens": 3, "iterations": [{"input_tokens": 5}, {"output_tokens": bad}]}
    return events


@st.composite
def responses(draw: st.DrawFn) -> list[Events]:
    found = []
    for number in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["text", "tools"]))
        ids = draw(st.lists(st.sampled_from([f"toolu_{number}a", f"toolu_{number}b"]), min_size=1, max_size=3))
        events = reply_events(_reply(kind, ids), model="claude-sonnet-5-5", message_id="msg", input_tokens=20)
        found.append(draw(mutated(events)) if draw(st.booleans()) else events)
    return found


class HostileServer:
    """Plays `responses` one per request, then a plain text answer for every request after them."""

    def __init__(self, responses: list[Events]) -> None:
        self.responses = responses
        self.requests = 0

    async def stream(self, request: ModelRequest) -> AsyncGenerator[Any, None]:
        self.requests += 1
        if self.requests <= len(self.responses):
            events = self.responses[self.requests - 1]
        else:
            events = reply_events(_reply("text", []), model=request.model, message_id="msg_end", input_tokens=20)
        for event in events:
            await trio.lowlevel.checkpoint()
            yield event


# -- the host -------------------------------------------------------------------------------------

Behaviour = str
"""`none` (no such callback), `ok`, `raises`, `wrong_type`."""
behaviours = st.sampled_from(["none", "ok", "raises", "wrong_type"])


@dataclass(frozen=True)
class Host:
    permission: Behaviour
    stop_hook: Behaviour
    post_hook: Behaviour
    attachments: Behaviour
    memory: Behaviour
    validator: Behaviour
    tool: Behaviour


hosts = st.builds(Host, behaviours, behaviours, behaviours, behaviours, behaviours, behaviours, behaviours)


def _callback(behaviour: Behaviour, ok: Any) -> Any:
    async def call(*_: Any) -> Any:
        if behaviour == "raises":
            raise RuntimeError("host bug")
        if behaviour == "wrong_type":
            return 42
        return ok

    return None if behaviour == "none" else call


class Source:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour

    async def collect(self) -> Any:
        if self.behaviour == "raises":
            raise OSError("watcher died")
        return "not a list" if self.behaviour == "wrong_type" else [{"type": "note", "content": "x"}]


def _tool(host: Host) -> Tool:
    class Args(BaseModel):
        n: int = 0

        @field_validator("n")
        @classmethod
        def _check(cls, value: int) -> int:
            if host.validator == "raises" and value % 2:
                raise TypeError("validator bug")
            return value

    async def act(args: Args, _: ToolContext) -> Any:
        if host.tool == "raises":
            raise RuntimeError("tool bug")
        return object() if host.tool == "wrong_type" else f"done {args.n}"

    return Tool(name="act", call=act, input_model=Args)


def _options(host: Host, server: HostileServer, max_retries: int) -> QueryOptions:
    return QueryOptions(
        provider=server,
        tools=[_tool(host)],
        max_retries=max_retries,
        max_turns=6,
        can_use_tool=_callback(host.permission, Allow() if host.permission == "ok" else Deny(message="no")),
        stop_hooks=[h] if (h := _callback(host.stop_hook, None)) else [],
        post_tool_use_hooks=[h] if (h := _callback(host.post_hook, HookDecision())) else [],
        attachment_sources=[] if host.attachments == "none" else [Source(host.attachments)],
        memory_prefetch=_callback(host.memory, "remember this"),
    )


# -- the property ---------------------------------------------------------------------------------


@dataclass
class Observed:
    events: list[QueryEvent]
    live_tasks: int
    problems: list[str]


async def _run(server: HostileServer, host: Host, max_retries: int) -> Observed:
    with trio.fail_after(HANG_S):
        async with Runtime.open() as runtime:
            session = await runtime.open_session(_options(host, server, max_retries))
            async with session.query("Do it") as handle:
                events = [event async for event in handle]
            problems = transcript_problems(await session.transcript())
            return Observed(events, session.live_tasks(), problems)


@PROPERTIES
@given(responses(), hosts, st.integers(0, 2))
def test_every_query_ends_with_one_result_whatever_the_server_and_the_host_do(
    script: list[Events], host: Host, max_retries: int
) -> None:
    observed = trio.run(
        _run, HostileServer(script), host, max_retries, clock=trio.testing.MockClock(autojump_threshold=0)
    )
    results = [e for e in observed.events if isinstance(e, ResultMessage)]
    assert len(results) == 1 and observed.events[-1] is results[0]
    result = results[0]
    assert math.isfinite(result.total_cost_usd) and result.total_cost_usd >= 0
    usage = result.usage
    counts = (usage.input_tokens, usage.output_tokens, usage.cache_creation_input_tokens, usage.cache_read_input_tokens)
    assert all(c >= 0 for c in counts)
    assert observed.live_tasks == 0
    assert observed.problems == []
