"""`queryloop.runtime.loop.context`: thresholds, token counts and the lighter steps of the context pipeline.

Every step must keep each `tool_use` paired with its `tool_result`: the checks use
`transcript_problems`, which reports without repairing.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queryloop.actors.compactor import ContextConfig, context_config
from queryloop.runtime.loop.context import (
    CLEARED_TOOL_RESULT,
    COMPACT_SUMMARY_PREFIX,
    ContextLimits,
    StagedCollapse,
    TokenCountMemo,
    apply_tool_result_budget,
    collapse_may_stage,
    commit_collapses,
    estimate_tokens,
    fit_for_summary,
    microcompact,
    post_compact_messages,
    snip,
    split_rounds,
    stage_collapse,
    token_count_with_estimation,
    token_warning_state,
)
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    Block,
    SystemMessage,
    TranscriptMessage,
    Usage,
    UserMessage,
)
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.pricing import context_window_for
from queryloop.runtime.loop.transcript import messages_after_compact_boundary, transcript_problems
from tests.blocks import text, tool_result, tool_use

MODEL = "claude-sonnet-4-5"


# -- builders ---------------------------------------------------------------------------------


def assistant(*blocks: Block | str, mid: str = "msg_1", usage: Usage | None = None) -> AssistantMessage:
    content = [text(b) if isinstance(b, str) else b for b in blocks]
    return AssistantMessage(message_id=mid, model=MODEL, content=content, usage=usage)


def results(*blocks: Block) -> UserMessage:
    return UserMessage(content=list(blocks))


def tool_round(index: int, *, size: int = 20, split: bool = False) -> list[TranscriptMessage]:
    """One response (text, a `read` and a `bash` call) and the results of both calls."""
    mid = f"msg_{index}"
    blocks = [text(f"Step {index}"), tool_use(f"toolu_{index}_r", "read"), tool_use(f"toolu_{index}_b", "bash")]
    usage = Usage(input_tokens=1_000 * (index + 1), output_tokens=50)
    replies: list[TranscriptMessage]
    if split:  # as the loop records it: one message per completed block, sharing the message id
        replies = [assistant(b, mid=mid, usage=usage) for b in blocks]
    else:
        replies = [assistant(*blocks, mid=mid, usage=usage)]
    return [
        *replies,
        results(tool_result(f"toolu_{index}_r", f"file {index} " + "r" * size)),
        results(tool_result(f"toolu_{index}_b", f"ran {index} " + "b" * size, is_error=index % 2 == 1)),
    ]


def conversation(rounds: int, *, size: int = 20, final: bool = True) -> list[TranscriptMessage]:
    messages: list[TranscriptMessage] = [UserMessage(content="Fix the failing test")]
    for index in range(rounds):
        messages.extend(tool_round(index, size=size, split=index % 2 == 0))
    if final:
        messages.append(assistant("All done.", mid="msg_final", usage=Usage(input_tokens=9_000, output_tokens=20)))
    return messages


def result_blocks(messages: list[TranscriptMessage]) -> list[Block]:
    return [
        b
        for m in messages
        if isinstance(m, UserMessage) and isinstance(m.content, list)
        for b in m.content
        if b.get("type") == "tool_result"
    ]


def use_ids(messages: list[TranscriptMessage]) -> list[str]:
    return [b["id"] for m in messages if isinstance(m, AssistantMessage) for b in m.content if b["type"] == "tool_use"]


def assert_paired(messages: list[TranscriptMessage]) -> None:
    assert transcript_problems(messages) == []
    sent = messages_after_compact_boundary(messages)
    assert sorted(use_ids(sent)) == sorted(b["tool_use_id"] for b in result_blocks(sent))


class Store:
    """A `store` callback that remembers what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, tool_use_id: str, full_text: str) -> str:
        self.calls.append((tool_use_id, full_text))
        return f"/session/tool-results/{tool_use_id}.out"


# -- thresholds -------------------------------------------------------------------------------


def test_context_limits_derive_every_threshold_from_the_window() -> None:
    limits = ContextLimits(context_window=200_000, max_output_tokens=8_000)

    assert limits.effective_window == 192_000
    assert limits.autocompact_threshold == 179_000
    assert limits.warning_threshold == 159_000
    assert limits.blocking_limit == 189_000


