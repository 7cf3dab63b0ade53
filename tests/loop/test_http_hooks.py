"""Claude Code's http hooks, from settings files: the event's JSON posted to a real policy server (uvicorn, in
its own process: `tests/loop/http_hook_server.py`), its answer read as Claude Code reads it, and the url,
headers and response treated as the hostile input they are."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from queryloop import Runtime
from queryloop.runtime.loop.events import SystemMessage
from queryloop.runtime.loop.http_hooks import (
    HttpHookError,
    HttpResponse,
    http_hook_output,
    interpolated,
    is_blocked_address,
    post,
    target_of,
)
from queryloop.runtime.loop.settings import SettingsError, load_settings
from queryloop.runtime.providers.scripted import ScriptedModel
from tests.helpers import (
    TESTS,
    Ran,
    ToolLog,
    assert_settled,
    consume,
    open_session,
    scripted_tool,
    text_reply,
    tool_use,
    tools_reply,
)


@contextmanager
def serving(folder: Path, pem: Path | None = None) -> Iterator[tuple[str, Path]]:
    """A policy server's base url and its request log (https with `pem`'s key and certificate chain)."""
    log = folder / "requests.jsonl"
    log.touch()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.loop.http_hook_server", str(log), *([str(pem)] if pem else [])],
        cwd=TESTS.parent,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())  # printed once the socket listens: connections wait in its backlog
        yield f"{'https' if pem else 'http'}://127.0.0.1:{port}", log
    finally:
        process.terminate()
        process.wait(timeout=30)
        assert process.stdout is not None
        process.stdout.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    with serving(tmp_path_factory.mktemp("http-hooks")) as served:
        yield served


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """An https policy server whose certificate a test CA signed: its url, log and the CA's certificate."""
    folder = tmp_path_factory.mktemp("https-hooks")
    ca = trustme.CA()
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(folder / "server.pem"))
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    with serving(folder, folder / "server.pem") as (url, log):
        yield url, log, folder / "ca.pem"


def requests(log: Path, path: str) -> list[dict[str, Any]]:
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    return [entry for entry in entries if entry["path"] == path]


def hook_errors(ran: Ran) -> list[str]:
    return [str(e.content) for e in ran.events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]


async def run_write(tmp_path: Path, handler: dict[str, Any], log: ToolLog | None = None, **options: Any) -> Ran:
    """One `write` call (t1) under a project settings file whose PreToolUse hook is `handler`."""
    (tmp_path / ".claude").mkdir(parents=True, exist_ok=True)
    settings = {"hooks": {"PreToolUse": [{"matcher": "write", "hooks": [handler]}]}}
    (tmp_path / ".claude" / "settings.json").write_text(json.dumps(settings))
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "write", {"path": "notes.md"})), text_reply("Answered.")])
        session = await open_session(
            runtime,
            model,
            tools=[scripted_tool("write", log=log)],
            cwd=tmp_path,
            setting_sources=["project"],
            **options,
        )
        ran = await consume(session, session.query("Write the notes"), model)
        await assert_settled(ran)
        return ran


# What the hook's server is sent, and what its answer does.


