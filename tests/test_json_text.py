"""`json_text.dumps` gives exactly `json.dumps`'s text (the scripted wire's `partial_json` depends on it)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from queryloop.runtime.loop.json_text import dumps

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
