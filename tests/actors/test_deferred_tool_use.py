"""A PreToolUse hook's `permissionDecision: "defer"`, as Claude Code (2.1.89 and later, in its SDK mode) handles it:
the query ends `tool_deferred` with the call on the result's `deferred_tool_use` and the call left unanswered in the
transcript; the session's next query (or a session resumed from the transcript) replays it, its hooks deciding
again. Real scripted queries, as the other hook tests run them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any, cast

import trio
from pydantic import BaseModel

from queryloop import (
    AgentDefinition,
    DeferredToolUse,
    HookContext,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    QueryOptions,
    Runtime,
    ScriptedModel,
    ToolContext,
    tool,
)
from queryloop.runtime.loop.events import AttachmentMessage, TranscriptMessage
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.restore import load_transcript
from queryloop.runtime.loop.transcript import transcript_problems
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import (
    Ran,
    ToolLog,
    assert_settled,
    consume,
    log_records,
    open_session,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)

WRITE = {"path": "a.txt"}


class Decides:
    """A PreToolUse hook answering with the decision it holds now (the host's, out of band), and what it saw."""

    def __init__(self, decision: str | None = "defer", **extra: Any) -> None:
        self.decision, self.extra = decision, extra
        self.seen: list[tuple[str | None, dict[str, Any]]] = []

    async def __call__(self, input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        self.seen.append((tool_use_id, dict(cast("dict[str, Any]", input_data)["tool_input"])))
        if self.decision is None:
            return {}
        output = {"hookEventName": "PreToolUse", "permissionDecision": self.decision, **self.extra}
        return cast("HookJSONOutput", {"hookSpecificOutput": output})

    def options(self) -> dict[str, Any]:
        return {"hooks": {"PreToolUse": [HookMatcher(hooks=[self])]}}


def deferred_attachments(messages: list[TranscriptMessage]) -> list[dict[str, Any]]:
    return [
        m.attachment
        for m in messages
        if isinstance(m, AttachmentMessage) and m.attachment.get("type") == "hook_deferred_tool"
    ]


def results_sent(request: ModelRequest) -> dict[str, dict[str, Any]]:
    """The tool_results of a request's last user message, by id."""
    content = request.messages[-1]["content"]
    return {b["tool_use_id"]: b for b in content if b.get("type") == "tool_result"}


async def deferred_first(
    hook: Decides,
    log: ToolLog,
    replies: list[dict[str, Any]],
    *,
    runtime: Runtime,
    transcript: Path | None = None,
    **options: Any,
) -> Ran:
    """A session whose first query's single `write` call (t1) its PreToolUse hook defers."""
    model = ScriptedModel([tools_reply(tool_use("t1", "write", WRITE)), *replies])
    options.setdefault("tools", [scripted_tool("write", result="wrote", log=log)])
    session = await runtime.open_session(
        QueryOptions(provider=model, **hook.options(), **options), transcript=transcript
    )
    return await consume(session, session.query("Write a.txt"), model)


async def test_a_defer_ends_the_query_tool_deferred_with_the_call_on_the_result_and_left_unanswered() -> None:
    hook, log = Decides("defer"), ToolLog()
    async with Runtime.open() as runtime:
        ran = await deferred_first(hook, log, [], runtime=runtime)
        await assert_settled(ran)  # a deferred call waiting at the end is a valid conversation
        result = ran.handle.result
        assert result is not None
        assert ran.reason == "tool_deferred" and result.terminal_reason == "tool_deferred"
        assert result.subtype == "success" and result.is_error is False and result.errors == []
        assert result.deferred_tool_use == DeferredToolUse(id="t1", name="write", input=WRITE)
        assert log.order == [] and ran.tool_results() == {}  # never ran, no tool_result
        assert len(ran.model.requests) == 1
        transcript = await ran.session.transcript()
        assert deferred_attachments(transcript) == [
            {
                "type": "hook_deferred_tool",
                "toolUseID": "t1",
                "toolName": "write",
                "toolInput": WRITE,
                "hookEvent": "PreToolUse",
            }
        ]
        assert transcript[-1].type == "attachment"  # the call's attachment closes the conversation


async def test_the_next_query_replays_the_deferred_call_its_hook_allowing_and_goes_on_to_the_model() -> None:
    hook, log = Decides("defer"), ToolLog()
    async with Runtime.open() as runtime:
        first = await deferred_first(hook, log, [text_reply("Wrote it.")], runtime=runtime)
        assert first.reason == "tool_deferred"
        hook.decision = "allow"  # the host decided, out of band
        session = first.session
        ran = await consume(session, session.query(""), first.model)
        await assert_settled(ran)
        assert ran.reason == "completed" and ran.handle.result is not None
        assert ran.handle.result.result == "Wrote it." and ran.handle.result.deferred_tool_use is None
        assert log.order == ["t1"]  # ran once, under its own id
        assert hook.seen == [("t1", WRITE), ("t1", WRITE)]  # the hooks fired again for the same call
        assert ran.tool_results()["t1"]["content"] == "wrote"
        second = first.model.requests[1]
        assert results_sent(second)["t1"]["content"] == "wrote"
        assert second.messages[-1]["content"] == [results_sent(second)["t1"]]  # the empty prompt never joined
        assert second.messages[-2]["content"][-1]["id"] == "t1"  # right after the call, as the API wants it


async def test_a_prompt_given_to_the_resuming_query_joins_after_the_calls_result() -> None:
    hook, log = Decides("defer"), ToolLog()
    async with Runtime.open() as runtime:
        first = await deferred_first(hook, log, [text_reply("Done.")], runtime=runtime)
        hook.decision = "allow"
        ran = await consume(first.session, first.session.query("Then say done."), first.model)
        await assert_settled(ran)
        content = first.model.requests[1].messages[-1]["content"]
        assert [b["type"] for b in content] == ["tool_result", "text"] and content[1]["text"] == "Then say done."


async def test_a_deny_on_replay_answers_the_call_with_the_deny_and_the_model_reads_it() -> None:
    hook, log = Decides("defer"), ToolLog()
    async with Runtime.open() as runtime:
        first = await deferred_first(hook, log, [text_reply("Understood.")], runtime=runtime)
        hook.decision, hook.extra = "deny", {"permissionDecisionReason": "the reviewer said no"}
        ran = await consume(first.session, first.session.query(""), first.model)
        await assert_settled(ran)
        assert log.order == [] and ran.reason == "completed"
        sent = results_sent(first.model.requests[1])["t1"]
        assert sent["is_error"] is True and "the reviewer said no" in str(sent["content"])
        assert ran.handle.result is not None
        assert ran.handle.result.permission_denials == [
            {"tool_name": "write", "tool_use_id": "t1", "tool_input": WRITE}
        ]


async def test_a_defer_again_on_replay_ends_the_query_tool_deferred_again_without_a_model_call() -> None:
    hook, log = Decides("defer"), ToolLog()
    async with Runtime.open() as runtime:
        first = await deferred_first(hook, log, [text_reply("Finally.")], runtime=runtime)
        again = await consume(first.session, first.session.query(""), first.model)
        await assert_settled(again)
        assert again.reason == "tool_deferred" and again.handle.result is not None
        assert again.handle.result.deferred_tool_use == DeferredToolUse(id="t1", name="write", input=WRITE)
        assert len(first.model.requests) == 1 and log.order == []
        assert len(deferred_attachments(await first.session.transcript())) == 2
        hook.decision = "allow"  # still pending: a third query runs it
        last = await consume(first.session, first.session.query(""), first.model)
        assert last.reason == "completed" and log.order == ["t1"]


class PathArgs(BaseModel):
    path: str


async def test_an_allows_updated_input_on_replay_is_what_the_tool_runs_with() -> None:
    received: list[str] = []

    @tool
    async def write(args: PathArgs, ctx: ToolContext) -> str:
        """Write a file."""
        received.append(args.path)
        return "wrote"

    hook = Decides("defer")
    async with Runtime.open() as runtime:
        first = await deferred_first(hook, ToolLog(), [text_reply()], runtime=runtime, tools=[write])
        hook.decision, hook.extra = "allow", {"updatedInput": {"path": "/sandbox/a.txt"}}
        ran = await consume(first.session, first.session.query(""), first.model)
        await assert_settled(ran)
    assert received == ["/sandbox/a.txt"]
    assert first.model.requests[1].messages[-2]["content"][-1]["input"] == WRITE  # the model's own call


async def test_with_several_tool_calls_in_the_turn_a_defer_is_ignored_with_a_warning() -> None:
    hook, log = Decides("defer"), ToolLog()
    model = ScriptedModel(
        [tools_reply(tool_use("t1", "write", WRITE), tool_use("t2", "write", {"path": "b.txt"})), text_reply("Both.")]
    )
    with log_records() as records:
        async with Runtime.open() as runtime:
            session = await open_session(runtime, model, tools=[scripted_tool("write", log=log)], **hook.options())
            ran = await consume(session, session.query("Write both"), model)
            await assert_settled(ran)
    assert ran.reason == "completed" and ran.handle.result is not None
    assert ran.handle.result.deferred_tool_use is None
    assert log.order == ["t1", "t2"]  # the normal permission flow: nothing to ask, so both ran
    warnings = [r["message"] for r in records if r["level"] == "WARNING" and "defer" in r["message"]]
    assert len(warnings) == 2 and all("2 tool calls" in w for w in warnings)


async def test_a_deferred_tool_gone_when_replayed_ends_tool_deferred_unavailable_before_any_hook() -> None:
    hook, log = Decides("defer"), ToolLog()
    async with Runtime.open() as runtime:
        first = await deferred_first(hook, log, [text_reply("Done.")], runtime=runtime)
        hook.decision = "allow"
        gone = await consume(first.session, first.session.query("", tools=[]), first.model)
        await assert_settled(gone)
        result = gone.handle.result
        assert result is not None and gone.reason == "tool_deferred_unavailable"
        assert result.terminal_reason == "tool_deferred_unavailable" and result.is_error is True
        assert result.deferred_tool_use == DeferredToolUse(id="t1", name="write", input=WRITE)
        assert len(hook.seen) == 1 and len(first.model.requests) == 1  # no hook fired, no model call
        back = await consume(first.session, first.session.query(""), first.model)  # the tool is back: it runs
        assert back.reason == "completed" and log.order == ["t1"]


async def test_a_session_resumed_from_its_transcript_replays_the_deferred_call(tmp_path: Path) -> None:
    path, hook, log = tmp_path / "t.jsonl", Decides("defer"), ToolLog()
    async with Runtime.open() as runtime:
        first = await deferred_first(hook, log, [], runtime=runtime, transcript=path)
        assert first.reason == "tool_deferred"
        await first.session.close()
    loaded = load_transcript(path)
    assert loaded.problems == [] and deferred_attachments(loaded.messages)  # left open: no crash's repair
    assert transcript_problems(loaded.messages) == []
    hook.decision = "allow"
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Resumed and wrote.")])
        options = QueryOptions(
            provider=model, tools=[scripted_tool("write", result="wrote", log=log)], **hook.options()
        )
        session = await runtime.open_session(options, resume=path)
        ran = await consume(session, session.query(""), model)
        await assert_settled(ran)
        assert ran.reason == "completed" and log.order == ["t1"]
        assert hook.seen == [("t1", WRITE), ("t1", WRITE)]
        assert results_sent(model.requests[0])["t1"]["content"] == "wrote"
        await session.close()
    assert load_transcript(path).problems == []


async def test_a_settings_command_hook_printing_defer_defers_the_call(tmp_path: Path) -> None:
    (tmp_path / ".claude").mkdir()
    output = {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "defer"}}
    hook = {"type": "command", "command": f"cat >/dev/null; echo '{json.dumps(output)}'"}
    settings = {"hooks": {"PreToolUse": [{"matcher": "write", "hooks": [hook]}]}}
    (tmp_path / ".claude" / "settings.json").write_text(json.dumps(settings))
    log = ToolLog()
    model = ScriptedModel([tools_reply(tool_use("t1", "write", WRITE))])
    async with Runtime.open() as runtime:
        tools = [scripted_tool("write", log=log)]
        session = await open_session(runtime, model, tools=tools, cwd=tmp_path, setting_sources=["project"])
        ran = await consume(session, session.query("Write a.txt"), model)
        await assert_settled(ran)
    assert ran.reason == "tool_deferred" and log.order == []
    assert ran.handle.result is not None and ran.handle.result.deferred_tool_use is not None


class StallsAtTheEnd:
    """Streams each reply until its `message_delta`, then waits forever: the response never ends."""

    def __init__(self, inner: ScriptedModel) -> None:
        self.inner, self.requests = inner, inner.requests
        self.stalled = trio.Event()

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        async with aclosing(self.inner.stream(request)) as events:
            async for event in events:
                if event.get("type") == "message_delta":
                    self.stalled.set()
                    await trio.sleep_forever()
                yield event


async def test_an_abort_while_the_deferred_call_waits_for_its_response_ends_the_query_cleanly() -> None:
    asked = trio.Event()

    async def defers(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        asked.set()
        return {"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "defer"}}

    log = ToolLog()
    model = StallsAtTheEnd(ScriptedModel([tools_reply(tool_use("t1", "write", WRITE))]))
    async with Runtime.open() as runtime:
        options = QueryOptions(
            provider=model,
            tools=[scripted_tool("write", log=log)],
            hooks={"PreToolUse": [HookMatcher(hooks=[defers])]},
        )
        session = await runtime.open_session(options)
        handle = session.query("Write a.txt")
        async with trio.open_nursery() as nursery:

            async def abort_once_waiting() -> None:
                await asked.wait()
                await model.stalled.wait()
                await trio.testing.wait_all_tasks_blocked()
                session.abort_nowait("user")

            nursery.start_soon(abort_once_waiting)
            ran = await consume(session, handle, model.inner)
        await assert_settled(ran)
    assert ran.reason == "aborted_streaming" and log.order == []
    assert ran.tool_results()["t1"]["is_error"] is True  # answered by the abort, as any call it cut
    assert ran.handle.result is not None and ran.handle.result.deferred_tool_use is None


async def test_a_subagents_call_is_not_deferred_its_defer_ignored_with_a_warning() -> None:
    hook, log = Decides(), ToolLog()
    provider = ByPrompt(
        {
            "Delegate": [tools_reply(agent_call("call_1", "writer", "Write it")), text_reply("Delegated.")],
            "Write it": [tools_reply(tool_use("w1", "write", WRITE)), text_reply("Written.")],
        }
    )
    writer = AgentDefinition(description="Writes files", prompt="You write.", tools=["write"])
    with log_records() as records:
        async with Runtime.open() as runtime:
            options = QueryOptions(
                provider=provider,
                tools=[scripted_tool("write", log=log)],
                agents={"writer": writer},
                hooks={"PreToolUse": [HookMatcher(matcher="write", hooks=[hook])]},
            )
            session = await runtime.open_session(options)
            handle = session.query("Delegate")
            _ = [event async for event in handle]
    assert handle.terminal is not None and handle.terminal.reason == "completed"
    assert handle.result is not None and handle.result.deferred_tool_use is None
    assert log.order == ["w1"] and hook.seen == [("w1", WRITE)]
    assert any("subagent" in r["message"] for r in records if r["level"] == "WARNING")


async def test_an_abort_during_the_replay_answers_the_call_as_interrupted_and_ends_the_query() -> None:
    hook, log = Decides(), ToolLog()
    replaying, release = trio.Event(), trio.Event()

    async def waits_on_replay(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        if hook.seen:  # the second time: the replay
            replaying.set()
            await release.wait()
        return await hook(input_data, tool_use_id, context)

    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "write", WRITE)), text_reply("never")])
        options = QueryOptions(
            provider=model,
            tools=[scripted_tool("write", log=log)],
            hooks={"PreToolUse": [HookMatcher(hooks=[waits_on_replay])]},
        )
        session = await runtime.open_session(options)
        first = await consume(session, session.query("Write a.txt"), model)
        assert first.reason == "tool_deferred"
        handle = session.query("")
        async with trio.open_nursery() as nursery:

            async def abort_once_replaying() -> None:
                await replaying.wait()
                session.abort_nowait("user")

            nursery.start_soon(abort_once_replaying)
            ran = await consume(session, handle, model)
        await assert_settled(ran)
        assert ran.reason == "aborted_tools" and log.order == [] and len(model.requests) == 1
        assert ran.tool_results()["t1"]["is_error"] is True  # answered: no longer pending
        transcript = await session.transcript()
        assert not isinstance(transcript[-1], AttachmentMessage)