@pytest.mark.parametrize("max_output", [20_000, 32_000, 128_000])
def test_context_limits_reserve_at_most_the_summary_output(max_output: int) -> None:
    limits = ContextLimits(context_window=200_000, max_output_tokens=max_output)

    assert limits.effective_window == 180_000
    assert limits.autocompact_threshold == 167_000
    assert limits.warning_threshold == 147_000
    assert limits.blocking_limit == 177_000


def test_context_limits_use_the_configured_buffers() -> None:
    limits = ContextLimits(
        context_window=100_000,
        max_output_tokens=30_000,
        summary_output_reserve=10_000,
        autocompact_buffer=5_000,
        warning_buffer=7_000,
        blocking_buffer=1_000,
    )

    assert limits.effective_window == 90_000
    assert limits.autocompact_threshold == 85_000
    assert limits.warning_threshold == 78_000
    assert limits.blocking_limit == 89_000


def test_token_warning_state_flags_switch_on_exactly_at_each_threshold() -> None:
    limits = ContextLimits(context_window=200_000, max_output_tokens=8_000)

    below = token_warning_state(158_999, limits)
    assert (below.above_warning, below.above_autocompact, below.at_blocking_limit) == (False, False, False)
    warning = token_warning_state(159_000, limits)
    assert (warning.above_warning, warning.above_autocompact, warning.at_blocking_limit) == (True, False, False)
    assert token_warning_state(178_999, limits).above_autocompact is False
    autocompact = token_warning_state(179_000, limits)
    assert (autocompact.above_autocompact, autocompact.at_blocking_limit) == (True, False)
    assert token_warning_state(188_999, limits).at_blocking_limit is False
    assert token_warning_state(189_000, limits).at_blocking_limit is True


def test_collapse_staging_is_skipped_below_the_warning_threshold_and_asked_from_it() -> None:
    limits = ContextLimits(context_window=2_000, max_output_tokens=100, autocompact_buffer=0, warning_buffer=0)
    threshold = limits.warning_threshold
    below: list[TranscriptMessage] = [UserMessage(content="a" * 4 * (threshold - 5))]  # threshold - 5 + 4 tokens
    at: list[TranscriptMessage] = [UserMessage(content="a" * 4 * (threshold - 4))]
    assert token_count_with_estimation(below) == threshold - 1
    assert collapse_may_stage(below, limits) is False
    assert collapse_may_stage(at, limits) is True
    assert collapse_may_stage(at, limits) == token_warning_state(threshold, limits).above_warning


def test_the_token_count_memo_gives_the_count_of_the_conversation_it_is_handed_grown_or_copied() -> None:
    """The memo never answers for a conversation it did not count: one grown in place is counted again (how
    seldom it counts is `bench tricks`')."""
    from queryloop.runtime.loop import context

    memo = TokenCountMemo()
    limits = ContextLimits(context_window=200_000, max_output_tokens=8_000)  # warning from 159,000 tokens
    conversation: list[TranscriptMessage] = [UserMessage(content="a" * 400)]
    assert collapse_may_stage(conversation, limits, memo) is False
    assert not context.pipeline_needed(
        conversation, limits, max_tool_result_chars=10_000, snip_max_rounds=None, count=memo
    )
    assert memo(conversation) == token_count_with_estimation(conversation)
    conversation.append(UserMessage(content="b" * 640_000))  # grown in place: now above the warning
    assert collapse_may_stage(conversation, limits, memo) is True
    copy = list(conversation)
    assert memo(copy) == memo(conversation) == token_count_with_estimation(conversation)


def test_token_warning_state_percent_left_counts_down_to_the_autocompact_threshold() -> None:
    limits = ContextLimits(context_window=200_000, max_output_tokens=8_000)

    assert token_warning_state(0, limits).percent_left == 100
    assert token_warning_state(89_500, limits).percent_left == 50
    assert token_warning_state(179_000, limits).percent_left == 0
    assert token_warning_state(250_000, limits).percent_left == 0  # never negative


# -- counting ---------------------------------------------------------------------------------


