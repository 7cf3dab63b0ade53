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

from queryloop.runtime._records import keyword_maker, record
from queryloop.runtime.errors import QueryloopError
from queryloop.runtime.loop.events import Model, stream_event

ModelErrorKind = Literal[
    "prompt_too_long",
    "context_overflow",
    "max_tokens_cap",
    "overloaded",
    "rate_limit",
    "api_error",
    "connection",
    "image_size",
    "invalid_request",
    "authentication",
    "not_found",
    "script_exhausted",
    "model_unavailable",
]

RETRYABLE_KINDS: frozenset[str] = frozenset({"overloaded", "rate_limit", "api_error", "connection"})
"""The kinds retried as they are, unless the server said otherwise (`ModelError.should_retry`)."""

MAX_TOKENS_KINDS: frozenset[str] = frozenset({"context_overflow", "max_tokens_cap"})
"""400s fixed by asking for fewer output tokens (`queryloop.runtime.loop.max_tokens`), not by a retry as is."""


Effort = Literal["low", "medium", "high", "xhigh", "max"]
"""The Messages API's `output_config.effort`: how much the model puts into a response."""

DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0
"""Claude Code's stream watchdog default: five minutes without an event (pings aside) fails the call."""


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
    effort: Effort | None = None
    purpose: Literal["main", "summary", "compact"] = "main"
    stream_idle_timeout_s: float | None = DEFAULT_STREAM_IDLE_TIMEOUT_S
    """How long the response may take to start, then go without an event other than `ping`, before the call
    fails as a retryable `connection` error (`QueryOptions.stream_idle_timeout_s`; None: no limit). Honoured by
    the providers that read a wire (`AnthropicModel`)."""


model_request = keyword_maker(ModelRequest)
"""`ModelRequest(...)` for the loop's every call (`keyword_maker`)."""


class ModelError(QueryloopError):
    """A failed model call, classified so recovery can be decided without looking at HTTP classes.

    Kinds beyond the obvious: `context_overflow` is the 400 "input length and `max_tokens` exceed
    context limit" (the answer's room, not the prompt, is too big: lower `max_tokens`, else treat it
    as `prompt_too_long`); `max_tokens_cap` is the 400 "`max_tokens`: N > M, which is the maximum
    allowed number of output tokens for MODEL"; `model_unavailable` is a model the provider asked to fall back
    from (`FallbackTriggered`) when no fallback model is set (Claude Code's "X is currently unavailable.").

    `should_retry` is the server's `x-should-retry` header (None when it sent none, or for an error
    event inside a 200 stream): it wins over the kind, as in the SDK.
    """

    def __init__(
        self,
        kind: ModelErrorKind,
        message: str,
        *,
        status: int | None = None,
        retry_after: float | None = None,
        should_retry: bool | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind: ModelErrorKind = kind
        self.message = message
        self.status = status
        self.retry_after = retry_after
        self.should_retry = should_retry
        self.request_id = request_id
        """The API's id of the failed request (its `request-id` header, or the error body's `request_id`): what
        Anthropic's support asks for. None where the error names none (a cut connection, a 413 from the edge)."""

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from what `__init__` takes (it crosses Ray, and into worker processes), its subclasses too.
        keywords = {
            "status": self.status,
            "retry_after": self.retry_after,
            "should_retry": self.should_retry,
            "request_id": self.request_id,
        }
        return _rebuild_model_error, (type(self), self.kind, self.message, keywords)

    @property
    def retryable(self) -> bool:
        """Whether sending the same request again may succeed: the server's word if it gave one, else the kind's."""
        if self.should_retry is not None:
            return self.should_retry
        return self.kind in RETRYABLE_KINDS

    def __repr__(self) -> str:
        return f"ModelError({self.kind!r}, {self.message!r}, status={self.status})"


RETRY_BASE_S = 0.5
RETRY_MAX_S = 8.0
"""The backoff of a failed request's retries (the ModelCaller's defaults; the Compactor's compaction calls)."""


def retry_delay_s(
    attempt: int, error: ModelError, *, jitter: float, base_s: float = RETRY_BASE_S, max_s: float = RETRY_MAX_S
) -> float:
    """Seconds before retry `attempt` (0-based) of a failed request: the server's `retry-after` wins, else the
    exponential backoff (`base_s` doubling up to `max_s`) times `jitter` (0.75-1: many sessions must not
    retry in step)."""
    if error.retry_after is not None:
        return float(error.retry_after)
    backoff: float = min(base_s * 2**attempt, max_s)
    return backoff * jitter


class FallbackTriggered(QueryloopError):
    """The provider asks to switch to the fallback model (repeated overload of the primary, say)."""


@runtime_checkable
class ModelProvider(Protocol):
    """Streams one call. Cancelling the iteration must close the underlying stream.

    A provider written for asyncio (it awaits an aiohttp session, the host's own `AsyncAnthropic`
    client, an `asyncio.Queue`) says so with an attribute `runs_on = "asyncio"`: under
    `queryloop.aio.AsyncioRuntime` its calls then stream on the host's loop; the trio `Runtime`
    refuses it. Without the attribute a provider runs on trio (the built-in ones, and wrappers of them).
    """

    def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]: ...


