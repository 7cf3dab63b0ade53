"""A damaged transcript: its loading never raises and reports every line it skipped; a resume goes on only
from a conversation repaired completely (else `TranscriptDamaged` names the lines); and what a resume's
loading decided is written back, so that every later load reads the same conversation.

The property test is bounded as the others are (`QUERYLOOP_HYPOTHESIS_PROFILE`: `ci`, the default, 100
examples; `nightly` 2,000; `dev` 20: the `queryloop-properties` profile of `conftest.py`).
"""

from __future__ import annotations

import json
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from queryloop import Runtime
from queryloop.runtime.errors import TranscriptDamaged
from queryloop.runtime.loop.events import (
    AssistantMessage,
    AttachmentMessage,
    SystemMessage,
    TombstoneEvent,
    TranscriptMessage,
    UserMessage,
)
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.persistence import SidechainLog, TranscriptLog
from queryloop.runtime.loop.restore import (
    INTERRUPTED_BY_CRASH,
    LoadedTranscript,
    load_transcript,
    open_log,
    resume_refusal,
)
from queryloop.runtime.loop.transcript import normalize_messages_for_api, transcript_problems
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import assert_settled, consume, scripted_tool, text_reply, tool_use, tools_reply

PROPERTIES = settings.get_profile("queryloop-properties")  # registered in conftest.py
GARBAGE = b'{"type": "user", "content": [{"ty\xff'
"""A line as a bad sector or a bad hand leaves it: not JSON."""


def results_by_id(messages: list[TranscriptMessage]) -> dict[str, list[dict[str, Any]]]:
    """Every tool_result block of the conversation, by the tool_use it answers."""
    found: dict[str, list[dict[str, Any]]] = {}
    for message in messages:
        if isinstance(message, UserMessage) and isinstance(message.content, list):
            for block in message.content:
                if block.get("type") == "tool_result":
                    found.setdefault(block["tool_use_id"], []).append(block)
    return found


def result(tool_id: str, text: str = "ok") -> UserMessage:
    return UserMessage(content=[{"type": "tool_result", "tool_use_id": tool_id, "content": text, "is_error": False}])


def block(message_id: str, *content: dict[str, Any]) -> AssistantMessage:
    return AssistantMessage(message_id=message_id, model="claude-sonnet-5-5", content=list(content))


def crash_in_a_response(log: TranscriptLog, prompt: str, calls: tuple[str, str]) -> None:
    """A response whose first tool finished while it streamed (its result `held`), cut by a crash while its
    second tool ran: no `release`, no second result."""
    first, second = calls
    log.append(UserMessage(content=prompt))
    log.append(block("msg_1", tool_use(first, "read")))
    log.append(result(first, f"real {first}"), held=True)
    log.append(block("msg_1", tool_use(second, "read")))


# -- 1. what a resume's loading decided is in the file --------------------------------------------------


async def test_a_resume_into_the_crashed_file_releases_its_held_results_there_so_later_loads_keep_them_paired(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    log = TranscriptLog(path, "s-1")
    crash_in_a_response(log, "go", ("t1", "t2"))
    log.close()
    first = load_transcript(path)
    assert first.unreleased and [r.content[0]["tool_use_id"] for r in first.repairs] == ["t2"]  # type: ignore[index]
    tools = [scripted_tool("read", result="fresh", safe=True)]
    async with Runtime.open() as runtime:
        # Its stream outlasts its tool: the new response's result is held and released too.
        model = ScriptedModel([tools_reply(tool_use("t3", "read"), text="Again.", latency_ms=20), text_reply()])
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools), resume=path)
        ran = await consume(session, session.query("Go on"), model)
        await assert_settled(ran)
        after = await session.transcript()
        await session.close()
    reloaded = load_transcript(path)
    assert reloaded.problems == [] and reloaded.repairs == [] and not reloaded.unreleased
    assert [m.uuid for m in reloaded.messages] == [m.uuid for m in after]
    # Each real result answers its own tool_use; the one the crash cut is the only synthetic one.
    results = results_by_id(reloaded.messages)
    assert {i: [b["content"] for b in blocks] for i, blocks in results.items()} == {
        "t1": ["real t1"],
        "t2": [INTERRUPTED_BY_CRASH],
        "t3": ["fresh"],
    }
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Still here.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path)
        ran = await consume(session, session.query("And now?"), model)
        await assert_settled(ran)
        sent = model.requests[0].messages
        assert sent == normalize_messages_for_api([*reloaded.messages, UserMessage(content="And now?")])
        assert "Tool result missing" not in json.dumps(sent)
        await session.close()


