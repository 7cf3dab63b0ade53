"""examples/web_service.py against a real uvicorn on loopback, driven by an httpx client, all on one
asyncio loop under `asyncio.run` (pytest-trio never sees these tests)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from examples.web_service import Service, create_app
from queryloop import QueryOptions, ScriptedModel, ToolContext, tool
from tests.helpers import text_reply, tool_use, tools_reply

STREAMS = 100


@tool(description="Answers at once")
async def quick(args: Any, ctx: ToolContext) -> str:
    await asyncio.sleep(0)
    return "quick"


@tool(description="Waits until cancelled")
async def hang(args: Any, ctx: ToolContext) -> str:
    await ctx.progress("hanging")
    await asyncio.Event().wait()
    return "never"


def options_for(prompt: str) -> QueryOptions:
    name = "hang" if prompt.startswith("hang") else "quick"
    model = ScriptedModel([tools_reply(tool_use("t1", name)), text_reply(f"{prompt}: done")])
    return QueryOptions(provider=model, tools=[quick, hang])


@asynccontextmanager
async def serving() -> AsyncIterator[tuple[httpx.AsyncClient, Service]]:
    app = create_app(options_for)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4 * STREAMS)  # listening already: connections made before uvicorn accepts wait in the backlog
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(2000):  # uvicorn has no event for it: the lifespan's startup (the runtime) before the tests look
        if server.started or task.done():
            break
        await asyncio.sleep(0.005)
    limits = httpx.Limits(max_connections=2 * STREAMS + 10)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=30) as client:
            yield client, app.state.service
    finally:
        server.should_exit = True
        await task
        sock.close()


async def events_of(response: httpx.Response) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    kind = None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: ") and kind is not None:
            yield kind, json.loads(line.removeprefix("data: "))


async def complete(client: httpx.AsyncClient, i: int) -> list[str]:
    async with client.stream("POST", "/query", json={"prompt": f"quick {i}"}) as response:
        assert response.status_code == 200
        return [kind async for kind, _ in events_of(response)]


async def disconnect_mid_tool(client: httpx.AsyncClient, i: int) -> None:
    async with client.stream("POST", "/query", json={"prompt": f"hang {i}"}) as response:
        async for kind, _ in events_of(response):
            if kind == "progress":  # the tool runs: leave now
                break
    # Leaving the block closes the connection: the server sees the client gone.


async def wait_for_ended(service: Service, count: int) -> None:
    async with service.changed:
        await service.changed.wait_for(lambda: len(service.ended) >= count)


def run(main: Any) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(60):
            await main()

    asyncio.run(bounded())


def test_complete_streams_and_disconnected_clients_each_end_their_query_with_nothing_left_running() -> None:
    async def main() -> None:
        async with serving() as (client, service):
            async with asyncio.TaskGroup() as group:
                completed = [group.create_task(complete(client, i)) for i in range(STREAMS)]
                for i in range(STREAMS):
                    group.create_task(disconnect_mid_tool(client, i))
            await wait_for_ended(service, 2 * STREAMS)
            for task in completed:
                kinds = task.result()
                assert kinds[0] == "session" and kinds[-1] == "result" and "user" in kinds
            reasons = sorted({e.reason or "" for e in service.ended})
            assert reasons == ["aborted_tools", "completed"]
            assert sum(e.reason == "completed" for e in service.ended) == STREAMS
            assert all(e.live_tasks == 0 for e in service.ended)
            runtime = service.runtime  # made by the app's lifespan, which ran before the first request
            assert runtime is not None and runtime.open_sessions == 0 and runtime.host_tasks == 0
            assert service.sessions == {}

    run(main)


def test_delete_aborts_a_query_from_another_request_and_shutdown_drains_the_runtime() -> None:
    async def main() -> None:
        async with serving() as (client, service):
            async with client.stream("POST", "/query", json={"prompt": "hang"}) as response:
                session_id = response.headers["x-session-id"]
                kinds = []
                async for kind, data in events_of(response):
                    kinds.append(kind)
                    if kind == "progress":
                        deleted = await client.delete(f"/sessions/{session_id}/query")
                        assert deleted.status_code == 204
                    if kind == "result":
                        assert data["subtype"] == "error_during_execution"
            assert kinds[-1] == "result"
            assert (await client.delete("/sessions/nope/query")).status_code == 404
            # A query still streaming when the server shuts down: the runtime's close aborts it.
            response = await client.send(client.build_request("POST", "/query", json={"prompt": "hang"}), stream=True)
            stream = events_of(response)
            async for kind, _ in stream:
                if kind == "progress":
                    break
            runtime = service.runtime
        assert runtime is not None and runtime.closed and runtime.open_sessions == 0
        assert [e.reason for e in service.ended] == ["aborted_tools", "aborted_tools"]
        await response.aclose()

    run(main)


@pytest.mark.parametrize("prompt", [None, "", 3])
def test_a_query_without_a_prompt_is_refused(prompt: Any) -> None:
    async def main() -> None:
        async with serving() as (client, service):
            assert (await client.post("/query", json={"prompt": prompt})).status_code == 422
            assert service.ended == []

    run(main)
