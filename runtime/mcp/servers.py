"""How an MCP server is reached: a command run as a subprocess (stdio) or a URL (streamable HTTP).

Plain data, importable without the `mcp` SDK: `queryloop` exports these whether or not the extra is
installed; `Runtime.open_mcp` needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

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


McpServer = McpStdioServer | McpHttpServer