def test_estimate_tokens_counts_four_characters_a_token_plus_four() -> None:
    assert estimate_tokens(UserMessage(content="a" * 40)) == 14
    assert estimate_tokens(UserMessage(content=[text("a" * 40)])) == 14
    assert estimate_tokens(results(tool_result("t", "a" * 400))) == 104
    assert estimate_tokens(results(tool_result("t", [text("a" * 40), text("b" * 40)]))) == 24
    use = tool_use("t", "read", {"path": "x"})  # '{"path": "x"}' is 13 characters, "read" 4
    assert estimate_tokens(assistant(use)) == 17 // 4 + 4
    assert estimate_tokens(SystemMessage(subtype="informational", content="z" * 4_000)) == 4  # never sent


def test_token_count_with_estimation_uses_the_last_usage_and_estimates_what_follows() -> None:
    later = results(tool_result("t2", "a" * 400))
    messages: list[TranscriptMessage] = [
        UserMessage(content="q" * 4_000),
        assistant(tool_use("t1"), mid="m1", usage=Usage(input_tokens=10, output_tokens=1)),
        results(tool_result("t1", "ok")),
        assistant(
            tool_use("t2"),
            mid="m2",
            usage=Usage(
                input_tokens=1_000, cache_creation_input_tokens=200, cache_read_input_tokens=300, output_tokens=50
            ),
        ),
        later,
    ]

    assert token_count_with_estimation(messages) == 1_550 + estimate_tokens(later)


def test_token_count_with_estimation_skips_responses_without_usage() -> None:
    no_usage = assistant("thinking aloud " * 10, mid="m2")
    messages: list[TranscriptMessage] = [
        UserMessage(content="question"),
        assistant("first", mid="m1", usage=Usage(input_tokens=700, output_tokens=30)),
        UserMessage(content="follow-up " * 20),
        no_usage,
    ]

    assert token_count_with_estimation(messages) == 730 + estimate_tokens(messages[2]) + estimate_tokens(no_usage)


def test_token_count_with_estimation_estimates_everything_without_a_usage() -> None:
    messages: list[TranscriptMessage] = [
        UserMessage(content="q" * 400),
        assistant("a" * 800, mid="m1"),
        UserMessage(content="f" * 40),
    ]

    assert token_count_with_estimation(messages) == 104 + 204 + 14
    assert token_count_with_estimation([]) == 0


# -- rounds -----------------------------------------------------------------------------------


def test_split_rounds_keeps_the_blocks_of_one_response_and_its_results_together() -> None:
    messages = conversation(2)
    notice = SystemMessage(subtype="informational", content="retrying")
    messages.insert(2, notice)  # between two blocks of the first (split) response

    head, rounds = split_rounds(messages)

    assert head == [messages[0]]
    assert len(rounds) == 3
    first_ids = [m.uuid for m in rounds[0]]
    assert notice.uuid in first_ids
    assert [m.uuid for m in rounds[0] if isinstance(m, AssistantMessage)] == [
        m.uuid for m in messages if isinstance(m, AssistantMessage) and m.message_id == "msg_0"
    ]
    assert rounds[2] == [messages[-1]]
    assert [m for r in rounds for m in r] == messages[1:]


# -- step 1: tool-result budget ---------------------------------------------------------------


