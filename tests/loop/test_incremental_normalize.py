"""`IncrementalNormalizer`: the same API messages as `normalize_messages_for_api`, normalising only what is new.

The property: for random conversations that grow, and now and then are rewritten (a message replaced,
copied, removed, the history compacted or cut, thinking blocks stripped), the normaliser's answer at
every step equals the whole normalisation of the conversation at that step, and no answer it gave
earlier changes afterwards. The cost: appending k messages to a long conversation puts O(k) messages
through the per-message normalisation (`_api_blocks` calls are counted), whatever its length.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from queryloop import QueryOptions, Runtime, ScriptedModel
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
    IncrementalNormalizer,
    normalize_messages_for_api,
    strip_signature_blocks,
    user_context_message,
)
from tests.blocks import text, tool_result, tool_use
from tests.helpers import assert_settled, count_size_measures, run_query, scripted_tool, text_reply, tools_reply
from tests.helpers import tool_use as scripted_use

# -- conversations ------------------------------------------------------------------------------

IDS = ["t1", "t2", "t3", "t4"]
"""Few ids: duplicate, orphan and missing results are frequent."""


def thinking(value: str) -> Block:
    return {"type": "thinking", "thinking": value, "signature": "sig"}


def user(*blocks: Block) -> UserMessage:
    return UserMessage(content=list(blocks))


def assistant(*blocks: Block, api_error: bool = False) -> AssistantMessage:
    return AssistantMessage(message_id="msg_1", model="m", content=list(blocks), is_api_error=api_error)


words = st.sampled_from(["", "a", "go on", "done"])
ids = st.sampled_from(IDS)
user_blocks = st.lists(st.one_of(words.map(text), ids.map(tool_result)), max_size=3)
assistant_blocks = st.lists(st.one_of(words.map(text), ids.map(tool_use), words.map(thinking)), max_size=3)

messages = st.one_of(
    words.map(lambda w: UserMessage(content=w)),
    user_blocks.map(lambda blocks: user(*blocks)),
    st.builds(lambda blocks, error: assistant(*blocks, api_error=error), assistant_blocks, st.booleans()),
    assistant_blocks.map(lambda blocks: assistant(*blocks)),
    st.just(SystemMessage(subtype="model_fallback", content="switched")),
    st.sampled_from(["file_changed", "queued_message", "memory", "max_turns_reached", "hook_success"]).map(
        lambda kind: AttachmentMessage(attachment={"type": kind, "content": "body"})
    ),
)
"""Every kind of message, sent or not, with and without tool uses and results, some empty."""

exchange = st.builds(
    lambda uses, said, answered: [
        assistant(text(said), *(tool_use(i) for i in uses)),
        user(*(tool_result(i) for i in answered)),
    ],
    st.lists(ids, max_size=2, unique=True),
    words,
    st.lists(ids, max_size=2, unique=True),
)
"""One turn of the loop: a response with its tool uses, and a message of results."""

Rewrite = Callable[[list[TranscriptMessage]], list[TranscriptMessage]]


def _at(history: list[TranscriptMessage], position: int) -> int:
    return position % len(history)


def replace(position: int, message: TranscriptMessage) -> Rewrite:
    return lambda h: [*h[: _at(h, position)], message, *h[_at(h, position) + 1 :]] if h else h


def equal_copy(position: int) -> Rewrite:
    """An equal message that is another object (a no-op `model_copy`)."""
    return lambda h: [*h[: _at(h, position)], h[_at(h, position)].model_copy(), *h[_at(h, position) + 1 :]] if h else h


def remove(position: int) -> Rewrite:
    """A tombstone."""
    return lambda h: [*h[: _at(h, position)], *h[_at(h, position) + 1 :]] if h else h


def compact(keep: int) -> Rewrite:
    return lambda h: [
        SystemMessage(subtype="compact_boundary"),
        UserMessage(content="summary", is_meta=True),
        *h[len(h) - min(keep, len(h)) :],
    ]


def cut(keep: int) -> Rewrite:
    return lambda h: h[:keep]


def clear_results() -> Rewrite:
    """Microcompact: every tool result's content replaced, the messages holding them rewritten."""

    def rewrite(history: list[TranscriptMessage]) -> list[TranscriptMessage]:
        out: list[TranscriptMessage] = []
        for message in history:
            if isinstance(message, UserMessage) and isinstance(message.content, list):
                blocks = [{**b, "content": "cleared"} if b.get("type") == "tool_result" else b for b in message.content]
                out.append(message.model_copy(update={"content": blocks}))
            else:
                out.append(message)
        return out

    return rewrite


def retype_last_assistant(message: TranscriptMessage) -> Rewrite:
    """The last assistant message replaced (the normaliser's checkpoint is at the last that opens a response)."""

    def rewrite(history: list[TranscriptMessage]) -> list[TranscriptMessage]:
        found = [i for i, m in enumerate(history) if isinstance(m, AssistantMessage)]
        return replace(found[-1], message)(history) if found else history

    return rewrite


