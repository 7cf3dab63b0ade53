"""The session controls (`compact`, `context_usage`, `set_model`, `resume_session_at`) on the asyncio and blocking
hosts: each does what the trio `Session`'s does (tests/hosts/test_session_controls.py checks that against Claude
Code's behaviour). Ray's is in tests/hosts/test_ray.py, on its cluster. Each test is a sync function (the asyncio
one runs its own loop, bounded with `asyncio.timeout`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from queryloop import (
    BlockingRuntime,
    HookMatcher,
    QueryOptions,
    ScriptedModel,
    load_transcript,
)
from queryloop.aio import AsyncioRuntime
from tests.actors.test_lifecycle_hooks import Seen, sent_text
from tests.helpers import text_reply

LIMIT_S = 30.0
LONG_PROMPT = "Remember the parser bug in tokens.py. " * 200


def _options(model: ScriptedModel, summary: ScriptedModel, hook: Seen) -> QueryOptions:
    return QueryOptions(
        provider=model,
        compact_provider=summary,
        model="claude-sonnet-4-5",
        hooks={"PreCompact": [HookMatcher(hooks=[hook])]},
    )


def test_an_asyncio_session_compacts_counts_its_context_sets_its_model_and_resumes_at_a_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    model = ScriptedModel([text_reply("Noted."), text_reply("Fixed.")])
    summary, hook = ScriptedModel([text_reply("We fixed tokens.py.")], name="compactor"), Seen()

    async def main() -> None:
        async with asyncio.timeout(LIMIT_S), AsyncioRuntime.open() as runtime:
            session = await runtime.open_session(_options(model, summary, hook), transcript=path)
            query = session.query(LONG_PROMPT)
            await query.wait()
            before = await session.context_usage()
            boundary = await session.compact("Keep the file names.")
            after = await session.context_usage()
            await session.set_model("claude-opus-4-6")
            await session.query("Go on").wait()
            conversation = await session.transcript()
            await session.close()
            assert boundary.subtype == "compact_boundary" and boundary.data["trigger"] == "manual"
            assert after["totalTokens"] < before["totalTokens"] and before["model"] == "claude-sonnet-4-5"
            resumed = await runtime.open_session(
                QueryOptions(provider=ScriptedModel([])), resume=path, resume_session_at=conversation[1].uuid
            )
            assert await resumed.transcript() == conversation[:2]
            with pytest.raises(ValueError, match="'unknown' names no message"):
                await runtime.open_session(
                    QueryOptions(provider=ScriptedModel([])), resume=tmp_path / "t.jsonl", resume_session_at="unknown"
                )

    asyncio.run(main())
    assert [(data["trigger"], data["custom_instructions"]) for data in hook.inputs] == [
        ("manual", "Keep the file names.")
    ]
    assert [request.model for request in model.requests] == ["claude-sonnet-4-5", "claude-opus-4-6"]
    assert "We fixed tokens.py." in sent_text(model.requests[1]) and "parser bug" not in sent_text(model.requests[1])


def test_a_blocking_session_compacts_counts_its_context_sets_its_model_and_resumes_at_a_message(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    model = ScriptedModel([text_reply("Noted."), text_reply("Fixed.")])
    summary, hook = ScriptedModel([text_reply("We fixed tokens.py.")], name="compactor"), Seen()
    with BlockingRuntime() as runtime:
        session = runtime.open_session(_options(model, summary, hook), transcript=path)
        session.query(LONG_PROMPT).wait()
        before = session.context_usage()
        boundary = session.compact()
        after = session.context_usage()
        session.set_model("claude-opus-4-6")
        session.query("Go on").wait()
        conversation = session.transcript()
        session.close()
        forked = runtime.open_session(
            QueryOptions(provider=ScriptedModel([])),
            resume=path,
            transcript=tmp_path / "fork.jsonl",
            fork=True,
            resume_session_at=conversation[1].uuid,
        )
        assert forked.transcript() == conversation[:2]
        forked.close()
    assert boundary.subtype == "compact_boundary" and boundary.data["trigger"] == "manual"
    assert after["totalTokens"] < before["totalTokens"]
    assert [(data["trigger"], data["custom_instructions"]) for data in hook.inputs] == [("manual", None)]
    assert [request.model for request in model.requests] == ["claude-sonnet-4-5", "claude-opus-4-6"]
    assert "parser bug" not in sent_text(model.requests[1])
    assert [m.uuid for m in load_transcript(tmp_path / "fork.jsonl").messages] == [m.uuid for m in conversation[:2]]
