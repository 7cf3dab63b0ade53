"""`AnthropicModel`: the real provider, one Messages API call streamed through the official SDK.

What it yields: every server-sent event of the response as the plain dict the server sent
(`json.loads` of its `data:`), in wire order, `ping` included. The events are read from the
SDK stream's HTTP response instead of by iterating the SDK stream, for two reasons found in
`anthropic` 2.12.0: its `AsyncStream` silently drops `ping`, and it builds every event into a
pydantic model whose unions are closed, so an unknown block or delta type (`compaction`,
`compaction_delta`, …) is coerced into a `TextBlock` / `TextDelta`: `model_dump()` then adds a
bogus `"text": null` and warns. Raw JSON passes any newer type through untouched.

How failures map to `ModelError.kind` (`status` is the HTTP code, `retry_after` in seconds):

- 400 "input length and `max_tokens` exceed context limit: I + M > L": `context_overflow` (not a
  prompt too long: the ModelCaller first retries with a `max_tokens` that fits);
- 400 "`max_tokens`: N > M, which is the maximum allowed number of output tokens for MODEL":
  `max_tokens_cap` (the ModelCaller clamps to M, retries, and remembers M for the model);
- 400 / 413 whose message passes `is_prompt_too_long` (every 413 does): `prompt_too_long`;
- 400 about image size ("image exceeds", "image too large", "image dimensions"): `image_size`;
- any other 400, and 4xx codes not listed here (402 billing, 422, …): `invalid_request`;
- 401 / 403: `authentication`; 404: `not_found`;
- 429: `rate_limit`, `retry_after` from `retry-after-ms`, else `retry-after` (any status gets it);
- `x-should-retry: true|false` on any HTTP error sets `should_retry`, which wins over the kind when
  the ModelCaller decides to retry (as in the SDK: a 500 with `false` is not retried, a 400 with
  `true` is); any other value, or no header, leaves it None;
- 529: `overloaded`; 408 / 409 / any other 5xx: `api_error`;
- `event: error` inside a 200 stream: its `error.type` is turned into the status it stands for
  (`overloaded_error` → 529, `rate_limit_error` → 429, `invalid_request_error` → 400,
  `api_error` and unknown types → 500, …) and classified as above; the message names the
  in-stream origin and `retry_after` and `should_retry` stay None (headers of a 200 say nothing
  about the error);
- an event whose data is a JSON object without a string `type`: `api_error` ("malformed stream
  event …"), raised before it is yielded, like data that is not JSON at all;
- connection refused, timeout, transport error while reading the body: `connection`;
- a body that ends without `message_stop`, or is cut inside an event: `connection`
  ("stream ended before message_stop"), after every whole event before it was yielded;
- the wire defences (docs/design.md, "The wire defences"), each a `WireDefenceError`: a response that
  does not start within `request.stream_idle_timeout_s`, or then goes that long without an event
  other than `ping` (the stream watchdog, `watchdog.py`): `connection` ("Stream idle timeout - …");
  more than `sse.MAX_EVENT_BYTES` (16 MiB) without a whole event: `api_error`; a `Content-Encoding`
  that cannot be read (`content_encoding.py`): `api_error` with `should_retry` False; a body not valid
  in its coding: `api_error`.

The SDK's own retries default to 0: the runtime's ModelCaller retries, and a retry inside the
SDK would be invisible to its budgets and events.

Prompt caching is on by default, as in Claude Code: each request carries the API's top-level
`cache_control` (`{"type": "ephemeral"}`, a five-minute cache), which marks its last cacheable block.
The tools, the system prompt and the conversation up to it are written to the cache, and the next
request (the same prefix, one turn longer) reads them at the cache-read price (a tenth of the input
price or less), as the usage's `cache_read_input_tokens` shows. The loop rewrites no message it has
sent except when it compacts, so from one turn to the next the prefix stays byte for byte the same.
`prompt_caching=False` sends no marker. `cache_ttl="1h"` asks for the one-hour cache instead (as Claude
Code does where it is allowed): a write there costs twice the input price, against 1.25 times for five
minutes, and the usage's `cache_creation` breakdown says which was written; the runtime prices each at its
rate (`Pricing.cache_write`, `Pricing.one_hour_cache_write`).
"""