async def test_a_resume_into_the_crashed_file_writes_each_sidechains_release_and_repairs(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    log = TranscriptLog(path, "s-1")
    log.append(UserMessage(content="Review"))
    log.append(block("msg_0", tool_use("call_a", "Agent", {"subagent_type": "reviewer", "prompt": "file a"})))
    side = SidechainLog(log, agent_id="s-1/call_a", agent_type="reviewer", parent_tool_use_id="call_a")
    crash_in_a_response(side, "file a", ("t1", "t2"))
    log.close()
    first = load_transcript(path)
    assert first.unreleased_sidechains == {"s-1/call_a"} and list(first.sidechain_repairs) == ["s-1/call_a"]
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Resumed.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path)
        resumed = await session.sidechains()
        await session.query("Go on").wait()
        await session.close()
    reloaded = load_transcript(path)
    assert reloaded.problems == [] and reloaded.sidechain_repairs == {} and reloaded.unreleased_sidechains == set()
    restored = reloaded.sidechains["s-1/call_a"]
    assert [m.uuid for m in restored.messages] == [m.uuid for m in resumed["s-1/call_a"].messages]
    assert {m.parent_tool_use_id for m in restored.messages} == {"call_a"}
    assert {i: [b["content"] for b in bs] for i, bs in results_by_id(restored.messages).items()} == {
        "t1": ["real t1"],
        "t2": [INTERRUPTED_BY_CRASH],
    }


# -- 2. the loading never raises ---------------------------------------------------------------------


SESSION_LINE = b'{"type":"session","session_id":"s-1","version":2}'


def message_line(message: TranscriptMessage, **extra: Any) -> bytes:
    return json.dumps({**message.model_dump(mode="json"), **extra}).encode()


HOSTILE_LINES = {
    "a list for a type": b'{"type": []}',
    "an object for a type": b'{"type": {}}',
    "100,000 nested brackets": b"[" * 100_000 + b"]" * 100_000,
    "a tool_use without an id": message_line(block("m", {"type": "tool_use", "name": "read", "input": {}})),
    "a tool_use with a list for an id": message_line(
        block("m", {"type": "tool_use", "id": [], "name": "r", "input": {}})
    ),
    "a tool_result without a tool_use_id": message_line(UserMessage(content=[{"type": "tool_result", "content": "x"}])),
    "a block that is not an object": json.dumps(
        {**UserMessage(content="x").model_dump(mode="json"), "content": [3]}
    ).encode(),
    "a block without a type": message_line(UserMessage(content=[{"text": "hi"}])),
    "a held that is not true or false": message_line(UserMessage(content="x"), held=[]),
    "an isSidechain that is not true or false": message_line(UserMessage(content="x"), isSidechain={}),
    "a sidechain agentType that is an object": message_line(
        UserMessage(content="x"), isSidechain=True, agentId="a", agentType={}
    ),
    "a sidechain parent_tool_use_id that is a list": message_line(
        UserMessage(content="x"), isSidechain=True, agentId="a", agentType="r", parent_tool_use_id=[1]
    ),
    "a tombstone of a list": b'{"type": "tombstone", "message_uuid": [1]}',
}


@pytest.mark.parametrize("line", HOSTILE_LINES.values(), ids=HOSTILE_LINES.keys())
def test_a_hostile_line_is_skipped_and_reported_with_its_number_never_raised(tmp_path: Path, line: bytes) -> None:
    path = tmp_path / "t.jsonl"
    hi = UserMessage(content="hi")
    path.write_bytes(b"\n".join([SESSION_LINE, message_line(hi), line, b""]))
    loaded = load_transcript(path)
    assert loaded.messages == [hi]
    assert (
        loaded.corrupt_lines == [3] and len(loaded.problems) == 1 and loaded.problems[0].startswith("line 3: corrupt")
    )
    assert loaded.sidechains == {}


