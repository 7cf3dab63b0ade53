"""MCP resources for the model: Claude Code's two tools, `ListMcpResourcesTool` and `ReadMcpResourceTool`.

A query whose `QueryOptions.mcp_servers` name a server that has resources gets both tools, over those
servers only (by name, the `server` the model passes). Listing gives JSON (`uri`, `name`, `server`,
and `mimeType`, `description` when the server gives them); reading gives the contents as a tool
result carries them (`content.resource_output`). An unknown server, a resource the server refuses and
a server that fails are error results, as for any MCP call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from queryloop.runtime.loop.tools import Tool, ToolContext, ToolError, ToolOutput

if TYPE_CHECKING:
    from queryloop.runtime.mcp.connection import McpConnection

LIST_TOOL = "ListMcpResourcesTool"
READ_TOOL = "ReadMcpResourceTool"


class ListResources(BaseModel):
    server: str | None = Field(default=None, description="Only this MCP server's resources (all servers if absent)")


class ReadResource(BaseModel):
    server: str = Field(description="The MCP server that has the resource")
    uri: str = Field(description="The resource's URI, as listed")


def resource_tools(servers: tuple[str, ...], connection: Callable[[str], McpConnection]) -> list[Tool]:
    """The two tools over `servers` (names), each looked up with `connection` when the model calls."""

    def named(server: str) -> McpConnection:
        if server not in servers:
            msg = f"no MCP server named {server!r} here; the servers are {', '.join(servers)}"
            raise ToolError(msg)
        return connection(server)

    async def list_resources(args: ListResources, context: ToolContext) -> str:
        found: list[dict[str, Any]] = []
        for server in servers if args.server is None else (args.server,):
            try:
                found += await named(server).resources()
            except ToolError as error:
                if args.server is not None:
                    raise
                found.append({"server": server, "error": str(error)})  # the others' resources still count
        return json.dumps(found)

    async def read_resource(args: ReadResource, context: ToolContext) -> ToolOutput:
        return await named(args.server).read(args.uri, context.tool_use_id)

    return [
        Tool(
            name=LIST_TOOL,
            call=list_resources,
            description=(
                "List the resources (files, records, documents) the connected MCP servers offer: each has a "
                "uri, a name and its server. Read one with ReadMcpResourceTool."
            ),
            input_model=ListResources,
            concurrency_safe=True,
            runs_on="trio",
        ),
        Tool(
            name=READ_TOOL,
            call=read_resource,
            description="Read a resource of an MCP server by its server and uri (as ListMcpResourcesTool lists them).",
            input_model=ReadResource,
            concurrency_safe=True,
            runs_on="trio",
        ),
    ]
