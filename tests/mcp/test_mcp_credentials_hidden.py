"""An MCP server's `repr` (and `str`, and an error naming it) hides its credentials; its fields keep them."""

from __future__ import annotations

import sys

import pytest

from queryloop import McpHttpServer, McpServerUnavailable, McpStdioServer, Runtime
from queryloop.runtime.mcp.servers import redacted_command, redacted_url

SECRETS = ("hunter2", "Bearer s3cr3t", "k-123", "c00kie", "ghp_abc", "sk-xyz", "pw!", "tok-9", "flag-secret")


def test_an_http_servers_repr_hides_auth_headers_userinfo_and_secret_query_values() -> None:
    server = McpHttpServer(
        url="https://alice:hunter2@mcp.example.com/mcp?access_token=tok-9&page=2",
        headers={
            "Authorization": "Bearer s3cr3t",
            "x-api-key": "k-123",
            "Cookie": "c00kie",
            "X-Request-Source": "queryloop",
        },
    )
    for shown in (repr(server), str(server), f"{server!r}", repr([server])):
        assert not any(secret in shown for secret in SECRETS), shown
        assert "mcp.example.com/mcp" in shown and "page=2" in shown
        assert "'X-Request-Source': 'queryloop'" in shown  # what is not secret stays readable
        assert "'Authorization': '***'" in shown
    assert server.headers is not None and server.headers["Authorization"] == "Bearer s3cr3t"  # kept to connect
    assert server.url.startswith("https://alice:hunter2@")


def test_a_stdio_servers_repr_hides_secret_env_values_and_secret_flags() -> None:
    server = McpStdioServer(
        command=["server", "--token", "ghp_abc", "--password=pw!", "--client-secret", "flag-secret", "--verbose"],
        env={"OPENAI_API_KEY": "sk-xyz", "DB_PASSWORD": "pw!", "GITHUB_TOKEN": "ghp_abc", "LOG_LEVEL": "debug"},
    )
    shown = repr(server)
    assert not any(secret in shown for secret in SECRETS), shown
    assert "'LOG_LEVEL': 'debug'" in shown and "'--verbose'" in shown and "'OPENAI_API_KEY': '***'" in shown
    assert server.env is not None and server.env["OPENAI_API_KEY"] == "sk-xyz"


def test_the_redactions_leave_what_holds_no_secret_as_it_is() -> None:
    assert redacted_url("http://127.0.0.1:8000/mcp") == "http://127.0.0.1:8000/mcp"
    assert redacted_url("https://user@host/x") == "https://***@host/x"
    assert redacted_command([sys.executable, "server.py", "stdio"]) == [sys.executable, "server.py", "stdio"]


async def test_a_server_that_cannot_be_reached_is_named_without_its_credentials() -> None:
    server = McpHttpServer(url="http://alice:hunter2@127.0.0.1:1/mcp?api_key=k-123", connect_timeout_s=5)
    async with Runtime.open() as runtime:
        with pytest.raises(McpServerUnavailable) as caught:
            await runtime.open_mcp("web", server)
    message = str(caught.value)
    assert "127.0.0.1:1/mcp" in message
    assert "hunter2" not in message and "k-123" not in message
