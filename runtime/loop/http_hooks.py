"""A settings file's http hook (`{"type": "http", "url": "...", "headers": {...}, "allowedEnvVars": [...],
"timeout": N}`) as a callback in the Agent SDK's shape, beside the command hooks (`command_hooks`).

* The request: `POST url` with the event's `input_data` as its JSON body, plus the handler's headers. A header
  value's `$VAR` and `${VAR}` are filled from the environment only for the variables `allowedEnvVars` lists;
  any other reference becomes an empty string, as in Claude Code (`interpolated`).
* Where it may go (`checked_addresses`), as Claude Code's guard for http hooks decides: `http` or `https` only;
  the host is resolved once and every address must be outside the unspecified, private, CGNAT and link-local
  ranges (`is_blocked_address`), so a project's settings cannot reach a cloud's metadata endpoint or the
  internal network. Loopback is allowed: a local policy server is the common case. The connection goes to an
  address checked, so a second lookup cannot move it elsewhere. A redirect is not followed (a 3xx is not a 2xx).
* The response (`http_hook_output`, pure), as Claude Code reads it: a 2xx with an empty body is success with no
  output; a 2xx whose body is a JSON object is read as a command hook's stdout JSON is; any other body, any
  other status, a connection failure and the timeout (600 s by default) are non-blocking errors
  (`HttpHookError`). At most `CAPTURE_BYTES` of a body are read. An abort cancels the request at once.
* Why h11 over trio's sockets and not an HTTP client: the connection must go to the address checked, the body
  must be bounded, and trio's cancellation must reach it; h11 (a dependency already) does HTTP/1.1's framing.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

from queryloop.runtime.loop.command_hooks import CAPTURE_BYTES, json_object
from queryloop.runtime.loop.sdk_hooks import HookCallback, HookContext, HookInput, HookJSONOutput

HTTP_TIMEOUT_S = 600.0
"""How long an http hook may take when its settings give no `timeout` (Claude Code's default)."""

FRAMING_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})
"""Headers the request's framing sets; a handler may not set them (a `SettingsError` when its file is read)."""

BLOCKED_NETWORKS = tuple(
    ipaddress.ip_network(network)
    for network in (
        "0.0.0.0/8",  # "this" network
        "10.0.0.0/8",
        "100.64.0.0/10",  # shared address space (some clouds' metadata)
        "169.254.0.0/16",  # link-local: cloud metadata
        "172.16.0.0/12",
        "192.168.0.0/16",
        "::/128",
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
    )
)
"""The ranges an http hook may not reach (loopback is not among them)."""

_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")
_READ_CHUNK = 64 * 1024


class HttpHookError(Exception):
    """An http hook failed without blocking: a refused url or address, a connection failure, the timeout, a
    status other than 2xx, a body that is neither empty nor a JSON object. The message names the url (never
    its headers, which may hold a secret)."""


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """A hook's response: its status and body (at most `CAPTURE_BYTES`; `overflowed` when it had more)."""

    status: int
    body: bytes
    overflowed: bool = False


def interpolated(value: str, allowed: Sequence[str], environ: Mapping[str, str]) -> str:
    """`value` with each `$VAR` / `${VAR}` filled: from `environ` for the `allowed` names, else empty."""

    def fill(reference: re.Match[str]) -> str:
        name = reference.group(1) or reference.group(2)
        return environ.get(name, "") if name in allowed else ""

    return _ENV_REFERENCE.sub(fill, value)


def is_blocked_address(address: str) -> bool:
    """Whether an http hook may not connect to `address` (an IP literal): see `BLOCKED_NETWORKS`. An IPv4
    address mapped into IPv6 is judged as itself."""
    ip = ipaddress.ip_address(address.partition("%")[0])  # an IPv6 zone (`fe80::1%eth0`) is not the address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return any(ip.version == network.version and ip in network for network in BLOCKED_NETWORKS)


def _shown(url: str) -> str:
    return repr(url if len(url) <= 200 else url[:200] + "…")


@dataclass(frozen=True, slots=True)
class Target:
    """Where a hook's url points: its scheme, host, port and the request target (path and query)."""

    https: bool
    host: str
    port: int
    path: str

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.https else 80
        return host if self.port == default else f"{host}:{self.port}"