def test_tool_result_budget_persists_only_results_over_max_chars() -> None:
    big = "HEAD" + "y" * 5_000 + "TAIL"
    listed = [text("L" * 700), text("M" * 700)]
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "i" * 5_000}}]
    prompt = UserMessage(content="z" * 5_000)  # a prompt is never persisted
    reply = assistant(tool_use("t_short"), tool_use("t_big"), tool_use("t_edge"), tool_use("t_list"), tool_use("t_img"))
    short = results(tool_result("t_short", "fine"))
    mixed = results(
        tool_result("t_big", big, is_error=True),
        tool_result("t_edge", "e" * 1_000),  # exactly max_chars: stays
    )
    listed_message = results(tool_result("t_list", listed), tool_result("t_img", image))
    messages: list[TranscriptMessage] = [prompt, reply, short, mixed, listed_message]
    store = Store()

    out, replaced = apply_tool_result_budget(messages, max_chars=1_000, preview_chars=100, store=store)

    assert replaced == 2
    assert store.calls == [("t_big", big), ("t_list", "L" * 700 + "M" * 700)]
    assert out[0] is prompt
    assert out[1] is reply
    assert out[2] is short
    assert out[3] is not mixed
    assert out[3].uuid == mixed.uuid
    assert isinstance(out[3], UserMessage)
    assert isinstance(out[3].content, list)
    persisted, edge = out[3].content
    assert edge is mixed.content[1]
    assert persisted["tool_use_id"] == "t_big"
    assert persisted["is_error"] is True
    body = persisted["content"]
    assert body.startswith("<persisted-output>\n")
    assert body.endswith("\n</persisted-output>")
    assert "Output too large (5008 characters)." in body
    assert "Full output saved to: /session/tool-results/t_big.out" in body
    assert f"Preview (first 100 characters):\n{big[:100]}\n</persisted-output>" in body
    assert "TAIL" not in body
    assert isinstance(out[4], UserMessage)
    assert isinstance(out[4].content, list)
    assert f"Preview (first 100 characters):\n{'L' * 100}\n</persisted-output>" in out[4].content[0]["content"]
    assert "/session/tool-results/t_list.out" in out[4].content[0]["content"]
    assert out[4].content[1] is listed_message.content[1]  # images are not persisted
    assert_paired(out)


def test_tool_result_budget_leaves_a_conversation_of_short_results_identical() -> None:
    messages = conversation(3, size=50)
    store = Store()

    out, replaced = apply_tool_result_budget(messages, max_chars=1_000, preview_chars=100, store=store)

    assert replaced == 0
    assert store.calls == []
    assert all(after is before for after, before in zip(out, messages, strict=True))


def test_tool_result_budget_is_idempotent() -> None:
    messages = conversation(3, size=8_000)
    first, replaced = apply_tool_result_budget(messages, max_chars=5_000, preview_chars=500, store=Store())
    assert replaced == 6
    store = Store()

    second, replaced_again = apply_tool_result_budget(first, max_chars=5_000, preview_chars=500, store=store)

    assert replaced_again == 0
    assert store.calls == []
    assert all(after is before for after, before in zip(second, first, strict=True))


def test_a_persisted_result_is_never_persisted_again() -> None:
    full = "F" * 1_500
    messages: list[TranscriptMessage] = [
        UserMessage(content="go"),
        assistant(tool_use("t1")),
        results(tool_result("t1", full)),
    ]
    first_store = Store()
    first, _ = apply_tool_result_budget(messages, max_chars=1_000, preview_chars=2_000, store=first_store)
    assert first_store.calls == [("t1", full)]
    store = Store()

    _, replaced = apply_tool_result_budget(first, max_chars=1_000, preview_chars=2_000, store=store)

    assert store.calls == []  # actual: [("t1", "<persisted-output>...")], replacing the full output on disk
    assert replaced == 0


# -- step 2: snip -----------------------------------------------------------------------------


def test_snip_off_returns_the_same_list() -> None:
    messages = conversation(6)

    out, freed = snip(messages, None)

    assert out is messages
    assert freed == 0


def test_snip_within_max_rounds_changes_nothing() -> None:
    messages = conversation(3)  # three tool rounds and the final answer: four rounds

    out, freed = snip(messages, 4)

    assert out is messages
    assert freed == 0


def test_snip_keeps_the_head_and_the_newest_rounds() -> None:
    messages = conversation(6)  # rounds 0..5, then the final answer
    head, rounds = split_rounds(messages)

    out, freed = snip(messages, 3)

    assert out == [*head, *rounds[4], *rounds[5], *rounds[6]]
    assert out[0] is messages[0]
    assert sorted(use_ids(out)) == ["toolu_4_b", "toolu_4_r", "toolu_5_b", "toolu_5_r"]
    assert freed == sum(estimate_tokens(m) for r in rounds[:4] for m in r)
    assert freed > 0
    assert_paired(out)


# -- step 3: microcompact -----------------------------------------------------------------------


