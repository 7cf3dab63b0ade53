"""The six actors of a queryloop session, one module each: QueryLoop, ModelCaller,
StreamingToolExecutor, Compactor, HaikuSummarizer, BudgetGuard; each declares its messages beside it.

Imports `queryloop.runtime.kernel` and `queryloop.runtime.loop` (and `errors`); the runtime's `host`
layer spawns them, and nothing below `host` imports this package.
"""
