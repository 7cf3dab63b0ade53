"""The live view shows outside text as text: escape sequences in model text, tool names and input,
tool results and progress, subagent text and errors reach the terminal escaped, never as controls,
and brackets never as rich markup. Rendered to a rich console that believes it is a terminal
(`force_terminal=True`), so rich emits its own styling and cursor moves around them."""

from __future__ import annotations

import io
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from queryloop.runtime.cli import demo
from queryloop.runtime.cli import main as cli
from queryloop.runtime.cli.main import LiveView
from queryloop.runtime.cli.printable import printable
from queryloop.runtime.loop.events import (
    AssistantMessage,
    ProgressEvent,
    QueryEvent,
    StreamEvent,
    SystemMessage,
    ToolUseSummaryEvent,
    UserMessage,
)
from queryloop.runtime.providers.scripted import ScriptedModel

OSC_52 = "\x1b]52;c;aGVsbG8=\x07"  # writes "hello" to the clipboard
OSC_0 = "\x1b]0;pwned\x07"  # sets the window title
CSI_CLEAR = "\x1b[2J"  # clears the screen
C1_CLEAR = "\x9b2J"  # the same, with the one-character C1 CSI
HOSTILE = f"before {OSC_52} {OSC_0} {CSI_CLEAR} {C1_CLEAR} [bold red]not markup[/] after"
RAW = ("\x1b]52;", "\x1b]0;", "\x1b[2J", "\x9b", "\x07")
"""What must never reach the terminal (rich writes none of these itself)."""
SHOWN = ("\\x1b]52;c;aGVsbG8=\\x07", "\\x1b]0;pwned\\x07", "\\x1b[2J", "\\x9b2J", "[bold red]not markup[/]")
"""How the same text shows instead: escaped, and brackets as brackets."""


def _terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, color_system="truecolor", width=400), out


def _assert_shown_escaped(output: str, times: int = 1) -> None:
    for raw in RAW:
        assert raw not in output, f"{raw!r} reached the terminal"
    for shown in SHOWN:
        assert output.count(shown) >= times, f"{shown!r} not shown {times} times"


def _assistant(*blocks: dict[str, Any], parent: str | None = None, api_error: bool = False) -> AssistantMessage:
    return AssistantMessage(
        message_id="m", model="scripted", content=list(blocks), parent_tool_use_id=parent, is_api_error=api_error
    )


def _result(tool_use_id: str, content: str, parent: str | None = None) -> UserMessage:
    block = {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, "is_error": True}
    return UserMessage(content=[block], parent_tool_use_id=parent)


def test_every_text_the_view_takes_from_an_event_is_shown_escaped() -> None:
    view = LiveView()
    tool_use = {"type": "tool_use", "id": "t1", "name": f"tool{OSC_0}", "input": {"path": HOSTILE}}
    agent_use = {"type": "tool_use", "id": "t2", "name": "Agent", "input": {}}
    sub_use = {"type": "tool_use", "id": "t3", "name": f"sub{CSI_CLEAR}", "input": {}}
    events: list[QueryEvent] = [
        StreamEvent(event={"type": "content_block_delta", "delta": {"type": "text_delta", "text": HOSTILE}}),
        _assistant({"type": "text", "text": HOSTILE}),
        _assistant(tool_use),
        ProgressEvent(tool_use_id="t1", data=HOSTILE),
        _assistant(agent_use),
        _assistant({"type": "text", "text": HOSTILE}, parent="t2"),  # the subagent's own text
        _assistant(sub_use, parent="t2"),
        ProgressEvent(tool_use_id="t3", data=HOSTILE, parent_tool_use_id="t2"),
        ToolUseSummaryEvent(summary=HOSTILE, preceding_tool_use_ids=["t1"]),
        SystemMessage(subtype=f"warning{OSC_52}", content=HOSTILE),
        StreamEvent(event={"type": "content_block_delta", "delta": {"type": "text_delta", "text": HOSTILE}}),
    ]
    for event in events:
        view.apply(event)
    console, out = _terminal()
    console.print(view.render())  # the rows still running: names, input and progress
    running = out.getvalue()
    _assert_shown_escaped(running, times=5)
    assert "tool\\x1b]0;pwned\\x07(" in running and "sub\\x1b[2J(" in running
    assert "warning\\x1b]52;c;aGVsbG8=\\x07" in running

    api_error = _assistant({"type": "text", "text": HOSTILE}, api_error=True)
    for event in (_result("t1", HOSTILE), _result("t3", HOSTILE, parent="t2"), api_error):
        view.apply(event)
    console, out = _terminal()
    console.print(view.render())  # the rows done: their results
    _assert_shown_escaped(out.getvalue(), times=6)


