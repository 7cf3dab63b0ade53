"""PreToolUse hooks in the Agent SDK's shape (`QueryOptions.hooks`), run by real scripted queries: what Claude
Code does with their answers (deny, allow, ask, updatedInput, several hooks at once, a matcher per tool),
and a hook that fails (raises, times out, answers nonsense) being a non-blocking hook error.
"""

from __future__ import annotations

import os
from typing import Any, cast

import pytest
import trio
import trio.testing
from pydantic import BaseModel, ValidationError

from queryloop import (
    AgentDefinition,
    Allow,
    Deny,
    HookContext,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    QueryOptions,
    Runtime,
    ScriptedModel,
    ToolContext,
    tool,
)
from queryloop.runtime.loop.events import AttachmentMessage, SystemMessage
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import (
    Ran,
    ToolLog,
    assert_settled,
    consume,
    open_session,
    run_query,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)


def deny(reason: str) -> HookJSONOutput:
    return {
        "hookSpecificOutput": {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": reason,
        }
    }


def decides(decision: str, **extra: Any) -> HookJSONOutput:
    return {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": decision, **extra}}  # type: ignore[typeddict-item]


def pre(*matchers: HookMatcher) -> dict[str, Any]:
    return {"hooks": {"PreToolUse": list(matchers)}}


def hook_errors(ran: Ran) -> list[SystemMessage]:
    return [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]


async def run_write(
    hooks: dict[str, Any], *, tool_input: dict[str, Any] | None = None, log: ToolLog | None = None, **options: Any
) -> Ran:
    """One `write` call (t1), then the model's answer, with `hooks`."""
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "write", tool_input or {"path": "a.txt"})), text_reply("Answered.")],
            tools=[scripted_tool("write", result="wrote", log=log)],
            **hooks,
            **options,
        )
        await assert_settled(ran)
        return ran


