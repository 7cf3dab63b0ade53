"""A small MCP server for the MCP tests, run as a subprocess: `python tests/mcp/server.py stdio|http`.

Over `http` it serves streamable HTTP on 127.0.0.1 on a port the system picks, and prints that port
on its first stdout line (`port 12345`) once it listens.

Its tools: `echo` (fast), `slow` (reports progress, then returns, or waits to be cancelled: it
records a cancellation and whether `notifications/cancelled` asked for it), `cancellations` (waits
for the next recorded cancellation and returns what was recorded), `meet` (read-only: waits for
`count` callers of the same `group`, so only concurrent calls can succeed), `fail` (an `isError`
result), `picture` (text and an image), `pid` (this process's id), `die` (kills this process), `erase`
(asks the user, by elicitation, to confirm before it answers) and, with `--grow`, `grow` (adds a tool and
says the tools changed). Its resources: `notes://today` (text)
and `pictures://pixel` (a PNG). Its prompt: `review` (`file`, and `focus`, "bugs" if not given).

With `--hostile`, tools a careless client trips on (`add_hostile_tools`): `a.b` and `a_b` (names that
clean up alike), two whose names are 201 characters, `flood` (`chars` characters of text, and an
image if asked), `flood_declared` and `flood_small` (the same, declaring a size limit of their own in
`_meta`), `yell` (an `isError` result of `chars` characters) and `hold` (asks by elicitation and keeps
its request open even once its call is cancelled: no `notifications/cancelled` for it).
"""

from __future__ import annotations

import base64
import logging
import os
import signal
import socket
import sys
from typing import Annotated, Any

import anyio
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.mcpserver import (
    AcceptedElicitation,
    CancelledElicitation,
    Context,
    DeclinedElicitation,
    Elicit,
    ElicitationResult,
    MCPServer,
    Resolve,
)
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ImageContent, TextContent, ToolAnnotations
from pydantic import BaseModel

READ_ONLY = ToolAnnotations(read_only_hint=True)
PIXEL = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
"""A 1x1 PNG, base64."""
WAIT_TIMEOUT_S = 10.0
"""How long `meet` and `cancellations` wait for what they expect before answering without it."""

_cancellations: list[str] = []
_tool_cancelled = anyio.Event()
_cancel_notified = anyio.Event()
_groups: dict[str, tuple[int, anyio.Event]] = {}