KINDS = ["user", "assistant", "system", "attachment", "session", "tombstone", "release"]
IDS = st.sampled_from(["t1", "t2", "t3"])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6) | IDS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
blocks = st.one_of(
    json_values,
    st.fixed_dictionaries(
        {"type": st.sampled_from(["tool_use", "tool_result", "text", "image"])},
        optional={
            "id": IDS | json_values,
            "name": st.just("read") | json_values,
            "input": st.just({}) | json_values,
            "tool_use_id": IDS | json_values,
            "text": st.text(max_size=5) | json_values,
            "content": json_values,
        },
    ),
)
FIELDS = {
    "content": st.lists(blocks, max_size=3) | json_values,
    "uuid": st.text(max_size=3) | json_values,
    "held": st.booleans() | json_values,
    "isSidechain": st.booleans() | json_values,
    "agentId": st.sampled_from(["a", "b"]) | json_values,
    "agentType": st.just("reviewer") | json_values,
    "parent_tool_use_id": IDS | json_values,
    "message_id": st.just("msg_1") | json_values,
    "model": st.just("claude") | json_values,
    "message_uuid": st.text(max_size=3) | json_values,
    "session_id": st.just("s-1") | json_values,
    "version": st.sampled_from([1, 2, 3]) | json_values,
    "attachment": st.dictionaries(st.sampled_from(["type", "content"]), json_values) | json_values,
    "subtype": st.just("compact_boundary") | json_values,
}
records = st.fixed_dictionaries({"type": st.sampled_from(KINDS)}, optional=FIELDS)


def base_lines() -> list[bytes]:
    """A real transcript's lines: a held result and its release, a tombstone, a sidechain, the kinds of message."""
    tool, retracted = block("msg_1", tool_use("t1", "read")), block("msg_2", {"type": "text", "text": "abandoned"})
    side = {"isSidechain": True, "agentId": "s-1/t2", "agentType": "reviewer", "parent_tool_use_id": "t2"}
    return [
        SESSION_LINE,
        message_line(UserMessage(content="go")),
        message_line(block("msg_1", {"type": "text", "text": "Reading."})),
        message_line(tool),
        message_line(result("t1"), held=True),
        message_line(block("msg_1", tool_use("t2", "Agent"))),
        b'{"type":"release"}',
        message_line(UserMessage(content="file"), **side),
        message_line(block("c1", tool_use("t3", "read")), **side),
        message_line(result("t3"), held=True, **side),
        json.dumps({"type": "release", **side}).encode(),
        message_line(SystemMessage(subtype="model_fallback", content="switched")),
        message_line(retracted),
        json.dumps(TombstoneEvent(message_uuid=retracted.uuid).model_dump(mode="json")).encode(),
        message_line(result("t2")),
        message_line(AttachmentMessage(attachment={"type": "memory", "content": "notes"})),
        message_line(block("msg_3", {"type": "text", "text": "Done."})),
    ]


BASE = base_lines()


@st.composite
def transcripts(draw: st.DrawFn) -> list[bytes]:
    """The real transcript's lines, mutated as damage and hostile hands do; whatever lines end it."""
    lines = list(BASE)
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(lines) - 1)) if lines else 0
        how = draw(st.sampled_from(["bytes", "json", "record", "cut", "flip", "field", "drop", "repeat", "swap"]))
        if how in ("bytes", "json", "record"):
            new = {
                "bytes": st.binary(max_size=30).map(lambda b: b.replace(b"\n", b" ")),
                "json": json_values.map(lambda v: json.dumps(v).encode()),
                "record": records.map(lambda r: json.dumps(r).encode()),
            }[how]
            lines.insert(at, draw(new))
        elif not lines:
            continue
        elif how == "cut":
            lines[at] = lines[at][: draw(st.integers(0, len(lines[at])))]
        elif how == "flip":
            line = bytearray(lines[at])
            if line:
                line[draw(st.integers(0, len(line) - 1))] = draw(st.integers(0, 255).filter(lambda b: b != 10))
            lines[at] = bytes(line)
        elif how == "field":
            record = None if surely_skipped(lines[at]) else json.loads(lines[at])
            if isinstance(record, dict):
                key = draw(st.sampled_from(sorted({*record, *FIELDS})))
                record[key] = draw(FIELDS.get(key, json_values))
                lines[at] = json.dumps(record).encode()
        elif how == "drop":
            del lines[at]
        elif how == "repeat":
            lines.insert(at, lines[at])
        else:
            other = draw(st.integers(0, len(lines) - 1))
            lines[at], lines[other] = lines[other], lines[at]
    return lines


def surely_skipped(line: bytes) -> bool:
    """Whether a line cannot be a record, by what it is alone (the loading may skip more)."""
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return True
    return not isinstance(record, dict) or record.get("type") not in KINDS


