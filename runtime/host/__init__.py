"""What a host embeds: `Runtime` (sessions side by side in one trio run), `Session` and `QueryHandle`
(`session`), `BlockingRuntime` for threads and sync code (`blocking`), and the runtime's collector
policy (`_gc`). Imports `kernel`, `loop`, `mcp` and `queryloop.actors`; nothing below imports this package.
"""
