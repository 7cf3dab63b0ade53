"""`json_text.dumps` gives exactly `json.dumps`'s text (the scripted wire's `partial_json` depends on it), and
`json_text.loads` exactly `json.loads`'s value or error (a tool input's error is shown to the model)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from queryloop.runtime.loop.json_text import dumps, loads

VALUES: list[Any] = [
    {},
    [],
    {"x": 0},
    {"path": "a.txt", "nested": {"list": [1, 2.5, None, True, False]}},
    {"unicode": 'é ☃ \n \t " \\', "key with spaces": -1e300},
    [{"k": "v"}, [[]], {"": None}],
    {1: "int keys become strings"},
    {"nan": math.nan, "inf": math.inf, "-inf": -math.inf},
    "a string",
    3,
    None,
]


@pytest.mark.parametrize("value", VALUES)
def test_dumps_writes_what_json_dumps_writes(value: Any) -> None:
    assert dumps(value) == json.dumps(value)


TEXTS: list[str] = [
    '{"path": "a.txt"}',
    json.dumps(VALUES[4]),
    '[1, 2.5, null, true, false, "s"]',
    '"a string"',
    "3",
    "NaN",
    ' {"x": 1}',  # whitespace before
    '{"x": 1}\n',  # whitespace after
    "\ufeff{}",  # a BOM
    '{"x": 1} {"y": 2}',  # extra data
    '{"x": 1',  # cut off
    '{"x": tru}',
    "{'x': 1}",
    "",
    "   ",
    '{"x": "\\q"}',  # an invalid escape
]


@pytest.mark.parametrize("text", TEXTS)
def test_loads_gives_what_json_loads_gives_its_value_or_its_error(text: str) -> None:
    try:
        expected = json.loads(text)
    except json.JSONDecodeError as error:
        with pytest.raises(json.JSONDecodeError) as raised:
            loads(text)
        assert (raised.value.msg, raised.value.pos) == (error.msg, error.pos)
    else:
        assert repr(loads(text)) == repr(expected)  # repr: NaN equals nothing, its repr does