@PROPERTIES
@given(transcripts(), st.booleans())
def test_loading_never_raises_and_reports_every_line_it_skips(lines: list[bytes], ended: bool) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.jsonl"
        path.write_bytes(b"\n".join(lines) + (b"\n" if ended else b""))
        loaded = load_transcript(path)
        assert lines != BASE or loaded.problems == []
        written = path.read_bytes().split(b"\n")
        numbered = [n for n, line in enumerate(written, start=1) if line.strip()]
        skipped = {n for n in numbered if surely_skipped(written[n - 1])}
        assert skipped <= set(loaded.damaged_lines)
        assert set(loaded.damaged_lines) <= set(numbered)
        for number in loaded.damaged_lines:
            assert any(p.startswith(f"line {number}: ") for p in loaded.problems), (number, loaded.problems)
        assert bool(loaded.problems) or not loaded.damaged_lines
        # A conversation a resume would go on from is valid to send, and so is each sidechain.
        if resume_refusal(loaded) is None:
            assert transcript_problems(loaded.messages) == []
            for side in loaded.sidechains.values():
                assert transcript_problems(side.messages) == []
            # Written back into its own file, the next load reads the same conversation.
            if lines and lines[0] == BASE[0] and loaded.session_id is not None:
                open_log(path, loaded.session_id, loaded, path).close()
                again = load_transcript(path)
                assert [m.uuid for m in again.messages] == [m.uuid for m in loaded.messages]
                assert {k: [m.uuid for m in s.messages] for k, s in again.sidechains.items()} == {
                    k: [m.uuid for m in s.messages] for k, s in loaded.sidechains.items()
                }
                assert again.repairs == [] and again.sidechain_repairs == {}


# -- 3. a damaged middle: repaired completely, or refused ------------------------------------------------


def loaded_with(**fields: Any) -> LoadedTranscript:
    return LoadedTranscript(session_id="s-1", messages=[], problems=[], repairs=[], **fields)


def test_a_corrupt_line_after_a_tool_use_answered_synthetically_refuses_naming_it() -> None:
    refusal = resume_refusal(loaded_with(corrupt_lines=[3, 9], repaired_from_line=7))
    assert refusal is not None and "line 7" in refusal and "line 9" in refusal and "line 3" not in refusal


def test_a_corrupt_line_before_every_tool_use_answered_synthetically_is_no_refusal() -> None:
    # Results come after their tool_use in the file: a line before it cannot have been its result.
    assert resume_refusal(loaded_with(corrupt_lines=[3], repaired_from_line=7)) is None
    assert resume_refusal(loaded_with(corrupt_lines=[3])) is None


def test_a_crashs_cut_last_line_with_a_repair_is_no_refusal() -> None:
    assert resume_refusal(loaded_with(truncated_line=9, repaired_from_line=7)) is None


def test_a_conversation_still_invalid_after_repair_refuses_damaged_or_not() -> None:
    refusal = resume_refusal(loaded_with(unresolved=["message 1: tool_use t1 has no tool_result"]))
    assert refusal is not None and "t1 has no tool_result" in refusal


def test_a_damaged_file_that_does_not_open_with_a_user_message_refuses() -> None:
    unopened = ["the conversation does not open with a user message"]
    assert resume_refusal(loaded_with(corrupt_lines=[2], unopened=unopened)) is not None
    assert resume_refusal(loaded_with(unopened=unopened)) is None  # undamaged: as it was written


def test_transcript_damaged_names_the_file_and_the_lines_and_survives_pickling() -> None:
    error = TranscriptDamaged("/x/t.jsonl", [4, 7], ["line 4: corrupt record skipped (not JSON)"], "why")
    assert "/x/t.jsonl" in str(error) and "lines 4, 7" in str(error) and "load_transcript(path)" in str(error)
    again = pickle.loads(pickle.dumps(error))
    assert (again.path, again.lines, again.problems, str(again)) == (
        error.path,
        error.lines,
        error.problems,
        str(error),
    )


async def test_a_sidechain_left_invalid_by_a_damaged_line_refuses_the_resume_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    log = TranscriptLog(path, "s-1")
    log.append(UserMessage(content="Review"))
    log.append(block("msg_0", tool_use("call_a", "Agent")))
    side = SidechainLog(log, agent_id="s-1/call_a", agent_type="reviewer", parent_tool_use_id="call_a")
    side.append(UserMessage(content="file a"))
    side.append(block("c1", tool_use("t1", "read")))
    side.append(result("t1"))
    side.append(block("c2", {"type": "text", "text": "Fine."}))
    log.append(result("call_a", "Fine."))
    log.close()
    lines = path.read_bytes().splitlines(keepends=True)
    lines[3] = GARBAGE + b"\n"  # the sidechain's tool_use: its result is left answering nothing
    path.write_bytes(original := b"".join(lines))
    async with Runtime.open() as runtime:
        with pytest.raises(TranscriptDamaged, match="line 4 is damaged") as refused:
            await runtime.open_session(QueryOptions(provider=ScriptedModel([])), resume=path)
        assert refused.value.lines == [4] and "sidechain s-1/call_a" in refused.value.reason
        assert runtime.groups == {}
    assert path.read_bytes() == original


