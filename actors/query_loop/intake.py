"""What a query takes in, as steps of the `QueryLoop`: its setup when it starts (`new_run`: the options'
snapshot, its tools, system prompt and hooks), the messages sent while it runs that join it at a turn
boundary (`take_in_queued`), and their answer when it ends (`answer_absorbed`).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import trio

from queryloop.actors.compactor import context_config
from queryloop.actors.query_loop.deferred import has_text, replay, unavailable
from queryloop.actors.query_loop.lifecycle import session_start
from queryloop.actors.query_loop.messages import RunQuery
from queryloop.actors.query_loop.run import PhaseScope, QuerySetup, Run
from queryloop.actors.query_loop.sdk_fields import init_message, session_id
from queryloop.actors.query_loop.stopping import hook_error
from queryloop.actors.query_loop.subagent import AgentsHost, Subagents
from queryloop.runtime import telemetry
from queryloop.runtime.loop.control import control_plane, permission_asker
from queryloop.runtime.loop.deferred import pending_deferred
from queryloop.runtime.loop.event_hooks import QueryHooks, effect_messages
from queryloop.runtime.loop.events import AttachmentMessage, TranscriptMessage, UserMessage
from queryloop.runtime.loop.hooks import hook_error_message
from queryloop.runtime.loop.options import DEFAULT_SYSTEM_PROMPT
from queryloop.runtime.loop.settings import SettingsError
from queryloop.runtime.loop.state import Terminal
from queryloop.runtime.loop.structured_output import StructuredAnswer
from queryloop.runtime.loop.transcript import build_system_prompt
from queryloop.runtime.loop.turn_hooks import run_user_prompt_submit

if TYPE_CHECKING:
    from queryloop.actors.query_loop.loop import QueryLoop
    from queryloop.runtime.loop.options import QueryOptions
    from queryloop.runtime.loop.tools import Tool


def system_prompt(options: QueryOptions) -> list[dict[str, Any]]:
    """The query's system prompt; without a custom, appended or context part (most sessions), one list for all."""
    if options.system_prompt is None and not options.append_system_prompt and not options.system_context:
        return _DEFAULT_SYSTEM
    return build_system_prompt(
        DEFAULT_SYSTEM_PROMPT,
        custom=options.system_prompt,
        append=options.append_system_prompt,
        system_context=options.system_context,
    )


_DEFAULT_SYSTEM = build_system_prompt(DEFAULT_SYSTEM_PROMPT)
"""Shared by every query with the default system prompt (read only: requests and providers never change it)."""


def query_tools(loop: QueryLoop, options: QueryOptions) -> tuple[list[Tool], StructuredAnswer | None]:
    """The tools a query of `options` is given (its own, its MCP servers', the Agent tool, the structured answer's),
    and its structured answer (None without an `output_type`)."""
    tools = options.tools if not options.mcp_servers else with_mcp_tools(loop, options)
    if options.agents:
        subagents = loop.subagents
        if subagents is None:
            subagents = loop.subagents = Subagents(loop, type(loop), loop.agents_host or AgentsHost(), loop.depth)
        agent_tool = subagents.tool_for(options)
        if agent_tool is not None:
            tools = [*tools, agent_tool]
    structured = None
    if options.output_type is not None:
        structured = StructuredAnswer(options.output_type)
        tools = [*tools, structured.tool()]
    return tools, structured


def new_run(loop: QueryLoop, message: RunQuery) -> Run:
    """The query `message` starts, its config snapshot taken once, used by every iteration."""
    options = message.options
    tools, structured = query_tools(loop, options)
    caches = loop.caches
    setup = QuerySetup(
        options=options,
        sink=message.sink,
        control=message.control,
        system=system_prompt(options),
        tool_schemas=[t.api_schema() for t in tools],
        tools={t.name: t for t in tools},
        started=time.monotonic(),
        context_config=context_config(options),
        context_message=caches.context_message(options.user_context),
        prompt_uuid=message.prompt.uuid,
        can_use_tool=permission_asker(options.can_use_tool),
        opening=message.opening,
        **control(loop, options),
    )
    if loop.agent is None and message.control.abort_reason is None:  # a session's query opens with it, first
        message.sink.push(init_message(loop, setup))  # (not a subagent's, nor one aborted before it started)
    return Run(setup=setup, caches=caches, model=options.model, structured=structured)


def with_mcp_tools(loop: QueryLoop, options: QueryOptions) -> list[Tool]:
    """The query's tools: its own, then its MCP servers' as listed now (which replace their namesakes)."""
    if loop.mcp_tools is None:
        msg = "QueryOptions.mcp_servers needs a session of a runtime (Runtime.open_session)"
        raise ValueError(msg)
    live = loop.mcp_tools(options.mcp_servers)
    names = {tool.name for tool in live}
    return [*(tool for tool in options.tools if tool.name not in names), *live]


