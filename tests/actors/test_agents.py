"""Subagents: the `Agent` tool runs a child query loop under the session's supervisor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from queryloop import (
    AgentDefinition,
    HookDecision,
    ProgressEvent,
    QueryEvent,
    QueryOptions,
    Runtime,
    Session,
    StopHookInput,
    SystemMessage,
    ToolContext,
    UserMessage,
    load_transcript,
    tool,
)
from queryloop.lowlevel import TrioActor
from queryloop.runtime.loop.transcript import transcript_problems
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import hang_guard, text_reply, tool_use, tools_reply

REVIEWER = AgentDefinition(description="Reviews one file", prompt="You review code.")


def results_of(events: list[QueryEvent], *, of_parent: bool = True) -> dict[str, dict[str, Any]]:
    found = {}
    for event in events:
        if isinstance(event, UserMessage) and isinstance(event.content, list):
            if of_parent and event.parent_tool_use_id is not None:
                continue
            for block in event.content:
                if block.get("type") == "tool_result":
                    found[block["tool_use_id"]] = block
    return found


def fan_out(*prompts: str) -> dict[str, Any]:
    return tools_reply(*(agent_call(f"call_{p[-1]}", "reviewer", p) for p in prompts))


@tool(description="Wait until cancelled", concurrency_safe=True)
async def wait_forever(args: dict[str, Any], ctx: ToolContext) -> str:
    await ctx.progress("waiting")
    await trio.sleep_forever()
    return "never"


async def assert_nothing_left(session: Session) -> None:
    assert session.live_tasks() == 0, "a task of a subagent outlived the parent's stream"
    assert session.supervisor.children == [], "a child group is still open"
    assert transcript_problems(await session.transcript()) == []


async def test_a_parent_with_three_concurrent_subagents_completes_with_their_results_in_its_history(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow: dict[str, Any] = {"latency_ms": 100}
    provider = ByPrompt(
        {
            "Review": [fan_out("file a", "file b", "file c"), text_reply("All three are fine.")],
            "file a": [text_reply("a: fine", **slow)],
            "file b": [text_reply("b: fine", **slow)],
            "file c": [text_reply("c: fine", **slow)],
        }
    )
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=provider, agents={"reviewer": REVIEWER}))
        started = trio.current_time()
        handle = session.query("Review")
        events = [event async for event in handle]
        assert trio.current_time() - started < 0.2  # concurrent: three 100 ms children took one 100 ms
        assert runtime.agents.slots.peak == 3 and runtime.agents.slots.live == 0

        assert handle.terminal is not None and handle.terminal.reason == "completed"
        assert handle.result is not None and handle.result.result == "All three are fine."
        results = results_of(await session.transcript())  # type: ignore[arg-type]
        assert {k: (v["content"], v["is_error"]) for k, v in results.items()} == {
            "call_a": ("a: fine", False),
            "call_b": ("b: fine", False),
            "call_c": ("c: fine", False),
        }
        # The children's own messages are not in the parent's history: they are its sidechains.
        assert all(m.parent_tool_use_id is None for m in await session.transcript())
        sidechains = await session.sidechains()
        assert sorted(s.parent_tool_use_id or "" for s in sidechains.values()) == ["call_a", "call_b", "call_c"]
        # The parent's request carried the agent tool, whose description lists the agents.
        agent_tool = next(t for t in provider.requests_of("Review")[0].tools if t["name"] == "Agent")
        assert "- reviewer: Reviews one file" in agent_tool["description"]
        assert set(agent_tool["input_schema"]["required"]) == {"description", "prompt", "subagent_type"}
        # The child ran with its own system prompt and no agent tool (depth 1, the default).
        child_request = provider.requests_of("file a")[0]
        assert child_request.system == [{"type": "text", "text": "You review code."}]
        assert [t["name"] for t in child_request.tools] == []
        # Its cost counts in the parent's result, per agent too.
        result = handle.result
        assert len(result.usage_by_agent) == 3
        children_cost = sum(a.total_cost_usd for a in result.usage_by_agent.values())
        assert children_cost > 0 and result.total_cost_usd > children_cost
        assert {a.parent_tool_use_id for a in result.usage_by_agent.values()} == {"call_a", "call_b", "call_c"}
        assert events[-1] is result
        await assert_nothing_left(session)


async def test_a_subagents_events_reach_the_parents_consumer_tagged_with_parent_tool_use_id() -> None:
    provider = ByPrompt(
        {
            "Review": [fan_out("file a"), text_reply("Done.")],
            "file a": [tools_reply(tool_use("w1", "note")), text_reply("a: fine")],
        }
    )

    @tool(description="Take a note")
    async def note(args: dict[str, Any], ctx: ToolContext) -> str:
        await ctx.progress("noting")
        return "noted"

    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, tools=[note], agents={"reviewer": REVIEWER})
        session = await runtime.open_session(options)
        events = [event async for event in session.query("Review")]

    child = [e for e in events if getattr(e, "parent_tool_use_id", None) == "call_a"]
    labels = {e.label for e in child}
    assert {"stream_request_start", "stream_event", "assistant", "user", "progress"} <= labels
    assert any(isinstance(e, ProgressEvent) and e.tool_use_id == "w1" for e in child)
    # The child's events come between the agent call and its result, in the child's own order.
    call_at = next(i for i, e in enumerate(events) if e.label == "assistant" and e.content[0].get("id") == "call_a")  # type: ignore[union-attr]
    result_at = next(i for i, e in enumerate(events) if e.label == "user" and e.parent_tool_use_id is None)  # type: ignore[union-attr]
    assert all(call_at < events.index(e) < result_at for e in child)
    parent_own = [e for e in events if e not in child]
    assert all(getattr(e, "parent_tool_use_id", None) is None for e in parent_own)


@pytest.mark.parametrize("reason", ["user", "interrupt"])
async def test_aborting_the_parent_mid_fan_out_ends_every_child_with_nothing_running(
    reason: str, tmp_path: Path
) -> None:
    child_script = [tools_reply(tool_use("w", "wait_forever"))]
    provider = ByPrompt(
        {
            "Review": [fan_out("file a", "file b", "file c"), text_reply("Next answered.")],
            "file a": child_script,
            "file b": child_script,
            "file c": child_script,
        }
    )
    path = tmp_path / "session.jsonl"
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, tools=[wait_forever], agents={"reviewer": REVIEWER})
        session = await runtime.open_session(options, transcript=path)
        handle = session.query("Review")
        waiting: set[str | None] = set()
        events: list[QueryEvent] = []
        async for event in handle:
            events.append(event)
            if isinstance(event, ProgressEvent):
                waiting.add(event.parent_tool_use_id)
                if len(waiting) == 3:  # every child's tool runs: abort mid-fan-out
                    children = list(session.supervisor.children)
                    actors = [actor for child in children for actor in child.actors]
                    assert len(children) == 3 and len(actors) == 9  # three actors each (helpers on need)
                    if reason == "user":
                        await session.abort("user")
                    else:
                        next_handle = session.query("Next", interrupt=True)  # a message that interrupts the query
        # The stream has ended: no task of any descendant runs, every child group is closed.
        assert all(child.closed and child.live_tasks() == 0 for child in children)
        assert all(actor.actor_stopped.is_set() for actor in actors)
        assert session.supervisor.children == []
        if reason == "user":  # (an interrupt's next query is running by now)
            assert session.live_tasks() == 0
        assert runtime.agents.slots.live == 0
        assert handle.terminal is not None and handle.terminal.reason == "aborted_tools"
        assert {k: v["is_error"] for k, v in results_of(events).items()} == dict.fromkeys(
            ["call_a", "call_b", "call_c"], True
        )
        if reason == "interrupt":
            assert (await next_handle.wait()).result == "Next answered."
        await assert_nothing_left(session)
        await session.close()

    loaded = load_transcript(path)
    assert loaded.problems == []
    assert transcript_problems(loaded.messages) == []
    assert len(loaded.sidechains) == 3
    for side in loaded.sidechains.values():
        assert transcript_problems(side.messages) == []
        # Each child's tool_use was answered by its own ending, not by the loader's repair.
        answered = results_of(side.messages, of_parent=False)  # type: ignore[arg-type]
        assert answered["w"]["is_error"] is True and "Interrupted" in answered["w"]["content"]


async def test_an_abort_at_any_step_of_a_subagents_start_ends_the_parent_and_closes_every_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The Agent tool asks the session's Compactor for its spill folder before it starts the child; an abort
    # landing at that step (or any other) must not leave the call waiting for a child query never handed over.
    for steps in range(0, 60, 2):
        provider = ByPrompt(
            {"Review": [fan_out("file a", "file b")], **{f"file {x}": [text_reply("ok")] for x in "ab"}}
        )
        async with Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=provider, agents={"reviewer": REVIEWER}))
            handle = session.query("Review")

            async def abort_after(session: Session = session, steps: int = steps) -> None:
                for _ in range(steps):
                    await trio.lowlevel.checkpoint()
                session.abort_nowait("user")

            with hang_guard(60, f"the parent aborted after {steps} steps"):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(abort_after)
                    result = await handle.wait()
            assert result.subtype in {"success", "error_during_execution"}, steps
            await assert_nothing_left(session)
            assert runtime.agents.slots.live == 0
            await session.close()


async def test_a_child_over_budget_stops_the_parent_with_max_budget_usd() -> None:
    # About $2 at the default model's price.
    costly: dict[str, Any] = {"usage": {"input_tokens": 1_000_000, "output_tokens": 10}}
    provider = ByPrompt(
        {
            "Review": [fan_out("file a", "file b"), text_reply("never sent")],
            "file a": [tools_reply(tool_use("w", "wait_forever"), **costly)],
            "file b": [tools_reply(tool_use("w", "wait_forever"))],
        }
    )
    async with Runtime.open() as runtime:
        options = QueryOptions(
            provider=provider, tools=[wait_forever], agents={"reviewer": REVIEWER}, max_budget_usd=1.0
        )
        session = await runtime.open_session(options)
        handle = session.query("Review")
        result = await handle.wait()
        assert handle.terminal is not None and handle.terminal.reason == "max_budget_usd"
        assert result.subtype == "error_max_budget_usd" and result.is_error
        assert result.total_cost_usd >= 2.0
        spent = {a.parent_tool_use_id: a.total_cost_usd for a in result.usage_by_agent.values()}
        assert spent["call_a"] >= 2.0
        assert len(provider.requests_of("Review")) == 1  # the parent made no further call
        await assert_nothing_left(session)


class Bomb(TrioActor):
    def on_start(self) -> None:
        raise RuntimeError("the child's actor blew up")


@tool(description="Start an actor that crashes")
async def explode(args: dict[str, Any], ctx: ToolContext) -> str:
    Bomb.start()  # in the child's group: its crash closes that group
    await trio.sleep_forever()
    return "never"


async def test_a_crash_in_a_childs_actor_is_an_error_result_and_the_parent_goes_on() -> None:
    provider = ByPrompt(
        {
            "Review": [fan_out("file a", "file b"), text_reply("b was fine; a crashed.")],
            "file a": [tools_reply(tool_use("x", "explode"))],
            "file b": [text_reply("b: fine")],
        }
    )
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, tools=[explode], agents={"reviewer": REVIEWER})
        session = await runtime.open_session(options)
        handle = session.query("Review")
        events = [event async for event in handle]
        results = results_of(events)
        assert results["call_a"]["is_error"] is True
        assert "crashed" in results["call_a"]["content"] and "blew up" in results["call_a"]["content"]
        assert results["call_b"] == {**results["call_b"], "content": "b: fine", "is_error": False}
        assert handle.terminal is not None and handle.terminal.reason == "completed"
        assert session.failure is None and not session.supervisor.closed
        await assert_nothing_left(session)


async def test_the_depth_cap_gives_the_deepest_children_no_agent_tool() -> None:
    provider = ByPrompt(
        {
            "Plan": [tools_reply(agent_call("outer", "planner", "Split")), text_reply("Planned.")],
            "Split": [tools_reply(agent_call("inner", "planner", "Leaf")), text_reply("Split done.")],
            "Leaf": [text_reply("Leaf done.")],
        }
    )
    planner = AgentDefinition(description="Plans", prompt="You plan.")
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, agents={"planner": planner}, max_agent_depth=2)
        session = await runtime.open_session(options)
        handle = session.query("Plan")
        events = [event async for event in handle]
        assert handle.result is not None and handle.result.result == "Planned."
        tools_at = {p: [t["name"] for t in provider.requests_of(p)[0].tools] for p in ("Plan", "Split", "Leaf")}
        assert tools_at == {"Plan": ["Agent"], "Split": ["Agent"], "Leaf": []}
        # The grandchild's events reach the top consumer tagged with the child's call: a UI can nest them.
        leaf = [e for e in events if getattr(e, "parent_tool_use_id", None) == "inner"]
        assert any(e.label == "assistant" for e in leaf)
        # Its cost counts twice up the tree: in the child's total, which counts in the parent's.
        assert handle.result.usage_by_agent[f"{session.id}/outer"].total_cost_usd > 0
        await assert_nothing_left(session)


async def test_a_child_that_calls_its_own_type_stops_at_the_depth_cap() -> None:
    provider = ByPrompt(
        {
            "Loop": [tools_reply(agent_call("c1", "echo", "Again")), text_reply("Stopped.")],
            "Again": [tools_reply(agent_call("c2", "echo", "Again")), text_reply("No agent tool here.")],
        }
    )
    echo = AgentDefinition(description="Calls itself", prompt="You call yourself.")
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=provider, agents={"echo": echo}))
        handle = session.query("Loop")
        events = [event async for event in handle]
        inner = results_of(events, of_parent=False)
        assert "No such tool available: Agent" in inner["c2"]["content"]  # the child has no agent tool
        assert handle.result is not None and handle.result.result == "Stopped."
        await assert_nothing_left(session)


async def test_a_subagents_transcript_is_a_sidechain_and_resume_restores_both(tmp_path: Path) -> None:
    path = tmp_path / "session.jsonl"
    provider = ByPrompt(
        {
            "Review": [fan_out("file a", "file b"), text_reply("Both fine.")],
            "file a": [tools_reply(tool_use("n", "wait_forever")), text_reply("unused")],
            "file b": [text_reply("b: fine")],
        }
    )

    @tool(description="Answer at once", concurrency_safe=True, name="wait_forever")
    async def quick(args: dict[str, Any], ctx: ToolContext) -> str:
        return "done"

    options = QueryOptions(provider=provider, tools=[quick], agents={"reviewer": REVIEWER})
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options, transcript=path)
        await session.query("Review").wait()
        before = await session.transcript()
        sides_before = await session.sidechains()
        await session.close()

    loaded = load_transcript(path)
    assert loaded.problems == []
    assert [m.uuid for m in loaded.messages] == [m.uuid for m in before]  # no sidechain message in the history
    assert {k: [m.uuid for m in s.messages] for k, s in loaded.sidechains.items()} == {
        k: [m.uuid for m in s.messages] for k, s in sides_before.items()
    }
    assert {s.agent_type for s in loaded.sidechains.values()} == {"reviewer"}

    follow_up = ByPrompt({"Review": [text_reply("Still fine.")]})
    async with Runtime.open() as runtime:
        resumed = await runtime.open_session(options.model_copy(update={"provider": follow_up}), resume=path)
        assert (await resumed.sidechains()).keys() == sides_before.keys()
        result = await resumed.query("And now?").wait()
        assert result.result == "Still fine."
        sent = follow_up.requests_of("Review")[0].messages
        # The prompt, the agent calls, their results, the answer, the new prompt: no child's message.
        assert [m["role"] for m in sent] == ["user", "assistant", "user", "assistant", "user"]
        assert "b: fine" in str(sent[2]) and "done" not in str(sent)
        await resumed.close()
    assert load_transcript(path).problems == []


async def test_calls_past_the_sessions_cap_wait_and_past_the_hosts_cap_are_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    slow: dict[str, Any] = {"latency_ms": 100}
    scripts = {f"file {x}": [text_reply(f"{x}: fine", **slow)] for x in "abc"}
    provider = ByPrompt({"Review": [fan_out("file a", "file b", "file c"), text_reply("Done.")], **scripts})
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, agents={"reviewer": REVIEWER}, max_concurrent_agents=2)
        session = await runtime.open_session(options)
        result = await session.query("Review").wait()
        assert result.result == "Done." and runtime.agents.slots.peak == 2  # the third waited for a slot
        assert len(result.usage_by_agent) == 3

    provider = ByPrompt({"Review": [fan_out("file a", "file b", "file c"), text_reply("Done.")], **scripts})
    async with Runtime.open(max_live_agents=1) as runtime:
        session = await runtime.open_session(QueryOptions(provider=provider, agents={"reviewer": REVIEWER}))
        events = [event async for event in session.query("Review")]
        refused = [r for r in results_of(events).values() if r["is_error"]]
        assert len(refused) == 2 and all("max_live_agents=1" in r["content"] for r in refused)
        assert runtime.agents.slots.peak == 1
        await assert_nothing_left(session)


async def test_an_unknown_agent_type_is_an_error_result() -> None:
    provider = ByPrompt({"Review": [tools_reply(agent_call("x", "nobody", "file a")), text_reply("Sorry.")]})
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=provider, agents={"reviewer": REVIEWER}))
        events = [event async for event in session.query("Review")]
        result = results_of(events)["x"]
        assert result["is_error"] and "Agent type 'nobody' not found. Available agents: reviewer" in result["content"]


async def test_the_token_budget_gate_stops_for_a_subagent() -> None:
    # Claude Code's `checkTokenBudget` stops at once when an agent id is set: the child makes one call, no nudge.
    provider = ByPrompt(
        {
            "Review": [fan_out("file a"), *[text_reply("More.")] * 8],
            "file a": [text_reply("a: fine"), text_reply("never asked")],
        }
    )
    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, agents={"reviewer": REVIEWER}, token_budget=100_000)
        session = await runtime.open_session(options)
        handle = session.query("Review")
        await handle.wait()
        assert len(provider.requests_of("file a")) == 1
        assert "token_budget_continuation" in handle.transitions  # the parent, without an agent id, was nudged


def test_agent_definitions_are_checked_against_the_sessions_tools() -> None:
    with pytest.raises(ValueError, match="no such tools"):
        QueryOptions(agents={"r": AgentDefinition(description="d", prompt="p", tools=["missing"])})
    with pytest.raises(ValueError, match="subagent tool's name"):
        QueryOptions(tools=[wait_forever.model_copy(update={"name": "Agent"})], agents={"r": REVIEWER})


async def test_subagent_stop_hooks_run_as_the_childs_stop_hooks_with_its_agent_id_and_type() -> None:
    provider = ByPrompt(
        {
            "Review": [fan_out("file a"), text_reply("Parent done.")],
            "file a": [text_reply("a: looks fine"), text_reply("a: fine, tests pass")],
        }
    )
    seen: list[tuple[str | None, str | None, bool]] = []

    async def subagent_stop(hook: StopHookInput) -> HookDecision | None:
        seen.append((hook.agent_id, hook.agent_type, hook.stop_hook_active))
        return None if hook.stop_hook_active else HookDecision(blocking_error="run the tests first")

    async def own_stop(hook: StopHookInput) -> HookDecision | None:
        seen.append((hook.agent_id, hook.agent_type, hook.stop_hook_active))
        return None

    async with Runtime.open() as runtime:
        options = QueryOptions(
            provider=provider, agents={"reviewer": REVIEWER}, stop_hooks=[own_stop], subagent_stop_hooks=[subagent_stop]
        )
        session = await runtime.open_session(options)
        events = [event async for event in session.query("Review")]
        await assert_nothing_left(session)

    child_id = f"{session.id}/call_a"
    # The child was sent back once, then let go; the parent's own hook ran for the parent only.
    assert seen == [(child_id, "reviewer", False), (child_id, "reviewer", True), (None, None, False)]
    assert results_of(events)["call_a"]["content"] == "a: fine, tests pass"
    assert len(provider.requests_of("file a")) == 2


async def test_a_subagent_stop_hook_that_raises_is_reported_as_a_subagentstop_hook_error() -> None:
    provider = ByPrompt({"Review": [fan_out("file a"), text_reply("Parent done.")], "file a": [text_reply("a: fine")]})

    async def broken(hook: StopHookInput) -> HookDecision | None:
        raise ValueError("no linter here")

    async with Runtime.open() as runtime:
        options = QueryOptions(provider=provider, agents={"reviewer": REVIEWER}, subagent_stop_hooks=[broken])
        session = await runtime.open_session(options)
        events = [event async for event in session.query("Review")]
        await assert_nothing_left(session)

    errors = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]
    assert [(e.data["hook_event"], e.parent_tool_use_id) for e in errors] == [("SubagentStop", "call_a")]
    assert results_of(events)["call_a"]["content"] == "a: fine"
