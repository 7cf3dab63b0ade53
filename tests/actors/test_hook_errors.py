"""Hook errors: a stop hook or a PostToolUse hook that raises is reported (a `system` event of subtype
`hook_error` and its text in `result.errors`), the loop goes on as if it had passed, and the model never
sees it. Also: an attachment source that raises is skipped, never the session's end.
"""

from __future__ import annotations

import json
from typing import Any

from queryloop import Runtime
from queryloop.runtime.loop.events import AttachmentMessage, SystemMessage, UserMessage
from queryloop.runtime.loop.hooks import HookDecision, PostToolUseInput, StopHookInput
from tests.helpers import Ran, assert_settled, run_query, scripted_tool, text_reply, tool_use, tools_reply


def hook_errors(ran: Ran) -> list[SystemMessage]:
    return [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]


def request_text(ran: Ran, index: int) -> str:
    request = ran.model.requests[index]
    return json.dumps([request.system, request.messages])


async def failing_stop_hook(_: StopHookInput) -> HookDecision | None:
    raise ValueError("lint server unreachable")


async def failing_post_hook(_: PostToolUseInput) -> HookDecision | None:
    raise RuntimeError("audit log full")


async def test_stop_hook_exception_is_reported_as_system_event_and_in_result_errors() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply("Done.")], stop_hooks=[failing_stop_hook])
        assert ran.reason == "completed"  # as if the hook had returned None
        (event,) = hook_errors(ran)
        name = failing_stop_hook.__qualname__
        assert event.data == {"hook_event": "Stop", "hook_name": name, "error": "ValueError: lint server unreachable"}
        assert event.content == f"Stop hook {name} failed: ValueError: lint server unreachable"
        assert ran.labels[-2:] == ["system:hook_error", "result"]
        result = ran.handle.result
        assert result is not None
        assert (result.subtype, result.is_error, result.result) == ("success", False, "Done.")  # non-blocking
        assert result.errors == [event.content]
        assert event in await ran.session.transcript()  # a transcript message, for the user
        await assert_settled(ran)


async def test_a_failing_stop_hook_leaves_the_other_hooks_decisions_and_is_never_sent_to_the_model() -> None:
    async def blocks_once(hook_input: StopHookInput) -> HookDecision | None:
        return None if hook_input.stop_hook_active else HookDecision(blocking_error="tests fail")

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime, [text_reply("Done."), text_reply("Fixed.")], stop_hooks=[failing_stop_hook, blocks_once]
        )
        assert ran.reason == "completed" and ran.handle.transitions == ["stop_hook_blocking"]
        events = hook_errors(ran)
        assert len(events) == 2  # the hook ran (and failed) at each of the two stops
        sent = request_text(ran, 1)
        assert "Stop hook feedback:\\ntests fail" in sent
        assert "lint server unreachable" not in sent and "hook_error" not in sent
        assert ran.labels.index("system:hook_error") < ran.labels.index("user")  # before the feedback
        result = ran.handle.result
        assert result is not None and result.subtype == "success"
        assert result.errors == [e.content for e in events]
        await assert_settled(ran)


async def test_a_stop_hook_error_does_not_hide_a_prevent_and_follows_its_reason_in_errors() -> None:
    async def prevents(_: StopHookInput) -> HookDecision:
        return HookDecision(prevent="policy says stop")

    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply()], stop_hooks=[failing_stop_hook, prevents])
        assert ran.reason == "stop_hook_prevented"
        (event,) = hook_errors(ran)
        result = ran.handle.result
        assert result is not None
        assert result.errors == ["policy says stop", event.content]
        await assert_settled(ran)


