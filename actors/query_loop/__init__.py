"""QueryLoop: owns the session's conversation; runs queries as Claude Code's query loop does.

One actor class (`loop`: its messages, the session's state, the emission every step goes through, and a
query's run read top to bottom) and the query's steps as plain functions taking the loop and the query's
`Run`: `intake` (setup, the control plane, the prompt, queued messages), `deferred` (a deferred tool call
replayed), `context` (compaction, recoveries, summaries, the token budget, stop hooks), `turn` (the model call
and the dispatch of its stream and tools' results) and `ending` (early endings, the outcome). `messages`
declares what it receives and sends; `run` the per-query state the steps share; `subagent` the Agent tool;
`controls` what a session asks beside its queries (its conversation, its context usage, a manual compaction).
The steps import `loop` only for its type; like every actor, the package imports only `queryloop.runtime` (the
kernel, the loop's pure modules, telemetry) besides the other actors.
"""

from queryloop.actors.query_loop.loop import QueryLoop
from queryloop.actors.query_loop.messages import (
    CompactNow,
    GetContextUsage,
    GetConversation,
    GetSidechains,
    QueryControl,
    RunQuery,
    Settled,
)

__all__ = [
    "CompactNow",
    "GetContextUsage",
    "GetConversation",
    "GetSidechains",
    "QueryControl",
    "QueryLoop",
    "RunQuery",
    "Settled",
]
