"""Claude Code's permission flow in real scripted queries: hooks → deny rules → ask rules → mode → allow rules
→ `can_use_tool` (asked with the SDK's context, only for what is left undecided), `Deny(interrupt=True)`,
`Allow(updated_permissions=...)` kept for the session, and the result's `permission_denials`.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from queryloop import (
    Allow,
    Deny,
    HookContext,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    PermissionRuleValue,
    PermissionUpdate,
    QueryOptions,
    Runtime,
    ScriptedModel,
    ToolPermissionContext,
)
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


class Asked:
    """A `can_use_tool` in the SDK's form, recording what it is asked, answering `answer`."""

    def __init__(self, answer: Allow | Deny | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any], ToolPermissionContext]] = []
        self.answer = answer or Allow()

    async def __call__(self, name: str, tool_input: dict[str, Any], context: ToolPermissionContext) -> Allow | Deny:
        self.calls.append((name, tool_input, context))
        return self.answer


async def run_bash(command: str, log: ToolLog | None = None, **options: Any) -> Ran:
    """One `Bash` call (t1) with `command`, then the model's answer."""
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "Bash", {"command": command})), text_reply("Answered.")],
            tools=[scripted_tool("Bash", result="ran", log=log)],
            **options,
        )
        await assert_settled(ran)
        return ran


def denials(ran: Ran) -> list[dict[str, Any]]:
    assert ran.handle.result is not None
    return ran.handle.result.permission_denials


async def test_a_deny_rule_keeps_the_call_from_running_and_the_result_lists_the_denial() -> None:
    log = ToolLog()
    ran = await run_bash("rm -rf build", log=log, disallowed_tools=["Bash(rm *)"])
    assert log.order == []
    content = str(ran.tool_results()["t1"]["content"])
    assert "denied by the rule Bash(rm *)" in content
    assert denials(ran) == [{"tool_name": "Bash", "tool_use_id": "t1", "tool_input": {"command": "rm -rf build"}}]
    assert ran.reason == "completed"


async def test_a_deny_rule_applies_even_in_bypass_permissions_mode() -> None:
    log = ToolLog()
    await run_bash("rm -rf build", log=log, disallowed_tools=["Bash(rm:*)"], permission_mode="bypassPermissions")
    assert log.order == []


async def test_an_allowed_call_runs_without_asking_can_use_tool_and_the_rest_are_asked_with_the_sdks_context() -> None:
    asked = Asked()
    ran = await run_bash("git status", allowed_tools=["Bash(git status)"], can_use_tool=asked)
    assert asked.calls == [] and ran.tool_results()["t1"]["content"] == "ran"
    asked = Asked()
    ran = await run_bash("npm test", allowed_tools=["Bash(git status)"], can_use_tool=asked)
    ((name, tool_input, context),) = asked.calls
    assert (name, tool_input) == ("Bash", {"command": "npm test"})
    assert context.tool_use_id == "t1" and context.agent_id is None


async def test_an_allow_prefix_rule_does_not_allow_a_command_chained_after_it() -> None:
    asked = Asked(Deny(message="no"))
    log = ToolLog()
    await run_bash("git diff && rm -rf /", log=log, allowed_tools=["Bash(git diff:*)"], can_use_tool=asked)
    assert len(asked.calls) == 1 and log.order == []


async def test_a_hooks_allow_does_not_pass_a_deny_rule() -> None:
    async def allows(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        return {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "allow"}}

    log = ToolLog()
    ran = await run_bash(
        "rm -rf build", log=log, disallowed_tools=["Bash(rm *)"], hooks={"PreToolUse": [HookMatcher(hooks=[allows])]}
    )
    assert log.order == [] and len(denials(ran)) == 1


async def test_dont_ask_mode_denies_what_no_rule_allows_without_asking() -> None:
    asked = Asked()
    log = ToolLog()
    ran = await run_bash("make", log=log, permission_mode="dontAsk", can_use_tool=asked)
    assert asked.calls == [] and log.order == []
    assert "no rule allows it" in str(ran.tool_results()["t1"]["content"])


async def test_an_ask_rule_with_no_can_use_tool_to_ask_is_refused() -> None:
    log = ToolLog()
    ran = await run_bash("git push", log=log, settings='{"permissions": {"ask": ["Bash(git push:*)"]}}')
    assert log.order == []
    assert "There is no can_use_tool to ask" in str(ran.tool_results()["t1"]["content"])


