"""MCP tools: a runtime's clients of MCP servers, and the `Tool`s through which sessions call them.

Owns: how a server is reached (`servers`: `McpStdioServer`, `McpHttpServer`, plain data importable
without the `mcp` SDK), one client per server and per runtime with its life (`connection`: connected
by `Runtime.open_mcp`, shared by every session's calls, restarted on next use after it died, closed
with the runtime), and the translation of MCP results into tool_result content (`content`).
Imports `queryloop.runtime.loop` (the `Tool` contract) and `errors`; the `mcp` SDK (the optional
extra `queryloop[mcp]`) is imported by `connection` and `content` only, which the host imports when
a server is opened, so `import queryloop` never needs it.
"""
