"""The model-provider boundary: what a provider is given, what it yields, what it raises.

A provider streams one Messages API call as the API's own raw events (plain
dicts: `message_start`, `content_block_*`, `message_delta`, `message_stop`,
`ping`, and any newer type, passed through). It raises `ModelError` (classified
by `kind`, not by HTTP class alone) or `FallbackTriggered`. Retries, withheld
errors and fallback are the ModelCaller's business, not the provider's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import ConfigDict

from queryloop.runtime._records import record
from queryloop.runtime.errors import QueryloopError
from queryloop.runtime.loop.events import Model

ModelErrorKind = Literal[
    "prompt_too_long",
    "overloaded",
    "rate_limit",
    "api_error",
    "connection",
    "image_size",
    "invalid_request",
    "authentication",
    "not_found",
    "script_exhausted",
]

RETRYABLE_KINDS: frozenset[str] = frozenset({"overloaded", "rate_limit", "api_error", "connection"})


@record
class ModelRequest(Model):
    """One Messages API request, already normalized for the wire.

    A record: the loop builds one per call from parts already valid (a copy of every message dict
    to validate them again would cost more than the call's own work); `model_validate` checks one
    that comes from outside.
    """

    __pydantic_config__ = ConfigDict(extra="forbid")

    model: str
    system: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    max_tokens: int
    thinking: dict[str, Any] | None = None
    task_budget: dict[str, int] | None = None
    purpose: Literal["main", "summary", "compact"] = "main"


class ModelError(QueryloopError):
    """A failed model call, classified so recovery can be decided without looking at HTTP classes."""

    def __init__(
        self,
        kind: ModelErrorKind,
        message: str,
        *,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: ModelErrorKind = kind
        self.message = message
        self.status = status
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE_KINDS

    def __repr__(self) -> str:
        return f"ModelError({self.kind!r}, {self.message!r}, status={self.status})"


class FallbackTriggered(QueryloopError):
    """The provider asks to switch to the fallback model (repeated overload of the primary, say)."""


@runtime_checkable
class ModelProvider(Protocol):
    """Streams one call. Cancelling the iteration must close the underlying stream."""

    def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]: ...


PROMPT_TOO_LONG_MARKERS = (
    "prompt is too long",
    "exceed context limit",
    "request size exceeds model context window",
    "request_too_large",
)


def is_prompt_too_long(status: int | None, message: str) -> bool:
    """Every wording of "too long" seen on the wire (API_FACTS §2): 400s and both 413 bodies."""
    text = message.lower()
    return status == 413 or any(marker in text for marker in PROMPT_TOO_LONG_MARKERS)