async def test_an_ask_rule_asks_can_use_tool_with_the_rule_as_the_reason() -> None:
    asked = Asked()
    await run_bash("git push", settings='{"permissions": {"ask": ["Bash(git push:*)"]}}', can_use_tool=asked)
    ((_, _, context),) = asked.calls
    assert context.decision_reason is not None and "Bash(git push:*)" in context.decision_reason


async def test_a_deny_with_interrupt_ends_the_query_as_an_interrupt_does() -> None:
    asked = Asked(Deny(message="stop everything", interrupt=True))
    ran = await run_bash("make", can_use_tool=asked)
    assert ran.reason == "aborted_tools"
    assert "stop everything" in str(ran.tool_results()["t1"]["content"])
    assert len(ran.model.requests) == 1  # no further model call


async def test_updated_permissions_are_kept_for_the_rest_of_the_session() -> None:
    asked = Asked(
        Allow(
            updated_permissions=[
                PermissionUpdate(type="addRules", rules=[PermissionRuleValue("Bash", "make:*")], behavior="allow")
            ]
        )
    )
    async with Runtime.open() as runtime:
        replies = [tools_reply(tool_use(f"t{i}", "Bash", {"command": "make all"})) for i in range(2)]
        model = ScriptedModel(
            [
                replies[0],
                replies[1],
                text_reply("Done."),
                tools_reply(tool_use("t9", "Bash", {"command": "make"})),
                text_reply("Again."),
            ]
        )
        session = await open_session(runtime, model, tools=[scripted_tool("Bash", result="ran")], can_use_tool=asked)
        first = await consume(session, session.query("build"), model)
        second = await consume(session, session.query("build again"), model)
    assert [call[2].tool_use_id for call in asked.calls] == ["t0"]  # t1 and the next query's t9 were allowed
    assert first.tool_results()["t1"]["content"] == "ran" and second.tool_results()["t9"]["content"] == "ran"


async def test_a_two_argument_can_use_tool_is_still_called_with_two() -> None:
    seen: list[str] = []

    async def older(name: str, tool_input: dict[str, Any]) -> Allow:
        seen.append(name)
        return Allow()

    await run_bash("make", can_use_tool=older)
    assert seen == ["Bash"]


async def test_a_settings_command_hook_exiting_2_denies_the_call(tmp_path: Any) -> None:
    (tmp_path / ".claude").mkdir()
    hook = {"type": "command", "command": "cat >/dev/null; echo 'not on release day' >&2; exit 2"}
    settings = {"hooks": {"PreToolUse": [{"matcher": "Bash", "hooks": [hook]}]}}
    (tmp_path / ".claude" / "settings.json").write_text(__import__("json").dumps(settings))
    log = ToolLog()
    ran = await run_bash("make", log=log, cwd=tmp_path, setting_sources=["project"])
    assert log.order == [] and "not on release day" in str(ran.tool_results()["t1"]["content"])
    log = ToolLog()
    await run_bash("make", log=log, cwd=tmp_path)  # no setting_sources: the project's file is not read
    assert log.order == ["t1"]


async def test_a_hostile_settings_file_ends_the_query_with_an_error_naming_it_and_the_session_goes_on(
    tmp_path: Any,
) -> None:
    (tmp_path / ".claude").mkdir()
    (tmp_path / ".claude" / "settings.json").write_text('{"hooks": {"PreToolUse": [{"hooks": "nope"}]}}')
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Answered.")])
        session = await open_session(runtime, model, cwd=tmp_path, setting_sources=["project"])
        ran = await consume(session, session.query("hi"), model)
        assert ran.reason == "turn_setup_failed" and ran.handle.result is not None
        assert ran.handle.result.is_error and "settings.json" in ran.handle.result.errors[0]
        assert model.requests == []
        (tmp_path / ".claude" / "settings.json").write_text("{}")
        again = await consume(session, session.query("hi again"), model)
        assert again.reason == "completed"


def test_permission_mode_auto_and_a_malformed_rule_are_refused_when_the_options_are_made() -> None:
    with pytest.raises(ValidationError):
        QueryOptions(permission_mode="auto")
    with pytest.raises(ValidationError, match="allowed_tools"):
        QueryOptions(allowed_tools=["Bash(git"])