rewrites = st.one_of(
    st.builds(replace, st.integers(0, 99), messages),
    st.builds(retype_last_assistant, messages),
    st.builds(equal_copy, st.integers(0, 99)),
    st.builds(remove, st.integers(0, 99)),
    st.builds(compact, st.integers(0, 4)),
    st.builds(cut, st.integers(0, 12)),
    st.just(clear_results()),
    st.just(strip_signature_blocks),
)

Step = list[TranscriptMessage] | Rewrite
steps = st.lists(
    st.one_of(
        st.lists(messages, min_size=1, max_size=4),
        exchange,
        exchange,
        st.lists(messages, max_size=0),  # a call with nothing new (a retry, a fallback's second call)
        rewrites,
    ),
    min_size=1,
    max_size=25,
)


def grow(history: list[TranscriptMessage], step: Step) -> list[TranscriptMessage]:
    return [*history, *step] if isinstance(step, list) else step(history)


# -- the property -------------------------------------------------------------------------------


@settings(max_examples=1000, deadline=None)
@given(steps)
@example(  # an orphan-only user message between two responses without tool uses: the halves meet on one role
    [
        [UserMessage(content="go"), assistant(text("a"))],
        [user(tool_result("t1")), assistant(text("b"))],
        [user(tool_result("t2")), assistant(text("c")), UserMessage(content="more")],
        [assistant(tool_use("t1"))],
        [user(tool_result("t1")), assistant(), UserMessage(content="after an empty response")],
    ]
)
@example(  # the message at the checkpoint replaced by a user message: the results now answer the first response
    [
        [UserMessage(content=""), UserMessage(content=""), assistant(tool_use("t1")), UserMessage(content="")],
        [assistant(text("")), user(tool_result("t1"))],
        replace(4, UserMessage(content="")),
    ]
)
@example(  # a response split by invisible messages, then answered
    [
        [SystemMessage(subtype="init"), assistant(tool_use("t1")), SystemMessage(subtype="x")],
        [assistant(text("more"), api_error=True), assistant(tool_use("t2"))],
        [AttachmentMessage(attachment={"type": "hook_success"}), user(tool_result("t2"), tool_result("t1"))],
    ]
)
def test_incremental_normalization_equals_the_whole_one_at_every_step(steps: list[Step]) -> None:
    normalizer = IncrementalNormalizer()
    history: list[TranscriptMessage] = []
    given_out: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]] = []
    for step in steps:
        history = grow(history, step)
        before = list(history)
        answer = normalizer.normalize(history)
        assert answer == normalize_messages_for_api(history)
        assert history == before  # its input untouched
        given_out.append((answer, copy.deepcopy(answer)))
    for answer, as_given in given_out:
        assert answer == as_given  # no later call changed an earlier answer


def test_an_answer_is_a_new_list_whose_changes_do_not_reach_the_next() -> None:
    normalizer = IncrementalNormalizer()
    history: list[TranscriptMessage] = [UserMessage(content="go"), assistant(tool_use("t1")), user(tool_result("t1"))]
    first = normalizer.normalize(history)
    first.append({"role": "assistant", "content": [text("not in the conversation")]})
    history = [*history, assistant(text("done"))]
    assert normalizer.normalize(history) == normalize_messages_for_api(history)


# -- the cost -----------------------------------------------------------------------------------


@dataclass
class Counter:
    calls: int = 0


@pytest.fixture
def per_message_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """How many messages went through the per-message normalisation (`_api_blocks`)."""
    counter = Counter()
    original = transcript._api_blocks

    def counted(message: TranscriptMessage) -> tuple[str, list[Block]] | None:
        counter.calls += 1
        return original(message)

    monkeypatch.setattr(transcript, "_api_blocks", counted)
    yield counter


def turn(number: int, *, uses: int = 2) -> list[TranscriptMessage]:
    """One loop iteration's messages: a response (a text and `uses` tool uses), its results, an attachment."""
    ids = [f"t{number}_{i}" for i in range(uses)]
    return [
        AssistantMessage(message_id=f"msg_{number}", model="m", content=[text("working")]),
        *(AssistantMessage(message_id=f"msg_{number}", model="m", content=[tool_use(i)]) for i in ids),
        *(user(tool_result(i)) for i in ids),
        AttachmentMessage(attachment={"type": "file_changed", "content": "x"}),
    ]


def conversation(turns: int) -> list[TranscriptMessage]:
    return [UserMessage(content="start"), *(m for n in range(turns) for m in turn(n))]


@pytest.mark.parametrize("turns", [10, 100])
def test_appending_k_messages_normalizes_o_of_k_messages_whatever_the_length(
    per_message_calls: Counter, turns: int
) -> None:
    normalizer = IncrementalNormalizer()
    history = conversation(turns)
    normalizer.normalize(history)
    assert per_message_calls.calls == len(history)  # the first call normalises everything once
    for number in range(turns, turns + 20):
        appended = turn(number)
        history = [*history, *appended]
        per_message_calls.calls = 0
        answer = normalizer.normalize(history)
        # What was appended, and the previous turn again (its response opened the last checkpoint):
        # the same count at 61 messages as at 601.
        assert per_message_calls.calls == len(appended) + len(turn(number - 1))
        assert answer == normalize_messages_for_api(history)
    assert normalizer.restarts == 0


