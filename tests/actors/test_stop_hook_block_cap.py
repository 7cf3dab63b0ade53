"""The stop-hook block cap: Claude Code's bound on a stop hook that blocks every stop.

The rule is a pure function (`stop_hook_block_capped`), the counter a field of `State` that the
continue sites keep, and the loop's ending at the cap is checked on real actors.
"""

from __future__ import annotations

from collections.abc import Callable

import pydantic
import pytest

from queryloop import Runtime
from queryloop.runtime.loop.decisions import stop_hook_block_capped
from queryloop.runtime.loop.events import SystemMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.hooks import STOP_HOOK_BLOCK_CAP, HookDecision, StopHookInput
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.state import (
    State,
    collapse_drain_retry,
    initial_state,
    max_output_tokens_escalate,
    max_output_tokens_recovery,
    next_turn,
    pause_turn_continuation,
    reactive_compact_retry,
    stop_hook_blocking,
    token_budget_continuation,
)
from tests.helpers import assert_settled, run_query, scripted_tool, text_reply, tool_use, tools_reply


def test_stop_hook_block_cap_honours_cap_blocks_in_a_row_then_overrides_the_next() -> None:
    assert [stop_hook_block_capped(blocks, 8) for blocks in range(10)] == [False] * 8 + [True, True]
    assert not stop_hook_block_capped(0, 1) and stop_hook_block_capped(1, 1)


def test_stop_hook_block_cap_of_zero_is_no_cap() -> None:
    assert not any(stop_hook_block_capped(blocks, 0) for blocks in (0, 1, 8, 10_000))


def test_stop_hook_block_cap_option_defaults_to_claude_codes_eight_and_refuses_a_negative() -> None:
    assert QueryOptions().stop_hook_block_cap == 8
    with pytest.raises(pydantic.ValidationError, match="stop_hook_block_cap"):
        QueryOptions(stop_hook_block_cap=-1)


# Every other continue site, applied with fixed inputs.
_MESSAGES: list[TranscriptMessage] = [UserMessage(content="prompt")]
_NUDGE = UserMessage(content="go on", is_meta=True)
OTHER_SITES: dict[str, Callable[[State], State]] = {
    "next_turn": lambda s: next_turn(s, _MESSAGES),
    "max_output_tokens_escalate": lambda s: max_output_tokens_escalate(s, _MESSAGES, 64_000),
    "max_output_tokens_recovery": lambda s: max_output_tokens_recovery(s, _MESSAGES, [], _NUDGE),
    "token_budget_continuation": lambda s: token_budget_continuation(s, _MESSAGES, [], _NUDGE),
    "reactive_compact_retry": lambda s: reactive_compact_retry(s, _MESSAGES),
    "collapse_drain_retry": lambda s: collapse_drain_retry(s, _MESSAGES, 1),
    "pause_turn_continuation": lambda s: pause_turn_continuation(s, _MESSAGES, []),
}


def test_stop_hook_blocking_counts_the_blocks_in_a_row() -> None:
    state = initial_state(list(_MESSAGES))
    assert state.stop_hook_blocks == 0
    for expected in (1, 2, 3):
        state = stop_hook_blocking(state, _MESSAGES, [], [UserMessage(content="no", is_meta=True)])
        assert state.stop_hook_blocks == expected


@pytest.mark.parametrize("site", list(OTHER_SITES))
def test_every_other_continue_site_resets_the_stop_hook_block_count(site: str) -> None:
    blocked = initial_state(list(_MESSAGES))
    for _ in range(5):
        blocked = stop_hook_blocking(blocked, _MESSAGES, [], [UserMessage(content="no", is_meta=True)])
    assert OTHER_SITES[site](blocked).stop_hook_blocks == 0


def _always_blocks(seen: list[int]) -> Callable[[StopHookInput], object]:
    async def hook(hook_input: StopHookInput) -> HookDecision:
        seen.append(hook_input.consecutive_blocks)
        return HookDecision(blocking_error="tests fail")

    return hook


