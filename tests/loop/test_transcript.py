"""`queryloop.runtime.loop.transcript`: what is sent to the API, and whether a transcript is valid."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from queryloop.runtime.loop import transcript
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    Block,
    SystemMessage,
    TranscriptMessage,
    UserMessage,
)
from queryloop.runtime.loop.transcript import (
    INTERRUPTED_BY_USER,
    CompactBoundary,
    build_system_prompt,
    messages_after_compact_boundary,
    missing_tool_results,
    normalize_messages_for_api,
    response_text,
    strip_signature_blocks,
    tool_error,
    tool_result_message,
    transcript_problems,
    user_context_message,
)
from tests.blocks import text
from tests.blocks import tool_result as tr
from tests.blocks import tool_use as tu

MISSING = "<tool_use_error>Tool result missing</tool_use_error>"


def u(*blocks: Block | str) -> UserMessage:
    if len(blocks) == 1 and isinstance(blocks[0], str):
        return UserMessage(content=blocks[0])
    return UserMessage(content=[text(b) if isinstance(b, str) else b for b in blocks])


def a(*blocks: Block | str, mid: str = "msg_1", api_error: bool = False) -> AssistantMessage:
    content = [text(b) if isinstance(b, str) else b for b in blocks]
    return AssistantMessage(message_id=mid, model="claude-sonnet-5-5", content=content, is_api_error=api_error)


def attachment(kind: str, content: str = "body") -> AttachmentMessage:
    return AttachmentMessage(attachment={"type": kind, "content": content})


def roles(api: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in api]


def result_ids(blocks: list[Block]) -> list[str]:
    return [b["tool_use_id"] for b in blocks if b.get("type") == "tool_result"]


def use_ids(blocks: list[Block]) -> list[str]:
    return [b["id"] for b in blocks if b.get("type") == "tool_use"]


def as_transcript(api: list[dict[str, Any]]) -> list[TranscriptMessage]:
    """The API messages back as transcript messages, so `transcript_problems` can judge them."""
    out: list[TranscriptMessage] = []
    for number, message in enumerate(api):
        if message["role"] == "user":
            out.append(UserMessage(content=message["content"]))
        else:
            out.append(a(*message["content"], mid=f"msg_{number}"))
    return out


# -- normalize_messages_for_api ----------------------------------------------------------------


def test_normalize_drops_system_messages_api_error_messages_and_internal_fields() -> None:
    messages: list[TranscriptMessage] = [
        SystemMessage(subtype="init", content="session started"),
        u("hello"),
        SystemMessage(subtype="model_fallback", content="Switched to fallback model"),
        a("hi there"),
        a("API Error: overloaded", mid="synthetic", api_error=True),
        u("again"),
    ]
    api = normalize_messages_for_api(messages)
    assert api == [
        {"role": "user", "content": [text("hello")]},
        {"role": "assistant", "content": [text("hi there")]},
        {"role": "user", "content": [text("again")]},
    ]
    assert all(set(m) == {"role", "content"} for m in api)  # no uuid, is_meta, message_id, model...


def test_normalize_merges_the_blocks_of_one_response_into_one_assistant_message() -> None:
    messages: list[TranscriptMessage] = [
        u("read both"),
        a({"type": "thinking", "thinking": "hmm", "signature": "s"}, mid="msg_7"),
        a("I'll read them", mid="msg_7"),
        a(tu("t1"), mid="msg_7"),
        a(tu("t2"), mid="msg_7"),
        u(tr("t1")),
        u(tr("t2")),
    ]
    api = normalize_messages_for_api(messages)
    assert roles(api) == ["user", "assistant", "user"]
    assert [b["type"] for b in api[1]["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert use_ids(api[1]["content"]) == ["t1", "t2"]
    assert api[2]["content"] == [tr("t1"), tr("t2")]


def test_normalize_merges_consecutive_user_messages_with_tool_results_first() -> None:
    messages: list[TranscriptMessage] = [
        u("go"),
        a(tu("t1"), tu("t2")),
        u("by the way, also check the README"),
        attachment("file_changed", "src/app.py changed"),
        u(tr("t2", "second")),
        u(tr("t1", "first")),
    ]
    api = normalize_messages_for_api(messages)
    assert roles(api) == ["user", "assistant", "user"]
    content = api[2]["content"]
    assert content[:2] == [tr("t1", "first"), tr("t2", "second")]  # in tool_use order, ahead of any text
    assert content[2:] == [
        text("by the way, also check the README"),
        text("<system-reminder>\nsrc/app.py changed\n</system-reminder>"),
    ]


def test_normalize_pairs_every_tool_use_with_exactly_one_tool_result() -> None:
    messages: list[TranscriptMessage] = [
        u("start"),
        a("three tools", tu("t1"), tu("t2"), tu("t3")),
        u(tr("t2", "first answer"), tr("t2", "duplicate"), tr("t9", "orphan"), "note"),
        a("one more", tu("t4"), mid="msg_2"),  # the transcript ends before t4 was answered
    ]
    api = normalize_messages_for_api(messages)
    assert roles(api) == ["user", "assistant", "user", "assistant", "user"]
    answer = api[2]["content"]
    assert result_ids(answer) == ["t1", "t2", "t3"]
    assert answer[1] == tr("t2", "first answer")  # the first result is kept, the duplicate dropped
    for synthesized in (answer[0], answer[2]):
        assert synthesized["is_error"] is True
        assert synthesized["content"] == MISSING
    assert answer[3:] == [text("note")]
    assert all(b.get("tool_use_id") != "t9" for b in answer)  # the orphan is gone
    assert api[4]["content"] == [{"type": "tool_result", "tool_use_id": "t4", "content": MISSING, "is_error": True}]
    assert transcript_problems(as_transcript(api)) == []
    assert transcript_problems(messages) != []  # the repair happened in normalize, not in the input
    answered = messages[2]
    assert isinstance(answered, UserMessage)
    assert isinstance(answered.content, list)
    assert result_ids(answered.content) == ["t2", "t2", "t9"]


def test_normalize_drops_orphan_results_answering_an_assistant_without_tool_use() -> None:
    messages: list[TranscriptMessage] = [u("hi"), a("no tools here"), u(tr("stale"), "and a question")]
    api = normalize_messages_for_api(messages)
    assert api[-1] == {"role": "user", "content": [text("and a question")]}


def test_normalize_turns_model_visible_attachments_into_user_text_and_drops_the_rest() -> None:
    messages: list[TranscriptMessage] = [
        u("go"),
        a("done"),
        attachment("file_changed", "a.py was edited"),
        attachment("memory", "the user prefers tabs"),
        attachment("text", "plain context"),
        attachment("queued_message", "also fix the docs"),
        attachment("max_turns_reached", "ignored"),
        attachment("hook_stopped_continuation", "ignored"),
        AttachmentMessage(attachment={"type": "something_new", "content": "ignored"}),
    ]
    api = normalize_messages_for_api(messages)
    assert roles(api) == ["user", "assistant", "user"]
    assert api[2]["content"] == [
        text("<system-reminder>\na.py was edited\n</system-reminder>"),
        text("<system-reminder>\nthe user prefers tabs\n</system-reminder>"),
        text("<system-reminder>\nplain context\n</system-reminder>"),
        text("also fix the docs"),  # a queued message is the user's own words
    ]


def test_normalize_of_only_invisible_messages_is_empty() -> None:
    messages: list[TranscriptMessage] = [
        SystemMessage(subtype="compact_boundary"),
        attachment("max_turns_reached"),
        a("API Error", api_error=True),
    ]
    assert normalize_messages_for_api(messages) == []
    assert normalize_messages_for_api([]) == []


def test_normalize_does_not_modify_its_input() -> None:
    first = u("go")
    call = a(tu("t1"), tu("t2"))
    partial = u(tr("t2"), tr("zz"))
    messages: list[TranscriptMessage] = [first, call, partial]
    snapshot = [m.model_dump() for m in messages]
    normalize_messages_for_api(messages)
    assert [m.model_dump() for m in messages] == snapshot


def test_normalize_drops_an_orphan_result_in_the_first_user_message() -> None:
    # e.g. what follows a compact boundary may start with the results of a summarised tool_use
    messages: list[TranscriptMessage] = [u(tr("summarised_away"), "continue"), a("ok")]
    api = normalize_messages_for_api(messages)
    assert api[0] == {"role": "user", "content": [text("continue")]}


def test_normalize_keeps_roles_alternating_when_an_orphan_only_user_message_is_dropped() -> None:
    messages: list[TranscriptMessage] = [u("hi"), a("first"), u(tr("stale")), a("second", mid="msg_2")]
    api = normalize_messages_for_api(messages)
    assert roles(api) in (["user", "assistant"], ["user", "assistant", "user", "assistant"])


# -- transcript_problems ---------------------------------------------------------------------


def valid_transcript() -> list[TranscriptMessage]:
    return [
        u("go"),
        a("reading", mid="m1"),
        a(tu("t1"), mid="m1"),
        a(tu("t2"), mid="m1"),
        u(tr("t2")),
        u(tr("t1")),
        attachment("file_changed", "x"),
        a("done", mid="m2"),
    ]


def test_a_valid_transcript_has_no_problems() -> None:
    assert transcript_problems(valid_transcript()) == []
    assert transcript_problems([]) == []
    assert transcript_problems([u("just a question")]) == []


def test_transcript_problems_reports_an_orphan_result_without_repairing() -> None:
    messages = [*valid_transcript(), u(tr("ghost"))]
    before = [m.model_dump() for m in messages]
    problems = transcript_problems(messages)
    assert len(problems) == 1
    assert "ghost" in problems[0]
    assert "answers no tool_use" in problems[0]
    assert [m.model_dump() for m in messages] == before


def test_transcript_problems_reports_a_missing_result() -> None:
    messages: list[TranscriptMessage] = [u("go"), a(tu("t1"), tu("t2")), u(tr("t1"))]
    problems = transcript_problems(messages)
    assert len(problems) == 1
    assert "t2" in problems[0]
    assert "has no tool_result" in problems[0]
    # a transcript that ends on an unanswered tool_use is missing its result too
    assert any("t9" in p for p in transcript_problems([u("go"), a(tu("t9"))]))


def test_transcript_problems_reports_duplicate_results() -> None:
    messages: list[TranscriptMessage] = [u("go"), a(tu("t1")), u(tr("t1")), u(tr("t1", "again"))]
    problems = transcript_problems(messages)
    assert len(problems) == 1
    assert "t1" in problems[0]
    assert "several tool_results" in problems[0]


def test_transcript_problems_reports_a_first_message_that_is_not_user() -> None:
    problems = transcript_problems([a("I speak first"), u("hm")])
    assert problems == ["the first message is not a user message"]
    # what the API never sees does not count: a system notice first is fine
    assert transcript_problems([SystemMessage(subtype="init"), u("go"), a("ok")]) == []


def test_transcript_problems_reports_every_problem_at_once() -> None:
    messages: list[TranscriptMessage] = [a("first"), u(tr("orphan")), a(tu("t1"), mid="m2"), u("no result")]
    problems = transcript_problems(messages)
    assert len(problems) == 3
    assert problems[0] == "the first message is not a user message"
    assert any("orphan" in p for p in problems)
    assert any("t1" in p and "has no tool_result" in p for p in problems)


def test_transcript_problems_only_judges_what_follows_the_last_compact_boundary() -> None:
    broken_history: list[TranscriptMessage] = [u("go"), a(tu("lost")), SystemMessage(subtype="compact_boundary")]
    assert transcript_problems([*broken_history, u("summary"), a("ok")]) == []
    assert transcript_problems([*broken_history, a("assistant first")]) == ["the first message is not a user message"]


# -- small helpers ------------------------------------------------------------------------------


def test_messages_after_compact_boundary() -> None:
    early, summary, later = u("early"), u("summary 1"), u("summary 2")
    first = SystemMessage(subtype="compact_boundary")
    second = SystemMessage(subtype="compact_boundary")
    notice = SystemMessage(subtype="model_fallback")
    assert messages_after_compact_boundary([early, notice]) == [early, notice]
    assert messages_after_compact_boundary([early, first, summary]) == [summary]
    assert messages_after_compact_boundary([early, first, summary, second, later]) == [later]
    assert messages_after_compact_boundary([early, first]) == []
    assert messages_after_compact_boundary([]) == []
    messages: list[TranscriptMessage] = [early, notice]
    assert messages_after_compact_boundary(messages) is messages  # nothing to cut: no copy


def test_strip_signature_blocks_drops_thinking_and_messages_left_empty() -> None:
    thinking = {"type": "thinking", "thinking": "plan", "signature": "sig"}
    redacted = {"type": "redacted_thinking", "data": "opaque"}
    question = u("go")
    only_thinking = a(thinking, mid="m1")
    mixed = a(redacted, "answer", tu("t1"), thinking, mid="m2")
    plain = a("no thinking", mid="m3")
    notice = SystemMessage(subtype="model_fallback")
    out = strip_signature_blocks([question, only_thinking, mixed, notice, plain])
    assert len(out) == 4
    assert out[0] is question
    stripped = out[1]
    assert isinstance(stripped, AssistantMessage)
    assert stripped.content == [text("answer"), tu("t1")]
    assert (stripped.uuid, stripped.message_id) == (mixed.uuid, mixed.message_id)
    assert out[2] is notice
    assert out[3] is plain
    assert len(mixed.content) == 4  # the original is untouched


def test_missing_tool_results_synthesizes_an_error_for_each_unanswered_tool_use() -> None:
    calls = [a("go", tu("t1"), tu("t2"), mid="m1"), a(tu("t3"), mid="m1")]
    done: list[TranscriptMessage] = [u(tr("t2"))]
    synthetic = missing_tool_results(calls, done, INTERRUPTED_BY_USER)
    assert [result_ids(m.content) for m in synthetic if isinstance(m.content, list)] == [["t1"], ["t3"]]
    for message in synthetic:
        assert isinstance(message.content, list)
        (block,) = message.content
        assert isinstance(block, dict)
        assert block == {
            "type": "tool_result",
            "tool_use_id": block["tool_use_id"],
            "content": "Interrupted by user",
            "is_error": True,
        }
    assert missing_tool_results(calls, [u(tr("t1")), u(tr("t2")), u(tr("t3"))], "x") == []
    assert missing_tool_results([a("no tools")], [], "x") == []


def test_tool_result_message_and_tool_error_shape() -> None:
    assert tool_error("boom") == "<tool_use_error>boom</tool_use_error>"
    message = tool_result_message("t1", tool_error("boom"), is_error=True)
    assert message.content == [
        {
            "type": "tool_result",
            "tool_use_id": "t1",
            "content": "<tool_use_error>boom</tool_use_error>",
            "is_error": True,
        }
    ]
    assert message.is_meta is False


def test_user_context_message() -> None:
    assert user_context_message({}) is None
    message = user_context_message({"claudeMd": "Use tabs.", "currentDate": "Today is 2026-01-01."})
    assert message is not None
    assert message.is_meta is True
    assert isinstance(message.content, str)
    assert message.content.startswith("<system-reminder>\n")
    assert message.content.endswith("\n</system-reminder>")
    assert "# claudeMd\nUse tabs.\n# currentDate\nToday is 2026-01-01." in message.content
    assert message.content.index("claudeMd") < message.content.index("currentDate")


def test_build_system_prompt_layers_custom_or_default_then_append_then_system_context() -> None:
    default = ["You are an agent.", "Be careful."]
    assert build_system_prompt(default) == [text("You are an agent."), text("Be careful.")]
    assert build_system_prompt(default, custom="You are a pirate.") == [text("You are a pirate.")]
    assert build_system_prompt(default, append="Answer in French.") == [
        text("You are an agent."),
        text("Be careful."),
        text("Answer in French."),
    ]
    layered = build_system_prompt(
        default,
        custom="You are a pirate.",
        append="Answer in French.",
        system_context={"gitStatus": "clean", "cwd": "/repo"},
    )
    assert layered == [text("You are a pirate."), text("Answer in French."), text("gitStatus: clean\ncwd: /repo")]
    assert build_system_prompt(default, append="", system_context={}) == build_system_prompt(default)
    assert default == ["You are an agent.", "Be careful."]  # the default list is not extended in place


# -- properties ------------------------------------------------------------------------------------

ORPHANS = ["orphan_a", "orphan_b"]
NOISE: list[TranscriptMessage] = [
    SystemMessage(subtype="api_retry"),
    attachment("file_changed", "f changed"),
    attachment("queued_message", "queued"),
    attachment("max_turns_reached"),
    a("API Error: 529", mid="synthetic", api_error=True),
]


@st.composite
def transcripts(draw: st.DrawFn, *, greeted: bool) -> list[TranscriptMessage]:
    """Random agent transcripts: assistant responses with tool_uses, user turns answering any subset of them
    (with duplicates, stale ids and orphans), attachments, system notices and API error messages between."""
    messages: list[TranscriptMessage] = [u("start")]
    if greeted:
        messages.append(a("hello", mid="msg_greet"))
    issued: list[str] = []
    open_ids: list[str] = []
    for step in range(draw(st.integers(0, 8))):
        kind = draw(st.sampled_from(["assistant", "user", "noise"]))
        if kind == "assistant":
            ids = [f"toolu_{len(issued) + i}" for i in range(draw(st.integers(0, 3)))]
            issued.extend(ids)
            open_ids = ids
            blocks: list[Block] = [tu(i) for i in ids]
            if not ids or draw(st.booleans()):
                blocks.insert(0, text(f"thinking aloud {step}"))
            messages.extend(a(b, mid=f"msg_{step}") for b in blocks)  # one message per block, as streamed
        elif kind == "user":
            pool = open_ids + issued + ORPHANS
            answered = draw(st.lists(st.sampled_from(open_ids), max_size=4)) if open_ids else []
            extra = draw(st.lists(st.sampled_from(pool), max_size=2))
            results = draw(st.permutations([tr(i) for i in answered + extra]))
            parts: list[Block] = list(results)
            if draw(st.booleans()):
                parts.insert(draw(st.integers(0, len(parts))), text("user words"))
            if not parts:
                parts = [text("user words")]
            if draw(st.booleans()) and len(parts) > 1:
                cut = draw(st.integers(1, len(parts) - 1))
                messages.extend([u(*parts[:cut]), u(*parts[cut:])])
            else:
                messages.append(u(*parts))
        else:
            messages.append(draw(st.sampled_from(NOISE)))
    return messages


def _assert_paired(api: list[dict[str, Any]]) -> None:
    for index, message in enumerate(api):
        assert message["content"], "no empty message is sent"
        if message["role"] == "assistant":
            wanted = use_ids(message["content"])
            if not wanted:
                continue
            following = api[index + 1]
            assert following["role"] == "user"
            results = result_ids(following["content"])
            assert results == wanted  # exactly one result per tool_use, in order
            assert [b.get("type") for b in following["content"][: len(wanted)]] == ["tool_result"] * len(wanted)
        else:
            previous = api[index - 1] if index else None
            answerable = use_ids(previous["content"]) if previous and previous["role"] == "assistant" else []
            assert set(result_ids(message["content"])) <= set(answerable)


@given(transcripts(greeted=True))
def test_normalize_always_answers_every_tool_use_exactly_once_in_the_next_user_message(
    messages: list[TranscriptMessage],
) -> None:
    api = normalize_messages_for_api(messages)
    _assert_paired(api)
    assert api[0]["role"] == "user"
    assert not any(b.get("type") == "tool_result" and b["tool_use_id"] in ORPHANS for m in api for b in m["content"]), (
        "orphans never reach the API"
    )


@given(transcripts(greeted=False))
@example([u("hi"), a("first"), u(tr("orphan_a")), a("second", mid="msg_2")])
def test_normalize_output_always_alternates_and_is_valid_to_send(messages: list[TranscriptMessage]) -> None:
    api = normalize_messages_for_api(messages)
    _assert_paired(api)
    assert all(api[i]["role"] != api[i + 1]["role"] for i in range(len(api) - 1))
    assert not api or api[0]["role"] == "user"
    assert transcript_problems(as_transcript(api)) == []


def _step_by_step(messages: list[TranscriptMessage]) -> list[dict[str, Any]]:
    """The module doc's normalisation, one step at a time, each a pass of its own: the oracle of the one-pass code."""
    merged = transcript._merge(messages)  # the merging step alone, as `transcript_problems` takes it

    def uses(message: dict[str, Any] | None) -> list[str]:
        if message is None or message["role"] != "assistant":
            return []
        return [b["id"] for b in message["content"] if b.get("type") == "tool_use"]

    def answer(wanted: list[str], content: list[Block]) -> list[Block]:
        first: dict[str, Block] = {}
        for block in content:
            if block.get("type") == "tool_result" and block["tool_use_id"] in wanted:
                first.setdefault(block["tool_use_id"], block)
        gap = {"type": "tool_result", "content": MISSING, "is_error": True}
        results = [first.get(t, {**gap, "tool_use_id": t}) for t in wanted]
        return results + [b for b in content if b.get("type") != "tool_result"]

    paired: list[dict[str, Any]] = []
    for index, message in enumerate(merged):
        if message["role"] == "assistant":
            paired.append(message)
            if index == len(merged) - 1 and uses(message):
                paired.append({"role": "user", "content": answer(uses(message), [])})
        else:
            previous = merged[index - 1] if index else None
            paired.append({"role": "user", "content": answer(uses(previous), message["content"])})
    alternating: list[dict[str, Any]] = []
    for message in (m for m in paired if m["content"]):
        if alternating and alternating[-1]["role"] == message["role"]:
            alternating[-1]["content"].extend(message["content"])
        else:
            alternating.append(message)
    return alternating


