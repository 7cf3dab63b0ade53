"""Prompt-cache writes priced by their lifetime: five minutes (1.25 times the input price) or one hour (twice).

The API reports every cache write in `cache_creation_input_tokens` and, in its `cache_creation` breakdown,
how many of them went to the one-hour cache (api-facts §5). These tests hold the runtime to that from the
pure cost function through the stream's assembler to a whole query over the real SDK and a local server.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import trio
from pydantic import ValidationError

from queryloop import QueryOptions, Runtime
from queryloop.actors.budget_guard import cost_usd
from queryloop.runtime.cli.scenario import load_scenario, run_scenario
from queryloop.runtime.loop.events import Usage, usage_of
from queryloop.runtime.loop.pricing import Pricing, pricing_for
from queryloop.runtime.loop.stream import ResponseAssembler, usage_from
from queryloop.runtime.providers.anthropic_model import AnthropicModel
from queryloop.runtime.providers.local_api import LocalMessagesAPI
from queryloop.runtime.providers.scripted import ScriptedReply, ScriptedUsage, reply_events
from tests.helpers import text_reply

PRICE = Pricing(input=2.0, output=10.0, cache_write=2.5, cache_read=0.2)


def test_one_hour_cache_writes_are_priced_at_twice_the_input_price_and_the_rest_at_the_five_minute_rate() -> None:
    usage = Usage(
        input_tokens=100,
        output_tokens=10,
        cache_creation_input_tokens=3_000,
        cache_read_input_tokens=500,
        cache_creation_1h_input_tokens=1_000,
    )
    expected = 100 * 2.0 + 10 * 10.0 + 2_000 * 2.5 + 1_000 * 4.0 + 500 * 0.2
    assert cost_usd(usage, PRICE) == pytest.approx(expected / 1_000_000)
    # Without one-hour writes the cost is what it always was.
    five_minutes = usage_of(100, 10, 3_000, 500)
    assert cost_usd(five_minutes, PRICE) == pytest.approx((200 + 100 + 3_000 * 2.5 + 100) / 1_000_000)
    # A price that names its one-hour rate is taken at its word.
    named = PRICE.model_copy(update={"cache_write_1h": 5.0})
    assert cost_usd(usage, named) == pytest.approx((expected - 1_000 * 4.0 + 1_000 * 5.0) / 1_000_000)


def test_every_listed_model_prices_a_one_hour_write_at_twice_its_input() -> None:
    for model in ("claude-opus-5-5", "claude-sonnet-5-5", "claude-haiku-5-5", "claude-fable-5-1"):
        price = pricing_for(model)
        assert price.one_hour_cache_write == pytest.approx(2 * price.input)
        assert price.one_hour_cache_write > price.cache_write


def test_usages_add_their_one_hour_cache_writes() -> None:
    first = Usage(cache_creation_input_tokens=50, cache_creation_1h_input_tokens=20)
    second = Usage(input_tokens=3, cache_creation_input_tokens=40, cache_creation_1h_input_tokens=5)
    assert first + second == Usage(input_tokens=3, cache_creation_input_tokens=90, cache_creation_1h_input_tokens=25)
    assert (usage_of(1, 2, 3, 4) + usage_of(1, 1, 1, 1)).cache_creation_1h_input_tokens == 0


def _reply(usage: ScriptedUsage) -> list[dict[str, Any]]:
    reply = ScriptedReply(content=[{"type": "text", "text": "hi"}], usage=usage)
    return reply_events(reply, model="claude-sonnet-5-5", message_id="msg_1", input_tokens=1)


def test_the_assembler_reads_one_hour_cache_writes_from_the_usage_breakdown() -> None:
    events = _reply(ScriptedUsage(input_tokens=9, cache_creation_input_tokens=700, cache_creation_1h_input_tokens=600))
    assert events[0]["message"]["usage"]["cache_creation"] == {
        "ephemeral_5m_input_tokens": 100,
        "ephemeral_1h_input_tokens": 600,
    }
    assembler = ResponseAssembler()
    for event in events:
        assembler.feed(event)
    assert assembler.usage.cache_creation_input_tokens == 700
    assert assembler.usage.cache_creation_1h_input_tokens == 600
    # The usage of a call cut short is read the same way.
    assert usage_from(events[0]["message"]["usage"], Usage()).cache_creation_1h_input_tokens == 600
    # A breakdown that says nothing of the one-hour cache, or is not an object, counts none.
    for breakdown in ({"ephemeral_5m_input_tokens": 7}, None, "odd"):
        start = {"input_tokens": 1, "cache_creation_input_tokens": 7, "cache_creation": breakdown}
        assert usage_from(start, Usage()).cache_creation_1h_input_tokens == 0


def test_a_scripted_usage_refuses_more_one_hour_writes_than_cache_writes() -> None:
    with pytest.raises(ValidationError, match="cannot exceed"):
        ScriptedUsage(cache_creation_input_tokens=10, cache_creation_1h_input_tokens=11)


def test_a_cache_ttl_other_than_five_minutes_or_one_hour_is_refused() -> None:
    with pytest.raises(ValueError, match="cache_ttl must be '5m' or '1h', not '2h'"):
        AnthropicModel(api_key="sk-local-test", cache_ttl="2h")  # type: ignore[arg-type]


async def test_a_one_hour_cache_is_asked_for_on_the_wire_and_its_writes_are_priced_at_the_one_hour_rate() -> None:
    written = {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_creation_input_tokens": 2_000,
        "cache_creation_1h_input_tokens": 2_000,
    }
    with trio.fail_after(15):
        async with LocalMessagesAPI([text_reply("Cached for an hour.", usage=written)]) as api:
            model = AnthropicModel(api_key="sk-local-test", base_url=api.base_url, cache_ttl="1h")
            try:
                async with Runtime.open() as rt:
                    session = await rt.open_session(QueryOptions(provider=model))
                    result = await session.query("hi").wait()
            finally:
                await model.aclose()
                gc.collect()
        assert api.requests[0].body["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert result.result == "Cached for an hour."
    assert result.usage.cache_creation_1h_input_tokens == 2_000
    price = pricing_for("claude-sonnet-5-5")
    spent = 10 * price.input + 5 * price.output + 2_000 * price.one_hour_cache_write
    assert result.total_cost_usd == pytest.approx(spent / 1_000_000)
    assert result.total_cost_usd > (10 * price.input + 5 * price.output + 2_000 * price.cache_write) / 1_000_000


async def test_a_scenario_verdict_names_one_hour_cache_writes_only_when_there_were_some() -> None:
    def scenario(usage: dict[str, int]) -> dict[str, Any]:
        return {
            "options": {"model": "claude-sonnet-5-5"},
            "prompt": "hi",
            "model": [{"content": [{"type": "text", "text": "ok"}], "usage": usage}],
        }

    plain = await run_scenario(load_scenario(scenario({"input_tokens": 5, "output_tokens": 1})))
    assert set(plain["result"]["usage"]) == {
        "input_tokens",
        "output_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
    }
    hour = {
        "input_tokens": 5,
        "output_tokens": 1,
        "cache_creation_input_tokens": 9,
        "cache_creation_1h_input_tokens": 4,
    }
    cached = await run_scenario(load_scenario(scenario(hour)))
    assert cached["result"]["usage"]["cache_creation_1h_input_tokens"] == 4
    assert cached["result"]["total_cost_usd"] > plain["result"]["total_cost_usd"]