def check_provider(value: Any) -> Any:
    """The options' validator of a provider: it has a `stream` method and a known `runs_on`, if any."""
    # What `isinstance(value, ModelProvider)` checks, at a sixth of its cost (a runtime-checkable protocol
    # walks its members on every check; a host opens a session per agent run).
    if value is not None and not callable(getattr(value, "stream", None)):
        msg = f"a model provider has a `stream(request)` method; {type(value).__name__} has none"
        raise ValueError(msg)
    if getattr(value, "runs_on", None) not in (None, "trio", "asyncio"):
        msg = f"a model provider's `runs_on` is 'trio' or 'asyncio', not {value.runs_on!r}"
        raise ValueError(msg)
    return value


def runs_on_asyncio(provider: object) -> bool:
    """Whether `provider` is written for asyncio (`runs_on = "asyncio"`, see `ModelProvider`)."""
    return getattr(provider, "runs_on", None) == "asyncio"


# Not "exceed context limit": that 400 is `context_overflow`, fixed by a smaller `max_tokens` first.
PROMPT_TOO_LONG_MARKERS = (
    "prompt is too long",
    "request size exceeds model context window",
    "request_too_large",
)


def is_prompt_too_long(status: int | None, message: str) -> bool:
    """Every wording of "prompt too long" seen on the wire (api-facts §2): 400s and both 413 bodies."""
    text = message.lower()
    return status == 413 or any(marker in text for marker in PROMPT_TOO_LONG_MARKERS)


# What a server's stream must be: checked by the assembler and by the ModelCaller before it forwards an event
# (pure: tested without an actor).

USAGE_COUNTS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
"""The counts of a usage object that are billed (the one-hour writes are part of `cache_creation_input_tokens`)."""

ReportedUsage = tuple[int | None, int | None, int | None, int | None, int | None]
"""A usage object's input, output, cache write and cache read counts, and its one-hour cache writes; None where
it does not report one."""