def target_of(url: str) -> Target:
    """The url's parts; `HttpHookError` for one that is not an absolute http(s) url without credentials."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        msg = f"http hook url {_shown(url)} is not a url: {error}"
        raise HttpHookError(msg) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        msg = f"http hook url {_shown(url)} is not an http or https url with a host"
        raise HttpHookError(msg)
    if parts.username is not None or parts.password is not None:
        msg = f"http hook url {_shown(url)} carries credentials: put them in a header"
        raise HttpHookError(msg)
    https = parts.scheme == "https"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(https, parts.hostname, port or (443 if https else 80), path)


async def checked_addresses(target: Target, url: str) -> list[str]:
    """The addresses the host resolves to, every one of them allowed (`is_blocked_address`), else
    `HttpHookError`."""
    try:
        found = await trio.socket.getaddrinfo(target.host, target.port, type=trio.socket.SOCK_STREAM)
    except OSError as error:
        msg = f"http hook url {_shown(url)}: its host does not resolve: {error}"
        raise HttpHookError(msg) from None
    addresses = list(dict.fromkeys(str(entry[4][0]) for entry in found))
    blocked = [address for address in addresses if is_blocked_address(address)]
    if blocked or not addresses:
        msg = f"http hook url {_shown(url)} resolves to {', '.join(blocked) or 'nothing'}, which hooks may not reach"
        raise HttpHookError(msg)
    return addresses


def tls_context() -> ssl.SSLContext:
    """The default verifying context, made once for each trust store OpenSSL is told to read (`SSL_CERT_FILE`,
    `SSL_CERT_DIR`): making one reads the whole store, about 29 ms of CPU (`python -m timeit -s "import ssl"
    "ssl.create_default_context()"`), which every https hook call would pay."""
    return _context_for(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _context_for(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    return ssl.create_default_context()  # reads the variables itself: they are the cache's key


async def _connect(target: Target, addresses: list[str]) -> trio.abc.Stream:
    """A connection to the first of `addresses` that answers, wrapped in TLS (verified for the url's host) for
    https."""
    failure: OSError | None = None
    for address in addresses:
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream(address, target.port)
            break
        except OSError as error:
            failure = error
    else:
        raise failure or OSError("no address")
    if not target.https:
        return stream
    tls = trio.SSLStream(stream, tls_context(), server_hostname=target.host, https_compatible=True)
    try:
        await tls.do_handshake()
    except BaseException:
        await trio.aclose_forcefully(stream)  # a refused certificate, or a cancellation: the socket closes now
        raise
    return tls


async def _exchange(stream: trio.abc.Stream, request: h11.Request, body: bytes) -> HttpResponse:
    connection = h11.Connection(h11.CLIENT)
    await stream.send_all(connection.send(request) + connection.send(h11.Data(data=body)))
    await stream.send_all(connection.send(h11.EndOfMessage()))
    status, data, overflowed = 0, bytearray(), False
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            chunk = bytes(await stream.receive_some(_READ_CHUNK))
            if not chunk and not status:
                msg = "the connection closed without a response"
                raise ConnectionError(msg)
            connection.receive_data(chunk)
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            room = CAPTURE_BYTES - len(data)
            data += event.data[: max(room, 0)]
            if len(event.data) > room:
                overflowed = True
                break  # the rest is not read: the connection is closed
        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            break
    return HttpResponse(status, bytes(data), overflowed)


async def post(url: str, body: bytes, headers: Sequence[tuple[str, str]], *, timeout_s: float) -> HttpResponse:
    """`POST url` (module docstring), within `timeout_s`; `HttpHookError` for anything but a response."""
    target = target_of(url)
    typed = any(name.lower() == "content-type" for name, _ in headers)
    request_headers = [
        ("Host", target.host_header),
        *([] if typed else [("Content-Type", "application/json")]),
        ("Content-Length", str(len(body))),
        ("Connection", "close"),
        *headers,
    ]
    try:
        request = h11.Request(method="POST", target=target.path, headers=request_headers)
    except h11.LocalProtocolError as error:
        msg = f"http hook url {_shown(url)}: a header cannot be sent: {error}"
        raise HttpHookError(msg) from None
    with trio.move_on_after(timeout_s):
        addresses = await checked_addresses(target, url)
        try:
            stream = await _connect(target, addresses)
            async with stream:
                return await _exchange(stream, request, body)
        except (OSError, ssl.SSLError, trio.BrokenResourceError, h11.ProtocolError) as error:
            cause = error.__cause__ or error  # trio's BrokenResourceError carries the TLS error as its cause
            msg = f"http hook url {_shown(url)}: the request failed: {type(cause).__name__}: {cause}"
            raise HttpHookError(msg) from None
    msg = f"http hook url {_shown(url)} timed out after {timeout_s:g} s"
    raise HttpHookError(msg)


def http_hook_output(response: HttpResponse, url: str) -> dict[str, Any]:
    """What a response says, as the SDK's JSON output (module docstring); `HttpHookError` otherwise."""
    if not 200 <= response.status < 300:
        msg = f"http hook url {_shown(url)} answered HTTP {response.status}"
        raise HttpHookError(msg)
    if response.overflowed:
        msg = f"http hook url {_shown(url)} answered with more than {CAPTURE_BYTES} bytes"
        raise HttpHookError(msg)
    text = response.body.decode("utf-8", errors="replace").strip()
    if not text:
        return {}
    try:
        return json_object(text)
    except ValueError as error:
        msg = f"http hook url {_shown(url)} answered with a body that is not a JSON object: {error}"
        raise HttpHookError(msg) from None


def http_hook(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    allowed_env_vars: Sequence[str] = (),
    timeout_s: float = HTTP_TIMEOUT_S,
) -> HookCallback:
    """A callback in the SDK's shape that posts each event to `url` (module docstring). The environment is read
    when the hook runs, as a command hook's is."""
    if not timeout_s > 0:
        msg = f"an http hook's timeout must be > 0 seconds, not {timeout_s!r}"
        raise ValueError(msg)
    target_of(url)  # a url that can never be posted to is refused now, not at each event
    given = dict(headers or {})
    allowed = tuple(allowed_env_vars)

    async def run(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
        sent = [(name, interpolated(value, allowed, os.environ)) for name, value in given.items()]
        body = json.dumps(input_data, ensure_ascii=False).encode()
        response = await post(url, body, sent, timeout_s=timeout_s)
        return http_hook_output(response, url)  # type: ignore[return-value]  # the SDK's shape, unchecked

    run.__name__ = run.__qualname__ = f"http_hook({_shown(url)})"
    return run
