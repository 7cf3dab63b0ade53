"""`dumps` and `loads`: `json.dumps` / `json.loads` with the default settings, without their per-call layers.

`json.dumps` with default arguments goes through `JSONEncoder.encode`, which makes a new C encoder for
every call: two thirds of the cost of dumping a tool's small input. The runtime dumps those on every
call it streams or estimates (the scripted wire's `input_json_delta`, the token estimate of a
`tool_use`), so it keeps one encoder. The text is `json.dumps`'s exactly (", " and ": " separators,
ASCII escapes, `NaN`/`Infinity` allowed); values the runtime dumps are parsed JSON, so no cycle check.

`json.loads` goes through `JSONDecoder.decode` and `raw_decode`, two Python calls and two regex matches
around the C scanner: three quarters of the cost of parsing a tool's small input (about 1.3 against
0.3 µs). The runtime parses one per tool use it assembles and one per event the API streams, so
`loads` calls the scanner itself and leaves every other case (whitespace around the value, a BOM,
extra data, an error) to `json.loads`, whose value or error it then is.
"""

from __future__ import annotations

import json
import json.encoder
import json.scanner
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


# The scanner `json.loads` ends in (C where available), with the default decoder's settings.
_scan: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]  # typeshed: a class of its own


def loads(text: str) -> Any:
    """`json.loads(text)`: the same value, or the same error."""
    if text.__class__ is str:
        try:
            value, end = _scan(text, 0)
        except (StopIteration, ValueError):  # no value right at the start (whitespace, a BOM, nothing), or malformed
            pass
        else:
            if end == len(text):  # nothing after it: what `json.loads` returns
                return value
    return json.loads(text)  # whitespace around the value, extra data, an error: `json.loads` decides