@given(st.booleans().flatmap(lambda greeted: transcripts(greeted=greeted)))
@example([u("hi"), a(tu("toolu_x"), tu("toolu_x")), u(tr("toolu_x", "first"), tr("toolu_x", "second"), "words")])
def test_normalize_in_one_pass_equals_the_step_by_step_normalisation(messages: list[TranscriptMessage]) -> None:
    """Merging, pairing, dropping emptied messages and re-alternating, fused into one pass for the hot path,
    give exactly what the steps give one after the other (a duplicated tool_use id answered by its first result)."""
    assert normalize_messages_for_api(messages) == _step_by_step(messages)


class _CountingList(list[TranscriptMessage]):
    """A conversation that counts the messages read from it one by one (slices are C-level copies)."""

    reads = 0

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            _CountingList.reads += 1
        return super().__getitem__(index)


def test_compact_boundary_tracker_searches_only_what_a_growing_conversation_gained() -> None:
    """`CompactBoundary.after` equals `messages_after_compact_boundary` on every call, and searches
    only the new messages of a conversation that grew by appending (whole again once rewritten)."""
    tracker = CompactBoundary()
    conversation: list[TranscriptMessage] = []
    for step in range(60):
        added: list[TranscriptMessage] = [u(f"q{step}"), a(f"r{step}")]
        if step % 17 == 16:
            added.append(SystemMessage(subtype="compact_boundary"))
        conversation = [*conversation, *added]
        if step == 40:  # a step rewrote the conversation: not a prefix any more
            conversation = [u("rewritten"), *conversation[1:]]
        counted = _CountingList(conversation)
        _CountingList.reads = 0
        assert tracker.after(counted) == messages_after_compact_boundary(conversation)
        if step and step != 40:
            assert _CountingList.reads <= len(added) + 1  # the new messages, and the prefix check's last one
    assert tracker.after([]) == []


def test_the_result_text_is_the_last_responses_text_and_a_new_message_id_starts_it_again() -> None:
    first = AssistantMessage(model="m", message_id="msg_1", content=[text("Reading ")])
    tool = AssistantMessage(model="m", message_id="msg_1", content=[tu("t1", "read", {})])
    more = AssistantMessage(model="m", message_id="msg_1", content=[text("both.")])
    final = AssistantMessage(model="m", message_id="msg_2", content=[text("Done.")])
    state = ("", "")
    for message in (first, tool, more):
        state = response_text(*state, message)
    assert state == ("msg_1", "Reading both.")
    assert response_text(*state, final) == ("msg_2", "Done.")
