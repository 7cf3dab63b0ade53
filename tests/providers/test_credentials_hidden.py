"""No repr shows a credential: `AnthropicModel` hides its key, the userinfo and query of its `base_url`, and its
client's auth headers; `LocalMessagesAPI`'s record of a request masks the key the client sent. A repr ends up
in logs, tracebacks and the reports of failing tests."""

from __future__ import annotations

import anthropic
import pytest
import trio

from queryloop.runtime.providers.anthropic_model import AnthropicModel, redacted_url
from queryloop.runtime.providers.local_api import LocalMessagesAPI
from tests.helpers import text_reply
from tests.providers.test_anthropic_model import collect

KEY = "sk-ant-secret-key-123"


async def test_a_key_in_the_base_urls_userinfo_is_hidden_and_the_host_still_shown() -> None:
    model = AnthropicModel(api_key=KEY, base_url=f"http://proxy-user:{KEY}@proxy.internal:8443/anthropic")
    try:
        text = repr(model)
    finally:
        await model.aclose()

    assert KEY not in text and "proxy-user" not in text
    assert "http://***@proxy.internal:8443/anthropic" in text


async def test_a_key_in_the_base_urls_query_is_hidden() -> None:
    model = AnthropicModel(api_key=KEY, base_url=f"https://gateway.example/v1?api-key={KEY}")
    try:
        text = repr(model)
    finally:
        await model.aclose()

    assert KEY not in text
    assert "https://gateway.example/v1?***" in text


async def test_auth_headers_of_a_client_passed_in_are_never_shown() -> None:
    client = anthropic.AsyncAnthropic(
        api_key=KEY,
        base_url="http://testserver",
        default_headers={"Authorization": f"Bearer {KEY}-bearer", "x-api-key": f"{KEY}-header"},
    )
    model = AnthropicModel(client=client)
    try:
        assert KEY not in repr(model) and KEY not in str(model)
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://user:pw@host", "http://***@host"),
        ("http://user@host:1/p", "http://***@host:1/p"),
        ("http://a:b@c@host/x", "http://***@host/x"),
        ("https://host/v1?key=k#frag", "https://host/v1?***"),
        ("http://host/", "http://host/"),
        ("http://[::1", "***"),
    ],
)
def test_redacted_url_drops_userinfo_and_query(url: str, shown: str) -> None:
    assert redacted_url(url) == shown


async def test_the_local_servers_record_of_a_request_masks_the_key_it_received() -> None:
    with trio.fail_after(15):
        async with LocalMessagesAPI([text_reply("Hi")]) as api:
            model = AnthropicModel(api_key=KEY, base_url=api.base_url)
            try:
                await collect(model)
            finally:
                await model.aclose()

    received = api.requests[0]
    assert KEY in (received.headers.get("x-api-key", "") + received.headers.get("authorization", ""))
    assert KEY not in repr(received) and KEY not in repr(api.requests) and KEY not in repr(api)
    assert "'***'" in repr(received)