def test_a_hostile_demo_run_reaches_the_terminal_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def write_hostile_files(folder: Path) -> None:
        (folder / "evil.txt").write_text(f"{HOSTILE}\nsecond line\n")

    replies: list[dict[str, Any]] = [
        {
            "content": [
                {"type": "text", "text": HOSTILE},
                {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "evil.txt"}},
                {"type": "tool_use", "id": "t2", "name": f"nope{OSC_52}", "input": {"path": HOSTILE}},
                {"type": "tool_use", "id": "t3", "name": "read_file", "input": {"path": f"{OSC_0}{CSI_CLEAR}"}},
            ],
            "stop_reason": "tool_use",
        },
        {"content": [{"type": "text", "text": f"Done. {HOSTILE}"}]},
    ]
    console, out = _terminal()
    monkeypatch.setattr(demo, "write_demo_files", write_hostile_files)
    monkeypatch.setattr(cli, "demo_model", lambda: ScriptedModel(replies))
    monkeypatch.setattr(cli, "Console", lambda: console)
    assert cli.main(["demo", "--demo-tool-delay", "0"]) == cli.EXIT_OK
    shown = out.getvalue()
    assert "terminal: completed" in shown
    _assert_shown_escaped(shown)
    assert "✓ read_file(" in shown  # the file was read, and its first line shown escaped
    assert "No such tool available: nope\\x1b]52;" in shown
    assert "\\x1b]0;pwned" in shown and "does not exist" in shown  # the refused path, named escaped
    captured = capsys.readouterr()
    for raw in RAW:
        assert raw not in captured.out + captured.err


_ESCAPED_CODES = {*range(0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


@given(st.text())
def test_printable_leaves_no_character_a_terminal_acts_on(text: str) -> None:
    for multiline, layout in ((True, "\n\t"), (False, "")):
        shown = printable(text, multiline=multiline)
        for char in shown:
            assert char in layout or not (ord(char) in _ESCAPED_CODES or unicodedata.category(char) == "Cs"), repr(char)


@given(
    st.text(
        st.characters(
            blacklist_categories=("Cc", "Cs"),
            blacklist_characters="\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069",
        )
    )
)
def test_printable_keeps_printable_text_as_it_is(text: str) -> None:
    assert printable(text) == text
    assert printable(f"{text}\n\t{text}") == f"{text}\n\t{text}"


def test_printable_escapes_what_it_names() -> None:
    assert printable("a\x1bb\x07c\x9bd\re\x08f\x7f") == "a\\x1bb\\x07c\\x9bd\\x0de\\x08f\\x7f"
    assert printable("one\ntwo\tthree") == "one\ntwo\tthree"
    assert printable("one\ntwo\tthree", multiline=False) == "one\\x0atwo\\x09three"
    assert printable("abc\u202edef") == "abc\\u202edef"  # shown in the order it is read
    assert printable("byte \udcff") == "byte \\udcff"  # a lone surrogate would fail to encode
    assert printable("naïve 中文 emoji 🎉") == "naïve 中文 emoji 🎉"
