"""What host code hands back, checked before the loop uses it.

A host's callbacks (`can_use_tool`, stop and PostToolUse hooks, attachment sources, a memory
prefetch, a tool's input model) are outside code: they may raise anything or return anything. Claude
Code treats a failing hook as a non-blocking error, and so does the loop with all of them: the
failure becomes an error tool_result (a permission check, an input validator) or a `hook_error`
system event (the rest), its text joins the result's `errors`, and the query goes on. These pure
functions turn a wrong return value into a `HostCodeError` (a `TypeError`), so the callers have one
failure to handle, and name what failed.
"""

from __future__ import annotations

from typing import Any, cast

from pydantic import ValidationError

from queryloop.runtime.loop.hooks import HookDecision, failure_text
from queryloop.runtime.loop.tools import Allow, Deny, PermissionResult


class HostCodeError(TypeError):
    """Host code returned a value of the wrong type (the message says what it returned and what was expected)."""


def _kind(value: object) -> str:
    return "None" if value is None else type(value).__name__


def _returned(value: object, kinds: tuple[type, ...], expected: str) -> Any:
    """`value` if it is one of `kinds`, else `HostCodeError` saying what it is and what was `expected`."""
    if isinstance(value, kinds):
        return value
    msg = f"returned {_kind(value)}, not {expected}"
    raise HostCodeError(msg)


def checked_field(mapping: dict[Any, Any], key: str, kinds: type | tuple[type, ...], expected: str) -> Any:
    """`mapping[key]` if absent (None) or one of `kinds`, else `HostCodeError` naming the key: a field of a
    hook's JSON output."""
    value = mapping.get(key)
    if value is None or isinstance(value, kinds):
        return value
    msg = f"returned {key} {_kind(value)}, not {expected}"
    raise HostCodeError(msg)


def checked_hook_output(value: object) -> dict[Any, Any]:
    """A hook's JSON output (the Agent SDK's shape): a dict, else `HostCodeError`."""
    return cast("dict[Any, Any]", _returned(value, (dict,), "a dict (the hook's JSON output)"))


def checked_hook_decision(value: object) -> HookDecision | None:
    """A stop or PostToolUse hook's answer: a `HookDecision` or None, else `HostCodeError`."""
    return cast("HookDecision | None", _returned(value, (HookDecision, type(None)), "a HookDecision or None"))


def checked_permission(value: object) -> PermissionResult:
    """`can_use_tool`'s answer: an `Allow` or a `Deny`, else `HostCodeError` (never taken as an allow)."""
    return cast("PermissionResult", _returned(value, (Allow, Deny), "Allow or Deny"))


def checked_attachments(value: object) -> list[dict[str, Any]]:
    """An attachment source's `collect()`: a list of dicts each with a string `type`, else `HostCodeError`."""
    if not isinstance(value, list):
        msg = f"returned {_kind(value)}, not a list of attachments"
        raise HostCodeError(msg)
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            msg = f"returned an attachment that is {_kind(item)}, not a dict with a string 'type'"
            raise HostCodeError(msg)
    return value


def checked_memory(value: object) -> str | None:
    """A memory prefetch's answer: a string or None, else `HostCodeError`."""
    return cast("str | None", _returned(value, (str, type(None)), "a string or None"))


def input_error_text(error: Exception) -> str:
    """The error result for a tool input that failed its input model: the model's own mistake
    (pydantic's `ValidationError`) or a validator of the host's that raised something else."""
    if isinstance(error, ValidationError):
        return f"InputValidationError: {error}"
    return f"InputValidationError: the input validator raised {failure_text(error)}"
