"""One Claude-Code query loop's data and rules, with no actor in sight.

Owns: the public events (`events`), the loop's `State`, its transitions and `Terminal` (`state`), the
continue/terminal decision (`decisions`), context management thresholds and rewrites (`context`), the
token budget gate (`token_budget`), the conversation's API form and invariants (`transcript`; a deferred
tool call's place in it, `deferred`) and its durable file (`persistence` writes it, `restore` reads it back,
`disk` waits out a full disk); and the contracts with the outside: the model provider protocol (`model`), the
assembly of a streamed response (`stream`), tools (`tools`), hooks (`hooks`), Claude Code's permission rules and
modes (`permissions`, with `permission_paths` and `shell_commands`), prices (`pricing`) and `QueryOptions`
(`options`).
Imports only `queryloop.runtime.errors` and `queryloop.runtime._records`; the actors call these functions,
never the reverse.
"""
