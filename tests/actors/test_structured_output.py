"""Structured output (`QueryOptions.output_type`): the answer through the `StructuredOutput` tool, on real actors."""

from __future__ import annotations

import asyncio
from typing import Any

import pydantic
import pytest

from queryloop import ResultMessage, Runtime
from queryloop.actors.query_loop.subagent import child_options
from queryloop.aio import AsyncioRuntime
from queryloop.runtime.host.aio_bridge import Mode
from queryloop.runtime.loop.agents import AgentDefinition
from queryloop.runtime.loop.events import SystemMessage
from queryloop.runtime.loop.hooks import STOP_HOOK_BLOCK_CAP, HookDecision, StopHookInput
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.structured_output import (
    ENFORCEMENT_TEXT,
    STRUCTURED_OUTPUT_ACCEPTED,
    STRUCTURED_OUTPUT_TOOL,
    StructuredAnswer,
    attempts_exhausted,
    exhausted_text,
)
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import (
    assert_settled,
    consume,
    open_session,
    run_query,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)


class City(pydantic.BaseModel):
    name: str
    population: int


PARIS: dict[str, Any] = {"name": "Paris", "population": 2_100_000}
LYON: dict[str, Any] = {"name": "Lyon", "population": 520_000}


def answer(tool_id: str, tool_input: dict[str, Any]) -> dict[str, Any]:
    return tools_reply(tool_use(tool_id, STRUCTURED_OUTPUT_TOOL, tool_input))


def test_structured_output_attempts_are_exhausted_at_the_cap() -> None:
    assert [attempts_exhausted(failures, 5) for failures in range(7)] == [False] * 5 + [True, True]
    assert exhausted_text(5) == "Failed to provide valid structured output after 5 attempts"


def test_structured_output_batch_counts_each_call_without_an_answer_and_keeps_the_last_valid_one() -> None:
    structured = StructuredAnswer(City)
    structured.answers["s2"] = City(**PARIS)
    structured.answers["s4"] = City(**LYON)
    uses = [tool_use("s1", STRUCTURED_OUTPUT_TOOL), tool_use("s2", STRUCTURED_OUTPUT_TOOL), tool_use("r", "read")]
    assert structured.settle_batch([*uses, tool_use("s4", STRUCTURED_OUTPUT_TOOL)]) == City(**LYON)
    assert structured.failures == 1  # s1: its input was refused


def test_structured_output_tool_name_is_reserved_when_an_output_type_is_given() -> None:
    clash = scripted_tool(STRUCTURED_OUTPUT_TOOL)
    assert QueryOptions(tools=[clash]).output_type is None  # no output_type: the name is free
    with pytest.raises(pydantic.ValidationError, match="structured output tool"):
        QueryOptions(tools=[clash], output_type=City)


def test_structured_output_is_not_inherited_by_subagents() -> None:
    parent = QueryOptions(output_type=City, agents={"helper": AgentDefinition(description="d", prompt="p")})
    assert child_options(parent, parent.agents["helper"]).output_type is None


async def test_structured_output_valid_call_ends_the_query_with_the_answer() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [answer("s1", PARIS), text_reply("never asked for")], output_type=City)
        assert len(ran.model.requests) == 1
        (schema,) = [t for t in ran.model.requests[0].tools if t["name"] == STRUCTURED_OUTPUT_TOOL]
        assert schema["input_schema"]["required"] == ["name", "population"]
        assert ran.reason == "completed"
        result = ran.handle.result
        assert result is not None and result.subtype == "success" and not result.is_error
        assert result.structured_output == PARIS
        assert City.model_validate(result.structured_output) == City(**PARIS)
        assert ran.tool_results()["s1"]["content"] == STRUCTURED_OUTPUT_ACCEPTED
        await assert_settled(ran)


async def test_structured_output_invalid_call_is_an_error_result_and_the_model_tries_again() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [answer("s1", {"name": "Paris"}), answer("s2", PARIS)], output_type=City)
        refused = ran.tool_results()["s1"]
        assert refused["is_error"] is True and "population" in str(refused["content"])
        assert ran.handle.transitions == ["next_turn"]
        assert ran.handle.result is not None and ran.handle.result.structured_output == PARIS
        await assert_settled(ran)


