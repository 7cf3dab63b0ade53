"""The lifecycle events' hooks in the Agent SDK's shape, run by real scripted queries where Claude Code fires them:
SessionStart (startup, resume, compact), SessionEnd, SubagentStart, PreCompact and PostCompact around the loop's
compactions, StopFailure; what their answers do (context for the model, a block), a failing hook being a
non-blocking hook error, and nothing running without a matcher that selects the event's value.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import trio
import trio.testing

from queryloop import AgentDefinition, HookContext, HookInput, HookJSONOutput, HookMatcher, QueryOptions, Runtime
from queryloop.runtime.loop.events import AttachmentMessage, SystemMessage
from queryloop.runtime.loop.lifecycle_hooks import session_end_budget_s
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.actors.test_context_loop import PTL, SMALL_WINDOW, summary_model
from tests.agent_helpers import agent_call
from tests.helpers import Ran, assert_settled, consume, run_query, text_reply, tools_reply

WAIT_S = 10.0


class Seen:
    """A hook recording each `input_data` it is given (`called` once it has been), answering `answer`."""

    def __init__(self, answer: HookJSONOutput | None = None, *, raises: str | None = None) -> None:
        self.inputs: list[dict[str, Any]] = []
        self.answer: HookJSONOutput = answer or {}
        self.raises = raises
        self.called = trio.Event()

    async def __call__(self, input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        self.inputs.append(dict(input_data))
        self.called.set()
        if self.raises is not None:
            raise RuntimeError(self.raises)
        return self.answer


def context(event: str, text: str) -> HookJSONOutput:
    specific: Any = {"hookEventName": event, "additionalContext": text}
    return {"hookSpecificOutput": specific}


def sent_text(request: ModelRequest) -> str:
    return str(request.messages)


def hook_errors(ran: Ran) -> list[SystemMessage]:
    return [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]


def attachments(ran: Ran, kind: str) -> list[dict[str, Any]]:
    return [e.attachment for e in ran.events if isinstance(e, AttachmentMessage) and e.attachment["type"] == kind]


# -- SessionStart, SessionEnd ------------------------------------------------------------------------------------
async def test_session_start_fires_at_a_sessions_first_query_with_startup_and_its_context_reaches_the_model() -> None:
    start = Seen(context("SessionStart", "The repo uses tabs."))
    model = ScriptedModel([text_reply("One."), text_reply("Two.")])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=model, hooks={"SessionStart": [HookMatcher(matcher="startup", hooks=[start])]})
        )
        first = await consume(session, session.query("Hello"), model)
        second = await consume(session, session.query("Again"), model)
        conversation = await session.transcript()
        await assert_settled(second)
    ((data,),) = [start.inputs]  # the session's first query only
    assert data["hook_event_name"] == "SessionStart" and data["source"] == "startup"
    assert data["session_id"] == session.id and "agent_id" not in data
    (added,) = attachments(first, "hook_additional_context")
    assert added["content"] == "SessionStart hook additional context: The repo uses tabs."
    assert "The repo uses tabs." in sent_text(model.requests[0]) and "The repo uses tabs." in sent_text(
        model.requests[1]
    )
    assert [type(m).__name__ for m in conversation[:2]] == ["AttachmentMessage", "UserMessage"]  # before the prompt
    assert attachments(second, "hook_additional_context") == []


async def test_session_start_fires_with_resume_for_a_session_restored_from_its_transcript(tmp_path: Path) -> None:
    path = tmp_path / "session.jsonl"
    start = Seen()
    hooks = {"SessionStart": [HookMatcher(hooks=[start])]}
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("First.")])
        session = await runtime.open_session(QueryOptions(provider=model, hooks=hooks), transcript=path)
        await consume(session, session.query("Hello"), model)
        await session.close()
        model = ScriptedModel([text_reply("Resumed.")])
        resumed = await runtime.open_session(QueryOptions(provider=model, hooks=hooks), resume=path)
        ran = await consume(resumed, resumed.query("Where were we?"), model)
    assert [data["source"] for data in start.inputs] == ["startup", "resume"]
    assert start.inputs[1]["transcript_path"] == str(path)
    assert ran.reason == "completed"


async def test_session_end_runs_detached_when_the_session_closes_with_reason_other() -> None:
    end = Seen()
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply()], hooks={"SessionEnd": [HookMatcher(hooks=[end])]})
        assert end.inputs == []  # a query's end is not the session's
        await ran.session.close()
        with trio.fail_after(WAIT_S):
            await end.called.wait()
    ((data,),) = [end.inputs]
    assert data["hook_event_name"] == "SessionEnd" and data["reason"] == "other"
    assert data["session_id"] == ran.session.id


async def test_session_end_hooks_past_their_shared_budget_are_cut_and_the_runtime_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    class Hangs(Seen):
        async def __call__(self, input_data: HookInput, tool_use_id: str | None, context: HookContext) -> Any:
            self.called.set()
            await trio.sleep_forever()

    hangs = Hangs()
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply()], hooks={"SessionEnd": [HookMatcher(hooks=[hangs])]})
        await ran.session.close()
        started = trio.current_time()
    assert hangs.called.is_set()
    assert trio.current_time() - started < 5.0  # cut at 1.5 s, Claude Code's budget, not the matcher's 60 s


def test_the_session_end_budget_is_raised_by_a_matchers_own_timeout_to_at_most_60_s() -> None:
    assert session_end_budget_s((HookMatcher(),)) == 1.5
    assert session_end_budget_s((HookMatcher(), HookMatcher(timeout=0.5), HookMatcher(timeout=10))) == 10
    assert session_end_budget_s((HookMatcher(timeout=600),)) == 60


# -- SubagentStart -----------------------------------------------------------------------------------------------
class ByStart:
    """Plays `scripts[prefix]` for the conversation whose first text starts with `prefix` (a child's first message
    holds its prompt and what SubagentStart's hooks added after it)."""

    def __init__(self, scripts: dict[str, list[dict[str, Any]]]) -> None:
        self.models = {prefix: ScriptedModel(entries) for prefix, entries in scripts.items()}

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        first = "".join(b.get("text", "") for b in request.messages[0]["content"] if b.get("type") == "text")
        model = next(m for prefix, m in self.models.items() if first.startswith(prefix))
        async with aclosing(model.stream(request)) as events:
            async for event in events:
                yield event


REVIEWER = AgentDefinition(description="Reviews one file", prompt="You review code.")


async def run_agent(hooks: dict[str, Any], child: list[dict[str, Any]] | None = None) -> tuple[Ran, ByStart]:
    provider = ByStart(
        {
            "Review": [tools_reply(agent_call("call_a", "reviewer", "file a")), text_reply("Reviewed.")],
            "file a": child or [text_reply("a: fine")],
        }
    )
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=provider, agents={"reviewer": REVIEWER}, hooks=hooks)
        )
        ran = await consume(session, session.query("Review"), provider.models["Review"])
        await assert_settled(ran)
        return ran, provider


