"""Host code is contained: a `can_use_tool`, an input validator, a stop or PostToolUse hook, an
attachment source or a memory prefetch that raises or returns the wrong type is a non-blocking error,
as Claude Code treats a failing hook. Permission and validation failures answer the tool call with an
error tool_result; the others are `hook_error` events; either way the query goes on, ends with its one
`result`, and `result.errors` names what failed. Nothing a host passes in can crash the session."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, field_validator

from queryloop import Allow, Deny, HookDecision, Runtime, Tool, ToolContext
from queryloop.runtime.loop.events import SystemMessage
from queryloop.runtime.loop.host_code import (
    HostCodeError,
    checked_attachments,
    checked_hook_decision,
    checked_memory,
    checked_permission,
    input_error_text,
)
from queryloop.runtime.providers.scripted import parse_entry
from tests.helpers import Ran, assert_settled, log_records, run_query, scripted_tool, text_reply, tool_use, tools_reply

ANSWERS: list[Any] = [True, "allow", {"behavior": "allow"}, None, 1]


def hook_errors(ran: Ran) -> list[SystemMessage]:
    return [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]


def result_errors(ran: Ran) -> list[str]:
    assert ran.handle.result is not None
    return ran.handle.result.errors


async def assert_session_still_answers(ran: Ran) -> None:
    """The session survived: a second query on it completes."""
    ran.model.entries.append(parse_entry(text_reply("Still here.")))
    async with ran.session.query("Again") as handle:
        _ = [e async for e in handle]
    assert handle.terminal is not None and handle.terminal.reason == "completed"


# The pure checks, without any actor running.


@pytest.mark.parametrize("value", ANSWERS)
def test_a_permission_answer_that_is_not_allow_or_deny_is_refused_never_taken_as_allow(value: Any) -> None:
    with pytest.raises(HostCodeError, match="not Allow or Deny"):
        checked_permission(value)
    assert checked_permission(Deny(message="no")) == Deny(message="no")


def test_a_hook_answer_must_be_a_hook_decision_or_none() -> None:
    assert checked_hook_decision(None) is None
    assert checked_hook_decision(HookDecision(prevent="x")) == HookDecision(prevent="x")
    for value in ("block", {"prevent": "x"}, True):
        with pytest.raises(HostCodeError, match="not a HookDecision or None"):
            checked_hook_decision(value)


def test_attachments_and_memory_are_checked_for_their_shape() -> None:
    assert checked_attachments([{"type": "note", "content": "x"}]) == [{"type": "note", "content": "x"}]
    for value in ("text", [1], [{"content": "no type"}], None):
        with pytest.raises(HostCodeError):
            checked_attachments(value)
    assert checked_memory("m") == "m" and checked_memory(None) is None
    with pytest.raises(HostCodeError):
        checked_memory(42)


def test_an_input_validator_that_raises_something_else_is_named_as_the_validator() -> None:
    assert input_error_text(TypeError("bad")) == "InputValidationError: the input validator raised TypeError: bad"


# Through whole queries.


async def raising_permission(_: str, __: dict[str, Any]) -> Allow:
    raise RuntimeError("policy server down")


async def test_a_can_use_tool_that_raises_answers_the_call_with_an_error_and_the_tool_does_not_run() -> None:
    ran_tools: list[str] = []

    async def track(_: Any, ctx: ToolContext) -> str:
        ran_tools.append(ctx.tool_use_id)
        return "ran"

    async with Runtime.open() as runtime:
        with log_records() as records:
            ran = await run_query(
                runtime,
                [tools_reply(tool_use("t1", "act")), text_reply()],
                tools=[Tool(name="act", call=track)],
                can_use_tool=raising_permission,
            )
        assert ran.reason == "completed" and ran.handle.result is not None
        assert ran.handle.result.subtype == "success"
        assert ran_tools == []
        block = ran.tool_results()["t1"]
        assert block["is_error"] and "permission check failed: RuntimeError: policy server down" in str(block)
        assert result_errors(ran) == ["can_use_tool failed for act (t1): RuntimeError: policy server down"]
        assert any(r["level"] == "WARNING" and r["exception"] is not None for r in records)
        await assert_settled(ran)
        await assert_session_still_answers(ran)


@pytest.mark.parametrize("answer", ANSWERS)
async def test_a_can_use_tool_that_returns_the_wrong_type_denies_the_call(answer: Any) -> None:
    async def sloppy(_: str, __: dict[str, Any]) -> Any:
        return answer

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "act")), text_reply()],
            tools=[scripted_tool("act", result="ran")],
            can_use_tool=sloppy,
        )
        assert ran.reason == "completed"
        block = ran.tool_results()["t1"]
        assert block["is_error"] and "ran" not in str(block["content"])
        assert len(result_errors(ran)) == 1 and "not Allow or Deny" in result_errors(ran)[0]
        await assert_settled(ran)


class Strict(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def _odd(cls, value: int) -> int:
        if value % 2 == 0:
            raise TypeError("even numbers are not handled")  # a host bug: not a ValueError
        return value


async def act(args: Strict, _: ToolContext) -> str:
    return str(args.n)


async def test_an_input_validator_that_raises_type_error_is_an_error_result_not_a_crash() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "act", {"n": 2}), tool_use("t2", "act", {"n": 3})), text_reply()],
            tools=[Tool(name="act", call=act, input_model=Strict)],
        )
        assert ran.reason == "completed"
        results = ran.tool_results()
        assert results["t1"]["is_error"] and "InputValidationError" in str(results["t1"]["content"])
        assert not results["t2"].get("is_error") and results["t2"]["content"] == "3"
        assert result_errors(ran) == ["input validator of act (t1) failed: TypeError: even numbers are not handled"]
        await assert_settled(ran)


async def test_a_model_input_that_fails_validation_is_the_models_mistake_not_a_host_error() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "act", {"n": "x"})), text_reply()],
            tools=[Tool(name="act", call=act, input_model=Strict)],
        )
        assert ran.tool_results()["t1"]["is_error"]
        assert result_errors(ran) == []
        await assert_settled(ran)


@pytest.mark.parametrize("answer", ["block", {"prevent": "stop"}, 0])
async def test_a_stop_hook_that_returns_the_wrong_type_is_a_hook_error_and_the_query_ends(answer: Any) -> None:
    async def sloppy(_: Any) -> Any:
        return answer

    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply("Done.")], stop_hooks=[sloppy])
        assert ran.reason == "completed"
        (event,) = hook_errors(ran)
        assert event.data["hook_event"] == "Stop" and "not a HookDecision or None" in event.data["error"]
        assert result_errors(ran) == [event.content]
        await assert_settled(ran)


async def test_a_post_tool_use_hook_that_returns_the_wrong_type_is_a_hook_error() -> None:
    async def sloppy(_: Any) -> Any:
        return {"prevent": "stop"}

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "read")), text_reply()],
            tools=[scripted_tool("read")],
            post_tool_use_hooks=[sloppy],
        )
        assert ran.reason == "completed"  # not prevented: the answer was not a decision
        (event,) = hook_errors(ran)
        assert event.data["hook_event"] == "PostToolUse" and event.data["tool_use_id"] == "t1"
        assert result_errors(ran) == [event.content]
        await assert_settled(ran)


class _WrongSource:
    async def collect(self) -> Any:
        return "not a list"


async def test_an_attachment_source_that_returns_the_wrong_type_is_a_hook_error() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "read")), text_reply()],
            tools=[scripted_tool("read")],
            attachment_sources=[_WrongSource()],
        )
        assert ran.reason == "completed"
        (event,) = hook_errors(ran)
        assert event.data["hook_event"] == "AttachmentSource" and "not a list" in event.data["error"]
        assert result_errors(ran) == [event.content]
        await assert_settled(ran)


@pytest.mark.parametrize("outcome", ["raises", "wrong type"])
async def test_a_memory_prefetch_that_fails_is_a_hook_error_and_the_query_goes_on(outcome: str) -> None:
    async def prefetch(_: Any) -> Any:
        if outcome == "raises":
            raise OSError("memory store offline")
        return 42

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [tools_reply(tool_use("t1", "read")), text_reply()],
            tools=[scripted_tool("read")],
            memory_prefetch=prefetch,
        )
        assert ran.reason == "completed"
        (text,) = result_errors(ran)
        assert text.startswith("MemoryPrefetch hook")
        assert [e.content for e in hook_errors(ran)] == [text]
        await assert_settled(ran)


async def test_a_tool_exception_is_logged_at_warning_with_its_traceback() -> None:
    async def crash(_: Any, __: ToolContext) -> str:
        raise RuntimeError("disk on fire")

    async with Runtime.open() as runtime:
        with log_records() as records:
            ran = await run_query(
                runtime,
                [tools_reply(tool_use("t1", "crash"), tool_use("t2", "report")), text_reply()],
                tools=[Tool(name="crash", call=crash), scripted_tool("report", raises="no such file")],
            )
        assert ran.tool_results()["t1"]["is_error"] and ran.tool_results()["t2"]["is_error"]
        (crashed,) = [r for r in records if "crash" in r["message"]]
        assert crashed["level"] == "WARNING" and crashed["exception"] is not None
        assert "RuntimeError: disk on fire" in crashed["message"]
        # A `ToolError` is the tool's own report of a failure: logged, without a traceback.
        (reported,) = [r for r in records if "report" in r["message"]]
        assert reported["level"] == "WARNING" and reported["exception"] is None
        await assert_settled(ran)
