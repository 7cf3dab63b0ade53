"""What a query reports in the Agent SDK's shape, so that a host reads it as it reads the SDK's messages: the
`system` event of subtype `init` each query opens with, and the fields of its `result` that Claude Code adds
(`terminal_reason`, `model_usage`, `duration_api_ms`, `api_error_status`; `session_id` and `uuid` are on every
event). Pure functions of the loop, its `Run` and the query's totals.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from queryloop.runtime.kernel.supervisor import Supervisor
from queryloop.runtime.loop.events import ClaudeCodeTerminalReason, ModelUsage, SystemMessage
from queryloop.runtime.loop.pricing import context_window_for

if TYPE_CHECKING:
    from queryloop.actors.budget_guard import ModelTally
    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.actors.query_loop.run import QuerySetup, Run
    from queryloop.runtime.loop.options import QueryOptions

API_ERROR_REASONS: frozenset[ClaudeCodeTerminalReason] = frozenset({"api_error", "prompt_too_long", "image_error"})
"""The endings on an API error, whose HTTP status the result reports (`api_error_status`)."""


def session_id(loop: QueryLoop) -> str:
    """The session's id: a subagent's loop gets its session's, as Claude Code's hooks, spans and events do."""
    group = loop.supervisor
    while isinstance(group, Supervisor) and group.parent is not None:
        group = group.parent
    return group.session_id


def init_message(loop: QueryLoop, setup: QuerySetup) -> SystemMessage:
    """The `system` event of subtype `init` a session's query opens with: its `data` keyed as the SDK's
    `SystemInitData` (`session_id`, `model`, `tools`, `mcp_servers`, `permissionMode`, `cwd`)."""
    options = setup.options
    permissions = setup.permissions
    mode = permissions.mode if permissions is not None else options.permission_mode or "default"
    cwd = options.cwd if options.cwd is not None else os.getcwd()
    sid = session_id(loop)
    data = {
        "type": "system",
        "subtype": "init",
        "session_id": sid,
        "cwd": str(cwd),
        "model": options.model,
        "tools": list(setup.tools),
        # A query starts only with servers open in its runtime (`with_mcp_tools`): each is connected.
        "mcp_servers": [{"name": name, "status": "connected"} for name in options.mcp_servers],
        "permissionMode": mode,
    }
    message = SystemMessage(subtype="init", data=data, session_id=sid)
    data["uuid"] = message.uuid
    return message


def model_usage(options: QueryOptions, models: dict[str, ModelTally] | None) -> dict[str, ModelUsage]:
    """The result's `model_usage`: per model, the query's calls (its own, its subagents', summaries' and
    compactions'), keyed as the SDK's `ModelUsage`. `webSearchRequests` is 0: the runtime does not count the
    API's server tool uses; `maxOutputTokens` is the query's output limit (`QueryOptions.max_output_tokens`)."""
    return {
        model: {
            "inputTokens": tally.input_tokens,
            "outputTokens": tally.output_tokens,
            "cacheReadInputTokens": tally.cache_read_input_tokens,
            "cacheCreationInputTokens": tally.cache_creation_input_tokens,
            "webSearchRequests": 0,
            "costUSD": tally.cost_usd,
            "contextWindow": (
                options.context_window
                if options.context_window is not None and model == options.model
                else context_window_for(model)
            ),
            "maxOutputTokens": options.max_output_tokens,
        }
        for model, tally in (models or {}).items()
    }


def api_error_status(reason: ClaudeCodeTerminalReason, run: Run) -> int | None:
    """The result's `api_error_status`: the HTTP status of the API error the query ended on, else None."""
    return run.api_error_status if reason in API_ERROR_REASONS else None


def duration_api_ms(run: Run) -> int:
    """The result's `duration_api_ms`: the query's requests (every attempt) and its subagents'."""
    return int(run.calls.api_s * 1000) + run.agents_api_ms