async def test_subagent_start_fires_on_the_parents_hooks_and_its_context_reaches_the_child() -> None:
    start = Seen(context("SubagentStart", "Check the license headers."))
    other = Seen()
    ran, provider = await run_agent(
        {
            "SubagentStart": [
                HookMatcher(matcher="reviewer", hooks=[start]),
                HookMatcher(matcher="planner", hooks=[other]),
            ]
        }
    )
    assert other.inputs == []  # matched against the agent's type
    ((data,),) = [start.inputs]
    assert data["hook_event_name"] == "SubagentStart" and data["agent_type"] == "reviewer"
    assert data["agent_id"] == f"{ran.session.id}/call_a" and data["session_id"] == ran.session.id
    (child_request,) = provider.models["file a"].requests
    assert "Check the license headers." in sent_text(child_request)
    assert "Check the license headers." not in sent_text(provider.models["Review"].requests[-1])
    (added,) = attachments(ran, "hook_additional_context")  # the child's, relayed tagged with the call
    assert ran.handle.result is not None and ran.handle.result.errors == []
    tagged = [e for e in ran.events if isinstance(e, AttachmentMessage) and e.attachment is added]
    assert tagged[0].parent_tool_use_id == "call_a"


async def test_a_failing_subagent_start_hook_is_a_hook_error_in_the_parents_result() -> None:
    ran, provider = await run_agent({"SubagentStart": [HookMatcher(hooks=[Seen(raises="no config")])]})
    (error,) = hook_errors(ran)
    assert error.data["hook_event"] == "SubagentStart" and "no config" in error.content
    assert ran.handle.result is not None and ran.handle.result.errors == [error.content]
    assert ran.handle.result.subtype == "success" and ran.tool_results()["call_a"]["is_error"] is False
    assert len(provider.models["file a"].requests) == 1  # the agent ran all the same


async def test_subagent_start_continue_false_stops_the_agent_before_it_starts() -> None:
    ran, provider = await run_agent(
        {"SubagentStart": [HookMatcher(hooks=[Seen({"continue_": False, "stopReason": "No agents today."})])]}
    )
    assert provider.models["file a"].requests == []
    result = ran.tool_results()["call_a"]
    assert result["is_error"] is True and "No agents today." in str(result["content"])


# -- PreCompact, PostCompact, SessionStart (compact) -------------------------------------------------------------
async def run_compacting(hooks: dict[str, Any], **options: Any) -> tuple[Ran, ScriptedModel]:
    """One query whose prompt is over the autocompact threshold (`SMALL_WINDOW`): autocompacted before its call."""
    model = ScriptedModel([text_reply("Answered.")])
    compactor = summary_model("The user sent a very long message.")
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=model, compact_provider=compactor, hooks=hooks, **SMALL_WINDOW, **options)
        )
        ran = await consume(session, session.query("x" * 40_000), model)
        await assert_settled(ran)
        return ran, compactor