async def test_post_tool_use_hook_exception_is_reported_after_its_tool_result_and_in_result_errors() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "write", {"path": "a"})), text_reply("Written.")],
            tools=[scripted_tool("write", result="wrote a")],
            post_tool_use_hooks=[failing_post_hook],
        )
        assert ran.reason == "completed" and ran.handle.transitions == ["next_turn"]  # the loop went on
        (event,) = hook_errors(ran)
        name = failing_post_hook.__qualname__
        assert event.data == {
            "hook_event": "PostToolUse",
            "hook_name": name,
            "error": "RuntimeError: audit log full",
            "tool_name": "write",
            "tool_use_id": "t1",
        }
        assert event.content == f"PostToolUse hook {name} failed for write (t1): RuntimeError: audit log full"
        # In production order: the tool's result, then its hook's error.
        tool_result = next(e for e in ran.events if isinstance(e, UserMessage))
        assert ran.events.index(event) == ran.events.index(tool_result) + 1
        assert ran.tool_results()["t1"]["content"] == "wrote a"
        sent = request_text(ran, 1)
        assert "wrote a" in sent and "audit log full" not in sent and "hook_error" not in sent
        result = ran.handle.result
        assert result is not None
        assert (result.subtype, result.is_error) == ("success", False)
        assert result.errors == [event.content]
        conversation = await ran.session.transcript()
        assert conversation.index(event) == conversation.index(tool_result) + 1
        await assert_settled(ran)


async def test_a_post_tool_use_hook_error_does_not_hide_another_hooks_prevent() -> None:
    async def prevents(_: PostToolUseInput) -> HookDecision:
        return HookDecision(prevent="policy")

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "write"), tool_use("t2", "write")), text_reply("unused")],
            tools=[scripted_tool("write")],
            post_tool_use_hooks=[failing_post_hook, prevents],
        )
        assert ran.reason == "hook_stopped"
        errors = hook_errors(ran)
        assert [e.data["tool_use_id"] for e in errors] == ["t1", "t2"]
        after_results = [
            e.label if not isinstance(e, AttachmentMessage) else e.attachment["type"]
            for e in ran.events
            if isinstance(e, UserMessage | SystemMessage | AttachmentMessage)
        ]
        assert after_results == [
            "system:init",
            "user",
            "system:hook_error",
            "hook_stopped_continuation",
            "user",
            "system:hook_error",
            "hook_stopped_continuation",
        ]
        result = ran.handle.result
        assert result is not None and result.errors == [e.content for e in errors]
        assert len(ran.model.requests) == 1
        await assert_settled(ran)


async def test_queries_without_failing_hooks_report_no_errors() -> None:
    async def passes(_: PostToolUseInput) -> None:
        return None

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "read")), text_reply()],
            tools=[scripted_tool("read")],
            post_tool_use_hooks=[passes],
        )
        assert hook_errors(ran) == []
        assert ran.handle.result is not None and ran.handle.result.errors == []
        await assert_settled(ran)


def test_hook_error_message_names_a_callable_objects_class_and_an_error_without_text_by_its_type() -> None:
    from queryloop.runtime.loop.hooks import hook_error_message

    class Auditor:
        async def __call__(self, _: PostToolUseInput) -> None:
            raise KeyError

    message = hook_error_message("PostToolUse", Auditor(), KeyError(), tool_name="write", tool_use_id="t9")
    assert message.data["hook_name"] == Auditor.__qualname__
    assert message.data["error"] == "KeyError"
    assert message.content == f"PostToolUse hook {Auditor.__qualname__} failed for write (t9): KeyError"


class _FailingSource:
    async def collect(self) -> list[dict[str, Any]]:
        raise OSError("watcher died")


class _Source:
    async def collect(self) -> list[dict[str, Any]]:
        return [{"type": "queued_message", "content": "also update the docs"}]


async def test_an_attachment_source_that_raises_is_skipped_and_the_query_goes_on() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t", "read")), text_reply()],
            tools=[scripted_tool("read")],
            attachment_sources=[_FailingSource(), _Source()],
        )
        assert ran.reason == "completed"
        assert "also update the docs" in request_text(ran, 1)  # the other source still counts
        await assert_settled(ran)
