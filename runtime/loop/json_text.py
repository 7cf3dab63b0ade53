"""`dumps`: `json.dumps(value)` with the default settings, without building an encoder per call.

`json.dumps` with default arguments goes through `JSONEncoder.encode`, which makes a new C encoder for
every call: two thirds of the cost of dumping a tool's small input. The runtime dumps those on every
call it streams or estimates (the scripted wire's `input_json_delta`, the token estimate of a
`tool_use`), so it keeps one encoder. The text is `json.dumps`'s exactly (", " and ": " separators,
ASCII escapes, `NaN`/`Infinity` allowed); values the runtime dumps are parsed JSON, so no cycle check.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable, Iterable
from typing import Any

# The C encoder `JSONEncoder.iterencode` makes for a one-shot call, made once (typeshed omits it).
_make: Callable[..., Callable[[Any, int], Iterable[str]]] | None = getattr(json.encoder, "c_make_encoder", None)
_DEFAULT = json.JSONEncoder()
_encode = (
    _make(None, _DEFAULT.default, json.encoder.encode_basestring_ascii, None, ": ", ", ", False, False, True)
    if _make is not None
    else None
)


def dumps(value: Any) -> str:
    """`json.dumps(value)`, the same text; for acyclic JSON data (a cycle recurses until RecursionError)."""
    cls = value.__class__
    # The C encoder takes containers (a dict or a list: nearly every call, told apart without `isinstance`);
    # a scalar is json.dumps's own fast path anyway.
    if _encode is not None and (
        cls is dict or cls is list or not (value is None or isinstance(value, str | int | float))
    ):
        return "".join(_encode(value, 0))
    return json.dumps(value)