async def test_pre_compact_and_post_compact_fire_around_an_autocompaction_and_session_start_after_it() -> None:
    pre, post = Seen(), Seen(context("PostCompact", "Re-read the plan."))
    start = Seen(context("SessionStart", "Compacted: be brief."))
    ran, compactor = await run_compacting(
        {
            "PreCompact": [HookMatcher(matcher="auto", hooks=[pre])],
            "PostCompact": [HookMatcher(hooks=[post])],
            "SessionStart": [HookMatcher(matcher="compact", hooks=[start])],
        },
        compact_instructions="Keep the file names.",
    )
    assert len(compactor.requests) == 1 and ran.reason == "completed"
    ((before,),) = [pre.inputs]
    assert before["hook_event_name"] == "PreCompact" and before["trigger"] == "auto"
    assert before["custom_instructions"] == "Keep the file names."
    ((after,),) = [post.inputs]
    assert after["trigger"] == "auto" and after["compact_summary"] == "The user sent a very long message."
    assert [data["source"] for data in start.inputs] == ["compact"]  # its matcher selects no startup
    sent = sent_text(ran.model.requests[0])
    assert "Re-read the plan." in sent and "Compacted: be brief." in sent  # after the summary, so sent
    assert sent.index("Compacted: be brief.") < sent.index("Re-read the plan.")  # SessionStart's, then PostCompact's


async def test_a_pre_compact_block_skips_the_autocompaction_and_the_query_goes_on() -> None:
    block = Seen({"decision": "block", "reason": "Not now."})
    ran, compactor = await run_compacting({"PreCompact": [HookMatcher(hooks=[block])]})
    assert len(block.inputs) == 1
    assert compactor.requests == []
    assert not [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "compact_boundary"]
    assert ran.reason == "completed" and "x" * 1_000 in sent_text(ran.model.requests[0])


async def test_a_failing_pre_compact_hook_is_a_hook_error_and_the_compaction_runs() -> None:
    ran, compactor = await run_compacting({"PreCompact": [HookMatcher(hooks=[Seen(raises="flaky")])]})
    (error,) = hook_errors(ran)
    assert error.data["hook_event"] == "PreCompact"
    assert ran.handle.result is not None and ran.handle.result.errors == [error.content]
    assert len(compactor.requests) == 1


async def test_a_pre_compact_block_fails_the_prompt_too_long_recovery() -> None:
    block = Seen({"decision": "block"})
    compactor = summary_model("unused")
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [PTL, text_reply()],
            compact_provider=compactor,
            context_collapse=False,
            hooks={"PreCompact": [HookMatcher(hooks=[block])]},
        )
        await assert_settled(ran)
    assert [data["trigger"] for data in block.inputs] == ["auto"]
    assert compactor.requests == [] and ran.reason == "prompt_too_long"


async def test_reactive_compaction_fires_post_compact_with_its_summary() -> None:
    post = Seen(context("PostCompact", "Summary checked."))
    compactor = summary_model("What happened so far.")
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [PTL, text_reply("Fixed.")],
            compact_provider=compactor,
            context_collapse=False,
            hooks={"PostCompact": [HookMatcher(hooks=[post])]},
        )
        await assert_settled(ran)
    assert ran.handle.transitions == ["reactive_compact_retry"] and ran.reason == "completed"
    assert [data["compact_summary"] for data in post.inputs] == ["What happened so far."]
    assert "Summary checked." in sent_text(ran.model.requests[-1])


# -- StopFailure -------------------------------------------------------------------------------------------------
async def test_stop_failure_hooks_in_the_sdk_shape_run_detached_on_an_api_error() -> None:
    failed, other = Seen(), Seen()
    hooks = {"StopFailure": [HookMatcher(matcher="rate_limit", hooks=[failed]), HookMatcher("billing_error", [other])]}
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [{"error": "rate_limit"}], max_retries=0, hooks=hooks)
        with trio.fail_after(WAIT_S):
            await failed.called.wait()
    ((data,),) = [failed.inputs]
    assert data["hook_event_name"] == "StopFailure" and data["error"] == "rate_limit"
    assert data["error_details"] and data["last_assistant_message"]
    assert other.inputs == []
    assert ran.handle.result is not None and ran.handle.result.is_error


# -- nothing without a matcher -----------------------------------------------------------------------------------
async def test_nothing_runs_without_a_matcher_for_the_event_or_its_value() -> None:
    resume_only = Seen()
    pre_tool = Seen()
    hooks = {
        "SessionStart": [HookMatcher(matcher="resume", hooks=[resume_only])],
        "PreToolUse": [HookMatcher(hooks=[pre_tool])],
    }
    ran, compactor = await run_compacting(hooks)
    assert resume_only.inputs == [] and pre_tool.inputs == []
    assert len(compactor.requests) == 1  # not deferred: no PreCompact hook
    assert attachments(ran, "hook_additional_context") == [] and hook_errors(ran) == []