def test_microcompact_clears_all_but_the_newest_results() -> None:
    messages = conversation(3)  # six results: 0r 0b 1r 1b 2r 2b
    before = result_blocks(messages)

    out, cleared = microcompact(messages, keep_recent=2)

    assert cleared == 4
    after = result_blocks(out)
    assert [b["content"] for b in after[:4]] == [CLEARED_TOOL_RESULT] * 4
    assert after[4:] == before[4:]
    assert [b["tool_use_id"] for b in after] == [b["tool_use_id"] for b in before]
    assert [b["is_error"] for b in after] == [b["is_error"] for b in before]
    assert True in [b["is_error"] for b in after[:4]]
    assert [m.uuid for m in out] == [m.uuid for m in messages]
    untouched = [i for i, m in enumerate(messages) if not isinstance(m, UserMessage) or isinstance(m.content, str)]
    assert all(out[i] is messages[i] for i in untouched)
    assert out[-2] is messages[-2]  # the newest result's message is not rewritten
    assert_paired(out)


def test_microcompact_with_enough_room_returns_the_same_list() -> None:
    messages = conversation(3)

    out, cleared = microcompact(messages, keep_recent=6)

    assert out is messages
    assert cleared == 0


def test_microcompact_keeping_none_clears_every_result() -> None:
    out, cleared = microcompact(conversation(2), keep_recent=0)

    assert cleared == 4
    assert [b["content"] for b in result_blocks(out)] == [CLEARED_TOOL_RESULT] * 4
    assert_paired(out)


def test_microcompact_is_idempotent() -> None:
    first, cleared = microcompact(conversation(3), keep_recent=2)
    assert cleared == 4

    second, cleared_again = microcompact(first, keep_recent=2)

    assert cleared_again == 0
    assert second is first  # the two newest results stay whole


def test_microcompact_on_the_next_turn_clears_only_the_oldest_uncleared_result() -> None:
    first, _ = microcompact(conversation(3, final=False), keep_recent=2)  # 0r 0b 1r 1b cleared
    grown = [*first, *tool_round(3)]  # two new results: 8 in all, 6 must be cleared

    out, cleared = microcompact(grown, keep_recent=2)

    assert cleared == 2
    assert [b["content"] != CLEARED_TOOL_RESULT for b in result_blocks(out)] == [False] * 6 + [True] * 2


# -- step 4: context collapse -------------------------------------------------------------------


def test_stage_collapse_has_nothing_to_fold_within_keep_recent_rounds() -> None:
    messages = conversation(2)  # three rounds

    assert stage_collapse(messages, 3) is None
    assert stage_collapse(messages, 4) is None
    assert stage_collapse([UserMessage(content="hi")], 1) is None


def test_stage_collapse_folds_the_older_rounds_into_one_note() -> None:
    messages = conversation(4)  # rounds 0..3 and the final answer
    _, rounds = split_rounds(messages)

    staged = stage_collapse(messages, 2)

    assert staged is not None
    span = [m for r in rounds[:3] for m in r]
    assert staged.first_uuid == span[0].uuid == messages[1].uuid
    assert staged.last_uuid == span[-1].uuid
    assert staged.messages == len(span)
    note = staged.replacement
    assert note.is_meta is True
    assert note.content == (
        f"[Collapsed {len(span)} earlier messages. Tools used: read ×3, bash ×3.]"
        "\nThe assistant said: Step 0 / Step 1 / Step 2"
    )


def test_stage_collapse_without_tools_says_none() -> None:
    messages: list[TranscriptMessage] = [
        UserMessage(content="hello"),
        assistant("Hi there.", mid="m1"),
        UserMessage(content="And now?"),
        assistant("Now this.", mid="m2"),
    ]

    staged = stage_collapse(messages, 1)

    assert staged is not None
    assert staged.messages == 2
    assert (
        staged.replacement.content == "[Collapsed 2 earlier messages. Tools used: none.]\nThe assistant said: Hi there."
    )


def test_commit_collapses_replaces_the_span_with_its_note() -> None:
    messages = conversation(4)
    head, rounds = split_rounds(messages)
    staged = stage_collapse(messages, 2)
    assert staged is not None

    out, committed = commit_collapses(messages, [staged])

    assert committed == 1
    assert out == [*head, staged.replacement, *rounds[3], *rounds[4]]
    assert_paired(out)