from __future__ import annotations

import contextlib
import email.utils
import math
import time
import urllib.parse
from typing import TYPE_CHECKING, Any, Literal, cast

import trio
from loguru import logger

from queryloop.runtime.loop.json_text import loads
from queryloop.runtime.loop.max_tokens import parse_context_overflow, parse_model_output_cap
from queryloop.runtime.loop.model import ModelError, ModelErrorKind, ModelRequest, is_prompt_too_long
from queryloop.runtime.providers.content_encoding import BodyDecoder, body_decoder
from queryloop.runtime.providers.sse import SSEReader, WireDefenceError
from queryloop.runtime.providers.watchdog import IdleWatchdog

if TYPE_CHECKING:
    from collections.abc import AsyncGenerator, Iterator

    import anthropic
    import httpx2
    from anthropic.types import (
        CacheControlEphemeralParam,
        MessageParam,
        TextBlockParam,
        ThinkingConfigParam,
        ToolUnionParam,
    )

__all__ = [
    "AnthropicModel",
    "classify_status",
    "model_error_from_sdk",
    "parse_retry_after",
    "parse_should_retry",
    "redacted_url",
]

IMAGE_SIZE_MARKERS = ("image exceeds", "image too large", "image dimensions")

# An `event: error` arrives with HTTP 200; these are the statuses its `error.type` stands for
# (api-facts §2), so an in-stream error is classified exactly like the HTTP one it replaces.
STATUS_OF_ERROR_TYPE: dict[str, int] = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "billing_error": 402,
    "permission_error": 403,
    "not_found_error": 404,
    "request_too_large": 413,
    "rate_limit_error": 429,
    "api_error": 500,
    "timeout_error": 504,
    "overloaded_error": 529,
}

TASK_BUDGETS_BETA = "task-budgets-2026-03-13"

_CACHE_MARKERS: dict[str, CacheControlEphemeralParam] = {
    "5m": {"type": "ephemeral"},
    "1h": {"type": "ephemeral", "ttl": "1h"},
}
"""The request's top-level cache marker by lifetime: the API puts it on the last cacheable block (five
minutes unless it says `ttl`)."""

# Closing must finish even when the consumer was cancelled (that is when it matters most), but a
# wedged transport must not hold the cancelled task forever either.
DRAIN_S = 0.5
"""How long a stream ended by an error is read on to its end before it is simply closed."""
CLOSE_GRACE_S = 5.0