async def test_an_http_hook_gets_the_events_json_and_its_deny_blocks_the_call(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    base, log = server
    tools = ToolLog()
    ran = await run_write(tmp_path, {"type": "http", "url": f"{base}/decide/deny"}, tools)
    assert tools.order == []
    assert "the policy server says deny" in str(ran.tool_results()["t1"]["content"])
    (sent,) = requests(log, "/decide/deny")
    assert sent["headers"]["content-type"] == "application/json"
    body = sent["body"]
    assert body["hook_event_name"] == "PreToolUse" and body["tool_name"] == "write"
    assert body["tool_input"] == {"path": "notes.md"} and body["tool_use_id"] == "t1"
    assert body["cwd"] == str(tmp_path) and body["session_id"] == ran.session.id


async def test_an_http_hooks_allow_lets_the_call_run(server: tuple[str, Path], tmp_path: Path) -> None:
    base, _ = server
    tools = ToolLog()
    ran = await run_write(tmp_path, {"type": "http", "url": f"{base}/decide/allow"}, tools)
    assert tools.order == ["t1"] and ran.reason == "completed" and hook_errors(ran) == []


async def test_an_empty_2xx_body_is_success_with_no_output(server: tuple[str, Path], tmp_path: Path) -> None:
    base, _ = server
    tools = ToolLog()
    ran = await run_write(tmp_path, {"type": "http", "url": f"{base}/empty"}, tools)
    assert tools.order == ["t1"] and hook_errors(ran) == []


@pytest.mark.parametrize(
    ("path", "said"),
    [
        ("/status/500", "answered HTTP 500"),
        ("/status/403", "answered HTTP 403"),
        ("/redirect", "answered HTTP 307"),
        ("/text", "not a JSON object"),
        ("/huge", "more than 1048576 bytes"),
    ],
)
async def test_a_failing_answer_is_a_non_blocking_error_and_the_call_goes_on(
    server: tuple[str, Path], tmp_path: Path, path: str, said: str
) -> None:
    base, log = server
    tools = ToolLog()
    denied = len(requests(log, "/decide/deny"))
    ran = await run_write(tmp_path, {"type": "http", "url": f"{base}{path}"}, tools)
    assert tools.order == ["t1"] and ran.reason == "completed"
    (error,) = hook_errors(ran)
    assert said in error
    assert len(requests(log, "/decide/deny")) == denied  # a redirect is not followed


async def test_header_values_are_filled_only_from_the_environment_variables_the_hook_allows(
    server: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, _ = server
    monkeypatch.setenv("HOOK_TEAM", "platform")
    monkeypatch.setenv("HOOK_TOKEN", "s3cret")
    handler = {
        "type": "http",
        "url": f"{base}/context",
        "headers": {"X-Team": "team-${HOOK_TEAM}", "X-Token": "Bearer [$HOOK_TOKEN]"},
        "allowedEnvVars": ["HOOK_TEAM"],
    }
    ran = await run_write(tmp_path, handler)
    context = str(ran.model.requests[1].messages)
    assert "team='team-platform' token='Bearer []'" in context  # HOOK_TOKEN is not allowed: an empty string


async def test_an_http_hook_past_its_timeout_is_a_non_blocking_error(server: tuple[str, Path], tmp_path: Path) -> None:
    base, _ = server
    tools = ToolLog()
    ran = await run_write(tmp_path, {"type": "http", "url": f"{base}/slow", "timeout": 0.5}, tools)
    assert tools.order == ["t1"]
    (error,) = hook_errors(ran)
    assert "timed out after 0.5 s" in error


async def test_an_abort_while_an_http_hook_waits_ends_the_query_at_once(
    server: tuple[str, Path], tmp_path: Path
) -> None:
    base, log = server
    (tmp_path / ".claude").mkdir()
    handler = {"type": "http", "url": f"{base}/slow"}  # the default timeout: 600 s
    settings = {"hooks": {"PreToolUse": [{"matcher": "write", "hooks": [handler]}]}}
    (tmp_path / ".claude" / "settings.json").write_text(json.dumps(settings))
    tools = ToolLog()
    async with Runtime.open() as runtime:
        model = ScriptedModel([tools_reply(tool_use("t1", "write", {})), text_reply("never")])
        session = await open_session(
            runtime, model, tools=[scripted_tool("write", log=tools)], cwd=tmp_path, setting_sources=["project"]
        )
        waiting = len(requests(log, "/slow"))
        handle = session.query("Write")
        with trio.fail_after(60):
            while len(requests(log, "/slow")) == waiting:  # noqa: ASYNC110 - the server is another process: no event
                await trio.sleep(0.01)
            await session.abort("user")
            ran = await consume(session, handle, model)
        assert ran.handle.terminal is not None and ran.handle.terminal.reason == "aborted_tools"
        assert tools.order == [] and len(model.requests) == 1
        await assert_settled(ran)


async def test_an_if_rule_keeps_an_http_hook_to_the_calls_it_matches(server: tuple[str, Path], tmp_path: Path) -> None:
    base, log = server
    tools = ToolLog()
    handler = {"type": "http", "url": f"{base}/decide/ask", "if": "write(secrets/**)"}
    ran = await run_write(tmp_path, handler, tools)
    assert tools.order == ["t1"] and requests(log, "/decide/ask") == []  # notes.md is not under secrets/
    assert ran.reason == "completed"


async def test_an_https_hooks_certificate_is_verified_for_its_host(
    tls_server: tuple[str, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, log, ca = tls_server
    tools = ToolLog()
    ran = await run_write(tmp_path / "untrusted", {"type": "http", "url": f"{base}/decide/deny"}, tools)
    assert tools.order == ["t1"] and requests(log, "/decide/deny") == []  # no request over an unverified link
    (error,) = hook_errors(ran)
    assert "CERTIFICATE_VERIFY_FAILED" in error
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))  # the system's trust store, as OpenSSL reads it: now the test CA
    tools = ToolLog()
    ran = await run_write(tmp_path / "trusted", {"type": "http", "url": f"{base}/decide/deny"}, tools)
    assert tools.order == [] and "the policy server says deny" in str(ran.tool_results()["t1"]["content"])
    assert len(requests(log, "/decide/deny")) == 1


# Where a hook may connect: Claude Code's guard against a project's settings reaching inside the network.


@pytest.mark.parametrize(
    "address",
    [
        *("169.254.169.254", "10.1.2.3", "172.16.0.1", "192.168.1.1", "100.100.100.200", "0.0.0.0"),
        *("::", "fe80::1%eth0", "fc00::1", "fd12::1", "::ffff:169.254.169.254", "::ffff:10.0.0.1"),
    ],
)
def test_private_link_local_and_metadata_addresses_are_blocked(address: str) -> None:
    assert is_blocked_address(address)


@pytest.mark.parametrize("address", ["127.0.0.1", "127.9.9.9", "::1", "8.8.8.8", "172.32.0.1", "2001:4860::8888"])
def test_loopback_and_public_addresses_are_allowed(address: str) -> None:
    assert not is_blocked_address(address)


async def test_a_hook_to_the_cloud_metadata_endpoint_is_refused_before_any_connection(tmp_path: Path) -> None:
    tools = ToolLog()
    ran = await run_write(tmp_path, {"type": "http", "url": "http://169.254.169.254/latest/meta-data/"}, tools)
    assert tools.order == ["t1"]  # a non-blocking error: the call goes on
    (error,) = hook_errors(ran)
    assert "resolves to 169.254.169.254, which hooks may not reach" in error


async def test_a_host_that_does_not_resolve_is_a_clear_error() -> None:
    with pytest.raises(HttpHookError, match="does not resolve"):
        await post("http://no-such-host.invalid/hook", b"{}", [], timeout_s=30)


# The parts that decide, alone.


def test_references_to_variables_not_allowed_become_empty_strings() -> None:
    environ = {"A": "1", "B": "2"}
    assert interpolated("$A-${A}-$B-${B}-$C", ["A"], environ) == "1-1---"
    assert interpolated("$A", ["A", "C"], {}) == ""  # allowed but unset
    assert interpolated("plain $ and $1", ["A"], environ) == "plain $ and $1"


def test_a_hooks_url_must_be_http_or_https_with_a_host_and_no_credentials() -> None:
    for url in ("ftp://example.com/x", "file:///etc/passwd", "/relative", "http://", "http://host:99999/"):
        with pytest.raises(HttpHookError):
            target_of(url)
    with pytest.raises(HttpHookError, match="credentials"):
        target_of("https://user:pw@example.com/hook")
    target = target_of("https://example.com:8443/hooks/pre?team=a")
    assert (target.host, target.port, target.path, target.host_header) == (
        "example.com",
        8443,
        "/hooks/pre?team=a",
        "example.com:8443",
    )
    assert target_of("http://[::1]/").host_header == "[::1]"


def test_an_answer_is_read_as_claude_code_reads_an_http_hooks_response() -> None:
    url = "http://127.0.0.1/hook"
    assert http_hook_output(HttpResponse(204, b""), url) == {}
    assert http_hook_output(HttpResponse(200, b"  \n"), url) == {}
    assert http_hook_output(HttpResponse(200, b'{"continue": false, "stopReason": "no"}'), url) == {
        "continue_": False,
        "stopReason": "no",
    }
    for response in (HttpResponse(200, b"[1]"), HttpResponse(200, b"ok"), HttpResponse(200, b"{")):
        with pytest.raises(HttpHookError, match="not a JSON object"):
            http_hook_output(response, url)
    with pytest.raises(HttpHookError, match="HTTP 302"):
        http_hook_output(HttpResponse(302, b'{"decision": "block"}'), url)
    with pytest.raises(HttpHookError, match="more than"):
        http_hook_output(HttpResponse(200, b"{", overflowed=True), url)


@pytest.mark.parametrize(
    ("handler", "said"),
    [
        ({"type": "http"}, "needs a non-empty url"),
        ({"type": "http", "url": "ftp://example.com/"}, "not an http or https url"),
        ({"type": "http", "url": "http://example.com/", "headers": {"Content-Length": "1"}}, "'Content-Length'"),
        ({"type": "http", "url": "http://example.com/", "headers": {"X": 1}}, "headers"),
    ],
)
def test_an_unusable_http_hook_in_a_settings_file_is_a_settings_error(
    tmp_path: Path, handler: dict[str, Any], said: str
) -> None:
    settings = json.dumps({"hooks": {"Stop": [{"hooks": [handler]}]}})
    with pytest.raises(SettingsError, match=said):
        load_settings(settings=settings, setting_sources=None, cwd=tmp_path, home=tmp_path)


async def test_a_header_value_that_would_split_the_request_is_refused_before_anything_is_sent(
    server: tuple[str, Path],
) -> None:
    base, log = server
    before = len(requests(log, "/empty"))
    with pytest.raises(HttpHookError, match="a header cannot be sent"):
        await post(f"{base}/empty", b"{}", [("X-Team", "a\r\nX-Injected: 1")], timeout_s=30)
    assert len(requests(log, "/empty")) == before
    await post(f"{base}/empty", b"{}", [("Content-Type", "application/x-hook")], timeout_s=30)
    assert requests(log, "/empty")[-1]["headers"]["content-type"] == "application/x-hook"  # the hook's own


async def test_a_server_that_closes_the_connection_without_answering_is_a_clear_error() -> None:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]

    async def read_then_close() -> None:
        stream = await listener.accept()
        await stream.receive_some(64 * 1024)
        await stream.aclose()

    async with listener, trio.open_nursery() as nursery:
        nursery.start_soon(read_then_close)
        with pytest.raises(HttpHookError, match="the request failed: ConnectionError: the connection closed without"):
            await post(f"http://127.0.0.1:{port}/hook", b"{}", [], timeout_s=30)