def _count_of(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if value.__class__ is not int or value < 0:  # bool is an int subclass: its class is not `int`
        msg = f"usage {key} is {value!r:.40}, not a non-negative integer"
        raise ValueError(msg)
    count: int = value
    return count


def reported_usage(raw: Any) -> ReportedUsage:
    """The counts a `message_start` / `message_delta` usage object reports, checked: each one present must be a
    non-negative integer (else `ValueError`: a malformed response, never a negative or made-up cost).

    With `iterations[]` (one entry per sampling pass: server-side compaction, then the answer), the
    counts are the passes' sums, which is what the API bills; the top-level counts then cover the last
    pass only.
    """
    if raw.__class__ is not dict:
        msg = f"usage is {type(raw).__name__}, not an object"
        raise ValueError(msg)
    iterations = raw.get("iterations")
    if iterations:
        if iterations.__class__ is not list or not all(i.__class__ is dict for i in iterations):
            msg = "usage iterations is not a list of objects"
            raise ValueError(msg)
        passes = [reported_usage({k: v for k, v in i.items() if k != "iterations"}) for i in iterations]
        return (*(sum(p[n] or 0 for p in passes) for n in range(5)),)  # type: ignore[return-value]
    one_hour = None
    creation = raw.get("cache_creation")
    if creation.__class__ is dict:  # an optional breakdown: one that is not an object says nothing
        one_hour = _count_of(creation, "ephemeral_1h_input_tokens")
        _count_of(creation, "ephemeral_5m_input_tokens")
    return (*(_count_of(raw, key) for key in USAGE_COUNTS), one_hour)  # type: ignore[return-value]


def checked_usage(kind: str, usage: Any) -> dict[str, Any]:
    """`usage` of a `kind` event once its counts are known to be non-negative integers (`reported_usage`), else
    a malformed-stream `ModelError`: a malformed usage is never noted, so a cut call is never billed a made-up
    (or negative) cost."""
    try:
        reported_usage(usage)
    except ValueError as error:
        msg = f"malformed stream event {kind!r}: {error}"
        raise ModelError("api_error", msg) from error
    checked: dict[str, Any] = usage
    return checked


def before_message_start(raw: Any, kind: Any, item: Any, held: list[Any]) -> None:
    """An event (`raw`, its `kind` if read) of a stream that has not started yet, which nothing forwards now:
    `message_start` is held back in `held` (an error right after it then leaves nothing seen), a `ping`
    dropped (a keep-alive says nothing), anything else makes the stream malformed (a `ModelError`: a lone
    `message_stop` is never a success)."""
    if kind is None and isinstance(raw, dict):  # a dict subclass: its type is read here
        kind = raw.get("type")
    if kind == "message_start":
        held.append(item)
    elif kind != "ping":
        msg = f"malformed stream: {kind!r} before message_start"
        raise ModelError("api_error", msg)


class NotedUsage(Protocol):
    """Where a call notes the raw `usage` objects its stream reported (the ModelCaller's `CallProgress`): turned
    into a `Usage` only when a call cut short is billed."""

    start_usage: dict[str, Any] | None
    delta_usage: dict[str, Any] | None


FORWARDED_AS_THEY_ARE = ("content_block_start", "content_block_stop", "message_stop")
"""Event types that are forwarded unchecked when they come in a plain dict, as a `content_block_delta` is: their
`type` is a string, and they carry no usage (`message_start` and `message_delta` do, and `noted_event` notes it). A
tuple: an unhashable `type` (a malformed event) must reach `noted_event`, not raise in a set's lookup."""


def noted_event(raw: Any, kind: Any, progress: NotedUsage) -> Any:
    """An event neither a delta nor `FORWARDED_AS_THEY_ARE` (`kind`: its type, read already; None for any
    object but a plain dict), checked before it is forwarded, its usage noted: the item to forward (a dict
    subclass wrapped here, since the consumer's handle wraps plain dicts only)."""
    if kind is None and isinstance(raw, dict):
        kind = raw.get("type")
    if kind.__class__ is not str:
        # Nothing of it was forwarded: like a provider's own classified error, retried if nothing was.
        msg = f"malformed stream event: no type in {raw!r:.200}"
        raise ModelError("api_error", msg)
    if kind == "message_start":
        progress.start_usage, progress.delta_usage = checked_usage(kind, raw["message"].get("usage") or {}), None
    elif kind == "message_delta" and progress.start_usage is not None:
        progress.delta_usage = checked_usage(kind, raw.get("usage") or {})
    return raw if raw.__class__ is dict else stream_event(raw)


def _rebuild_model_error(
    cls: type[ModelError], kind: ModelErrorKind, message: str, keywords: dict[str, Any]
) -> ModelError:
    """A pickled `ModelError` (or subclass) made again: `cls(kind, message, **keywords)`."""
    return cls(kind, message, **keywords)
