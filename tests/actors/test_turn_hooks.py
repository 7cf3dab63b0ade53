"""The hooks that decide a query's turns, in the Agent SDK's shape, run by real scripted queries:
UserPromptSubmit (block erases the prompt, additionalContext reaches the model), Stop (block and
additionalContext send the model back, under the block cap; continue: false prevents), PermissionRequest
(answers in the host's stead) and Notification (told when a permission is about to be asked).
"""

from __future__ import annotations

from typing import Any

from queryloop import Allow, HookContext, HookInput, HookJSONOutput, HookMatcher, Runtime, ToolPermissionContext
from queryloop.runtime.loop.events import AttachmentMessage, SystemMessage, UserMessage
from tests.helpers import Ran, assert_settled, run_query, scripted_tool, text_reply, tool_use, tools_reply


class Seen:
    """A hook recording each `input_data` it is given, answering each time with the next of `answers`."""

    def __init__(self, *answers: HookJSONOutput) -> None:
        self.inputs: list[dict[str, Any]] = []
        self.answers = list(answers)

    async def __call__(self, input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        self.inputs.append(dict(input_data))
        return self.answers.pop(0) if self.answers else {}


async def run(replies: list[dict[str, Any]], **options: Any) -> Ran:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, replies, prompt="Ship it", **options)
        await assert_settled(ran)
        return ran


def on(event: str, hook: Any, matcher: str | None = None) -> dict[str, Any]:
    return {event: [HookMatcher(matcher=matcher, hooks=[hook])]}


async def test_user_prompt_submit_gets_the_prompt_and_its_context_reaches_the_model() -> None:
    hook = Seen({"hookSpecificOutput": {"hookEventName": "UserPromptSubmit", "additionalContext": "branch: main"}})
    ran = await run([text_reply("Shipped.")], hooks=on("UserPromptSubmit", hook))
    ((data,),) = [hook.inputs]
    assert data["hook_event_name"] == "UserPromptSubmit" and data["prompt"] == "Ship it"
    sent = str(ran.model.requests[0].messages)
    assert "Ship it" in sent and "UserPromptSubmit hook additional context: branch: main" in sent
    assert ran.reason == "completed"


async def test_a_blocked_prompt_is_erased_and_the_query_ends_without_a_model_call() -> None:
    hook = Seen({"decision": "block", "reason": "no shipping on Fridays"})
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply("Shipped.")], prompt="Ship it", hooks=on("UserPromptSubmit", hook))
        conversation = await ran.session.transcript()
    assert ran.model.requests == []
    assert ran.reason == "hook_stopped" and ran.handle.result is not None
    assert "no shipping on Fridays" in ran.handle.result.errors[0]
    assert not any(isinstance(m, UserMessage) and m.content == "Ship it" for m in conversation)


async def test_a_stop_hooks_block_sends_the_model_back_and_stop_hook_active_says_so_next_time() -> None:
    hook = Seen({"decision": "block", "reason": "run the tests first"}, {})
    ran = await run([text_reply("Done."), text_reply("Tests pass.")], hooks=on("Stop", hook))
    assert [d["stop_hook_active"] for d in hook.inputs] == [False, True]
    assert hook.inputs[0]["last_assistant_message"] == "Done."
    assert "run the tests first" in str(ran.model.requests[1].messages)
    assert ran.handle.result is not None and ran.handle.result.result == "Tests pass."


async def test_a_stop_hooks_continue_false_prevents_the_query_from_going_on() -> None:
    hook = Seen({"continue_": False, "stopReason": "budget review"})
    ran = await run([text_reply("Done.")], hooks=on("Stop", hook))
    assert ran.reason == "stop_hook_prevented" and ran.handle.terminal is not None
    assert ran.handle.terminal.error == "budget review"


async def test_stop_hooks_that_always_block_are_overridden_at_the_cap() -> None:
    block: HookJSONOutput = {"decision": "block", "reason": "again"}
    hook = Seen(*[block] * 5)
    ran = await run([text_reply(f"Try {i}.") for i in range(4)], hooks=on("Stop", hook), stop_hook_block_cap=2)
    assert len(hook.inputs) == 3 and ran.reason == "completed"
    notices = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "stop_hook_block_cap"]
    assert len(notices) == 1


async def test_a_stop_hook_that_raises_is_a_hook_error_and_the_turn_ends() -> None:
    async def broken(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        raise RuntimeError("linter missing")

    ran = await run([text_reply("Done.")], hooks=on("Stop", broken))
    errors = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]
    assert [e.data["hook_event"] for e in errors] == ["Stop"] and ran.reason == "completed"


async def test_permission_request_hooks_answer_in_the_hosts_stead_and_notification_hooks_are_told() -> None:
    asked: list[str] = []

    async def host(name: str, tool_input: dict[str, Any], context: ToolPermissionContext) -> Allow:
        asked.append(name)
        return Allow()

    request = Seen(
        {
            "hookSpecificOutput": {
                "hookEventName": "PermissionRequest",
                "decision": {"behavior": "deny", "message": "not without review"},
            }
        }
    )
    notified = Seen()
    ran = await run(
        [tools_reply(tool_use("t1", "write", {"path": "a"})), text_reply("Answered.")],
        tools=[scripted_tool("write", result="wrote")],
        can_use_tool=host,
        hooks={**on("PermissionRequest", request, "write"), **on("Notification", notified)},
    )
    assert asked == []  # the hook answered
    assert "not without review" in str(ran.tool_results()["t1"]["content"])
    ((data,),) = [request.inputs]
    assert data["tool_name"] == "write" and data["tool_input"] == {"path": "a"}
    ((note,),) = [notified.inputs]
    assert note["notification_type"] == "permission_prompt" and "write" in note["message"]
    assert ran.handle.result is not None and len(ran.handle.result.permission_denials) == 1


async def test_without_a_permission_request_answer_can_use_tool_is_asked() -> None:
    asked: list[str] = []

    async def host(name: str, tool_input: dict[str, Any], context: ToolPermissionContext) -> Allow:
        asked.append(context.tool_use_id or "")
        return Allow()

    ran = await run(
        [tools_reply(tool_use("t1", "write")), text_reply("Answered.")],
        tools=[scripted_tool("write", result="wrote")],
        can_use_tool=host,
        hooks=on("PermissionRequest", Seen()),
    )
    assert asked == ["t1"] and ran.tool_results()["t1"]["content"] == "wrote"
    assert not any(isinstance(e, AttachmentMessage) for e in ran.events)
