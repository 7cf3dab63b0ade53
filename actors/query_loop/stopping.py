"""The hooks that run when the model would end its turn, as steps of the `QueryLoop`: the older `stop_hooks`
and the Stop (SubagentStop, in a subagent) hooks of `QueryOptions.hooks` (`stop_hooks`), and how a hook that
failed is reported (`hook_error`: a `hook_error` event, its text in the result's `errors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from queryloop.actors.query_loop.run import PhaseScope, Run, Turn
from queryloop.runtime.loop.hooks import HookErrorSource, StopHookInput, hook_error_message
from queryloop.runtime.loop.host_code import checked_hook_decision
from queryloop.runtime.loop.turn_hooks import run_stop

if TYPE_CHECKING:
    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.runtime.loop.events import SystemMessage, TranscriptMessage
    from queryloop.runtime.loop.state import State


async def hook_error(loop: QueryLoop, run: Run, message: SystemMessage) -> None:
    run.add_hook_errors((message.content,))
    await loop.emit(run, message)


async def stop_hooks(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
) -> tuple[str | None, list[str]]:
    """The stop hooks (the older `stop_hooks`, then the Stop or SubagentStop hooks of `QueryOptions.hooks`): the
    first `prevent`, and the blocking errors' texts. A hook that fails counts as passing: its `hook_error`
    event is emitted at once and its text kept for the result's `errors`."""
    sdk = run.setup.hooks
    if sdk is not None and sdk.has("Stop" if loop.agent is None else "SubagentStop"):
        return await _sdk_stop_hooks(loop, run, state, messages_for_query, turn)
    if not run.setup.options.stop_hooks:
        return None, []
    return await _older_stop_hooks(loop, run, state, messages_for_query, turn)


async def _older_stop_hooks(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
) -> tuple[str | None, list[str]]:
    """Every older stop hook in turn (`QueryOptions.stop_hooks`, each given a `StopHookInput`)."""
    agent_id, agent_type = loop.agent or (None, None)
    hook_input = StopHookInput(
        messages=[*messages_for_query, *turn.assistant_messages],
        stop_hook_active=state.stop_hook_active,
        agent_id=agent_id,
        agent_type=agent_type,
        consecutive_blocks=state.stop_hook_blocks,
    )
    prevent: str | None = None
    errors: list[str] = []
    with PhaseScope(run):
        for hook in run.setup.options.stop_hooks:
            try:
                decision = checked_hook_decision(await hook(hook_input))
            except Exception as error:  # noqa: BLE001 - a failing hook is a non-blocking error, as in Claude Code
                loop.log.opt(exception=error).warning("stop hook failed")
                event: HookErrorSource = "Stop" if agent_id is None else "SubagentStop"
                await hook_error(loop, run, hook_error_message(event, hook, error))
                continue
            if decision is None:
                continue
            if decision.prevent is not None and prevent is None:
                prevent = decision.prevent
            if decision.blocking_error is not None:
                errors.append(decision.blocking_error)
    return prevent, errors


async def _sdk_stop_hooks(
    loop: QueryLoop, run: Run, state: State, messages_for_query: list[TranscriptMessage], turn: Turn
) -> tuple[str | None, list[str]]:
    """The older stop hooks, then the Stop (SubagentStop) hooks of `QueryOptions.hooks`, all at once
    (`run_stop`): the first `prevent` or `continue: false`, and every block's (and `additionalContext`'s) text,
    as Claude Code adds them up."""
    prevent: str | None = None
    errors: list[str] = []
    if run.setup.options.stop_hooks:
        prevent, errors = await _older_stop_hooks(loop, run, state, messages_for_query, turn)
    hooks = run.setup.hooks
    assert hooks is not None
    text = "".join(b.get("text", "") for m in turn.assistant_messages for b in m.content if b.get("type") == "text")
    verdict = None
    with PhaseScope(run):
        verdict = await run_stop(
            hooks, subagent=loop.agent is not None, stop_hook_active=state.stop_hook_active, last_assistant_message=text
        )
    if verdict is None:  # aborted: the caller ends the query
        return prevent, errors
    event: HookErrorSource = "Stop" if loop.agent is None else "SubagentStop"
    for hook, error in verdict.read.failures:
        loop.log.opt(exception=error).warning("{} hook failed", event)
        await hook_error(loop, run, hook_error_message(event, hook, error))
    stop = verdict.read.stop
    if stop is not None and prevent is None:
        prevent = stop.stop_reason or f"Execution stopped by {event} hook"
    return prevent, [*errors, *verdict.blocks, *verdict.read.contexts()]
