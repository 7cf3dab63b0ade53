"""`IncrementalNormalizer`: the same API messages as `normalize_messages_for_api`, normalising only what is new.

The property: for random conversations that grow, and now and then are rewritten (a message replaced,
copied, removed, the history compacted or cut, thinking blocks stripped), the normaliser's answer at
every step equals the whole normalisation of the conversation at that step, and no answer it gave
earlier changes afterwards. In the loop, each request is the whole normalisation of its conversation. The
cost (appending k messages puts O(k) messages through the per-message normalisation, whatever the
conversation's length) is `bench tricks`'.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from queryloop import QueryOptions, Runtime, ScriptedModel
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
from tests.helpers import assert_settled, run_query, scripted_tool, text_reply, tools_reply
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


# -- rewrites -----------------------------------------------------------------------------------


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


def test_a_rewritten_older_message_gives_the_whole_normalization_and_so_does_what_follows() -> None:
    normalizer = IncrementalNormalizer()
    history = conversation(50)
    normalizer.normalize(history)
    history = clear_results()(history)  # microcompact: older messages are new objects
    assert normalizer.normalize(history) == normalize_messages_for_api(history)
    history = [*history, *turn(50)]
    assert normalizer.normalize(history) == normalize_messages_for_api(history)


def test_a_retracted_message_gives_the_whole_normalization() -> None:
    normalizer = IncrementalNormalizer()
    history = conversation(20)
    normalizer.normalize(history)
    history = [m for m in history if m is not history[5]]  # a tombstone, same length once a message is added
    history.append(UserMessage(content="and then"))
    assert normalizer.normalize(history) == normalize_messages_for_api(history)


# -- in the loop --------------------------------------------------------------------------------


async def test_each_request_of_a_long_query_is_the_whole_normalization_of_its_conversation() -> None:
    """40 tool turns, the user context's message heading each request (how few messages each request puts
    through the normalisation is `bench tricks`')."""
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
        conversation = await ran.session.transcript()
        await assert_settled(ran)
    assert ran.reason == "completed" and len(ran.model.requests) == turns + 1
    context_message = user_context_message(context)
    assert context_message is not None
    sent = [context_message, *conversation]
    for number, request in enumerate(ran.model.requests):
        history = sent[: 2 + 3 * number]  # the context, the prompt, then three messages a turn
        assert request.messages == normalize_messages_for_api(history)


async def test_the_last_request_of_a_long_session_is_the_whole_normalization_of_its_conversation() -> None:
    """30 queries in one session, which keeps one normaliser (how few messages each query's first request
    puts through the normalisation is `bench tricks`')."""
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
    context_message = user_context_message(context)
    assert context_message is not None
    last = normalize_messages_for_api([context_message, *conversation[:-1]])
    assert model.requests[-1].messages == last