def test_commit_collapses_survives_microcompact_rewrites() -> None:
    messages = conversation(4)
    staged = stage_collapse(messages, 2)
    assert staged is not None
    compacted, cleared = microcompact(messages, keep_recent=1)
    assert cleared == 7

    out, committed = commit_collapses(compacted, [staged])

    assert committed == 1
    assert staged.replacement in out
    assert_paired(out)


def test_commit_collapses_skips_a_span_that_is_gone() -> None:
    messages = conversation(4)
    staged = stage_collapse(messages, 2)
    assert staged is not None
    snipped, _ = snip(messages, 3)  # the span's first round is dropped

    out, committed = commit_collapses(snipped, [staged])

    assert committed == 0
    assert out == snipped
    assert_paired(out)

    after_compact = post_compact_messages("summary", trigger="auto", pre_tokens=10)
    assert commit_collapses(after_compact, [staged]) == (after_compact, 0)


def test_commit_collapses_commits_only_the_first_of_two_overlapping_spans() -> None:
    messages = conversation(5)
    wide = stage_collapse(messages, 1)
    narrow = stage_collapse(messages, 3)
    assert wide is not None
    assert narrow is not None

    out, committed = commit_collapses(messages, [wide, narrow])

    assert committed == 1
    assert wide.replacement in out
    assert narrow.replacement not in out
    assert_paired(out)


def test_commit_collapses_with_nothing_staged_changes_nothing() -> None:
    messages = conversation(2)

    out, committed = commit_collapses(messages, [])

    assert committed == 0
    assert out == messages


# -- step 6: compaction -------------------------------------------------------------------------


def test_post_compact_messages_are_the_boundary_and_the_summary() -> None:
    boundary, summary = post_compact_messages("We fixed the parser.", trigger="reactive", pre_tokens=181_234)

    assert isinstance(boundary, SystemMessage)
    assert boundary.subtype == "compact_boundary"
    assert boundary.data == {"trigger": "reactive", "pre_tokens": 181_234}
    assert isinstance(summary, UserMessage)
    assert summary.is_meta is True
    assert summary.content == COMPACT_SUMMARY_PREFIX + "We fixed the parser."


def test_post_compact_messages_start_a_valid_transcript_after_any_history() -> None:
    broken: list[TranscriptMessage] = [UserMessage(content="go"), assistant(tool_use("lost"))]  # unanswered
    assert transcript_problems(broken) != []
    compacted = post_compact_messages("summary", trigger="auto", pre_tokens=5)

    messages = [*broken, *compacted, *tool_round(7), assistant("done", mid="m_end")]

    assert messages_after_compact_boundary(messages)[0] is compacted[1]
    assert_paired(messages)


def test_fit_for_summary_changes_nothing_that_fits() -> None:
    messages = conversation(3)

    assert fit_for_summary(messages, 1_000_000) == messages


def test_fit_for_summary_drops_the_oldest_rounds_until_it_fits() -> None:
    messages = conversation(6, size=400)
    head, rounds = split_rounds(messages)
    total = sum(estimate_tokens(m) for m in messages)
    budget = total // 2

    out = fit_for_summary(messages, budget)

    kept = len(split_rounds(out)[1])
    assert 0 < kept < len(rounds)
    assert out == [*head, *(m for r in rounds[len(rounds) - kept :] for m in r)]
    assert sum(estimate_tokens(m) for m in out) <= budget
    one_more = [*head, *(m for r in rounds[len(rounds) - kept - 1 :] for m in r)]
    assert sum(estimate_tokens(m) for m in one_more) > budget  # only as many dropped as needed
    assert_paired(out)


def test_fit_for_summary_keeps_at_least_the_head() -> None:
    messages = conversation(3)

    assert fit_for_summary(messages, 1) == [messages[0]]


# -- the pipeline -----------------------------------------------------------------------------


