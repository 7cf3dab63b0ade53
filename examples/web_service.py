"""A web service on queryloop: Starlette + uvicorn, each query streamed as server-sent events.

    pip install 'queryloop[web]'
    python -m examples.web_service            # http://127.0.0.1:8000 (offline: a scripted model)
    curl -N -X POST localhost:8000/query -H 'content-type: application/json' -d '{"prompt": "What is 2 + 3?"}'

* `POST /query` with `{"prompt": ...}` opens a session, runs the query and streams its events
  (`event: <type>`, `data: <the event as JSON>`), the session's id first (`event: session`, and the
  `x-session-id` header); the session is closed when the stream ends.
* A client that disconnects aborts its query: Starlette cancels the response's task, and
  `AsyncioQuery` hands the abort to the runtime in the cancelled wait itself, before any cleanup
  awaits (Starlette cancels those again: the cleanup here runs shielded).
* `DELETE /sessions/{id}/query` aborts that session's query from another request (204, or 404).
* Shutting the server down closes the runtime (the lifespan's end): running queries are aborted and
  end properly, their streams end with their `result`.

The runtime is a trio guest on uvicorn's asyncio loop (`AsyncioRuntime.open()`); tools written with
asyncio (`async def` with `asyncio.sleep`, an `httpx.AsyncClient`, ...) run on that loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from queryloop import AnthropicModel, QueryOptions, ScriptedModel, ToolContext, tool
from queryloop.aio import AsyncioQuery, AsyncioRuntime, AsyncioSession
from queryloop.runtime.loop.events import QueryEvent

OptionsFor = Callable[[str], QueryOptions]
"""The options of a new session, given its prompt."""


@dataclass
class Ended:
    """How one streamed query ended, seen by the server once its session was closed."""

    session_id: str
    reason: str | None
    live_tasks: int


@dataclass
class Service:
    """The app's state: the runtime, the sessions streaming now, and how the finished queries ended."""

    options_for: OptionsFor
    runtime: AsyncioRuntime | None = None
    sessions: dict[str, AsyncioSession] = field(default_factory=dict)
    ended: list[Ended] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def stream(self, session: AsyncioSession, query: AsyncioQuery) -> AsyncIterator[str]:
        reason: str | None = None
        try:
            yield sse("session", {"session_id": session.id})
            async with query:  # cancelled (the client left): the query is aborted at once
                async for event in query:
                    yield sse_event(event)
        finally:
            with anyio.CancelScope(shield=True):  # Starlette cancels every await of a cancelled response
                await query.aclose()  # at once if it ended; else the abort is already handed over
                reason = query.terminal.reason if query.terminal is not None else None
                self.sessions.pop(session.id, None)
                await session.close()
                async with self.changed:
                    self.ended.append(Ended(session.id, reason, session.live_tasks()))
                    self.changed.notify_all()


def sse(kind: str, data: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def sse_event(event: QueryEvent) -> str:
    return sse(event.type, event.model_dump(mode="json"))


def create_app(options_for: OptionsFor, *, mode: str = "guest") -> Starlette:
    """The app; `options_for(prompt)` gives each new session its options (its model, its tools)."""
    service = Service(options_for)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with AsyncioRuntime.open(mode="thread" if mode == "thread" else "guest") as runtime:
            service.runtime = runtime
            yield
        # Left: every session closed (running queries aborted, ended properly), the trio run over.

    async def query(request: Request) -> Response:
        body = await request.json()
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str) or not prompt:
            return JSONResponse({"error": "a JSON body with a non-empty 'prompt' string"}, status_code=422)
        assert service.runtime is not None
        session = await service.runtime.open_session(service.options_for(prompt))
        service.sessions[session.id] = session
        handle = session.query(prompt)
        return StreamingResponse(
            service.stream(session, handle), media_type="text/event-stream", headers={"x-session-id": session.id}
        )

    async def abort(request: Request) -> Response:
        session = service.sessions.get(request.path_params["session_id"])
        if session is None:
            return JSONResponse({"error": "no such session streaming"}, status_code=404)
        session.abort_nowait("user")
        return Response(status_code=204)

    routes = [
        Route("/query", query, methods=["POST"]),
        Route("/sessions/{session_id}/query", abort, methods=["DELETE"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = service
    return app


# -- the demo: offline unless ANTHROPIC_API_KEY is set ------------------------------------------------


class AddArgs(BaseModel):
    a: int
    b: int


@tool(description="Add two integers")
async def add(args: AddArgs, ctx: ToolContext) -> str:
    await asyncio.sleep(0.2)  # an asyncio tool: it runs on uvicorn's loop
    return str(args.a + args.b)


@functools.cache
def api_model() -> AnthropicModel:
    """One client for every session: its connections are made on the runtime's trio side, where it is used."""
    return AnthropicModel()


def demo_options(prompt: str) -> QueryOptions:
    if os.environ.get("ANTHROPIC_API_KEY"):
        return QueryOptions(provider=api_model(), tools=[add], max_turns=10)
    use = {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 2, "b": 3}}
    model = ScriptedModel(
        [
            {"content": [use], "stop_reason": "tool_use"},
            {"content": [{"type": "text", "text": "2 + 3 = 5"}]},
        ]
    )
    return QueryOptions(provider=model, tools=[add])


def main() -> None:  # pragma: no cover - run by hand
    import uvicorn

    uvicorn.run(create_app(demo_options), host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))


if __name__ == "__main__":
    main()
