"""MCP tools: a runtime's clients of MCP servers, and the `Tool`s through which sessions call them.

Owns: how a server is reached (`servers`: `McpStdioServer`, `McpHttpServer`, plain data importable
without the `mcp` SDK, credentials hidden from their `repr`), one client per server and per runtime
with its life (`connection`: connected by `Runtime.open_mcp`, shared by every session's calls,
restarted on next use after it died, closed with the runtime), the translation of MCP results into
tool_result content (`content`), and what keeps a server's words within bounds: unique, valid tool
names (`names`), results capped in size and tokens (`limits`), elicitation handlers that end with
their call (`calls`). Imports `queryloop.runtime.loop` (the `Tool` contract, the spill files) and
`errors`; the `mcp` SDK (the optional extra `queryloop[mcp]`) is imported by `connection`, `content`
and `_support` only, which the host imports when a server is opened, so `import queryloop` never
needs it.
"""
