"""queryloop's runtime: everything but the six actors, in layers that import one way.

- `errors`: the exception types of every layer; imports nothing of ours.
- `_records`: `record`, the frozen slotted dataclass that events and actor messages are made of (built
  without validation; pydantic validates them where data enters); imports nothing of ours.
- `_frozen`: `EMPTY_LIST`, `EMPTY_DICT` and `EMPTY_SET`, the shared empty defaults (no container per
  instance in flight); imports nothing of ours.
- `kernel`: pykka actors scheduled as trio tasks, their inboxes, futures, supervisors and event
  channels. It knows nothing of agent loops: it imports only `errors`, `_records` and `_frozen`.
- `loop`: what one Claude-Code loop is made of and the pure rules it follows: its events, state and
  continue/terminal decisions, context management, the token budget, the transcript, and the contracts
  it holds with the outside (the model provider protocol, tools, hooks, options). Imports `errors` and `_records`.
- `providers`: model providers behind `loop.model.ModelProvider` (scripted, Anthropic) and a local
  Messages API server. Imports `loop`.
- `mcp`: clients of MCP servers, one per server per runtime, and the `Tool`s that call them. Imports
  `loop`; the `mcp` SDK (an optional extra) only in the modules the host imports to open a server.
- `host`: what a host embeds: `Runtime`, `Session`, `QueryHandle`, the blocking facade. Imports
  `kernel`, `loop`, `mcp` and `queryloop.actors` (which import `kernel` and `loop`, never this package's
  upper layers).
- `cli`: the `queryloop` command, its demo and the scenario runner. May import everything.

The public names are re-exported by `queryloop` itself.
"""
