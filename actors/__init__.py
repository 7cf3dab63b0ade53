"""The six actors of a queryloop session, one module each: QueryLoop, ModelCaller,
StreamingToolExecutor, Compactor, ToolUseSummarizer, BudgetGuard; each declares its messages beside it.

Imports `queryloop.runtime.kernel` and `queryloop.runtime.loop` (and `errors`); the runtime's `host`
layer spawns the QueryLoop, the ModelCaller and the executor (and, under a host budget, the
BudgetGuard), the QueryLoop the rest on first need; nothing below `host` imports this package.
"""