def test_a_call_with_nothing_new_normalizes_only_the_last_turn(per_message_calls: Counter) -> None:
    normalizer = IncrementalNormalizer()
    history = conversation(50)
    normalizer.normalize(history)
    per_message_calls.calls = 0
    answer = normalizer.normalize(list(history))
    assert per_message_calls.calls == len(turn(49))
    assert answer == normalize_messages_for_api(history)


def test_a_rewritten_older_message_normalizes_everything_again(per_message_calls: Counter) -> None:
    normalizer = IncrementalNormalizer()
    history = conversation(50)
    normalizer.normalize(history)
    history = clear_results()(history)  # microcompact: older messages are new objects
    per_message_calls.calls = 0
    answer = normalizer.normalize(history)
    assert per_message_calls.calls == len(history)
    assert normalizer.restarts == 1
    assert answer == normalize_messages_for_api(history)
    history = [*history, *turn(50)]
    per_message_calls.calls = 0
    normalizer.normalize(history)
    assert per_message_calls.calls == 2 * len(turn(50))  # incremental again from there
    assert normalizer.restarts == 1


def test_a_retracted_message_normalizes_everything_again(per_message_calls: Counter) -> None:
    normalizer = IncrementalNormalizer()
    history = conversation(20)
    normalizer.normalize(history)
    history = [m for m in history if m is not history[5]]  # a tombstone, same length once a message is added
    history.append(UserMessage(content="and then"))
    per_message_calls.calls = 0
    answer = normalizer.normalize(history)
    assert per_message_calls.calls == len(history)
    assert normalizer.restarts == 1
    assert answer == normalize_messages_for_api(history)


# -- in the loop --------------------------------------------------------------------------------


async def test_a_long_query_normalizes_each_message_a_bounded_number_of_times(per_message_calls: Counter) -> None:
    """40 tool turns: each request normalises its new messages and the previous turn's, never the whole history
    (the user context's message heads each request as the same object); each request is the whole normalisation."""
    turns = 40
    replies = [tools_reply(scripted_use(f"t{n}", "read"), text=f"step {n}") for n in range(turns)]
    context = {"cwd": "/repo"}
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [*replies, text_reply("Done.")],
            tools=[scripted_tool("read", result="file text", safe=True)],
            user_context=context,
        )
        calls = per_message_calls.calls
        conversation = await ran.session.transcript()
        await assert_settled(ran)
    assert ran.reason == "completed" and len(ran.model.requests) == turns + 1
    # Per turn: an assistant text, its tool_use and the result (3 messages), each normalised at most twice.
    context_message = user_context_message(context)
    assert context_message is not None
    sent = [context_message, *conversation]
    assert calls <= 2 * len(sent)  # the whole normalisation at every request: about turns * len(sent) / 2
    for number, request in enumerate(ran.model.requests):
        history = sent[: 2 + 3 * number]  # the context, the prompt, then three messages a turn
        assert request.messages == normalize_messages_for_api(history)


async def test_a_long_session_normalizes_each_message_a_bounded_number_of_times(per_message_calls: Counter) -> None:
    """30 queries in one session: each query's first request normalises only what the conversation gained
    since the previous query (the session keeps one normaliser, and one context message per context)."""
    queries = 30
    context = {"cwd": "/repo"}
    model = ScriptedModel([text_reply(f"answer {n}") for n in range(queries)])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, user_context=context))
        for number in range(queries):
            await session.query(f"question {number}").wait()
        conversation = await session.transcript()
        await session.close()
    assert len(conversation) == 2 * queries
    # Made per query, each first request would normalise the whole conversation: about queries² messages.
    assert per_message_calls.calls <= 3 * len(conversation)
    context_message = user_context_message(context)
    assert context_message is not None
    last = normalize_messages_for_api([context_message, *conversation[:-1]])
    assert model.requests[-1].messages == last


async def test_a_long_session_scans_each_tool_result_for_its_size_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """30 queries of one session, a tool call each: the oversized-result scan is the session's (as its
    normaliser is), so a query's first call measures only the results gained since the query before."""
    measured = count_size_measures(monkeypatch)
    queries = 30
    replies: list[dict[str, Any]] = []
    for number in range(queries):
        replies += [tools_reply(scripted_use(f"t{number}", "read")), text_reply(f"answer {number}")]
    model = ScriptedModel(replies)
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=model, tools=[scripted_tool("read", result="file text", safe=True)])
        )
        for number in range(queries):
            handle = session.query(f"question {number}")
            await handle.wait()
            assert handle.terminal is not None and handle.terminal.reason == "completed"
        await session.close()
    assert sorted(set(measured)) == sorted(f"t{number}" for number in range(queries))
    # Per query, each earlier result measured again: 1 + 2 + ... + 30 = 465 measures.
    assert len(measured) <= 2 * queries
