"""QueryLoop: owns the loop `State` and the session's conversation; runs queries as Claude Code's query loop does.

One actor in four layers, each a module: `loop` (the actor's API and the `while True` of a query, in
Claude Code's check order), `context` (the steps around the model call: compaction, recoveries,
summaries, the token budget, stop hooks), `ending` (aborts, synthetic results, the outcome) and `turn`
(the model call, the dispatch of its stream and its tools' results, emission). `messages` declares
what it receives and sends; `run` the per-query context the layers share. The layers import one
another one way (`loop` → `context` → `ending` → `turn` → `run` → `messages`), and, like every
actor, only `queryloop.runtime.kernel` and `queryloop.runtime.loop` besides the other actors.
"""

from queryloop.actors.query_loop.loop import QueryLoop
from queryloop.actors.query_loop.messages import (
    GetConversation,
    GetSidechains,
    QueryControl,
    RunQuery,
    Settled,
)

__all__ = [
    "GetConversation",
    "GetSidechains",
    "QueryControl",
    "QueryLoop",
    "RunQuery",
    "Settled",
]
