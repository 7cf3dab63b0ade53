"""`LocalMessagesAPI`: a loopback Messages API server, so the real SDK path can be tested end to end.

`AnthropicModel` is only as trustworthy as the wire it was tested on. This server speaks real
HTTP/1.1 (trio + h11, bound to 127.0.0.1 on an ephemeral port) and plays a script, so a test can
drive the official `anthropic` SDK, its connection pool and real sockets through every fault the
runtime must survive, without a key or a network::

    async with LocalMessagesAPI([{"content": [{"type": "text", "text": "Hi"}]}]) as api:
        model = AnthropicModel(api_key="sk-local-test", base_url=api.base_url)
        ...
        await model.aclose()

Each `POST /v1/messages` (streaming: `"stream": true`) takes the next script entry. Entries are
`ScriptedModel`'s (`queryloop.runtime.providers.scripted.parse_entry`), played the way the real API would send them:

- a reply: `200 text/event-stream`, the events of `queryloop.runtime.providers.scripted.reply_events` (so the stream
  is the scripted one, event for event) framed as `event: <type>` / `data: <json>` / blank line,
  with one `ping` after the first `content_block_start`. `latency_ms` is spent half before the
  first event and half before `message_delta`, as `ScriptedModel` spends it;
- `prompt_too_long`: 400 `invalid_request_error` "prompt is too long: …";
- `image_size`: 400 `invalid_request_error` "… image exceeds 5 MB maximum …";
- `rate_limit`: 429 `rate_limit_error`; `overloaded` and `fallback`: 529 `overloaded_error` (the
  wire has no "fallback": a primary that stays overloaded is what makes the runtime switch);
  `api_error`: 500 `api_error`. These carry `x-should-retry: true`; `retry_after_s`, when given,
  becomes a `retry-after` header (on any status: the runtime honours it on any status);
- `connection`: `after_events` events of `content`, then the TCP connection is closed without
  `message_stop` (with `after_events` 0: closed before any response).

Error entries spend their whole `latency_ms` before answering. Bodies and headers are shaped as the
recorded ones in `tests/fixtures/errors`. Entries only a real wire can express (`WireFault`):

- `{"error": "midstream_overloaded", "after_events": N}`: a 200 stream of N events of `content`,
  then `event: error` with the `overloaded_error` body, and the connection closes;
- `{"error": "request_too_large"}`: the 413 Cloudflare answers before the API sees the request,
  whose body has no top-level `type` and no `request_id`;
- `{"error": "malformed_event", "after_events": N, "event": {...}}`: a 200 stream of N events of
  `content`, then one event whose data is `event` (by default an object without a `type`), and the
  connection closes;
- `{"error": "http", "status": S, "body": {...}, "headers": {...}}` (`HttpError`): a response of
  exactly that status, JSON body and headers (e.g. `{"x-should-retry": "false"}`), no others
  but the framing ones; or `{"error": "http", "fixture": PATH}`: the status, headers and body of a
  recorded error file (`tests/fixtures/errors/*.json`), with `status`, `body` and `headers` given
  beside it laid over the recorded ones;
- a reply with `"stall_after_events": N`: its first N events at once, then its whole `latency_ms`
  of silence, then the rest (a stream that stalls mid-way, to abort it there);
- `{"error": "pings_forever", "after_events": N, "ping_every_ms": MS}`: a 200 stream of N events of
  `content`, then a `ping` after every MS of silence (1000 by default), never ending: the stalled
  stream a keep-alive hides from a read timeout;
- `{"sse": BODY}`: a recorded response body (`tests/fixtures/sse/*.sse`) sent byte for byte as a
  200 event stream, padding and pings as recorded (one with an `error` event closes the connection);
  with `"content_encoding": NAME` beside it, sent under that `Content-Encoding` (compressed if NAME is
  `gzip` or `deflate`, as recorded under any other name).

`after_events` counts the script's events; `ping`s are extra. A request past the end of the
script gets a 500 `api_error` saying so; a path other than `/v1/messages` gets a 404.

Observations, for assertions: `requests` (every request received: parsed JSON body and
lower-cased headers), `disconnects` (streams the client abandoned before they ended: a send that
failed, or the peer closing, which a watcher notices at once even during a silent stall),
`open_connections` (server-side connections alive now; an idle keep-alive connection counts), and
`wait_until(predicate)`, which wakes on every change of those, so a test waits for a condition
without sleeping (bound it with `trio.fail_after`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import h11
import trio

from queryloop.runtime.errors import NotInTrio
from queryloop.runtime.providers.scripted import ScriptedError, ScriptedReply, reply_events
from queryloop.runtime.providers.wire_script import (
    IMAGE_SIZE_MESSAGE,
    PROMPT_TOO_LONG_MESSAGE,
    RATE_LIMIT_MESSAGE,
    HttpError,
    RawBytes,
    RecordedStream,
    Sleep,
    SseEvent,
    StalledReply,
    StreamPlan,
    WireEntry,
    WireFault,
    error_body,
    estimate_tokens,
    parse_wire_entry,
    pings_forever_plan,
    recorded_plan,
    reply_plan,
    stalled_plan,
    with_ping,
)

if TYPE_CHECKING:
    from types import TracebackType

__all__ = [
    "HttpError",
    "LocalMessagesAPI",
    "ReceivedRequest",
    "StalledReply",
    "WireEntry",
    "WireFault",
    "parse_wire_entry",
]

RECEIVE_SIZE = 65536

MESSAGES_PATH = "/v1/messages"

REASONS: dict[int, bytes] = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    413: b"Payload Too Large",
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    529: b"Overloaded",
}


CREDENTIAL_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie"})
"""Headers whose values a repr never shows (a failing test prints the requests it compared)."""


@dataclass(frozen=True)
class ReceivedRequest:
    """One HTTP request as the server received it."""

    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names; a repeated header keeps its last value."""
    body: dict[str, Any]
    """The parsed JSON body; `{}` when there was none or it was not a JSON object."""

    def __repr__(self) -> str:
        # The client's key is in `headers` (tests assert it was sent); a repr, printed by any failing
        # assertion that shows a request, masks it.
        shown = {name: "***" if name in CREDENTIAL_HEADERS else value for name, value in self.headers.items()}
        return f"ReceivedRequest(method={self.method!r}, path={self.path!r}, headers={shown!r}, body={self.body!r})"