def test_every_pipeline_step_keeps_every_tool_use_paired() -> None:
    messages = conversation(8, size=3_000)
    messages.insert(5, AttachmentMessage(attachment={"type": "file_changed", "content": "src/a.py changed"}))
    messages.insert(3, SystemMessage(subtype="informational", content="retrying"))
    assert_paired(messages)

    budgeted, replaced = apply_tool_result_budget(messages, max_chars=2_000, preview_chars=200, store=Store())
    assert replaced == 16
    assert_paired(budgeted)

    snipped, freed = snip(budgeted, 6)
    assert freed > 0
    assert_paired(snipped)

    compacted, cleared = microcompact(snipped, keep_recent=3)
    assert cleared == 7  # five tool rounds left: ten results
    assert_paired(compacted)

    staged = stage_collapse(compacted, 2)
    assert staged is not None
    collapsed, committed = commit_collapses(compacted, [staged])
    assert committed == 1
    assert_paired(collapsed)

    fitted = fit_for_summary(collapsed, sum(estimate_tokens(m) for m in collapsed) - 1)
    assert len(fitted) < len(collapsed)
    assert_paired(fitted)

    resumed = [*collapsed, *post_compact_messages("summary", trigger="auto", pre_tokens=1), *tool_round(9)]
    assert_paired(resumed)


# -- property: random valid conversations stay paired through the pipeline -----------------------