async def test_stop_hook_block_cap_ends_a_hook_that_always_blocks_completed_with_a_warning() -> None:
    seen: list[int] = []
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [text_reply(f"Done {n}.") for n in range(12)], stop_hooks=[_always_blocks(seen)])
        # Eight blocks honoured (the model answered each), the ninth overridden.
        assert seen == list(range(9))
        assert ran.handle.transitions == ["stop_hook_blocking"] * 8
        assert len(ran.model.requests) == 9
        assert ran.reason == "completed"
        result = ran.handle.result
        assert result is not None and result.subtype == "success" and not result.is_error
        assert result.result == "Done 8."
        notices = [e for e in ran.events if isinstance(e, SystemMessage) and e.subtype == STOP_HOOK_BLOCK_CAP]
        assert len(notices) == 1
        assert notices[0].data == {"cap": 8, "blocking_errors": ["tests fail"]}
        assert ran.handle.terminal is not None and ran.handle.terminal.error == notices[0].content
        assert result.errors == [notices[0].content]
        assert "8 consecutive times" in notices[0].content
        # The overridden block's feedback is neither emitted nor kept: eight feedback messages in all.
        feedback = [
            e for e in ran.events if isinstance(e, UserMessage) and e.content == "Stop hook feedback:\ntests fail"
        ]
        assert len(feedback) == 8
        history = await ran.session.transcript()
        assert sum(1 for m in history if isinstance(m, UserMessage) and m.is_meta) == 8
        await assert_settled(ran)


async def test_stop_hook_block_cap_of_zero_lets_a_hook_block_past_eight() -> None:
    async def blocks_twelve_times(hook_input: StopHookInput) -> HookDecision | None:
        return HookDecision(blocking_error="again") if hook_input.consecutive_blocks < 12 else None

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime, [text_reply() for _ in range(13)], stop_hooks=[blocks_twelve_times], stop_hook_block_cap=0
        )
        assert ran.handle.transitions == ["stop_hook_blocking"] * 12
        assert len(ran.model.requests) == 13
        assert ran.reason == "completed"
        assert ran.handle.result is not None and ran.handle.result.errors == []
        assert not any(isinstance(e, SystemMessage) and e.subtype == STOP_HOOK_BLOCK_CAP for e in ran.events)
        await assert_settled(ran)


async def test_stop_hook_block_count_resets_after_a_turn_that_ran_tools() -> None:
    seen: list[int] = []
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [text_reply(), text_reply(), tools_reply(tool_use("t1", "read")), text_reply(), text_reply(), text_reply()],
            tools=[scripted_tool("read", safe=True)],
            stop_hooks=[_always_blocks(seen)],
            stop_hook_block_cap=2,
        )
        assert seen == [0, 1, 0, 1, 2]
        assert ran.handle.transitions == ["stop_hook_blocking"] * 2 + ["next_turn"] + ["stop_hook_blocking"] * 2
        assert len(ran.model.requests) == 6
        assert ran.reason == "completed"
        assert ran.handle.result is not None and len(ran.handle.result.errors) == 1
        await assert_settled(ran)


async def test_stop_hook_prevent_wins_over_the_block_cap() -> None:
    async def blocks_then_prevents(hook_input: StopHookInput) -> HookDecision:
        prevent = "policy" if hook_input.consecutive_blocks == 1 else None
        return HookDecision(blocking_error="tests fail", prevent=prevent)

    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime, [text_reply(), text_reply()], stop_hooks=[blocks_then_prevents], stop_hook_block_cap=1
        )
        assert ran.reason == "stop_hook_prevented"
        assert ran.handle.transitions == ["stop_hook_blocking"]
        assert not any(isinstance(e, SystemMessage) and e.subtype == STOP_HOOK_BLOCK_CAP for e in ran.events)
        await assert_settled(ran)
