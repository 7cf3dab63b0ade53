"""The session's actors at work: the QueryLoop's rules, subagents, hooks, aborts while tools run."""