async def admit_prompt(loop: QueryLoop, run: Run, prompt: UserMessage) -> Terminal | None:
    """The prompt joins the conversation with what the hooks add, where Claude Code puts it: SessionStart's context
    before it (a session's first query), SubagentStart's (`run.setup.opening`) and UserPromptSubmit's after it.
    The query ends at once where its setup failed (`turn_setup_failed`), or where a UserPromptSubmit hook blocked
    the prompt (blocked and erased: it never joins) or stopped the query (`continue: false`).

    A call a PreToolUse hook deferred, waiting in the conversation, is replayed first (`deferred.replay`): the
    prompt follows its answer, and joins only if the replay lets the query go on and it has text (an empty
    prompt only says "go on", as the Agent SDK's resume does)."""
    setup = run.setup
    hooks = setup.hooks
    pending = pending_deferred(loop.conversation)
    if setup.setup_error is not None:  # nothing is sent: Claude Code's turn_setup_failed
        if pending is None:  # (a deferred call stays last, for a query that can replay it)
            loop.record(prompt)
        return Terminal(reason="turn_setup_failed", error=setup.setup_error)
    if pending is not None and pending[1].get("name") not in setup.tools:  # before any hook, as in Claude Code
        return unavailable(run, pending[1])
    if hooks is not None:
        await session_start(loop, run, hooks)
    if pending is not None:
        ended = await replay(loop, run, pending)
        if ended is not None or not has_text(prompt):
            return ended
    if hooks is None:
        loop.record(prompt)
        return None
    added: list[TranscriptMessage] = []
    stop = None
    if hooks.has("UserPromptSubmit"):
        verdict = None
        with PhaseScope(run):  # an abort cuts the hooks: the prompt joins, and the abort ends the query as usual
            verdict = await _user_prompt_submit(loop, run, hooks, prompt)
        if isinstance(verdict, Terminal):
            return verdict
        if verdict is not None:
            added, stop = verdict
    loop.record(prompt)
    for message in (*setup.opening, *added):
        await loop.emit(run, message)
    return None if stop is None else Terminal(reason="hook_stopped", error=stop)


async def _user_prompt_submit(
    loop: QueryLoop, run: Run, hooks: QueryHooks, prompt: UserMessage
) -> Terminal | tuple[list[TranscriptMessage], str | None]:
    """The UserPromptSubmit hooks: the query's end for a blocked prompt, else what they add and a stop's text."""
    content = prompt.content
    text = content if isinstance(content, str) else "".join(str(b.get("text", "")) for b in content)
    verdict = await run_user_prompt_submit(hooks, text)
    for hook, error in verdict.read.failures:
        loop.log.opt(exception=error).warning("UserPromptSubmit hook failed")
        await hook_error(loop, run, hook_error_message("UserPromptSubmit", hook, error))
    if verdict.blocks:
        blocked = "\n".join(verdict.blocks)
        return Terminal(reason="hook_stopped", error=f"Prompt blocked by UserPromptSubmit hook: {blocked}")
    added, stop = effect_messages("UserPromptSubmit", verdict.read)
    return list(added), stop


def query_span(loop: QueryLoop, run: Run) -> telemetry.QuerySpan | None:
    """The query's `invoke_agent` span, started in its own task while telemetry is on (docs/telemetry.md)."""
    agent_id, agent_type = loop.agent or (None, None)
    return telemetry.query_span_start(
        run.setup.control, session_id=session_id(loop), model=run.model, agent_name=agent_type, agent_id=agent_id
    )


def control(loop: QueryLoop, options: QueryOptions) -> dict[str, Any]:
    """The query's hooks, permissions and setup error (`QuerySetup`'s fields): from the options and the settings
    files they name (`control_plane`); nothing is built for options that configure none of it."""
    if not _governed(options):
        return {"hooks": None, "permissions": None, "setup_error": None}
    try:
        plane = control_plane(options)
    except (SettingsError, ValueError, TypeError) as error:  # a file in the working folder is outside input
        loop.log.warning("query not started: {}", error)
        return {"hooks": None, "permissions": None, "setup_error": f"Error: query not started: {error}"}
    permissions = plane.permissions
    updates = loop.caches.permission_updates
    if updates:
        permissions.apply(updates, replayed=True)
    permissions.applied = updates  # the session's list: what this query's `can_use_tool` allows joins it
    hooks = None
    if plane.matchers:
        path = str(loop.transcript.path) if loop.transcript is not None else ""
        hooks = QueryHooks(plane.matchers, session_id(loop), path, loop.agent, permissions.mode, str(permissions.cwd))
    governs = plane.governs or options.can_use_tool is not None or bool(updates)
    return {"hooks": hooks, "permissions": permissions if governs else None, "setup_error": None}


def _governed(options: QueryOptions) -> bool:
    """Whether the options configure any hook, permission or settings file (most do not: nothing to build)."""
    return bool(
        options.hooks
        or options.post_tool_use_hooks
        or options.can_use_tool is not None
        or options.allowed_tools
        or options.disallowed_tools
        or options.settings is not None
        or options.setting_sources
        or options.permission_mode is not None
        or options.add_dirs
    )


async def take_in_queued(loop: QueryLoop, run: Run) -> list[TranscriptMessage]:
    """The messages waiting with this query's options, in order, taken in at this turn boundary as Claude
    Code takes queued messages in: each joins the conversation (a `queued_message` attachment for a text
    prompt, the user message itself for blocks), its own stream gets that event, and this query's `result`
    answers it. A message with other options (overrides), or an interrupt, waits for a query of its own."""
    taken: list[TranscriptMessage] = []
    queued = loop.queued
    while queued and joins(queued[0], run):
        message = queued.popleft()
        prompt = message.prompt
        joined: TranscriptMessage = (
            AttachmentMessage(attachment={"type": "queued_message", "content": prompt.content})
            if type(prompt.content) is str
            else prompt
        )
        await loop.emit(run, joined)
        message.sink.push(joined)
        taken.append(joined)
        if run.absorbed is None:
            run.absorbed = []
        run.absorbed.append(message)
    return taken


def joins(message: RunQuery, run: Run) -> bool:
    """Whether a waiting message may be taken into `run` (same options, not an interrupt, not aborted)."""
    if message.interrupt or message.control.abort_reason is not None:
        return False
    return message.options is run.setup.options or message.options == run.setup.options


def answer_absorbed(run: Run) -> None:
    """The messages `run` took in get its `result` (its terminal and transitions too), and their streams end."""
    for message in run.absorbed or ():
        if run.outcome is not None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for event in run.outcome:
                    message.sink.push(event)
        message.sink.close()
        message.control.end()