async def test_a_second_crash_after_a_resumed_one_still_resumes(tmp_path: Path) -> None:
    """The first crash's cut line is cut off by the resume (its load reported it): the second crash's
    file has no damaged line, only an open tool_use to answer."""
    path = tmp_path / "t.jsonl"
    log = TranscriptLog(path, "s-1")
    log.append(UserMessage(content="go"))
    log.append(block("msg_1", tool_use("t1", "read")))
    log.close()
    with path.open("ab") as file:
        file.write(message_line(result("t1"))[:30])  # the first crash, mid-write
    async with Runtime.open() as runtime:
        model = ScriptedModel([text_reply("Resumed.")])
        session = await runtime.open_session(QueryOptions(provider=model), resume=path)
        await session.query("Go on").wait()
        await session.close()
    log = TranscriptLog(path, "s-1", resumes=path)  # the session goes on, then the second crash: t2 runs
    log.append(UserMessage(content="Read it again"))
    log.append(block("msg_3", tool_use("t2", "read")))
    log.close()
    loaded = load_transcript(path)
    assert loaded.problems == [] and loaded.corrupt_lines == []
    assert [r.content[0]["tool_use_id"] for r in loaded.repairs] == ["t2"]  # type: ignore[index]
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=ScriptedModel([])), resume=path)
        answers = results_by_id(await session.transcript())
        assert {i: [b["content"] for b in bs] for i, bs in answers.items()} == {
            "t1": [INTERRUPTED_BY_CRASH],
            "t2": [INTERRUPTED_BY_CRASH],
        }
        await session.close()


async def real_transcript(path: Path) -> list[bytes]:
    """A real session's lines (held results, a release, two queries), cut as a crash cuts it while the
    last response's tool runs: that tool_use has no result."""
    model = ScriptedModel(
        [
            tools_reply(tool_use("t1", "read"), tool_use("t2", "read"), text="Reading.", latency_ms=20),
            tools_reply(tool_use("t3", "read")),
            text_reply("Done."),
            tools_reply(tool_use("t4", "read"), text="Once more."),
            text_reply("Again."),
        ]
    )
    tools = [scripted_tool("read", result="real", safe=True)]
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=model, tools=tools), transcript=path)
        await session.query("Fix the bug").wait()
        await session.query("And again").wait()
        await session.close()
    lines = (await trio.Path(path).read_bytes()).splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if b'"id":"t4"' in line)
    return lines[: cut + 1]


async def test_every_one_line_damage_of_a_real_transcript_refuses_naming_it_or_replaces_no_real_result(
    tmp_path: Path,
) -> None:
    lines = await real_transcript(tmp_path / "real.jsonl")
    intact = tmp_path / "intact.jsonl"
    intact.write_bytes(b"".join(lines))
    real = results_by_id(load_transcript(intact).messages)
    assert sorted(real) == ["t1", "t2", "t3", "t4"] and real["t4"][0]["content"] == INTERRUPTED_BY_CRASH
    refused, resumed = [], []
    async with Runtime.open() as runtime:
        for number in range(1, len(lines) + 1):
            path = tmp_path / f"damaged-{number}.jsonl"
            path.write_bytes(b"".join([*lines[: number - 1], GARBAGE + b"\n", *lines[number:]]))
            try:
                session = await runtime.open_session(QueryOptions(provider=ScriptedModel([])), resume=path)
            except TranscriptDamaged as error:
                assert error.lines == [number] and f"line {number} " in str(error), (number, str(error))
                refused.append(number)
                continue
            conversation = await session.transcript()
            await session.close()
            assert transcript_problems(conversation) == [], number
            for tool_id, answers in results_by_id(conversation).items():
                # A real result is kept as it was; only the tool the crash cut has a synthetic one.
                if tool_id == "t4":
                    assert [a["content"] for a in answers] == [INTERRUPTED_BY_CRASH], number
                else:
                    assert answers == real[tool_id], (number, tool_id)
            resumed.append(number)
    assert refused and resumed, (refused, resumed)  # both ends of the rule were exercised
    assert 2 in refused  # the prompt: every request would open with the model's turn