async def record_cancel_notifications(ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
    """Middleware: every `notifications/cancelled` the server receives is recorded with the id it names."""
    if ctx.method == "notifications/cancelled":
        _cancellations.append(f"notifications/cancelled {(ctx.params or {}).get('requestId')}")
        _cancel_notified.set()
    return await call_next(ctx)


server: MCPServer[Any] = MCPServer("queryloop-test", middleware=[record_cancel_notifications])


@server.tool()
def echo(text: str) -> str:
    """Return the text as it came."""
    return text


@server.tool()
async def slow(steps: int, ctx: Context, wait_for_cancel: bool = False) -> str:
    """Report `steps` progress notifications, then return, or wait until cancelled."""
    try:
        for step in range(1, steps + 1):
            await ctx.report_progress(step, steps, f"step {step}")
        if wait_for_cancel:
            await anyio.sleep_forever()
    except anyio.get_cancelled_exc_class():
        _cancellations.append(f"slow cancelled {ctx.request_id}")
        _tool_cancelled.set()
        raise
    return f"done after {steps} steps"


@server.tool(annotations=READ_ONLY)
async def cancellations(notified: bool = True) -> list[str]:
    """Wait (bounded) until a `slow` call was cancelled (and, if `notified`, a cancel notification came).

    Returns every record so far: `slow cancelled <request id>`, `notifications/cancelled <request id>`.
    """
    with anyio.move_on_after(WAIT_TIMEOUT_S):
        await _tool_cancelled.wait()
        if notified:
            await _cancel_notified.wait()
    return list(_cancellations)


@server.tool(annotations=READ_ONLY)
async def meet(group: str, count: int) -> str:
    """Wait until `count` calls of `group` are in at once (read-only: only concurrent calls meet)."""
    arrived, everyone = _groups.get(group, (0, anyio.Event()))
    _groups[group] = (arrived + 1, everyone)
    if arrived + 1 >= count:
        everyone.set()
    with anyio.move_on_after(WAIT_TIMEOUT_S):
        await everyone.wait()
        return f"{group}: met {count}"
    raise ToolError(f"{group}: nobody else came")


@server.tool()
def fail(reason: str) -> str:
    """Fail with `reason`: an isError result."""
    raise ToolError(reason)


@server.tool(annotations=READ_ONLY)
def picture() -> list[TextContent | ImageContent]:
    """A caption and a 1x1 PNG."""
    return [TextContent(text="a pixel"), ImageContent(data=PIXEL, mime_type="image/png")]


@server.tool(annotations=READ_ONLY)
def pid() -> int:
    """This server process's id."""
    return os.getpid()


@server.tool()
def die() -> str:
    """Kill this server process at once, mid-call."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


class Confirmation(BaseModel):
    sure: bool
    why: str = ""


def confirm_erase(path: str) -> Elicit[Confirmation]:
    return Elicit(f"Erase {path}?", Confirmation)


@server.tool()
async def erase(path: str, answer: Annotated[ElicitationResult[Confirmation], Resolve(confirm_erase)]) -> str:
    """Erase `path` once the user confirms it (asked by elicitation); says what the user answered."""
    match answer:
        case AcceptedElicitation(data=Confirmation(sure=True, why=why)):
            return f"erased {path} ({why})"
        case AcceptedElicitation():
            return f"kept {path}"
        case DeclinedElicitation():
            return f"declined: {path} kept"
        case CancelledElicitation():
            return f"cancelled: {path} kept"
    raise ToolError(f"unexpected answer {answer!r}")


@server.resource("notes://today", name="today", description="Today's notes", mime_type="text/plain")
def today() -> str:
    return "Buy milk. Ship the release."


@server.resource("pictures://pixel", name="pixel", mime_type="image/png")
def pixel_png() -> bytes:
    return base64.b64decode(PIXEL)


@server.prompt(description="Review one file")
def review(file: str, focus: str = "bugs") -> str:
    return f"Review {file}, looking for {focus}."


async def grow(name: str, ctx: Context) -> str:
    """Add a tool `name` (it echoes its text, prefixed with its name), then say the tools changed."""

    def added(text: str) -> str:
        return f"{name}: {text}"

    server.add_tool(added, name=name, description=f"Echo, as {name}.")
    await ctx.notify_tools_changed()  # to `subscriptions/listen` (2026-07-28)
    session = ctx.request_context.session
    if hasattr(session, "send_tool_list_changed"):  # a 2025 client: a notification on its session
        await session.send_tool_list_changed()
    return f"added {name}"


async def serve_http() -> None:
    import uvicorn

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning", lifespan="on")
    web = uvicorn.Server(config)
    print(f"port {listener.getsockname()[1]}", flush=True)  # the socket is bound: connections queue
    await web.serve(sockets=[listener])


def flood_text(chars: int) -> str:
    """`chars` characters of text: the alphabet line after line (the tests compute it too)."""
    line = "abcdefghijklmnopqrstuvwxyz\n"
    return (line * (chars // len(line) + 1))[:chars]


LONG_NAME = "long_" * 40
"""The stem of the two tools whose names are 201 characters (each ends with one more letter)."""


def add_hostile_tools() -> None:
    def a_dot_b() -> str:
        return "I am a.b"

    def a_underscore_b() -> str:
        return "I am a_b"

    # The SDK warns (on stderr) of a name over 128 characters; serving one is the point here.
    logging.getLogger("mcp.shared.tool_name_validation").setLevel(logging.ERROR)
    server.add_tool(a_dot_b, name="a.b", description="Says it is a.b.")
    server.add_tool(a_underscore_b, name="a_b", description="Says it is a_b.")
    for last in "xy":

        def long(last: str = last) -> str:
            return f"I am the long {last}"

        server.add_tool(long, name=LONG_NAME + last, description="A name of 201 characters.")

    def flood(chars: int, image: bool = False) -> list[TextContent | ImageContent]:
        """`chars` characters of text (`flood_text`), then a 1x1 PNG if `image`."""
        blocks: list[TextContent | ImageContent] = [TextContent(text=flood_text(chars))]
        if image:
            blocks.append(ImageContent(data=PIXEL, mime_type="image/png"))
        return blocks

    server.add_tool(flood, name="flood")
    server.add_tool(flood, name="flood_declared", meta={"anthropic/maxResultSizeChars": 200_000})
    server.add_tool(flood, name="flood_small", meta={"anthropic/maxResultSizeChars": 1_000})

    def yell(chars: int) -> str:
        """Fail with an error message of `chars` characters."""
        raise ToolError(flood_text(chars))

    server.add_tool(yell)

    async def hold(path: str, ctx: Context) -> str:
        """Ask to hold `path` (by elicitation), shielded: its call's cancellation never reaches the request."""
        with anyio.CancelScope(shield=True):
            answer = await ctx.elicit(f"Hold {path}?", Confirmation)
        return f"held {path}: {answer.action}"

    server.add_tool(hold)


if __name__ == "__main__":
    if "--hostile" in sys.argv:
        add_hostile_tools()
        sys.argv.remove("--hostile")
    if "--grow" in sys.argv:
        server.add_tool(grow)
        sys.argv.remove("--grow")
    if sys.argv[1:] == ["http"]:
        anyio.run(serve_http)
    else:
        server.run("stdio")