class AnthropicModel:
    """A `ModelProvider` backed by `anthropic.AsyncAnthropic`. See the module docstring for the mapping."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        client: anthropic.AsyncAnthropic | None = None,
        max_retries: int = 0,
        timeout: float = 600.0,
        prompt_caching: bool = True,
        cache_ttl: Literal["5m", "1h"] = "5m",
    ) -> None:
        # The key goes straight into the client and is not kept here, so no attribute of this
        # object (and no repr of one) can leak it.
        self._owns_client = client is None
        if client is None:
            import anthropic  # the SDK takes a second to import: only hosts that call the API pay it

            client = anthropic.AsyncAnthropic(
                api_key=api_key, base_url=base_url, max_retries=max_retries, timeout=timeout
            )
        self._client = client
        if cache_ttl not in _CACHE_MARKERS:
            msg = f"cache_ttl must be '5m' or '1h', not {cache_ttl!r}"
            raise ValueError(msg)
        self.prompt_caching = prompt_caching
        self.cache_ttl = cache_ttl

    def __repr__(self) -> str:
        # No key, header or credential of the client: a repr ends up in logs, tracebacks and test reports.
        client = self._client
        return (
            f"AnthropicModel(base_url={redacted_url(str(client.base_url))!r}, "
            f"max_retries={client.max_retries}, timeout={client.timeout!r})"
        )

    async def aclose(self) -> None:
        """Close the HTTP client if this object built it; a client passed in belongs to the caller."""
        if self._owns_client:
            await self._client.close()

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        """Stream one call as raw event dicts; raise `ModelError` on any failure.

        Iterate it under `contextlib.aclosing` (or run it to the end): the HTTP response is
        closed in the generator's `finally`, which only runs promptly when the generator is
        closed. The wire defences (docs/design.md): the stream watchdog (`IdleWatchdog`), the
        body's `Content-Encoding` undone or refused (`content_encoding`), and the SSE reader's
        linear time and cap on one event (`SSEReader`).
        """
        import httpx2

        watchdog = IdleWatchdog(request.stream_idle_timeout_s)
        sdk_stream = await self._open(request, watchdog)
        response = sdk_stream.response
        # From the network: aiter_raw, not aiter_bytes, which abandons its inner aiter_raw generator
        # when closed and leaves the transport's body iterator to the garbage collector. A body
        # already in memory (a test transport) is read by aiter_bytes, with no generator beneath, and
        # is decoded already; a raw one is decoded here.
        raw = not response.is_stream_consumed
        chunks = response.aiter_raw() if raw else response.aiter_bytes()
        reader = SSEReader()
        saw_message_stop = False
        drain = True  # whether a stream that ends on an error is read on to its end before it is closed
        try:
            try:
                decoder = body_decoder(response.headers.get("content-encoding")) if raw else None
                watchdog.start()  # the headers are in: the idle count starts afresh
                while (chunk := await watchdog.read(chunks)) is not None:
                    for event in _chunk_events(chunk, decoder, reader, response):
                        saw_message_stop = saw_message_stop or event["type"] == "message_stop"
                        if event["type"] == "ping":  # restarts nothing; the consumer's time is not counted
                            watchdog.pause()
                            yield event
                            watchdog.resume()
                        else:
                            yield event
                            watchdog.heard()
            except httpx2.RequestError as exc:
                # The SDK wraps transport errors only while sending; reading the body raises them raw.
                raise ModelError("connection", f"stream broke: {exc!r}") from exc
            for event in _last_events(reader, response):
                saw_message_stop = saw_message_stop or event.get("type") == "message_stop"
                yield event
            if not saw_message_stop:
                raise ModelError("connection", "stream ended before message_stop")
        except GeneratorExit:
            drain = False  # the consumer left: it is not kept waiting
            raise
        except WireDefenceError as error:
            drain = False  # a silent server has nothing to drain, and a refused body is not read on
            _log_refusal(error, request)
            raise
        finally:
            await _close_body(chunks, sdk_stream, drain=drain)

    async def _open(self, request: ModelRequest, watchdog: IdleWatchdog) -> anthropic.AsyncStream[Any]:
        """Send the request; the SDK's stream once the response's headers have come, within the watchdog's
        first-byte deadline."""
        import anthropic  # loaded by now (a client exists): a lookup in sys.modules
        from anthropic import omit

        # The body is read raw (`stream`), so it should not be compressed (a proxy may still compress it).
        extra_headers: dict[str, str] = {"accept-encoding": "identity"}
        extra_body: dict[str, Any] = {}
        output_config: dict[str, Any] = {}
        if request.task_budget:
            # The API documents the budget inside `output_config`, typed {"type": "tokens", "total",
            # "remaining"} and behind a beta header (platform docs "Task budgets"; the SDK's
            # BetaOutputConfigParam), not as a top-level `task_budget` field.
            output_config["task_budget"] = {"type": "tokens", **request.task_budget}
            extra_headers["anthropic-beta"] = TASK_BUDGETS_BETA
        if request.effort is not None:
            output_config["effort"] = request.effort
        if output_config:
            extra_body["output_config"] = output_config
        watchdog.start()
        with trio.CancelScope(deadline=watchdog.deadline):
            try:
                return await self._client.messages.create(
                    stream=True,
                    model=request.model,
                    max_tokens=request.max_tokens,
                    messages=cast("list[MessageParam]", request.messages),
                    system=cast("list[TextBlockParam]", request.system) if request.system else omit,
                    tools=cast("list[ToolUnionParam]", request.tools) if request.tools else omit,
                    thinking=cast("ThinkingConfigParam", request.thinking) if request.thinking else omit,
                    cache_control=_CACHE_MARKERS[self.cache_ttl] if self.prompt_caching else omit,
                    extra_headers=extra_headers,
                    extra_body=extra_body or None,
                )
            except anthropic.AnthropicError as exc:
                raise model_error_from_sdk(exc) from exc
        # Out of the scope without a response: the first-byte deadline passed.
        error = watchdog.expired()
        _log_refusal(error, request)
        raise error


def _chunk_events(
    chunk: bytes, decoder: BodyDecoder | None, reader: SSEReader, response: httpx2.Response
) -> Iterator[dict[str, Any]]:
    """The events one chunk of the body completes, decoded, lazily: an event is yielded before the next one is
    read (a malformed one raises only once those before it were taken), and a compressed chunk's pieces are
    inflated one at a time."""
    for piece in (chunk,) if decoder is None else decoder.decode(chunk):
        for name, data in reader.feed(piece):
            event = _decode_event(name, data, response, at_eof=False)
            if event is not None:
                yield event


def _last_events(reader: SSEReader, response: httpx2.Response) -> Iterator[dict[str, Any]]:
    """The events left at the end of the body, lazily."""
    for name, data in reader.finish():
        # The last event may lack its blank line (a recording, or a proxy); it is whole exactly
        # when its data parses, otherwise the connection was cut inside it.
        event = _decode_event(name, data, response, at_eof=True)
        if event is not None:
            yield event


async def _close_body(
    chunks: AsyncGenerator[bytes, None], sdk_stream: anthropic.AsyncStream[Any], *, drain: bool
) -> None:
    """Close a response's body and stream, within a grace period even when cancelled; `drain`: read on to the
    end first, for a while."""
    with trio.move_on_after(CLOSE_GRACE_S, shield=True):
        if drain:
            # An error ended the stream and the server is closing it: reading on to EOF lets
            # every body iterator of the chain finish by itself (httpx2's transport wrapper
            # cannot close httpcore's from outside).
            with trio.move_on_after(DRAIN_S):
                async for _ in chunks:
                    pass
        await chunks.aclose()
        await sdk_stream.close()


def _log_refusal(error: ModelError, request: ModelRequest) -> None:
    """A wire defence refused the response (the watchdog, the event cap, an unreadable coding): said at WARNING."""
    log = logger.bind(provider="AnthropicModel", model=request.model, purpose=request.purpose)
    log.warning("model call refused by a wire defence: {}", error.message)


def redacted_url(url: str) -> str:
    """`url` without what may be a credential: its userinfo (`user:KEY@`) shown as `***@`, its query as `?***`.

    An unparseable URL is shown as `***` whole: better nothing than a key.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "***@" + netloc.rpartition("@")[2]
        return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "***" if parts.query else "", ""))
    except ValueError:
        return "***"


