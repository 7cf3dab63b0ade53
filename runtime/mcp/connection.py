"""`McpConnection`: one MCP server's client in a runtime, shared by every session that calls its tools.

Its connection lives in a task of the runtime's nursery (the `mcp` SDK runs on anyio, so on trio):
`open` connects it (a stdio server's subprocess is started) and lists the tools; every call goes
through it. A connection ends when the server's side closes (a stdio server that exits or is killed,
an HTTP server that cuts a stream): the watched read stream sees it, the connection task closes the
client (the SDK reaps the subprocess) and the next call connects again. A call in flight when that
happens, a server that cannot be restarted, and a protocol error are error results, logged as
warnings: never an exception out of the tool, never a crashed session.

The tools' list is kept current: a server that says its tools changed (`notifications/tools/list_changed`
before the 2026-07-28 protocol, a `subscriptions/listen` event from it on) is listed again, and so is a
server the connection had to start again; `tools` is then the new list. The lists a host already took
do not change: a session named in `QueryOptions.mcp_servers` takes `tools` afresh at each query.

A call cancelled by an abort (its tool's cancel scope) is abandoned by the SDK, which first sends
`notifications/cancelled` for it (shielded, bounded: on stdio and legacy HTTP; on a 2026-07-28 HTTP
connection it aborts the request's POST instead, the wire's cancellation there); the connection
stays up for the next call. Progress notifications become the tool's `progress` events, in order,
through a bounded buffer the call's own task drains (late or surplus notifications are dropped).

What a server says is not trusted to fit: its tools' names are made unique and valid (`names`), its
results capped (`limits`), and an elicitation handler does not outlive the call that asked (`calls`).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx2
import trio
from loguru import logger
from mcp import Client, MCPError, StdioServerParameters, stdio_client
from mcp.client.session import ClientRequestContext, IncomingMessage
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import ListenNotSupportedError, SubscriptionLost
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    ElicitRequestFormParams,
    ElicitRequestParams,
    ElicitResult,
    ErrorData,
)
from mcp_types import Tool as McpTool

from queryloop.runtime.errors import McpRequestFailed, McpServerUnavailable
from queryloop.runtime.loop.spill import remove_spill_folder
from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError, ToolOutput
from queryloop.runtime.mcp._support import CLIENT, describe, every_page, failure, prompt_argument
from queryloop.runtime.mcp._watched import WatchedStream
from queryloop.runtime.mcp.calls import Call, CallsInFlight
from queryloop.runtime.mcp.content import error_text, prompt_blocks, resource_output, result_output
from queryloop.runtime.mcp.elicitation import ElicitationHandler, McpElicitation, McpElicitationAnswer
from queryloop.runtime.mcp.limits import LargeResults, capped_error, declared_max_chars
from queryloop.runtime.mcp.names import tool_name, tool_names
from queryloop.runtime.mcp.servers import McpServer, McpStdioServer, redacted_command, redacted_url

TOOLS_CHANGED = "notifications/tools/list_changed"

PROGRESS_BUFFER = 64
"""Progress notifications buffered for one call while its consumer is slow; more are dropped."""

_CALLING: ContextVar[Call] = ContextVar("queryloop_mcp_call")
"""The MCP call the current task makes: an elicitation answered in the call's own tasks (the 2026-07-28
protocol's `input_required`) is that call's."""


@dataclass(eq=False, slots=True)
class _Link:
    """One connection to the server: usable until `ended` is set; cancelling `scope` closes it."""

    client: Client
    ended: trio.Event
    scope: trio.CancelScope


class McpConnection:
    """The runtime's client of one MCP server: `open` once, then `call` from any session's tools."""

    def __init__(
        self, name: str, server: McpServer, nursery: trio.Nursery, on_elicitation: ElicitationHandler | None = None
    ) -> None:
        self.name = name
        self.server = server
        self.on_elicitation = on_elicitation
        self._nursery = nursery
        self._link: _Link | None = None
        self._connecting = trio.Lock()
        self._closed = False
        self.tools: list[Tool] = []
        """The server's tools as last listed (a new list at each change)."""
        self.has_resources = False
        """Whether the server said, when the tools were last listed, that it has resources."""
        self._listed_on: _Link | None = None
        self._listed = trio.Event()
        self._legacy_changed = trio.Event()
        self._calls = CallsInFlight()
        self._renames_said: set[tuple[str, str]] = set()
        """The renames already logged: a list fetched again (a change, a restart) does not repeat them."""
        self._results = LargeResults(name, server.results_dir)
        self.log = logger.bind(mcp_server=name)

    async def open(self) -> list[Tool]:
        """Connect and list the server's tools as `Tool`s; `McpServerUnavailable` if either fails."""
        try:
            with trio.fail_after(self.server.connect_timeout_s):
                link = await self._connected()
                await self._list(link)
        except Exception as error:
            self.close()
            msg = f"MCP server {self.name!r} ({self._describe_server()}): {describe(error)}"
            raise McpServerUnavailable(msg) from error
        self.log.info("MCP server {} open with {} tools", self.name, len(self.tools))
        return self.tools

    def close(self) -> None:
        """Close the connection for good (the runtime's close; trio thread): later calls are error results.

        The temporary folder its large results were saved in (none when the server names a `results_dir`)
        is removed by a task of the runtime's nursery, whose end waits for it: gone once the runtime is."""
        self._closed = True
        if self._link is not None:
            self._link.scope.cancel()
        folder = self._results.close()
        if folder is not None:
            try:
                self._nursery.start_soon(remove_spill_folder, folder)
            except RuntimeError:  # the runtime's nursery has closed: nothing may run the removal now
                self.log.warning("MCP server {}: its results folder {} is left on disk", self.name, folder)

    async def call(
        self, tool: str, arguments: dict[str, Any], context: ToolContext, max_chars: int | None = None
    ) -> ToolOutput:
        """Call `tool` on the server; its progress becomes `context`'s; every failure a `ToolError`. Its
        result is capped (`limits`; `max_chars`: the tool's declared size); an elicitation handler
        still waiting when the call ends is cancelled (`calls`)."""
        link = await self._usable()
        sending, received = trio.open_memory_channel[dict[str, Any]](PROGRESS_BUFFER)

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            try:
                sending.send_nowait({"progress": progress, "total": total, "message": message})
            except (trio.WouldBlock, trio.ClosedResourceError):
                pass  # the consumer is behind, or the call has returned: progress is a hint

        outcome: Any
        async with trio.open_nursery() as nursery:  # nothing but Cancelled may leave it (no exception group)
            nursery.start_soon(_forward_progress, received, context)
            with self._calls.call(context.tool_use_id) as call:
                calling = _CALLING.set(call)
                try:
                    outcome = await link.client.call_tool(tool, arguments, progress_callback=on_progress)
                except Exception as error:  # noqa: BLE001 - any failure of the call is an error result (`_failed`)
                    outcome = error
                finally:
                    _CALLING.reset(calling)
                    sending.close()  # the forwarder sends what is buffered, then ends
        if isinstance(outcome, Exception):
            raise self._failed(link, tool, outcome)
        if outcome.is_error:
            raise ToolError(capped_error(error_text(outcome)))
        return await self._results.capped(result_output(outcome), context.tool_use_id, max_chars)

    async def resources(self) -> list[dict[str, Any]]:
        """The server's resources (every page), each as the model sees it: `uri`, `name`, `server`, and
        `mimeType` and `description` when given; [] from a server without resources."""
        link = await self._usable()
        if link.client.server_capabilities.resources is None:
            return []
        try:
            listed = await every_page(link.client.list_resources, "resources")
        except Exception as error:
            raise self._failed(link, "resources/list", error) from error
        found: list[dict[str, Any]] = []
        for item in listed:
            entry = {"uri": str(item.uri), "name": item.name, "server": self.name}
            if item.mime_type:
                entry["mimeType"] = item.mime_type
            if item.description:
                entry["description"] = item.description
            found.append(entry)
        return found

    async def read(self, uri: str, tool_use_id: str) -> ToolOutput:
        """One resource's contents as tool output, capped as a call's result (`limits`); a `ToolError` for
        what the server refuses or a failure."""
        link = await self._usable()
        try:
            result = await link.client.read_resource(uri)
        except Exception as error:
            raise self._failed(link, "resources/read", error) from error
        return await self._results.capped(resource_output(uri, list(result.contents)), tool_use_id, None)

    async def prompts(self) -> list[dict[str, Any]]:
        """The server's prompts (every page): `name`, and `description` and `arguments` (each `name`,
        `required`, and `description` when given) when it has them; [] from a server without prompts.
        Raises `McpRequestFailed`."""
        link = await self._requestable()
        if link.client.server_capabilities.prompts is None:
            return []
        try:
            listed = await every_page(link.client.list_prompts, "prompts")
        except Exception as error:
            raise McpRequestFailed(str(self._failed(link, "prompts/list", error))) from error
        found: list[dict[str, Any]] = []
        for item in listed:
            entry: dict[str, Any] = {"name": item.name}
            if item.description:
                entry["description"] = item.description
            if item.arguments:
                entry["arguments"] = [prompt_argument(argument) for argument in item.arguments]
            found.append(entry)
        return found

    async def prompt(self, name: str, arguments: dict[str, str] | None) -> list[dict[str, Any]]:
        """The prompt `name` filled in with `arguments`: its messages' content as one user message's blocks
        (`prompt_blocks`). Raises `McpRequestFailed` (an unknown prompt, a missing argument: the server's
        words)."""
        link = await self._requestable()
        try:
            result = await link.client.get_prompt(name, arguments)
        except Exception as error:
            raise McpRequestFailed(str(self._failed(link, f"prompts/get {name}", error))) from error
        return prompt_blocks(list(result.messages))

    async def _requestable(self) -> _Link:
        """`_usable` for a host's own request: a server that cannot be reached is `McpRequestFailed`."""
        try:
            return await self._usable()
        except ToolError as error:
            raise McpRequestFailed(str(error)) from error

    # -- the tools' list ------------------------------------------------------------------

    async def _list(self, link: _Link) -> None:
        """List the server's tools (every page) into `tools`: a new list object."""
        listed: list[McpTool] = await every_page(link.client.list_tools, "tools")
        self.tools = self._tools_of(listed)
        self.has_resources = link.client.server_capabilities.resources is not None
        self._listed_on = link
        self._listed.set()
        self._listed = trio.Event()

    async def tools_after(self, seen: list[Tool]) -> list[Tool]:
        """The tools once listed again after `seen` (a `tools` list this connection gave): at once if they were."""
        while self.tools is seen:
            await self._listed.wait()
        return self.tools

    async def _relist(self, link: _Link, why: str) -> None:
        before = {tool.name for tool in self.tools}
        try:
            with trio.fail_after(self.server.connect_timeout_s):
                await self._list(link)
        except Exception as error:  # noqa: BLE001 - the old list stays; the next change lists again
            self.log.warning("MCP server {}: listing its tools again ({}) failed: {}", self.name, why, describe(error))
            return
        after = {tool.name for tool in self.tools}
        self.log.info(
            "MCP server {}: tools listed again ({}): {} tools, added {}, removed {}",
            self.name,
            why,
            len(after),
            sorted(after - before),
            sorted(before - after),
        )

    async def _watch_tools(self, link: _Link) -> None:
        """The connection's watcher: lists the tools again whenever the server says they changed."""
        if self._listed_on is not None and self._listed_on is not link:
            await self._relist(link, "the server was connected again")
        try:
            async with link.client.listen(tools_list_changed=True) as subscription:
                if not subscription.honored.tools_list_changed:
                    return  # the server does not announce changes
                async for _ in subscription:
                    await self._relist(link, "the server said they changed")
        except ListenNotSupportedError:
            await self._watch_notifications(link)  # a protocol before 2026-07-28
        except (MCPError, SubscriptionLost, TimeoutError) as error:
            self.log.info("MCP server {}: no tool-change subscription: {}", self.name, describe(error))

    async def _watch_notifications(self, link: _Link) -> None:
        """Before the 2026-07-28 protocol: the changes come as notifications, through `_on_message`."""
        while True:
            await self._legacy_changed.wait()
            self._legacy_changed = trio.Event()
            await self._relist(link, "the server said they changed")

    async def _on_message(self, message: IncomingMessage) -> None:
        """The SDK's handler of server notifications (its reader task): a change is noted, not listed here."""
        if getattr(message, "method", None) == TOOLS_CHANGED:
            self._legacy_changed.set()
        await trio.lowlevel.checkpoint()

    async def _elicit(self, context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult | ErrorData:
        """The SDK's elicitation callback: the server's request to the host's handler, its answer back.

        The handler is cancelled once the call that asked has ended (`calls`), and the server told
        `cancel`: a question about a call that is over has no one to answer to."""
        handler = self.on_elicitation
        assert handler is not None, "the callback is only given with a handler"
        callers = self._calls.who_may_ask(_CALLING.get(None))
        calling = callers[0].tool_use_id if len(callers) == 1 else None
        asked = {"server": self.name, "message": params.message, "tool_use_id": calling}
        if isinstance(params, ElicitRequestFormParams):
            schema = dict(params.requested_schema)
            request = McpElicitation(**asked, requested_schema=schema)
        else:
            request = McpElicitation(**asked, mode="url", url=params.url)
        answer: McpElicitationAnswer | None = None
        try:
            with self._calls.asking(callers):
                answer = McpElicitationAnswer.model_validate(await handler(request))
        except Exception as error:  # noqa: BLE001 - the server gets an error answer; its call decides what follows
            self.log.warning("MCP server {}: the elicitation handler failed: {}", self.name, describe(error))
            return ErrorData(code=INTERNAL_ERROR, message=f"the client's elicitation handler failed: {describe(error)}")
        if answer is None:  # its scope was cancelled: the call that asked has ended
            self.log.info("MCP server {}: elicitation cancelled: the call that asked has ended", self.name)
            return ElicitResult(action="cancel")
        self.log.info("MCP server {}: elicitation answered {}", self.name, answer.action)
        return ElicitResult(action=answer.action, content=answer.content)

    # -- the connection's life --------------------------------------------------------------

    async def _usable(self) -> _Link:
        """The live connection, or a new one when there is none (first use, or the last one ended)."""
        link = self._link
        if link is not None and not link.ended.is_set():
            return link
        async with self._connecting:  # concurrent callers share one restart
            link = self._link
            if link is not None and not link.ended.is_set():
                return link
            if self._closed:
                msg = f"MCP server {self.name} is closed"
                raise ToolError(msg)
            self.log.info("MCP server {}: its last connection ended, connecting again", self.name)
            try:
                with trio.fail_after(self.server.connect_timeout_s):
                    return await self._connected()
            except Exception as error:
                self.log.warning("MCP server {} could not connect again: {}", self.name, describe(error))
                msg = f"MCP server {self.name} is unavailable: {describe(error)}"
                raise ToolError(msg) from error

    async def _connected(self) -> _Link:
        link: _Link = await self._nursery.start(self._run)
        self._link = link
        return link

    async def _run(self, *, task_status: trio.TaskStatus[_Link]) -> None:
        """The connection's task: until the server's side closes, or `close` (the runtime's close)."""
        ended = trio.Event()
        started = False
        try:
            with trio.CancelScope() as scope:
                async with (
                    Client(
                        self._transport(ended),
                        cache=None,
                        client_info=CLIENT,
                        message_handler=self._on_message,
                        elicitation_callback=None if self.on_elicitation is None else self._elicit,
                        mode=self.server.protocol,
                    ) as client,
                    trio.open_nursery() as watcher,
                ):
                    link = _Link(client, ended, scope)
                    task_status.started(link)
                    started = True
                    watcher.start_soon(self._watch_tools, link)
                    await ended.wait()
                    watcher.cancel_scope.cancel()
        except BaseException as error:
            failed = failure(error)
            if not started or failed is None:
                raise  # before `started`: to `_connected`'s caller, through `nursery.start`
            # Reported, not raised: the runtime's nursery must not fail for a server's sake (a pending
            # cancellation is delivered again at this task's next checkpoint).
            self.log.warning("MCP server {} connection failed ({}); {}", self.name, describe(failed), self._again)
            return
        finally:
            ended.set()
        if not self._closed:
            self.log.warning("MCP server {} closed the connection; {}", self.name, self._again)

    @asynccontextmanager
    async def _transport(self, ended: trio.Event) -> AsyncIterator[tuple[WatchedStream, Any]]:
        server = self.server
        if isinstance(server, McpStdioServer):
            command, *args = server.command
            parameters = StdioServerParameters(command=command, args=args, env=server.env, cwd=server.cwd)
            async with stdio_client(parameters) as (read, write):
                yield WatchedStream(read, ended), write
        elif server.headers is None:
            async with streamable_http_client(server.url) as (read, write):
                yield WatchedStream(read, ended), write
        else:
            timeout = httpx2.Timeout(30.0, read=300.0)  # the SDK's own client's timeouts
            async with (
                httpx2.AsyncClient(headers=server.headers, timeout=timeout) as http,
                streamable_http_client(server.url, http_client=http) as (read, write),
            ):
                yield WatchedStream(read, ended), write

    def _failed(self, link: _Link, tool: str, error: Exception) -> ToolError:
        """A call that raised: the server's error as it said it, or a connection that failed (ended here)."""
        if isinstance(error, MCPError) and error.code != CONNECTION_CLOSED:
            return ToolError(f"MCP server {self.name}: {error.message} (error {error.code})")
        link.scope.cancel()  # a connection that failed a call is not trusted with the next one
        if self._closed:
            return ToolError(f"MCP server {self.name} is closed")
        if isinstance(error, MCPError):
            self.log.warning("MCP server {} closed the connection during {}; {}", self.name, tool, self._again)
            return ToolError(f"MCP server {self.name} closed the connection during the call (it died?)")
        self.log.warning("MCP server {} failed during {}: {}; {}", self.name, tool, describe(error), self._again)
        return ToolError(f"MCP server {self.name} failed during the call: {describe(error)}")

    def _tools_of(self, listed: list[McpTool]) -> list[Tool]:
        """The listed tools as `Tool`s, in the server's order, each under a name of its own (`tool_names`):
        one listed twice is kept once, one renamed (a clash, a name too long) is logged as a WARNING."""
        unique: dict[str, McpTool] = {}
        for item in listed:
            if item.name in unique:
                self.log.warning("MCP server {}: tool {!r} is listed twice; the first is kept", self.name, item.name)
            else:
                unique[item.name] = item
        names = tool_names(self.name, unique)
        for original, name in names.items():
            if name != tool_name(self.name, original) and (original, name) not in self._renames_said:
                self._renames_said.add((original, name))
                self.log.warning(
                    "MCP server {}: tool {!r} is named {} (its name cleaned up is taken by another tool, or too long)",
                    self.name,
                    original,
                    name,
                )
        return [self._tool(item, names[item.name]) for item in unique.values()]

    def _tool(self, listed: McpTool, model_name: str) -> Tool:
        name = listed.name  # what the server is called with: its own name, whatever the model sees
        max_chars = declared_max_chars(listed.meta)

        async def call(args: dict[str, Any], context: ToolContext) -> ToolOutput:
            return await self.call(name, args, context, max_chars)

        hints = listed.annotations
        return Tool(
            name=model_name,
            call=call,
            description=listed.description or "",
            input_schema=listed.input_schema,
            concurrency_safe=bool(hints is not None and hints.read_only_hint),
            runs_on="trio",  # the connection is trio's: an asyncio host must not move the call to its loop
        )

    @property
    def _again(self) -> str:
        return "restarted on next use" if isinstance(self.server, McpStdioServer) else "reconnected on next use"

    def _describe_server(self) -> str:
        """The server for an error message: its credentials hidden, as its `repr` hides them."""
        server = self.server
        return (
            " ".join(redacted_command(server.command))
            if isinstance(server, McpStdioServer)
            else redacted_url(server.url)
        )


async def _forward_progress(received: trio.MemoryReceiveChannel[dict[str, Any]], context: ToolContext) -> None:
    last = -math.inf
    async with received:
        async for progress in received:
            if progress["progress"] > last:  # MCP progress only grows: an earlier one that ran late is dropped
                last = progress["progress"]
                await context.progress(progress)
