"""StopFailure hooks (Claude Code's loop: after the withheld prompt-too-long surfaces, `void
executeStopFailureHooks(lastMessage, toolUseContext)`; and wherever a query ends on an API error
message, which skips the stop hooks). Not awaited by the loop: they run in the runtime, whose close
waits for them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import sniffio
import trio
import trio.testing

from queryloop import AgentDefinition, QueryOptions, Runtime, ScriptedModel, StopFailureInput, StopHookInput
from queryloop.aio import AsyncioRuntime
from queryloop.runtime.host.runtime import SHUTDOWN_GRACE_S
from queryloop.runtime.loop.hooks import HookDecision, StopFailureError, stop_failure_error
from tests.actors.test_stop_reasons import REFUSED
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import log_records, run_query, text_reply, tools_reply
from tests.hosts.test_aio import run as run_on_asyncio

WAIT_S = 10.0


class Recorder:
    """A StopFailure hook that records what it gets; `done` once it has been called `expected` times."""

    def __init__(self, expected: int = 1) -> None:
        self.inputs: list[StopFailureInput] = []
        self.expected = expected
        self.done = trio.Event()

    async def __call__(self, hook_input: StopFailureInput) -> None:
        self.inputs.append(hook_input)
        if len(self.inputs) == self.expected:
            self.done.set()

    async def wait(self) -> StopFailureInput:
        with trio.fail_after(WAIT_S):
            await self.done.wait()
        return self.inputs[-1]


def never_blocks(calls: list[StopHookInput]) -> Any:
    async def stop_hook(hook_input: StopHookInput) -> HookDecision | None:
        calls.append(hook_input)
        return None

    return stop_hook


async def test_stop_failure_hooks_run_when_prompt_too_long_surfaces_and_stop_hooks_do_not() -> None:
    recorder = Recorder()
    stops: list[StopHookInput] = []
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [{"error": "prompt_too_long"}],
            context_collapse=False,
            reactive_compact=False,
            stop_hooks=[never_blocks(stops)],
            stop_failure_hooks=[recorder],
        )
        assert ran.reason == "prompt_too_long"
        hook_input = await recorder.wait()
    assert hook_input.error == "invalid_request" and hook_input.session_id == ran.session.id
    assert hook_input.last_assistant_message is not None and "too long" in hook_input.last_assistant_message.lower()
    assert hook_input.agent_id is None and hook_input.agent_type is None
    assert stops == []


@pytest.mark.parametrize(
    ("scripted", "expected", "reason"),
    [
        ("rate_limit", "rate_limit", "api_error"),
        ("overloaded", "overloaded", "api_error"),
        ("api_error", "server_error", "api_error"),
        ("connection", "unknown", "api_error"),
        ("fallback", "overloaded", "model_error"),  # no fallback model: the model is unavailable
    ],
)
async def test_stop_failure_hooks_run_on_a_model_error_with_its_category(
    scripted: str, expected: str, reason: str
) -> None:
    recorder = Recorder()
    stops: list[StopHookInput] = []
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [{"error": scripted}],
            max_retries=0,
            stop_hooks=[never_blocks(stops)],
            stop_failure_hooks=[recorder],
        )
        assert ran.reason == reason
        hook_input = await recorder.wait()
    assert hook_input.error == expected
    assert ran.handle.terminal is not None and ran.handle.terminal.error == hook_input.last_assistant_message
    assert hook_input.error_details is not None and hook_input.last_assistant_message is not None
    assert hook_input.error_details in hook_input.last_assistant_message
    assert stops == []


async def test_stop_failure_hooks_run_when_a_max_tokens_cut_off_surfaces() -> None:
    recorder = Recorder()
    stops: list[StopHookInput] = []
    async with Runtime.open() as runtime:
        ran = await run_query(
            runtime,
            [text_reply(f"part {i}", stop_reason="max_tokens") for i in range(5)],
            stop_hooks=[never_blocks(stops)],
            stop_failure_hooks=[recorder],
        )
        assert ran.reason == "completed"
        hook_input = await recorder.wait()
    assert hook_input.error == "max_output_tokens" and stops == []


async def test_stop_failure_hooks_run_when_a_refusal_surfaces() -> None:
    recorder = Recorder()
    async with Runtime.open() as runtime:
        ran = await run_query(runtime, [REFUSED], stop_failure_hooks=[recorder])
        assert ran.reason == "completed"
        hook_input = await recorder.wait()
    assert hook_input.error == "invalid_request"
    assert hook_input.last_assistant_message is not None and "refusal" in hook_input.last_assistant_message


async def test_stop_failure_hooks_do_not_run_on_a_completion_an_image_error_or_the_blocking_limit() -> None:
    recorder = Recorder()
    stops: list[StopHookInput] = []
    async with Runtime.open() as runtime:
        done = await run_query(
            runtime, [text_reply("fine")], stop_hooks=[never_blocks(stops)], stop_failure_hooks=[recorder]
        )
        image = await run_query(runtime, [{"error": "image_size"}], stop_failure_hooks=[recorder])
        blocked = await run_query(
            runtime,
            [text_reply()],
            prompt="x" * 40_000,
            auto_compact=False,
            context_window=10_000,
            max_output_tokens=1_000,
            stop_failure_hooks=[recorder],
        )
    # The runtime's close has waited for every hook started: none was.
    assert (done.reason, image.reason, blocked.reason) == ("completed", "image_error", "blocking_limit")
    assert len(stops) == 1 and recorder.inputs == []


async def test_a_stop_failure_hook_does_not_hold_the_query_and_the_runtimes_close_waits_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    finished: list[StopFailureError] = []

    async def slow(hook_input: StopFailureInput) -> None:
        await trio.sleep(SHUTDOWN_GRACE_S / 2)
        finished.append(hook_input.error)

    async with Runtime.open() as runtime:
        before = trio.current_time()
        ran = await run_query(runtime, [{"error": "api_error"}], max_retries=0, stop_failure_hooks=[slow])
        # The stream has ended, the result was sent, the session runs nothing: the hook still runs.
        assert ran.labels[-1] == "result" and ran.session.live_tasks() == 0
        assert trio.current_time() == before and finished == []
    assert finished == ["server_error"]


async def test_a_stop_failure_hook_that_raises_is_logged_and_the_others_still_run() -> None:
    recorder = Recorder()

    async def broken(hook_input: StopFailureInput) -> None:
        raise RuntimeError("the pager is down")

    with log_records() as records:
        async with Runtime.open() as runtime:
            ran = await run_query(
                runtime, [{"error": "overloaded"}], max_retries=0, stop_failure_hooks=[broken, recorder]
            )
            await recorder.wait()
    # The query had ended before the hook ran: its result says nothing of it.
    assert ran.handle.terminal is not None and ran.handle.result is not None
    assert ran.reason == "api_error" and ran.handle.result.errors == [ran.handle.terminal.error]
    failed = [r for r in records if "StopFailure hook" in r["message"]]
    assert len(failed) == 1 and "broken" in failed[0]["message"] and "the pager is down" in str(failed[0]["exception"])


def test_stop_failure_error_maps_model_error_kinds_to_claude_codes_categories() -> None:
    assert stop_failure_error("authentication", "invalid x-api-key") == "authentication_failed"
    assert stop_failure_error("not_found", "model: claude-x") == "model_not_found"
    assert stop_failure_error("invalid_request", "Your credit balance is too low to access the API") == "billing_error"
    assert stop_failure_error("prompt_too_long", "prompt is too long") == "invalid_request"
    assert stop_failure_error("script_exhausted", "no reply left") == "unknown"


async def test_a_subagents_api_error_runs_the_stop_failure_hooks_with_its_agent() -> None:
    recorder = Recorder()
    provider = ByPrompt(
        {
            "Review": [tools_reply(agent_call("c1", "reviewer", "file a")), text_reply("done")],
            "file a": [{"error": "overloaded"}],
        }
    )
    reviewer = AgentDefinition(description="Reviews one file", prompt="You review code.")
    options = QueryOptions(
        provider=provider, agents={"reviewer": reviewer}, max_retries=0, stop_failure_hooks=[recorder]
    )
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options)
        result = await session.query("Review").wait()
        hook_input = await recorder.wait()
    assert result.subtype == "success" and result.result == "done"  # the parent goes on
    assert hook_input.error == "overloaded" and hook_input.agent_type == "reviewer"
    assert hook_input.agent_id is not None and hook_input.agent_id.endswith("/c1")


def test_a_stop_failure_hook_runs_on_the_asyncio_hosts_loop() -> None:
    async def main() -> tuple[str, str]:
        seen: list[tuple[str, str]] = []
        called = asyncio.Event()

        async def page_someone(hook_input: StopFailureInput) -> None:
            seen.append((hook_input.error, sniffio.current_async_library()))
            called.set()

        model = ScriptedModel([{"error": "rate_limit"}])
        options = QueryOptions(provider=model, max_retries=0, stop_failure_hooks=[page_someone])
        async with AsyncioRuntime.open() as rt:
            session = await rt.open_session(options)
            assert (await session.query("go").wait()).is_error
            await called.wait()
        return seen[0]

    assert run_on_asyncio(main) == ("rate_limit", "asyncio")