def model_error_from_sdk(exc: anthropic.AnthropicError) -> ModelError:
    """Classify any SDK exception (the mapping is in the module docstring)."""
    import anthropic

    if isinstance(exc, anthropic.APIConnectionError):
        # Includes APITimeoutError: to the caller both mean "nothing usable came back, try again".
        return ModelError("connection", str(exc))
    if isinstance(exc, anthropic.APIStatusError):
        return _from_status_error(exc)
    if isinstance(exc, anthropic.CredentialsError):
        return ModelError("authentication", str(exc))
    return ModelError("api_error", f"{type(exc).__name__}: {exc}")


def _from_status_error(exc: anthropic.APIStatusError) -> ModelError:
    message = exc.api_message or str(exc)
    body = exc.body if isinstance(exc.body, dict) else {}
    request_id = exc.request_id or (body.get("request_id") if isinstance(body.get("request_id"), str) else None)
    if exc.status_code < 400:
        # Only an in-stream `event: error` produces a status error on a successful response.
        error_type = exc.type or ""
        status = STATUS_OF_ERROR_TYPE.get(error_type, 500)
        in_stream = f"{message} (in-stream error event {error_type or 'of unknown type'} on HTTP 200)"
        return ModelError(classify_status(status, message), in_stream, status=status, request_id=request_id)
    status = exc.status_code
    headers = exc.response.headers
    return ModelError(
        classify_status(status, message),
        message,
        status=status,
        retry_after=parse_retry_after(headers),
        should_retry=parse_should_retry(headers),
        request_id=request_id,
    )


