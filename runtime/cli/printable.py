"""Text the terminal shows as text: what the live view does with text it did not write itself.

Model text, tool names, inputs, results and progress, subagent text, error messages: any of them may
hold escape sequences (OSC 52 writes the clipboard, OSC 0 the window title, CSI 2J clears the
screen) or characters that reorder or hide what is shown. `printable(text)` guarantees that no
character of its result is one the terminal acts on:

- every C0 control (U+0000-U+001F), DEL (U+007F) and C1 control (U+0080-U+009F: U+009B is a CSI on
  its own) is shown as `\\xNN`, so ESC is `\\x1b`, BEL `\\x07`, a carriage return `\\x0d`;
- the bidirectional embeddings, overrides and isolates (U+202A-U+202E, U+2066-U+2069), which would
  show text in another order than it is read, and lone surrogates (bytes no encoding can print,
  which would make writing to the terminal fail) are shown as `\\uNNNN`;
- `\\n` and `\\t` are kept as layout in multi-line text (`multiline=True`); on one line they are
  escaped too (`\\x0a`, `\\x09`).

All other characters (printable Unicode, whatever the script) are kept. A backslash is not doubled:
the escaped form reads as text, which is all it must do. The result goes into a rich `Text`, never
into markup, so brackets in it are not rich's either.
"""

from __future__ import annotations

from itertools import chain

_KEPT_AS_LAYOUT = {ord("\n"), ord("\t")}
_CONTROLS = chain(range(0x00, 0x20), [0x7F], range(0x80, 0xA0))
_REORDERING = chain(range(0x202A, 0x202F), range(0x2066, 0x206A))
_SURROGATES = range(0xD800, 0xE000)

_ONE_LINE: dict[int, str] = {
    **{code: f"\\x{code:02x}" for code in _CONTROLS},
    **{code: f"\\u{code:04x}" for code in chain(_REORDERING, _SURROGATES)},
}
_MULTI_LINE: dict[int, str] = {code: escaped for code, escaped in _ONE_LINE.items() if code not in _KEPT_AS_LAYOUT}


def printable(text: str, *, multiline: bool = True) -> str:
    """`text` with every character a terminal would act on shown escaped (see the module docstring).

    `multiline`: `\\n` and `\\t` stay as they are (the text's layout); otherwise they are escaped too.
    """
    return text.translate(_MULTI_LINE if multiline else _ONE_LINE)