async def test_a_deny_keeps_the_tool_from_running_and_the_model_reads_the_reason() -> None:
    async def no_writes(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return deny("writes are frozen during the release")

    log = ToolLog()
    ran = await run_write(pre(HookMatcher(matcher="write", hooks=[no_writes])), log=log)
    assert log.order == []  # never ran
    result = ran.tool_results()["t1"]
    assert result["is_error"] is True
    assert "writes are frozen during the release" in str(result["content"])
    assert ran.reason == "completed" and ran.handle.result is not None
    assert ran.handle.result.result == "Answered."  # the model answered after the denial
    assert ran.handle.result.errors == []  # a deny is a decision, not a hook error


async def test_a_deny_without_a_reason_says_which_hook_denied_as_claude_code_does() -> None:
    async def blocks(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return decides("deny")

    ran = await run_write(pre(HookMatcher(hooks=[blocks])))
    assert "Hook PreToolUse:write denied this tool" in str(ran.tool_results()["t1"]["content"])


async def test_a_hooks_allow_runs_the_tool_without_asking_can_use_tool() -> None:
    asked: list[str] = []

    async def refuses(name: str, tool_input: dict[str, Any]) -> Allow | Deny:
        asked.append(name)
        return Deny(message="can_use_tool says no")

    async def allows(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return decides("allow")

    ran = await run_write(pre(HookMatcher(hooks=[allows])), can_use_tool=refuses)
    assert asked == []
    assert ran.tool_results()["t1"]["content"] == "wrote"


@pytest.mark.parametrize("answer", ["ask", None], ids=["ask", "no-decision"])  # defer: test_deferred_tool_use
async def test_ask_and_no_decision_leave_it_to_can_use_tool(answer: str | None) -> None:
    asked: list[str] = []

    async def refuses(name: str, tool_input: dict[str, Any]) -> Allow | Deny:
        asked.append(name)
        return Deny(message="can_use_tool says no")

    async def hook(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return {} if answer is None else decides(answer)

    ran = await run_write(pre(HookMatcher(hooks=[hook])), can_use_tool=refuses)
    assert asked == ["write"]
    assert "can_use_tool says no" in str(ran.tool_results()["t1"]["content"])


class PathArgs(BaseModel):
    path: str


@pytest.mark.parametrize(
    ("updated", "runs_with"),
    [({"path": "/sandbox/a.txt"}, "/sandbox/a.txt"), ({"path": 3}, None)],
    ids=["valid", "invalid"],
)
async def test_an_allows_updated_input_replaces_the_tools_input_and_is_validated_by_its_model(
    updated: dict[str, Any], runs_with: str | None
) -> None:
    seen: list[dict[str, Any]] = []
    received: list[str] = []

    async def sandbox(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        seen.append(dict(cast("dict[str, Any]", input_data)["tool_input"]))
        return decides("allow", updatedInput=updated)

    @tool
    async def write(args: PathArgs, ctx: ToolContext) -> str:
        """Write a file."""
        received.append(args.path)
        return "wrote"

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "write", {"path": "a.txt"})), text_reply()],
            tools=[write],
            **pre(HookMatcher(hooks=[sandbox])),
        )
        await assert_settled(ran)
    assert seen == [{"path": "a.txt"}]
    if runs_with is None:  # refused by the tool's model, as `can_use_tool`'s `updated_input` would be
        assert received == []
        assert "InputValidationError" in str(ran.tool_results()["t1"]["content"])
    else:
        assert received == [runs_with]
    assert ran.model.requests[1].messages[1]["content"][0]["input"] == {"path": "a.txt"}  # the model's own call


async def test_a_deny_beats_an_allow_and_matching_hooks_run_in_parallel(autojump_clock: trio.testing.MockClock) -> None:
    async def slow_allow(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        await trio.sleep(3)
        return decides("allow")

    async def slower_deny(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        await trio.sleep(5)
        return deny("policy")

    log = ToolLog()
    started = trio.current_time()
    ran = await run_write(
        pre(HookMatcher(matcher="write", hooks=[slow_allow]), HookMatcher(matcher="*", hooks=[slower_deny])), log=log
    )
    elapsed = trio.current_time() - started
    assert 5 <= elapsed < 8  # the longer hook's time, not the sum
    assert log.order == []
    assert "policy" in str(ran.tool_results()["t1"]["content"])


@pytest.mark.parametrize(
    ("matcher", "runs_for"),
    [
        ("write", {"write"}),
        ("write|edit", {"write", "edit"}),
        ("^mcp__files__", {"mcp__files__read"}),
        ("e.*t", {"edit"}),
        ("*", {"write", "edit", "mcp__files__read"}),
        (None, {"write", "edit", "mcp__files__read"}),
    ],
    ids=["exact", "list", "regex-prefix", "regex-unanchored", "star", "none"],
)
async def test_the_matcher_selects_the_tools_a_hook_runs_for(matcher: str | None, runs_for: set[str]) -> None:
    called: list[str] = []

    async def hook(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        called.append(cast("dict[str, Any]", input_data)["tool_name"])
        return {}

    names = ["write", "edit", "mcp__files__read"]
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(*(tool_use(f"t{i}", name) for i, name in enumerate(names))), text_reply()],
            tools=[scripted_tool(name) for name in names],
            **pre(HookMatcher(matcher=matcher, hooks=[hook])),
        )
        await assert_settled(ran)
    assert set(called) == runs_for and len(called) == len(runs_for)


async def test_a_raising_hook_is_a_hook_error_that_decides_nothing() -> None:
    async def broken(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        raise RuntimeError("policy server down")

    async def allows(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return decides("allow")

    ran = await run_write(pre(HookMatcher(hooks=[broken, allows])))
    assert ran.tool_results()["t1"]["content"] == "wrote"  # the other hook's allow stands
    (event,) = hook_errors(ran)
    assert event.data == {
        "hook_event": "PreToolUse",
        "hook_name": broken.__qualname__,
        "error": "RuntimeError: policy server down",
        "tool_name": "write",
        "tool_use_id": "t1",
    }
    assert ran.handle.result is not None and ran.handle.result.errors == [event.content]
    assert ran.handle.result.subtype == "success"
    assert "policy server down" not in str(ran.model.requests[1].messages)  # never to the model


async def test_a_hook_past_its_timeout_is_cancelled_and_is_a_hook_error_that_decides_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def stuck(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        await trio.sleep(1000)
        return deny("too late")

    started = trio.current_time()
    ran = await run_write(pre(HookMatcher(hooks=[stuck], timeout=2)))
    assert trio.current_time() - started < 5
    assert ran.tool_results()["t1"]["content"] == "wrote"
    (event,) = hook_errors(ran)
    assert event.data["error"] == "TimeoutError: timed out after 2 s"


async def test_the_default_timeout_is_the_sdks_sixty_seconds(autojump_clock: trio.testing.MockClock) -> None:
    async def stuck(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        await trio.sleep(1000)
        return {}

    started = trio.current_time()
    ran = await run_write(pre(HookMatcher(hooks=[stuck])))
    assert 60 <= trio.current_time() - started < 65
    assert hook_errors(ran)[0].data["error"] == "TimeoutError: timed out after 60 s"


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (None, "HostCodeError: returned None, not a dict (the hook's JSON output)"),
        ("deny", "HostCodeError: returned str, not a dict (the hook's JSON output)"),
        (
            {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "Deny"}},
            "HostCodeError: returned permissionDecision 'Deny', not one of allow, deny, ask, defer",
        ),
        ({"hookSpecificOutput": "deny"}, "HostCodeError: returned hookSpecificOutput str, not a dict"),
        (
            {"hookSpecificOutput": {"hookEventName": "PostToolUse", "permissionDecision": "deny"}},
            "HostCodeError: returned hookSpecificOutput for 'PostToolUse', not PreToolUse",
        ),
    ],
    ids=["none", "string", "bad-decision", "bad-specific", "other-event"],
)
async def test_an_answer_that_is_not_a_hook_output_is_a_hook_error_that_decides_nothing(
    answer: Any, error: str
) -> None:
    async def odd(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> Any:
        return answer

    ran = await run_write(pre(HookMatcher(hooks=[odd])))
    assert ran.tool_results()["t1"]["content"] == "wrote"
    (event,) = hook_errors(ran)
    assert event.data["error"] == error


async def test_the_deprecated_decision_block_denies_with_its_reason_and_approve_allows() -> None:
    async def legacy_block(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return {"decision": "block", "reason": "legacy policy"}

    ran = await run_write(pre(HookMatcher(hooks=[legacy_block])))
    assert "legacy policy" in str(ran.tool_results()["t1"]["content"])

    async def refuses(name: str, tool_input: dict[str, Any]) -> Allow | Deny:
        return Deny(message="can_use_tool says no")

    async def legacy_approve(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return {"decision": "approve"}

    ran = await run_write(pre(HookMatcher(hooks=[legacy_approve])), can_use_tool=refuses)
    assert ran.tool_results()["t1"]["content"] == "wrote"


async def test_continue_false_keeps_the_call_from_running_and_stops_the_query_with_its_stop_reason() -> None:
    async def halts(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return {"continue_": False, "stopReason": "release freeze", **decides("allow")}

    log = ToolLog()
    ran = await run_write(pre(HookMatcher(hooks=[halts])), log=log)
    assert log.order == []  # `continue: false` outranks the allow
    assert ran.tool_results()["t1"]["content"] == "<tool_use_error>release freeze</tool_use_error>"
    stopped = [e.attachment for e in ran.events if isinstance(e, AttachmentMessage)]
    assert [a["message"] for a in stopped if a["type"] == "hook_stopped_continuation"] == ["release freeze"]
    assert ran.reason == "hook_stopped" and len(ran.model.requests) == 1  # no further model call


async def test_additional_context_reaches_the_model_and_a_system_message_only_the_user() -> None:
    async def chatty(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return {
            "systemMessage": "hello user",
            "suppressOutput": True,
            "hookSpecificOutput": {"hookEventName": "PreToolUse", "additionalContext": "the repo is frozen"},
        }

    ran = await run_write(pre(HookMatcher(hooks=[chatty])))
    assert ran.tool_results()["t1"]["content"] == "wrote" and hook_errors(ran) == []
    kinds = [e.attachment["type"] for e in ran.events if isinstance(e, AttachmentMessage)]
    assert kinds == ["hook_additional_context", "hook_system_message"]
    sent = str(ran.model.requests[1].messages)
    assert "PreToolUse:write hook additional context: the repo is frozen" in sent
    assert "hello user" not in sent


async def test_a_hook_gets_the_sdks_arguments() -> None:
    calls: list[tuple[dict[str, Any], str | None, dict[str, Any]]] = []

    async def record(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        calls.append((dict(input_data), tool_use_id, dict(context)))
        cast("dict[str, Any]", input_data)["tool_input"]["path"] = (
            "edited in place"  # its own copy: the call's input is unchanged
        )
        return {}

    ran = await run_write(pre(HookMatcher(hooks=[record])), tool_input={"path": "a.txt"})
    ((data, tool_use_id, context),) = calls
    assert tool_use_id == "t1" and context == {"signal": None}
    assert data == {
        "session_id": ran.session.id,
        "transcript_path": "",  # a session without a transcript file
        "cwd": os.getcwd(),
        "permission_mode": "default",
        "hook_event_name": "PreToolUse",
        "tool_name": "write",
        "tool_input": {"path": "edited in place"},
        "tool_use_id": "t1",
    }
    sent = ran.model.requests[1].messages
    assert "edited in place" not in str(sent)


async def test_a_subagents_calls_run_the_hooks_with_its_agent_id_and_type() -> None:
    seen: list[dict[str, Any]] = []

    async def record(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        seen.append(dict(input_data))
        return {}

    provider = ByPrompt(
        {
            "Delegate": [tools_reply(agent_call("call_1", "writer", "Write it")), text_reply("Delegated.")],
            "Write it": [tools_reply(tool_use("w1", "write")), text_reply("Written.")],
        }
    )
    writer = AgentDefinition(description="Writes files", prompt="You write.", tools=["write"])
    async with Runtime.open() as runtime:
        options = QueryOptions(
            provider=provider,
            tools=[scripted_tool("write")],
            agents={"writer": writer},
            hooks={"PreToolUse": [HookMatcher(hooks=[record])]},
        )
        session = await runtime.open_session(options)
        handle = session.query("Delegate")
        _ = [event async for event in handle]
        assert handle.terminal is not None and handle.terminal.reason == "completed"
    by_tool = {data["tool_name"]: data for data in seen}
    assert set(by_tool) == {"Agent", "write"}
    assert "agent_id" not in by_tool["Agent"]  # the session's own call
    assert by_tool["write"]["agent_type"] == "writer"
    assert by_tool["write"]["agent_id"].endswith("call_1")
    assert by_tool["write"]["session_id"] == by_tool["Agent"]["session_id"] == session.id


async def test_the_sdk_docs_example_hook_runs_unchanged() -> None:
    # The Agent SDK's documented PreToolUse example, with `queryloop` imports in place of `claude_agent_sdk`.
    async def check_bash_command(
        input_data: HookInput, tool_use_id: str | None, context: HookContext
    ) -> HookJSONOutput:
        """Prevent certain bash commands from being executed."""
        tool_name = cast("dict[str, Any]", input_data)["tool_name"]
        tool_input = cast("dict[str, Any]", input_data)["tool_input"]
        if tool_name != "Bash":
            return {}
        command = tool_input.get("command", "")
        block_patterns = ["foo.sh"]
        for pattern in block_patterns:
            if pattern in command:
                return {
                    "hookSpecificOutput": {
                        "hookEventName": "PreToolUse",
                        "permissionDecision": "deny",
                        "permissionDecisionReason": f"Command contains invalid pattern: {pattern}",
                    }
                }
        return {}

    log = ToolLog()
    scripted = ScriptedModel(
        [
            tools_reply(tool_use("b1", "Bash", {"command": "./foo.sh --help"})),
            tools_reply(tool_use("b2", "Bash", {"command": "echo hello"})),
            text_reply("Done."),
        ]
    )
    async with Runtime.open() as runtime:
        session = await open_session(
            runtime,
            scripted,
            tools=[scripted_tool("Bash", result="hello", log=log)],
            hooks={"PreToolUse": [HookMatcher(matcher="Bash", hooks=[check_bash_command])]},
        )
        ran = await consume(session, session.query("Run things"), scripted)
        await assert_settled(ran)
    assert log.order == ["b2"]
    results = ran.tool_results()
    assert "Command contains invalid pattern: foo.sh" in str(results["b1"]["content"])
    assert results["b2"]["content"] == "hello"


def test_an_unknown_hook_event_is_refused() -> None:
    with pytest.raises(ValidationError, match="PreToolUse"):
        QueryOptions(hooks={"BeforeTool": [HookMatcher()]})


def test_a_matcher_timeout_that_is_not_positive_is_refused_when_made() -> None:
    with pytest.raises(ValueError, match="timeout must be > 0"):
        HookMatcher(timeout=0)