KIND_OF_STATUS: dict[int, ModelErrorKind] = {
    401: "authentication",
    403: "authentication",
    404: "not_found",
    408: "api_error",
    409: "api_error",
    429: "rate_limit",
    529: "overloaded",
}


def classify_status(status: int, message: str) -> ModelErrorKind:
    """The `ModelError.kind` of an HTTP error status and its API message."""
    if status in (400, 413):
        if status == 400 and parse_context_overflow(message) is not None:
            return "context_overflow"
        if status == 400 and parse_model_output_cap(message) is not None:
            return "max_tokens_cap"
        if is_prompt_too_long(status, message):
            return "prompt_too_long"
        if any(marker in message.lower() for marker in IMAGE_SIZE_MARKERS):
            return "image_size"
        return "invalid_request"
    if status in KIND_OF_STATUS:
        return KIND_OF_STATUS[status]
    return "invalid_request" if 400 <= status < 500 else "api_error"


def parse_retry_after(headers: httpx2.Headers) -> float | None:
    """Seconds to wait, from `retry-after-ms` (milliseconds) or `retry-after` (seconds or HTTP date)."""
    millis = headers.get("retry-after-ms")
    if millis is not None:
        with contextlib.suppress(ValueError):
            return _wait(float(millis) / 1000)
    raw = headers.get("retry-after")
    if raw is None:
        return None
    with contextlib.suppress(ValueError):
        return _wait(float(raw))
    parsed = email.utils.parsedate_tz(raw)
    if parsed is None:
        return None
    return _wait(email.utils.mktime_tz(parsed) - time.time())


def parse_should_retry(headers: httpx2.Headers) -> bool | None:
    """The server's `x-should-retry` verdict: True, False, or None (absent or neither word)."""
    raw = headers.get("x-should-retry")
    if raw is None:
        return None
    return {"true": True, "false": False}.get(raw.strip().lower())


def _wait(seconds: float) -> float | None:
    # "nan"/"inf" parse as floats; a retry loop must never sleep on them.
    return max(seconds, 0.0) if math.isfinite(seconds) else None


def _decode_event(name: str | None, data: str, response: httpx2.Response, *, at_eof: bool) -> dict[str, Any] | None:
    """One SSE event as its dict; raise the classified `ModelError` for an error event or garbage."""
    if not data:
        # An event with no data carries nothing to forward (the SDK skips these too).
        return None
    try:
        payload: object = loads(data)  # json.loads, without its Python layers (one per streamed event)
    except ValueError:
        payload = None
    if name == "error" or (isinstance(payload, dict) and payload.get("type") == "error"):
        body = payload if payload is not None else data
        # Built as the SDK itself builds it, so one classification covers both paths.
        import anthropic

        sdk_error = anthropic.APIStatusError(f"{body}", response=response, body=body)
        raise _from_status_error(sdk_error)
    if isinstance(payload, dict):
        if isinstance(payload.get("type"), str):
            return cast("dict[str, Any]", payload)
        # Nothing downstream can tell what it is: a protocol error of the server, said as such.
        raise ModelError("api_error", f"malformed stream event {name!r}: no type in {data[:200]!r}")
    if at_eof:
        raise ModelError("connection", "stream ended before message_stop (cut inside an event)")
    raise ModelError("api_error", f"malformed stream event {name!r}: {data[:200]!r}")
