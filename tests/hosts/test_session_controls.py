"""The Agent SDK's session controls on the trio `Session`, checked against Claude Code's behaviour:
`compact(instructions)` (its `/compact`), `context_usage()` (its `/context`), `set_model(model)`, and a resume
up to a given message (`resume_session_at`). The other hosts' own test of each control is in
tests/hosts/test_session_controls_hosts.py."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from queryloop import (
    AssistantMessage,
    CompactFailed,
    HookMatcher,
    QueryInProgress,
    QueryOptions,
    Runtime,
    ScriptedModel,
    SystemMessage,
    UserMessage,
)
from queryloop.runtime.loop.context import COMPACT_INSTRUCTIONS, COMPACT_SUMMARY_PREFIX, compact_prompt
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.restore import load_transcript
from tests.actors.test_lifecycle_hooks import Seen, context, sent_text
from tests.helpers import scripted_tool, text_reply, tool_use, tools_reply

LONG_PROMPT = "Remember the parser bug in tokens.py. " * 200
"""About 1,900 tokens at 4 characters a token: what a compaction visibly shrinks."""


def categories(usage: Any) -> dict[str, int]:
    return {category["name"]: category["tokens"] for category in usage["categories"]}


def compactor(*summaries: str) -> ScriptedModel:
    return ScriptedModel([text_reply(summary) for summary in summaries], name="compactor")


def last_text(request: ModelRequest) -> str:
    content = request.messages[-1]["content"]
    return content if isinstance(content, str) else "".join(block.get("text", "") for block in content)


# -- compact --------------------------------------------------------------------------------------------------
async def test_compact_without_instructions_fires_pre_and_post_compact_hooks_with_trigger_manual() -> None:
    pre, post = Seen(), Seen(context("PostCompact", "Re-read the plan."))
    start = Seen()
    model, summary = ScriptedModel([text_reply("Noted."), text_reply("Fixed it.")]), compactor("We fixed tokens.py.")
    hooks = {
        "PreCompact": [HookMatcher(matcher="manual", hooks=[pre])],
        "PostCompact": [HookMatcher(hooks=[post])],
        "SessionStart": [HookMatcher(matcher="compact", hooks=[start])],
    }
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, compact_provider=summary, hooks=hooks))
        await session.query(LONG_PROMPT).wait()
        boundary = await session.compact()
        conversation = await session.transcript()
        await session.query("Go on").wait()
    assert isinstance(boundary, SystemMessage) and boundary.subtype == "compact_boundary"
    assert boundary.data["trigger"] == "manual" and boundary.data["pre_tokens"] > 400
    ((before,),) = [pre.inputs]
    assert before["hook_event_name"] == "PreCompact" and before["trigger"] == "manual"
    assert before["custom_instructions"] is None
    ((after,),) = [post.inputs]
    assert after["trigger"] == "manual" and after["compact_summary"] == "We fixed tokens.py."
    assert [data["source"] for data in start.inputs] == ["compact"]
    # The summary request: the conversation, then Claude Code's instructions without additional ones.
    (request,) = summary.requests
    assert last_text(request) == COMPACT_INSTRUCTIONS and "parser bug" in sent_text(request)
    # The boundary and the summary joined the conversation, the PostCompact hook's context after them.
    index = next(i for i, m in enumerate(conversation) if m.uuid == boundary.uuid)
    following = conversation[index + 1]
    assert isinstance(following, UserMessage) and following.content == f"{COMPACT_SUMMARY_PREFIX}We fixed tokens.py."
    # The next query's model call sends the summary, not the messages it replaced.
    sent = sent_text(model.requests[1])
    assert "We fixed tokens.py." in sent and "Re-read the plan." in sent and "Go on" in sent
    assert "parser bug" not in sent and "Noted." not in sent


async def test_compact_with_instructions_appends_them_to_the_summary_prompt_and_gives_them_to_pre_compact() -> None:
    pre = Seen()
    summary = compactor("Only the file names: tokens.py.")
    options = QueryOptions(
        provider=ScriptedModel([text_reply("Noted.")]),
        compact_provider=summary,
        compact_instructions="The session's own instructions.",
        hooks={"PreCompact": [HookMatcher(hooks=[pre])]},
    )
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options)
        await session.query(LONG_PROMPT).wait()
        boundary = await session.compact("Keep only the file names.")
    assert boundary.data["trigger"] == "manual"
    assert [data["custom_instructions"] for data in pre.inputs] == ["Keep only the file names."]
    (request,) = summary.requests
    assert last_text(request) == compact_prompt("Keep only the file names.")
    assert last_text(request).endswith("\n\nAdditional Instructions:\nKeep only the file names.")


async def test_compact_while_a_query_runs_is_refused_with_query_in_progress_and_works_once_it_has_ended() -> None:
    summary = compactor("A summary.")
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=ScriptedModel([text_reply("Noted.")]), compact_provider=summary)
        )
        handle = session.query(LONG_PROMPT)
        with pytest.raises(QueryInProgress, match="runs"):
            await session.compact()
        await handle.wait()
        assert summary.requests == []  # the refused compaction sent nothing
        boundary = await session.compact()
    assert boundary.subtype == "compact_boundary" and len(summary.requests) == 1


async def test_a_message_sent_while_compact_runs_waits_for_it_and_a_second_compact_is_refused() -> None:
    release = trio.Event()
    model = ScriptedModel([text_reply("Noted."), text_reply("Fixed.")])

    class HeldSummary:
        """The compaction model, answering once the test has sent its next message."""

        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            await release.wait()
            async for event in compactor("Held summary.").stream(request):
                yield event

    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, compact_provider=HeldSummary()))
        await session.query(LONG_PROMPT).wait()
        async with trio.open_nursery() as nursery:
            boundaries: list[SystemMessage] = []

            async def compact() -> None:
                boundaries.append(await session.compact())

            nursery.start_soon(compact)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(QueryInProgress):  # one compaction at a time
                await session.compact()
            handle = session.query("Go on")  # sent while the compaction runs: it waits its turn
            release.set()
            result = await handle.wait()
    assert result.result == "Fixed." and len(boundaries) == 1
    sent = sent_text(model.requests[1])
    assert "Held summary." in sent and "parser bug" not in sent


async def test_closing_the_session_while_compact_runs_cancels_it_and_ends_the_message_waiting_for_it() -> None:
    model = ScriptedModel([text_reply("Noted."), text_reply("Fixed.")])

    class NeverAnswers:
        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            await trio.sleep_forever()
            yield {}

    with trio.fail_after(10):  # nothing waits past the session's close
        async with Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=model, compact_provider=NeverAnswers()))
            await session.query(LONG_PROMPT).wait()
            failures: list[CompactFailed] = []
            async with trio.open_nursery() as nursery:

                async def compact() -> None:
                    with pytest.raises(CompactFailed) as failed:
                        await session.compact()
                    failures.append(failed.value)

                nursery.start_soon(compact)
                await trio.testing.wait_all_tasks_blocked()
                handle = session.query("Go on")  # waits its turn behind the compaction
                await session.close()
            result = await handle.wait()
    assert [str(f) for f in failures] == ["Compaction canceled."]
    assert result.subtype == "error_during_execution" and handle.terminal is not None
    assert len(model.requests) == 1  # the waiting message never reached the model


async def test_compact_of_an_empty_conversation_fails_with_not_enough_messages() -> None:
    summary = compactor("unused")
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=ScriptedModel([]), compact_provider=summary))
        with pytest.raises(CompactFailed, match=r"^Not enough messages to compact\.$"):
            await session.compact()
        assert await session.transcript() == []
    assert summary.requests == []


async def test_a_pre_compact_block_refuses_a_manual_compact_with_its_reason() -> None:
    block = Seen({"decision": "block", "reason": "Not now."})
    summary = compactor("unused")
    options = QueryOptions(
        provider=ScriptedModel([text_reply("Noted.")]),
        compact_provider=summary,
        hooks={"PreCompact": [HookMatcher(hooks=[block])]},
    )
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options)
        await session.query(LONG_PROMPT).wait()
        with pytest.raises(CompactFailed, match=r"Not now\."):
            await session.compact()
        conversation = await session.transcript()
    assert summary.requests == []
    assert not [m for m in conversation if isinstance(m, SystemMessage) and m.subtype == "compact_boundary"]


async def test_a_failed_summary_request_fails_compact_with_the_models_error() -> None:
    summary = ScriptedModel([{"error": "prompt_too_long"}], name="compactor")
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=ScriptedModel([text_reply("Noted.")]), compact_provider=summary)
        )
        await session.query(LONG_PROMPT).wait()
        with pytest.raises(CompactFailed, match=r"^Error during compaction: "):
            await session.compact()
        assert len(await session.transcript()) == 2  # the prompt and its answer, as they were


async def test_an_abort_while_compact_runs_cancels_it() -> None:
    started = trio.Event()

    class Hanging:
        async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
            started.set()
            await trio.sleep_forever()
            yield {}  # pragma: no cover - never reached

    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=ScriptedModel([text_reply("Noted.")]), compact_provider=Hanging())
        )
        await session.query(LONG_PROMPT).wait()
        failures: list[BaseException] = []

        async def compact() -> None:
            try:
                await session.compact()
            except CompactFailed as failed:
                failures.append(failed)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(compact)
            await started.wait()
            await session.abort()
        assert len(await session.transcript()) == 2
    assert [str(failure) for failure in failures] == ["Compaction canceled."]


# -- context_usage --------------------------------------------------------------------------------------------
async def test_context_usage_counts_the_system_prompt_tools_and_messages_before_and_after_a_query_and_compact() -> None:
    summary = compactor("Short.")
    options = QueryOptions(
        provider=ScriptedModel([text_reply("Noted.")]), compact_provider=summary, context_window=200_000
    )
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options)
        empty = await session.context_usage()
        await session.query(LONG_PROMPT).wait()
        after_query = await session.context_usage()
        await session.compact()
        after_compact = await session.context_usage()
    assert set(empty) >= {"categories", "totalTokens", "maxTokens", "rawMaxTokens", "percentage", "model"}
    assert empty["model"] == options.model and empty["rawMaxTokens"] == 200_000
    assert empty["isAutoCompactEnabled"] and empty["maxTokens"] == empty["autoCompactThreshold"] < 200_000
    assert categories(empty)["Messages"] == 0 and categories(empty)["System prompt"] > 0
    assert empty["totalTokens"] == categories(empty)["System prompt"] + categories(empty)["System tools"]
    assert categories(after_query)["Messages"] > 400  # the long prompt and its answer
    assert after_query["totalTokens"] > empty["totalTokens"]
    assert after_query["percentage"] == round(100 * after_query["totalTokens"] / 200_000, 2)
    assert categories(after_query)["Free space"] == after_query["maxTokens"] - after_query["totalTokens"]
    assert 0 < categories(after_compact)["Messages"] < 100  # the summary alone
    assert after_compact["totalTokens"] < after_query["totalTokens"]
    assert after_query["memoryFiles"] == after_query["agents"] == []  # the runtime has none to count
    assert after_query["gridRows"] == []


# -- set_model ------------------------------------------------------------------------------------------------
async def test_set_model_changes_the_model_of_the_next_query_and_none_goes_back_to_the_options_model() -> None:
    model = ScriptedModel([text_reply("One."), text_reply("Two."), text_reply("Three.")])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, model="claude-sonnet-4-5"))
        await session.query("First").wait()
        await session.set_model("claude-opus-4-6")
        usage = await session.context_usage()
        await session.query("Second").wait()
        await session.set_model(None)
        await session.query("Third").wait()
    assert [request.model for request in model.requests] == [
        "claude-sonnet-4-5",
        "claude-opus-4-6",
        "claude-sonnet-4-5",
    ]
    assert usage["model"] == "claude-opus-4-6"


async def test_set_model_leaves_the_running_query_on_its_model() -> None:
    model = ScriptedModel([text_reply("One."), text_reply("Two.")])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, model="claude-sonnet-4-5"))
        handle = session.query("First")
        await session.set_model("claude-opus-4-6")
        await handle.wait()
        await session.query("Second").wait()
    assert [request.model for request in model.requests] == ["claude-sonnet-4-5", "claude-opus-4-6"]


async def test_set_model_refuses_a_model_the_options_refuse() -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=ScriptedModel([])))
        with pytest.raises(ValueError, match="no price known"):
            await session.set_model("no-such-model")


# -- resume_session_at ----------------------------------------------------------------------------------------
async def _two_turns(runtime: Runtime, path: Path) -> list[Any]:
    model = ScriptedModel([text_reply("First answer."), text_reply("Second answer.")])
    session = await runtime.open_session(QueryOptions(provider=model), transcript=path)
    await session.query("First question").wait()
    await session.query("Second question").wait()
    conversation = await session.transcript()
    await session.close()
    return conversation


async def test_resume_session_at_restores_the_conversation_up_to_that_message_and_retracts_the_rest(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    model = ScriptedModel([text_reply("Third answer.")])
    async with Runtime.open() as runtime:
        first, _, _, _ = conversation = await _two_turns(runtime, path)
        answer = conversation[1]
        session = await runtime.open_session(QueryOptions(provider=model), resume=path, resume_session_at=answer.uuid)
        restored = await session.transcript()
        await session.query("Third question").wait()
        session_id = session.id
        await session.close()
    assert restored == [first, answer]
    sent = sent_text(model.requests[0])
    assert "First answer." in sent and "Third question" in sent and "Second question" not in sent
    # The same file: what followed the message is retracted there, so a load reads what the session went on with.
    loaded = load_transcript(path)
    assert loaded.session_id == session_id and loaded.problems == []
    assert [m.uuid for m in loaded.messages[:2]] == [first.uuid, answer.uuid]
    third, reply = loaded.messages[2:]
    assert isinstance(third, UserMessage) and third.content == "Third question"
    assert isinstance(reply, AssistantMessage) and "Third answer." in str(reply.content)
    assert "Second question" not in str(loaded.messages) and "Second answer." not in str(loaded.messages)


async def test_resume_session_at_with_fork_starts_a_new_file_from_that_message_and_leaves_the_resumed_one(
    tmp_path: Path,
) -> None:
    path, forked = tmp_path / "t.jsonl", tmp_path / "fork.jsonl"
    async with Runtime.open() as runtime:
        conversation = await _two_turns(runtime, path)
        before = path.read_bytes()
        session = await runtime.open_session(
            QueryOptions(provider=ScriptedModel([])),
            resume=path,
            transcript=forked,
            fork=True,
            resume_session_at=conversation[1].uuid,
        )
        restored = await session.transcript()
        await session.close()
    assert restored == conversation[:2]
    assert path.read_bytes() == before  # the resumed file as it was
    loaded = load_transcript(forked)
    assert loaded.session_id == session.id and [m.uuid for m in loaded.messages] == [m.uuid for m in conversation[:2]]


async def test_resume_session_at_an_unknown_uuid_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with Runtime.open() as runtime:
        await _two_turns(runtime, path)
        before = path.read_bytes()
        with pytest.raises(ValueError, match="resume_session_at='no-such-uuid' names no message"):
            await runtime.open_session(
                QueryOptions(provider=ScriptedModel([])), resume=path, resume_session_at="no-such-uuid"
            )
        with pytest.raises(ValueError, match="give resume= too"):
            await runtime.open_session(QueryOptions(provider=ScriptedModel([])), resume_session_at="no-such-uuid")
        assert runtime.groups == {}
    assert path.read_bytes() == before


async def test_resume_session_at_a_tool_use_without_its_result_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    model = ScriptedModel([tools_reply(tool_use("t1", "lookup")), text_reply("Found it.")])
    async with Runtime.open() as runtime:
        session = await runtime.open_session(
            QueryOptions(provider=model, tools=[scripted_tool("lookup", result="42")]), transcript=path
        )
        await session.query("Look it up").wait()
        conversation = await session.transcript()
        await session.close()
        (call,) = [m for m in conversation if isinstance(m, AssistantMessage) and "tool_use" in str(m.content)]
        with pytest.raises(ValueError, match=r"cannot be sent again.*tool_use t1 has no tool_result"):
            await runtime.open_session(
                QueryOptions(provider=ScriptedModel([])), resume=path, resume_session_at=call.uuid
            )
