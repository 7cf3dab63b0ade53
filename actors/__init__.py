"""The six actors of a queryloop session, one module each (QueryLoop, ModelCaller,
StreamingToolExecutor, Compactor, HaikuSummarizer, BudgetGuard)."""