async def test_structured_output_final_response_without_the_answer_is_sent_back_with_the_demand() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply("Paris, I think."), answer("s1", PARIS)], output_type=City)
        assert ran.handle.transitions == ["stop_hook_blocking"]
        demand = ran.model.requests[1].messages[-1]["content"]
        assert demand[-1]["text"] == ENFORCEMENT_TEXT
        assert ran.reason == "completed"
        assert ran.handle.result is not None and ran.handle.result.structured_output == PARIS
        await assert_settled(ran)


async def test_structured_output_attempts_exhausted_end_with_error_max_structured_output_retries() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [text_reply("no"), answer("s1", {"name": 3}), text_reply("still no"), answer("s2", PARIS)],
            output_type=City,
            max_structured_output_retries=3,
        )
        assert len(ran.model.requests) == 3
        assert ran.reason == "max_structured_output_retries"
        result = ran.handle.result
        assert result is not None and result.subtype == "error_max_structured_output_retries" and result.is_error
        assert result.errors == [exhausted_text(3)]
        assert result.structured_output is None
        await assert_settled(ran)


async def test_structured_output_allows_five_failed_attempts_by_default() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply(f"no {n}") for n in range(7)], output_type=City)
        assert len(ran.model.requests) == 5
        assert ran.handle.transitions == ["stop_hook_blocking"] * 4
        assert ran.handle.result is not None and ran.handle.result.errors == [exhausted_text(5)]
        await assert_settled(ran)


async def test_structured_output_batch_runs_its_other_tools_and_the_last_valid_answer_wins() -> None:
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [
                tools_reply(
                    tool_use("r", "read"),
                    tool_use("s1", STRUCTURED_OUTPUT_TOOL, PARIS),
                    tool_use("s2", STRUCTURED_OUTPUT_TOOL, LYON),
                )
            ],
            tools=[scripted_tool("read", result="file text", safe=True)],
            output_type=City,
        )
        assert ran.tool_results()["r"]["content"] == "file text"
        assert ran.handle.result is not None and ran.handle.result.structured_output == LYON
        await assert_settled(ran)


async def test_structured_output_failures_are_counted_per_query() -> None:
    scripted = ScriptedModel([text_reply("no"), answer("s1", PARIS), text_reply("no"), answer("s2", LYON)])
    async with Runtime.open() as runtime:
        session = await open_session(runtime, scripted, output_type=City, max_structured_output_retries=2)
        first = await consume(session, session.query("Which city?"), scripted)
        second = await consume(session, session.query("And the next one?"), scripted)
        # One failed attempt each: a count kept across queries would have ended the second at its first.
        for ran, city in ((first, PARIS), (second, LYON)):
            assert ran.reason == "completed"
            assert ran.handle.result is not None and ran.handle.result.structured_output == city
        # The first query ended on its tool result: the next prompt joins it in one valid user message.
        joined = scripted.requests[2].messages[-1]
        assert joined["role"] == "user"
        assert [b["type"] for b in joined["content"]] == ["tool_result", "text"]
        await assert_settled(second)


async def test_structured_output_is_still_demanded_when_the_stop_hook_block_cap_overrides_a_hook() -> None:
    async def always_blocks(_: StopHookInput) -> HookDecision:
        return HookDecision(blocking_error="tests fail")

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [text_reply("done"), text_reply("done again"), answer("s1", PARIS)],
            output_type=City,
            stop_hooks=[always_blocks],
            stop_hook_block_cap=1,
        )
        assert ran.handle.transitions == ["stop_hook_blocking", "stop_hook_blocking"]
        assert ran.model.requests[2].messages[-1]["content"][-1]["text"] == ENFORCEMENT_TEXT
        assert ran.reason == "completed"
        result = ran.handle.result
        assert result is not None and result.structured_output == PARIS
        notices = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == STOP_HOOK_BLOCK_CAP]
        assert len(notices) == 1 and result.errors == [notices[0].content]
        await assert_settled(ran)


@pytest.mark.parametrize("mode", ["guest", "thread"])
def test_structured_output_reaches_an_asyncio_host(mode: Mode) -> None:
    async def main() -> ResultMessage:
        async with AsyncioRuntime.open(mode=mode) as rt:
            model = ScriptedModel([answer("s1", {"name": "Paris"}), answer("s2", PARIS)])
            session = await rt.open_session(QueryOptions(provider=model, output_type=City))
            query = session.query("Which city?")
            async with query:
                async for _ in query:
                    pass
            return await query.wait()

    result = asyncio.run(main())
    assert result.subtype == "success" and result.structured_output == PARIS