@st.composite
def conversations(draw: st.DrawFn) -> list[TranscriptMessage]:
    messages: list[TranscriptMessage] = [UserMessage(content="Start")]
    rounds = draw(st.integers(min_value=0, max_value=8))
    for r in range(rounds):
        ids = [f"toolu_{r}_{k}" for k in range(draw(st.integers(min_value=0, max_value=3)))]
        blocks: list[Block] = []
        if not ids or draw(st.booleans()):
            blocks.append(text(f"Working on step {r}"))
        blocks.extend(tool_use(i, draw(st.sampled_from(["read", "bash", "grep"]))) for i in ids)
        usage = draw(
            st.none() | st.builds(Usage, input_tokens=st.integers(0, 200_000), output_tokens=st.integers(0, 8_000))
        )
        if draw(st.booleans()):
            messages.extend(assistant(b, mid=f"msg_{r}", usage=usage) for b in blocks)
        else:
            messages.append(assistant(*blocks, mid=f"msg_{r}", usage=usage))
        if draw(st.booleans()):
            messages.append(SystemMessage(subtype="informational", content="note"))
        if ids:
            answered = [
                tool_result(
                    i, f"{i}:" + "x" * draw(st.sampled_from([0, 10, 300, 3_000, 12_000])), is_error=draw(st.booleans())
                )
                for i in draw(st.permutations(ids))
            ]
            if draw(st.booleans()):
                messages.extend(results(b) for b in answered)
            else:
                messages.append(results(*answered))
            if draw(st.booleans()):
                messages.append(AttachmentMessage(attachment={"type": "file_changed", "content": "changed"}))
        elif r < rounds - 1:
            messages.append(UserMessage(content=f"Next request {r}"))
    return messages


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=conversations(),
    max_chars=st.integers(min_value=100, max_value=5_000),
    preview_chars=st.integers(min_value=0, max_value=2_000),
    max_rounds=st.none() | st.integers(min_value=1, max_value=6),
    keep_recent=st.integers(min_value=0, max_value=6),
    keep_rounds=st.integers(min_value=1, max_value=4),
)
def test_the_pipeline_keeps_random_conversations_paired(
    *,
    messages: list[TranscriptMessage],
    max_chars: int,
    preview_chars: int,
    max_rounds: int | None,
    keep_recent: int,
    keep_rounds: int,
) -> None:
    assert_paired(messages)
    store = Store()

    budgeted, replaced = apply_tool_result_budget(
        messages, max_chars=max_chars, preview_chars=preview_chars, store=store
    )
    assert_paired(budgeted)
    oversized = [b for b in result_blocks(messages) if len(b["content"]) > max_chars]
    assert replaced == len(store.calls) == len(oversized)

    snipped, freed = snip(budgeted, max_rounds)
    assert_paired(snipped)
    assert (freed > 0) == (max_rounds is not None and len(split_rounds(budgeted)[1]) > max_rounds)

    compacted, cleared = microcompact(snipped, keep_recent)
    assert_paired(compacted)
    contents = [b["content"] for b in result_blocks(compacted)]
    assert cleared == max(0, len(contents) - keep_recent)
    assert all(c == CLEARED_TOOL_RESULT for c in contents[:cleared])
    assert all(c != CLEARED_TOOL_RESULT for c in contents[cleared:])
    assert microcompact(compacted, keep_recent) == (compacted, 0)  # a second pass (the next turn) clears nothing

    staged: list[StagedCollapse] = [
        s for s in (stage_collapse(messages, keep_rounds), stage_collapse(compacted, keep_rounds)) if s is not None
    ]
    collapsed, committed = commit_collapses(compacted, staged)
    assert_paired(collapsed)
    assert committed <= 1
    assert (committed == 1) == (len(split_rounds(compacted)[1]) > keep_rounds)

    fitted = fit_for_summary(collapsed, sum(estimate_tokens(m) for m in collapsed) // 2)
    assert_paired(fitted)


def test_the_oversized_result_scan_finds_an_oversized_result_as_the_conversation_grows_or_is_rewritten() -> None:
    """What the scan answers, whatever it looks at again (how little it measures is `bench tricks`')."""
    from queryloop.runtime.loop import context

    scan = context.OversizedResultScan()
    conversation: list[TranscriptMessage] = [UserMessage(content="go")]
    for index in range(5):
        conversation = [*conversation, *tool_round(index)]
        assert not scan.found(conversation, 1_000)
    rewritten = [UserMessage(content="go"), *conversation[2:]]  # a step replaced a message
    assert not scan.found(rewritten, 1_000)
    oversized_early = [UserMessage(content="go"), *tool_round(0, size=5_000), *conversation[4:]]
    assert scan.found(oversized_early, 1_000)  # a rewritten older message is looked at
    big = [*rewritten, *tool_round(5, size=5_000)]
    assert scan.found(big, 1_000) and scan.found(big, 1_000)  # found again until a step persists it
    assert context.pipeline_needed(
        big,
        ContextLimits(context_window=200_000, max_output_tokens=8_000),
        max_tool_result_chars=1_000,
        snip_max_rounds=None,
        scan=scan,
    )


def test_context_config_follows_every_option_it_reads() -> None:
    """A query's `ContextConfig` is kept per setting (that equal options share one is `bench tricks`'), and
    every option it is made of changes it (a field added to the config but not to the cache's key would serve
    a stale one)."""
    first = context_config(QueryOptions())
    assert context_config(QueryOptions()) == first
    assert first.limits.context_window == context_window_for(QueryOptions().model)
    on_config = {
        "auto_compact": False,
        "reactive_compact": False,
        "context_collapse": False,
        "max_tool_result_chars": 1_000,
        "tool_result_preview_chars": 10,
        "microcompact_keep_recent": 1,
        "collapse_keep_recent_rounds": 2,
        "snip_max_rounds": 3,
        "compact_instructions": "Keep the file names.",
        "max_retries": 0,
        "stream_idle_timeout_s": 17.0,
    }
    on_limits = {  # option → the `ContextLimits` field it sets
        "context_window": ("context_window", 50_000),
        "max_output_tokens": ("max_output_tokens", 4_000),
        "summary_output_reserve": ("summary_output_reserve", 9_000),
        "autocompact_buffer_tokens": ("autocompact_buffer", 1_000),
        "warning_buffer_tokens": ("warning_buffer", 2_000),
        "blocking_buffer_tokens": ("blocking_buffer", 500),
    }
    assert set(on_config) == {f.name for f in dataclasses.fields(ContextConfig)} - {"model", "limits"}
    assert {field for field, _ in on_limits.values()} == {f.name for f in dataclasses.fields(first.limits) if f.init}
    for name, value in on_config.items():
        config = context_config(QueryOptions(**{name: value}))
        assert getattr(config, name) == value, name
    for name, (field, value) in on_limits.items():
        config = context_config(QueryOptions(**{name: value}))
        assert getattr(config.limits, field) == value, name
    other = context_config(QueryOptions(model="claude-opus-5"))
    assert other.model == "claude-opus-5"
    assert other.limits.context_window == context_window_for("claude-opus-5")
