"""How an MCP server is reached: a command run as a subprocess (stdio) or a URL (streamable HTTP).

Plain data, importable without the `mcp` SDK: `queryloop` exports these whether or not the extra is
installed; `Runtime.open_mcp` needs it.

Their `repr` (and `str`) hides credentials, so a server logged or printed in a traceback does not
leak them: the value of a header or an environment variable whose name suggests a secret (`SECRET`:
token, key, secret, auth, cookie, password, credential), the userinfo of a URL and the value of such a
query parameter, and the value of such a `--flag` in a stdio command. The fields themselves keep the
real values (they are what the server is reached with).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

CONNECT_TIMEOUT_S = 30.0

Protocol = Literal["auto", "legacy"]
"""`auto`: the newest protocol both sides speak (2026-07-28's discovery, else the 2025 handshake);
`legacy`: the 2025 `initialize` handshake even with a server that offers 2026-07-28."""


class McpStdioServer(BaseModel):
    """A server started as a subprocess and spoken to over its stdin and stdout.

    `command` is the program and its arguments; `env` is added to a minimal inherited environment
    (`HOME`, `PATH`, ... as the SDK picks them); the server's stderr goes to this process's stderr.
    Started when the server is opened, and started again on the next call after it died.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    command: list[str] = Field(min_length=1)
    env: dict[str, str] | None = None
    cwd: Path | None = None
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    """How long starting the server and its MCP handshake may take before it counts as failed."""
    protocol: Protocol = "auto"
    results_dir: Path | None = None
    """Where a result too large to give the model whole is saved: its `tool-results` folder (the layout of
    `QueryOptions.session_dir`, so the two may be one); None: a temporary directory (`runtime/mcp/limits.py`)."""

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for field, value in super().__repr_args__():
            if field == "env" and value is not None:
                yield field, redacted_mapping(value)
            elif field == "command":
                yield field, redacted_command(value)
            else:
                yield field, value


class McpHttpServer(BaseModel):
    """A server reached over streamable HTTP at `url` (such as `http://127.0.0.1:8000/mcp`).

    `headers` go with every request (an `Authorization` header, say). After the connection failed,
    the next call connects again (a new MCP session); the server itself is not ours to restart.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str
    headers: dict[str, str] | None = None
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    """How long connecting and the MCP handshake may take before the server counts as unreachable."""
    protocol: Protocol = "auto"
    results_dir: Path | None = None
    """As `McpStdioServer.results_dir`."""

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        for field, value in super().__repr_args__():
            if field == "headers" and value is not None:
                yield field, redacted_mapping(value)
            elif field == "url":
                yield field, redacted_url(value)
            else:
                yield field, value


McpServer = McpStdioServer | McpHttpServer


HIDDEN = "***"
"""What a hidden credential shows as."""

SECRET = re.compile(r"token|secret|passw|cookie|auth|credential|private|key(?:s)?(?:$|[^a-z])", re.IGNORECASE)
"""A name that suggests its value is a credential: `Authorization`, `x-api-key`, `GITHUB_TOKEN`, `--password`."""


def is_secret(name: str) -> bool:
    """Whether a header, variable or flag of this name should not be shown (`SECRET`)."""
    return SECRET.search(name) is not None


def redacted_mapping(values: dict[str, str]) -> dict[str, str]:
    """`values` with each secret-named entry's value hidden (the names stay: they say what is set)."""
    return {name: HIDDEN if is_secret(name) else value for name, value in values.items()}


def redacted_url(url: str) -> str:
    """`url` without its userinfo's secrets (`https://***@host/...`) or secret-named query values."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URL a client could use either: shown hidden rather than parsed
        return HIDDEN
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{HIDDEN}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(name, HIDDEN if is_secret(name) else value) for name, value in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redacted_command(command: list[str]) -> list[str]:
    """`command` with the value of each secret-named flag hidden: `--token=x` and `--token x` alike."""
    shown: list[str] = []
    hide_next = False
    for arg in command:
        if hide_next:
            shown.append(HIDDEN)
            hide_next = False
        elif arg.startswith("-") and "=" in arg and is_secret(arg.partition("=")[0]):
            shown.append(f"{arg.partition('=')[0]}={HIDDEN}")
        else:
            shown.append(arg)
            hide_next = arg.startswith("-") and is_secret(arg)
    return shown