class _PeerGone(Exception):
    """The client closed while its response was still being sent."""


class _CloseConnection(Exception):
    """The script asks for the connection to be dropped here."""


class LocalMessagesAPI:
    """A scripted Messages API on 127.0.0.1; open it with `async with` inside a trio run."""

    def __init__(self, script: Sequence[WireEntry | dict[str, Any]], *, name: str = "local") -> None:
        self.entries: list[WireEntry] = [parse_wire_entry(entry) for entry in script]
        self.name = name
        self.requests: list[ReceivedRequest] = []
        self.disconnects = 0
        self.open_connections = 0
        self.port: int | None = None
        self._served = 0
        self._changed = trio.Event()
        self._stack: AsyncExitStack | None = None

    def __repr__(self) -> str:
        return (
            f"<LocalMessagesAPI {self.name} port={self.port}: {self._served}/{len(self.entries)} entries served, "
            f"{self.open_connections} open, {self.disconnects} disconnects>"
        )

    @property
    def base_url(self) -> str:
        if self.port is None:
            msg = "the server is not running: use it inside `async with`"
            raise RuntimeError(msg)
        return f"http://127.0.0.1:{self.port}"

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds; it is re-checked on every request, connection change and disconnect."""
        while not predicate():
            await self._changed.wait()

    # -- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if not trio.lowlevel.in_trio_run():
            raise NotInTrio("`async with LocalMessagesAPI(...)`")
        stack = AsyncExitStack()
        await stack.enter_async_context(self._serving())
        self._stack = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._stack = self._stack, None
        assert stack is not None, "__aexit__ without __aenter__"
        return await stack.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _serving(self) -> AsyncIterator[None]:
        # Loopback only: this server exists for tests and must never be reachable from elsewhere.
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = int(listeners[0].socket.getsockname()[1])
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._serve_connection, listeners)
                try:
                    yield
                finally:
                    # Leaving the block stops the server: connections still open are closed.
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The nursery wraps whatever the `async with` body raised; a lone exception is re-raised
            # bare, so a failing assertion in a test reads as itself.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- HTTP/1.1 ------------------------------------------------------------------------

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        self.open_connections += 1
        self._notify()
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await self._receive_request(conn, stream)
                if request is None:
                    return
                await self._respond(conn, stream, request)
                if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    return  # `connection: close` on either side
                conn.start_next_cycle()
        except (
            _PeerGone,
            _CloseConnection,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            h11.RemoteProtocolError,
        ):
            # The client went away (or the script cut the connection): nothing is left to answer.
            pass
        finally:
            await trio.aclose_forcefully(stream)
            self.open_connections -= 1
            self._notify()

    async def _receive_request(self, conn: h11.Connection, stream: trio.SocketStream) -> ReceivedRequest | None:
        """The next whole request on the connection, or None when the client closed it while idle."""
        head: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(RECEIVE_SIZE))  # b"" is EOF, which h11 tracks
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                return None
        assert head is not None
        try:
            parsed: Any = json.loads(body) if body else {}
        except ValueError:
            parsed = {}
        request = ReceivedRequest(
            method=head.method.decode("ascii"),
            path=head.target.decode("ascii").partition("?")[0],
            headers={name.decode("latin-1").lower(): value.decode("latin-1") for name, value in head.headers},
            body=parsed if isinstance(parsed, dict) else {},
        )
        self.requests.append(request)
        self._notify()
        return request

    async def _respond(self, conn: h11.Connection, stream: trio.SocketStream, request: ReceivedRequest) -> None:
        if request.method != "POST" or request.path != MESSAGES_PATH:
            body = error_body("not_found_error", f"{request.method} {request.path}: not served here")
            await _send_json(conn, stream, 404, body)
            return
        if request.body.get("stream") is not True:
            # Every call of the runtime streams; a non-streaming one here is a bug to surface.
            body = error_body("invalid_request_error", "LocalMessagesAPI serves streaming requests only")
            await _send_json(conn, stream, 400, body)
            return
        number = self._served
        self._served += 1
        request_id = f"req_{self.name}_{number + 1}"
        if number >= len(self.entries):
            message = (
                f"LocalMessagesAPI {self.name!r}: script exhausted, no entry for request {number + 1} "
                f"(the script has {len(self.entries)})"
            )
            await _send_json(conn, stream, 500, error_body("api_error", message, request_id), request_id=request_id)
            return
        entry = self.entries[number]
        model = str(request.body.get("model", "unknown-model"))
        message_id = f"msg_{self.name}_{number + 1}"
        if isinstance(entry, ScriptedReply):
            input_tokens = estimate_tokens(request.body.get("messages", []))
            events = reply_events(entry, model=model, message_id=message_id, input_tokens=input_tokens)
            await self._send_stream(conn, stream, reply_plan(events, entry.latency_ms), request_id)
        elif isinstance(entry, StalledReply):
            input_tokens = estimate_tokens(request.body.get("messages", []))
            events = reply_events(entry.reply, model=model, message_id=message_id, input_tokens=input_tokens)
            await self._send_stream(
                conn, stream, stalled_plan(events, entry.after_events, entry.reply.latency_ms), request_id
            )
        elif isinstance(entry, RecordedStream):
            await self._send_stream(conn, stream, recorded_plan(entry), request_id)
        elif isinstance(entry, WireFault):
            await self._fault(conn, stream, entry, model=model, message_id=message_id, request_id=request_id)
        elif isinstance(entry, HttpError):
            await trio.sleep(entry.latency_ms / 1000)
            await _send_json(conn, stream, entry.status, entry.body, headers=entry.header_list())
        else:
            await self._error(conn, stream, entry, model=model, message_id=message_id, request_id=request_id)

    async def _error(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        entry: ScriptedError,
        *,
        model: str,
        message_id: str,
        request_id: str,
    ) -> None:
        half = entry.latency_ms / 2000
        if entry.error == "connection":
            # As ScriptedModel: half the latency, the events before the cut, no second half.
            if entry.after_events == 0:
                await trio.sleep(half)
                raise _CloseConnection  # no response at all: the SDK sees "server disconnected"
            events = reply_events(
                ScriptedReply(content=entry.content), model=model, message_id=message_id, input_tokens=1
            )
            steps: list[Sleep | SseEvent] = [
                Sleep(half),
                *with_ping([SseEvent(e) for e in events[: entry.after_events]]),
            ]
            await self._send_stream(conn, stream, StreamPlan(steps=steps, ending="cut"), request_id)
            return
        await trio.sleep(2 * half)
        headers: list[tuple[str, str]] = []
        if entry.retry_after_s is not None:
            headers.append(("retry-after", f"{entry.retry_after_s:g}"))
        status, error_type, message, retry = {
            "prompt_too_long": (400, "invalid_request_error", PROMPT_TOO_LONG_MESSAGE, False),
            "image_size": (400, "invalid_request_error", IMAGE_SIZE_MESSAGE, False),
            "rate_limit": (429, "rate_limit_error", RATE_LIMIT_MESSAGE, True),
            "overloaded": (529, "overloaded_error", "Overloaded", True),
            "fallback": (529, "overloaded_error", "Overloaded", True),
            "api_error": (500, "api_error", "Internal server error", True),
        }[entry.error]
        headers.append(("x-should-retry", "true" if retry else "false"))
        # The recorded 529 body has no request_id (tests/fixtures/errors/529_overloaded_error.json).
        body = error_body(error_type, message, None if status == 529 else request_id)
        await _send_json(conn, stream, status, body, request_id=request_id, headers=headers)

    async def _fault(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        entry: WireFault,
        *,
        model: str,
        message_id: str,
        request_id: str,
    ) -> None:
        if entry.error == "request_too_large":
            await trio.sleep(entry.latency_ms / 1000)
            # Cloudflare's answer: no top-level "type", no request_id, no request-id header.
            body = {"error": {"type": "request_too_large", "message": "Request exceeds the maximum size"}}
            await _send_json(conn, stream, 413, body)
            return
        events = reply_events(ScriptedReply(content=entry.content), model=model, message_id=message_id, input_tokens=1)
        steps: list[Sleep | SseEvent] = [
            Sleep(entry.latency_ms / 2000),
            *with_ping([SseEvent(e) for e in events[: entry.after_events]]),
        ]
        if entry.error == "pings_forever":
            await self._send_stream(conn, stream, pings_forever_plan(steps, entry.ping_every_ms / 1000), request_id)
            return
        if entry.error == "malformed_event":
            steps.append(SseEvent(entry.event))
        else:
            # The recorded in-stream error (tests/fixtures/sse/derived_midstream_overloaded_error.sse).
            error = {
                "type": "error",
                "error": {"details": None, "type": "overloaded_error", "message": "Overloaded"},
                "request_id": request_id,
            }
            steps.append(SseEvent(error))
        await self._send_stream(conn, stream, StreamPlan(steps=steps, ending="error_event"), request_id)

    async def _send_stream(
        self, conn: h11.Connection, stream: trio.SocketStream, plan: StreamPlan, request_id: str
    ) -> None:
        """Send one SSE response; raise `_PeerGone` if the client left first, `_CloseConnection` for a cut."""
        headers = [("content-type", "text/event-stream; charset=utf-8"), ("cache-control", "no-cache")]
        headers.append(("request-id", request_id))
        headers.extend(plan.headers)
        if plan.ending != "complete":
            # The server closes after an error event; saying so keeps the client from pooling the connection.
            headers.append(("connection", "close"))
        await stream.send_all(_out(conn.send(h11.Response(status_code=200, headers=headers, reason=REASONS[200]))))
        finished = False
        peer_gone = False
        async with trio.open_nursery() as nursery:

            async def watch_peer() -> None:
                # An HTTP/1.1 client sends nothing more until this response ends, so a read that
                # ends means the peer went away. Watching for it now notices an abort during a
                # silent stall, when no send would fail for a long time.
                nonlocal peer_gone
                try:
                    while data := await stream.receive_some(RECEIVE_SIZE):
                        conn.receive_data(data)  # a pipelined request: h11 keeps it for the next cycle
                except trio.BrokenResourceError:
                    pass
                peer_gone = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_peer)
            try:
                for step in plan.steps:
                    if isinstance(step, Sleep):
                        if step.seconds > 0:
                            await trio.sleep(step.seconds)
                        continue
                    if isinstance(step, RawBytes):
                        await stream.send_all(_out(conn.send(h11.Data(data=step.data))))
                        continue
                    name = str(step.data.get("type", "message"))
                    frame = f"event: {name}\ndata: {json.dumps(step.data, separators=(',', ':'))}\n\n"
                    await stream.send_all(_out(conn.send(h11.Data(data=frame.encode()))))
                if plan.ending != "cut":
                    await stream.send_all(_out(conn.send(h11.EndOfMessage())))
                finished = True
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                peer_gone = True  # a send failed: the peer is gone
            nursery.cancel_scope.cancel()
        if peer_gone and not finished:
            self.disconnects += 1
            self._notify()
            raise _PeerGone
        if plan.ending == "cut":
            raise _CloseConnection  # the body ends without its last chunk: the client sees a cut stream


async def _send_json(
    conn: h11.Connection,
    stream: trio.SocketStream,
    status: int,
    body: dict[str, Any] | None,
    *,
    request_id: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    payload = b"" if body is None else json.dumps(body).encode()
    all_headers = [("content-type", "application/json"), ("content-length", str(len(payload))), *headers]
    if request_id is not None:
        all_headers.append(("request-id", request_id))
    reason = REASONS.get(status, b"")
    await stream.send_all(_out(conn.send(h11.Response(status_code=status, headers=all_headers, reason=reason))))
    await stream.send_all(_out(conn.send(h11.Data(data=payload))))
    await stream.send_all(_out(conn.send(h11.EndOfMessage())))


def _out(data: bytes | None) -> bytes:
    # h11 returns None only for ConnectionClosed, which this server never sends.
    return data or b""
