"""A policy server for the http hook tests: a Starlette app on a real uvicorn, run as its own process.

`python -m tests.loop.http_hook_server LOG [PEM]` serves on 127.0.0.1 at a port of the system's choosing (over
TLS with PEM's key and certificate chain, if given), prints that port on a line of its own once it listens,
and appends each request it gets to LOG as a JSON line (`path`, `headers`, `body`). Its routes answer as a
hook's server may:

- `/decide/{decision}`: a PreToolUse decision (`allow`, `deny`, `ask`, `defer`) with a reason;
- `/context`: additionalContext naming the `x-team` and `x-token` headers it got;
- `/empty`: 200 with no body; `/text`: 200 with a plain-text body;
- `/status/{code}`: that status; `/redirect`: a 307 to `/decide/deny`;
- `/huge`: 2 MiB of JSON; `/slow`: never answers.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route


def app(log: Path) -> Starlette:
    async def logged(request: Request) -> dict[str, object]:
        body = json.loads(await request.body() or b"null")
        entry = {"path": request.url.path, "headers": dict(request.headers), "body": body}
        with log.open("a") as file:
            file.write(json.dumps(entry) + "\n")
        return entry

    async def decide(request: Request) -> Response:
        await logged(request)
        decision = request.path_params["decision"]
        specific = {
            "hookEventName": "PreToolUse",
            "permissionDecision": decision,
            "permissionDecisionReason": f"the policy server says {decision}",
        }
        return JSONResponse({"hookSpecificOutput": specific})

    async def context(request: Request) -> Response:
        entry = await logged(request)
        headers = entry["headers"]
        assert isinstance(headers, dict)
        text = f"team={headers.get('x-team')!r} token={headers.get('x-token')!r}"
        event = entry["body"]["hook_event_name"]  # type: ignore[index]
        return JSONResponse({"hookSpecificOutput": {"hookEventName": event, "additionalContext": text}})

    async def empty(request: Request) -> Response:
        await logged(request)
        return Response(status_code=200)

    async def text(request: Request) -> Response:
        await logged(request)
        return PlainTextResponse("all good")

    async def status(request: Request) -> Response:
        await logged(request)
        return Response(status_code=int(request.path_params["code"]))

    async def redirect(request: Request) -> Response:
        await logged(request)
        return RedirectResponse("/decide/deny", status_code=307)

    async def huge(request: Request) -> Response:
        await logged(request)
        return Response('{"reason": "' + "x" * (2 << 20) + '"}', media_type="application/json")

    async def slow(request: Request) -> Response:
        await logged(request)
        await anyio.sleep_forever()
        raise AssertionError

    return Starlette(
        routes=[
            Route("/decide/{decision}", decide, methods=["POST"]),
            Route("/context", context, methods=["POST"]),
            Route("/empty", empty, methods=["POST"]),
            Route("/text", text, methods=["POST"]),
            Route("/status/{code:int}", status, methods=["POST"]),
            Route("/redirect", redirect, methods=["POST"]),
            Route("/huge", huge, methods=["POST"]),
            Route("/slow", slow, methods=["POST"]),
        ]
    )


def main() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(sock.getsockname()[1], flush=True)
    pem = sys.argv[2] if len(sys.argv) > 2 else None
    config = uvicorn.Config(
        app(Path(sys.argv[1])), log_level="warning", timeout_graceful_shutdown=1, ssl_keyfile=pem, ssl_certfile=pem
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])


if __name__ == "__main__":
    main()
