"""`queryloop.aio.AsyncioRuntime` under plain `asyncio.run`: each test is a sync function that runs its
own asyncio loop (pytest-trio's `trio_mode` never sees them). Waits are bounded with `asyncio.timeout`."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import sniffio
import trio

from queryloop import (
    AgentDefinition,
    Allow,
    Deny,
    HookContext,
    HookDecision,
    HookInput,
    HookJSONOutput,
    HookMatcher,
    PostToolUseInput,
    QueryloopError,
    QueryOptions,
    ResultMessage,
    Runtime,
    ScriptedModel,
    StopHookInput,
    SystemMessage,
    ToolContext,
    tool,
)
from queryloop.aio import AsyncioQuery, AsyncioRuntime, AsyncioSession, RuntimeClosed
from queryloop.runtime.host.aio_bridge import Mode
from queryloop.runtime.loop.tools import Tool, ToolOutput
from tests.agent_helpers import ByPrompt, agent_call
from tests.helpers import text_reply, tool_use, tools_reply

MODES: list[Mode] = ["guest", "thread"]
LIMIT_S = 30.0


def run(main: Callable[[], Awaitable[Any]]) -> Any:
    async def bounded() -> Any:
        async with asyncio.timeout(LIMIT_S):
            return await main()

    return asyncio.run(bounded())


class Blocker:
    """An asyncio tool that waits until released (or cancelled), recording both."""

    def __init__(self, expected: int = 1) -> None:
        self.started = 0
        self.cancelled = 0
        self.expected = expected
        self.running = asyncio.Event()
        self.all_running = asyncio.Event()
        self.release = asyncio.Event()

    def tool(self, name: str = "block") -> Tool:
        async def block(args: Any, ctx: ToolContext) -> ToolOutput:
            self.started += 1
            self.running.set()
            if self.started == self.expected:
                self.all_running.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return "released"

        return Tool(name=name, call=block)


def blocked_model() -> ScriptedModel:
    """A tool call to `block`; aborted, the query makes no other call: the next query gets "next"."""
    return ScriptedModel([tools_reply(tool_use("t1", "block")), text_reply("next")])


async def labels_of(query: AsyncioQuery) -> list[str]:
    async with query:
        return [event.label async for event in query]


@pytest.mark.parametrize("mode", MODES)
def test_a_query_streams_whole_with_the_same_events_as_on_trio(mode: Mode) -> None:
    def script() -> ScriptedModel:
        return ScriptedModel([tools_reply(tool_use("t1", "add"), text="Adding."), text_reply("2 + 3 = 5")])

    async def add(args: Any, ctx: ToolContext) -> ToolOutput:
        await ctx.progress("adding")
        return "5"

    async def on_trio() -> list[str]:
        async with Runtime.open() as runtime:
            session = await runtime.open_session(QueryOptions(provider=script(), tools=[Tool(name="add", call=add)]))
            return [event.label async for event in session.query("What is 2 + 3?")]

    async def on_asyncio() -> tuple[list[str], Any, ResultMessage, dict[str, int]]:
        async with AsyncioRuntime.open(mode=mode) as rt:
            session = await rt.open_session(QueryOptions(provider=script(), tools=[Tool(name="add", call=add)]))
            query = session.query("What is 2 + 3?")
            labels = await labels_of(query)
            result = await query.wait()
            await session.close()
            assert rt.open_sessions == 0
            return labels, query.terminal, result, rt.hops()

    expected = trio.run(on_trio)
    labels, terminal, result, hops = run(on_asyncio)
    assert labels == expected and labels[-1] == "result" and "progress" in labels
    assert terminal is not None and terminal.reason == "completed"
    assert result.subtype == "success" and result.result == "2 + 3 = 5" and result.num_turns == 2
    assert hops["hops_to_host"] < len(labels)  # events cross in batches


@pytest.mark.parametrize("mode", MODES)
def test_a_query_read_from_its_on_ready_callback_gives_the_events_async_for_gives(mode: Mode) -> None:
    """`on_ready` + `take_ready`: every event once, in order, then None at the end; no task awaits them."""

    def script() -> ScriptedModel:
        return ScriptedModel([tools_reply(tool_use("t1", "add"), text="Adding."), text_reply("2 + 3 = 5")])

    async def add(args: Any, ctx: ToolContext) -> ToolOutput:
        return "5"

    async def main() -> tuple[list[str], list[str], list[int]]:
        async with AsyncioRuntime.open(mode=mode) as rt:
            tools = [Tool(name="add", call=add)]
            session = await rt.open_session(QueryOptions(provider=script(), tools=tools))
            awaited = await labels_of(session.query("What is 2 + 3?"))
            session = await rt.open_session(QueryOptions(provider=script(), tools=tools))
            query = session.query("What is 2 + 3?")
            forwarded: list[str] = []
            batches: list[int] = []
            ended = asyncio.get_running_loop().create_future()

            def ready() -> None:
                while (batch := query.take_ready()) is not None:
                    if not batch:
                        return
                    batches.append(len(batch))
                    forwarded.extend(event.label for event in batch)
                ended.set_result(None)

            query.on_ready(ready)
            ready()
            await ended
            assert query.take_ready() is None and query.done
            assert query.terminal is not None and query.terminal.reason == "completed"
            return awaited, forwarded, batches

    awaited, forwarded, batches = run(main)
    assert forwarded == awaited and forwarded[-1] == "result"
    assert len(batches) < len(forwarded)  # events arrive in batches, one call each


def test_a_thousand_concurrent_queries_complete_in_few_hops() -> None:
    count = 1000

    async def main() -> tuple[list[str], dict[str, int], int]:
        async with AsyncioRuntime.open() as rt:

            async def one(i: int) -> str:
                model = ScriptedModel([tools_reply(tool_use("t1", "echo")), text_reply(f"answer {i}")])
                session = await rt.open_session(QueryOptions(provider=model, tools=[echo]))
                result = await session.query(f"question {i}").wait()
                await session.close()
                return result.result

            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(i)) for i in range(count)]
            return [task.result() for task in tasks], rt.hops(), rt.open_sessions

    @tool(description="echo")
    async def echo(args: Any, ctx: ToolContext) -> str:
        await asyncio.sleep(0)
        return "echoed"

    answers, hops, open_sessions = run(main)
    assert answers == [f"answer {i}" for i in range(count)]
    assert open_sessions == 0
    # Each query crosses several times (open, tool start, tool result, events, close): batched, far fewer.
    assert hops["hops_to_host"] < hops["calls_to_host"] / 5


async def blocked_query(rt: AsyncioRuntime, blocker: Blocker) -> tuple[AsyncioSession, AsyncioQuery]:
    session = await rt.open_session(QueryOptions(provider=blocked_model(), tools=[blocker.tool()]))
    return session, session.query("go")


async def assert_aborted_then_next(rt: AsyncioRuntime, session: AsyncioSession, query: AsyncioQuery) -> None:
    await query.aclose()  # it has ended: returns at once, with its terminal
    assert query.terminal is not None and query.terminal.reason == "aborted_tools"
    assert session.live_tasks() == 0
    assert (await session.query("again").wait()).result == "next"
    await session.close()


CANCELLERS = ["task_cancel", "asyncio_timeout", "task_group_sibling"]


@pytest.mark.parametrize("canceller", CANCELLERS)
@pytest.mark.parametrize("mode", MODES)
def test_cancelling_consumers_aborts_each_query_and_the_session_takes_the_next(mode: Mode, canceller: str) -> None:
    count = 50

    async def main() -> None:
        blocker = Blocker(count)
        async with AsyncioRuntime.open(mode=mode) as rt:
            opened = [await blocked_query(rt, blocker) for _ in range(count)]
            seen: list[list[str]] = [[] for _ in range(count)]

            async def consume(i: int) -> None:
                async for event in opened[i][1]:  # no `async with`: the cancelled wait itself aborts
                    seen[i].append(event.label)

            if canceller == "task_cancel":
                tasks = [asyncio.create_task(consume(i)) for i in range(count)]
                await blocker.all_running.wait()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                assert all(task.cancelled() for task in tasks)
            elif canceller == "asyncio_timeout":
                deadlines: list[asyncio.Timeout] = []

                async def consume_until_the_deadline(i: int) -> None:
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(None) as deadline:
                            deadlines.append(deadline)
                            await consume(i)

                consumers = asyncio.gather(*(consume_until_the_deadline(i) for i in range(count)))
                await blocker.all_running.wait()
                now = asyncio.get_running_loop().time()
                for deadline in deadlines:
                    deadline.reschedule(now)
                await consumers
            else:

                async def fail_once_all_run() -> None:
                    await blocker.all_running.wait()
                    raise LookupError("a sibling failed")

                with pytest.raises(ExceptionGroup) as caught:
                    async with asyncio.TaskGroup() as group:
                        for i in range(count):
                            group.create_task(consume(i))
                        group.create_task(fail_once_all_run())
                assert caught.group_contains(LookupError)
            assert all("user" not in labels for labels in seen)  # cancelled mid-tool: nothing after the tool's start
            for session, query in opened:
                await assert_aborted_then_next(rt, session, query)
            assert blocker.cancelled == count and rt.host_tasks == 0 and rt.open_sessions == 0

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_query_abort_from_another_thread_ends_it_aborted_tools(mode: Mode) -> None:
    async def main() -> None:
        blocker = Blocker()
        async with AsyncioRuntime.open(mode=mode) as rt:
            session, query = await blocked_query(rt, blocker)
            async with query:
                async for event in query:
                    if event.label == "assistant":  # the tool_use block: the tool starts now
                        await blocker.running.wait()
                        aborter = threading.Thread(target=query.abort)
                        aborter.start()
                        aborter.join()
            assert query.terminal is not None and query.terminal.reason == "aborted_tools"
            result = await query.wait()
            assert result.subtype == "error_during_execution" and blocker.cancelled == 1
            await assert_aborted_then_next(rt, session, query)

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_abort_threadsafe_from_another_thread_returns_the_acks_and_ends_the_query_aborted(mode: Mode) -> None:
    async def main() -> None:
        blocker = Blocker()
        async with AsyncioRuntime.open(mode=mode) as rt:
            session, query = await blocked_query(rt, blocker)
            async with query:
                async for event in query:
                    if event.label == "assistant":  # the tool_use block: the tool starts now
                        await blocker.running.wait()
                        acked = await asyncio.to_thread(lambda: session.abort_threadsafe("user").result(LIMIT_S))
                        assert acked >= 1
            assert query.terminal is not None and query.terminal.reason == "aborted_tools"
            assert blocker.cancelled == 1
            await assert_aborted_then_next(rt, session, query)
        with pytest.raises(RuntimeClosed):
            session.abort_threadsafe()

    run(main)


@pytest.mark.parametrize("detected", [True, False])
def test_an_asyncio_tool_runs_on_the_host_loop_and_an_abort_cancels_it(detected: bool) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ran_on: list[asyncio.AbstractEventLoop] = []
        cancelled = asyncio.Event()

        async def wait_forever(args: Any, ctx: ToolContext) -> str:
            ran_on.append(asyncio.get_running_loop())
            assert sniffio.current_async_library() == "asyncio"  # what anyio-based clients (httpx) ask
            await ctx.progress("waiting")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return "never"

        hosted = tool(name="block", runs_on=None if detected else "asyncio")(wait_forever)
        async with AsyncioRuntime.open() as rt:
            session = await rt.open_session(QueryOptions(provider=blocked_model(), tools=[hosted]))
            query = session.query("go")
            async for event in query:
                if event.label == "progress":
                    await session.abort("user")
            await cancelled.wait()
            assert query.terminal is not None and query.terminal.reason == "aborted_tools"
            assert ran_on == [loop] and rt.host_tasks == 0 and session.live_tasks() == 0

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_the_hosts_permission_prompt_and_hooks_run_on_its_asyncio_loop(mode: Mode) -> None:
    # A web host's `can_use_tool` waits for its user's answer on asyncio objects; its hooks, memory
    # prefetch and attachment sources are asyncio code too. Each runs on the host's loop, and a hook that
    # raises is still reported under its own name.
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ran: list[tuple[str, str, bool]] = []
        answer: asyncio.Queue[bool] = asyncio.Queue()

        def note(what: str) -> None:
            ran.append((what, sniffio.current_async_library(), asyncio.get_running_loop() is loop))

        async def ask_the_user(name: str, tool_input: dict[str, Any]) -> Allow | Deny:
            note("can_use_tool")
            return Allow() if await answer.get() else Deny(message="the user said no")

        async def audit(hook: PostToolUseInput) -> HookDecision | None:
            note("post_tool_use")
            return None

        async def pre(input_data: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
            note("pre_tool_use")
            return {}

        async def check(hook: StopHookInput) -> HookDecision | None:
            note("stop")
            return None

        async def broken_check(hook: StopHookInput) -> HookDecision | None:
            raise ValueError("no linter here")

        async def recall(messages: list[Any]) -> str | None:
            note("memory_prefetch")
            return None

        class Inbox:
            async def collect(self) -> list[dict[str, Any]]:
                note("attachments")
                return []

        async def echo(args: Any, ctx: ToolContext) -> str:
            return "echoed"

        async def user() -> None:
            await answer.put(True)  # the user approves from another asyncio task

        model = ScriptedModel([tools_reply(tool_use("t1", "echo")), text_reply("done")])
        options = QueryOptions(
            provider=model,
            tools=[tool(name="echo")(echo)],
            can_use_tool=ask_the_user,
            post_tool_use_hooks=[audit],
            hooks={"PreToolUse": [HookMatcher(hooks=[pre])]},
            stop_hooks=[check, broken_check],
            memory_prefetch=recall,
            attachment_sources=[Inbox()],
        )
        async with AsyncioRuntime.open(mode=mode) as rt, asyncio.TaskGroup() as users:
            users.create_task(user())
            session = await rt.open_session(options)
            query = session.query("go")
            async with query:
                events = [event async for event in query]
            result = await query.wait()
        assert result.subtype == "success" and result.result == "done"
        assert {what for what, _, _ in ran} == {
            "can_use_tool",
            "pre_tool_use",
            "post_tool_use",
            "stop",
            "memory_prefetch",
            "attachments",
        }
        assert all(library == "asyncio" and on_loop for _, library, on_loop in ran), ran
        errors = [e for e in events if isinstance(e, SystemMessage) and e.subtype == "hook_error"]
        assert [e.data["hook_name"] for e in errors] == [broken_check.__qualname__]

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_a_subagent_stop_hook_runs_on_the_hosts_asyncio_loop(mode: Mode) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ran: list[tuple[str | None, str, bool]] = []

        async def subagent_stop(hook: StopHookInput) -> HookDecision | None:
            ran.append((hook.agent_type, sniffio.current_async_library(), asyncio.get_running_loop() is loop))
            return None

        provider = ByPrompt(
            {
                "Review": [tools_reply(agent_call("c1", "reviewer", "file a")), text_reply("done")],
                "file a": [text_reply("a: fine")],
            }
        )
        reviewer = AgentDefinition(description="Reviews one file", prompt="You review code.")
        options = QueryOptions(provider=provider, agents={"reviewer": reviewer}, subagent_stop_hooks=[subagent_stop])
        async with AsyncioRuntime.open(mode=mode) as rt:
            session = await rt.open_session(options)
            query = session.query("Review")
            async with query:
                async for _ in query:
                    pass
            result = await query.wait()
        assert result.subtype == "success" and result.result == "done"
        assert ran == [("reviewer", "asyncio", True)]

    run(main)


@pytest.mark.parametrize("mode", MODES)
def test_an_abort_cancels_a_permission_prompt_waiting_on_the_host_loop(mode: Mode) -> None:
    async def main() -> None:
        asked, cancelled = asyncio.Event(), asyncio.Event()
        ran: list[str] = []
        prompts: list[asyncio.Task[Any]] = []

        async def ask_the_user(name: str, tool_input: dict[str, Any]) -> Allow | Deny:
            prompts.append(asyncio.current_task())  # type: ignore[arg-type]
            asked.set()
            try:
                await asyncio.Event().wait()  # the user never answers
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return Allow()

        async def block(args: Any, ctx: ToolContext) -> str:
            ran.append("block")
            return "ran"

        options = QueryOptions(provider=blocked_model(), tools=[tool(name="block")(block)], can_use_tool=ask_the_user)
        async with AsyncioRuntime.open(mode=mode) as rt:
            session = await rt.open_session(options)
            query = session.query("go")
            async with query:
                await asked.wait()
                await session.abort("user")
                async for _ in query:
                    pass
            await asyncio.wait(prompts)  # its end, after the runtime's own done callback
            assert cancelled.is_set() and prompts[0].cancelled()
            assert query.terminal is not None and query.terminal.reason == "aborted_tools"
            assert ran == [] and rt.host_tasks == 0 and session.live_tasks() == 0

    run(main)


def test_a_trio_tool_stays_on_trio_under_the_asyncio_runtime() -> None:
    @tool(runs_on="trio")
    async def nap(args: Any, ctx: ToolContext) -> str:
        await trio.lowlevel.checkpoint()
        return "napped"

    async def main() -> str:
        async with AsyncioRuntime.open() as rt:
            model = ScriptedModel([tools_reply(tool_use("t1", "nap")), text_reply("rested")])
            session = await rt.open_session(QueryOptions(provider=model, tools=[nap]))
            return (await session.query("go").wait()).result

    assert run(main) == "rested"


def test_an_asyncio_tool_under_the_trio_runtime_is_an_error_result() -> None:
    @tool(runs_on="asyncio")
    async def hosted(args: Any, ctx: ToolContext) -> str:
        return "unreachable"

    async def main() -> list[Any]:
        async with Runtime.open() as runtime:
            model = ScriptedModel([tools_reply(tool_use("t1", "hosted")), text_reply("ok")])
            session = await runtime.open_session(QueryOptions(provider=model, tools=[hosted]))
            return [event async for event in session.query("go") if event.label == "user"]

    (answer,) = trio.run(main)
    assert "needs a queryloop.aio.AsyncioRuntime" in answer.content[0]["content"]


def test_a_callback_that_raises_never_ends_the_trio_run() -> None:
    async def main() -> str:
        async with AsyncioRuntime.open() as rt:
            rt._bridge.to_trio(lambda: 1 / 0)
            rt._bridge.to_trio(lambda: (_ for _ in ()).throw(KeyboardInterrupt))
            session = await rt.open_session(QueryOptions(provider=ScriptedModel([text_reply("alive")])))
            return (await session.query("still there?").wait()).result

    assert run(main) == "alive"


@pytest.mark.parametrize("mode", MODES)
def test_calls_into_a_closed_runtime_raise_runtime_closed(mode: Mode) -> None:
    async def main() -> None:
        rt = await AsyncioRuntime.start(mode=mode)
        session = await rt.open_session(QueryOptions(provider=ScriptedModel([text_reply("one")])))
        await rt.aclose()
        await rt.aclose()  # idempotent
        assert rt.closed
        with pytest.raises(RuntimeClosed):
            await rt.open_session(QueryOptions(provider=ScriptedModel([])))
        with pytest.raises(RuntimeClosed):
            session.query("late")
        with pytest.raises(RuntimeClosed):
            await session.close()
        assert issubclass(RuntimeClosed, QueryloopError)

    run(main)


def test_a_runtime_spans_separate_runs_of_one_loop_as_notebook_cells_do() -> None:
    loop = asyncio.new_event_loop()
    try:
        before = signal.getsignal(signal.SIGINT)
        rt = loop.run_until_complete(AsyncioRuntime.start())
        assert signal.getsignal(signal.SIGINT) is before  # the host's Ctrl+C handling is left alone
        model = ScriptedModel([text_reply("first"), text_reply("second")])
        session = loop.run_until_complete(rt.open_session(QueryOptions(provider=model)))
        first = loop.run_until_complete(session.query("one").wait())
        second = loop.run_until_complete(session.query("two").wait())
        assert (first.result, second.result) == ("first", "second")
        loop.run_until_complete(rt.aclose())
        assert not trio.lowlevel.in_trio_run()
    finally:
        loop.close()


def test_a_second_guest_on_one_loop_is_refused_and_a_thread_runtime_works_there() -> None:
    async def main() -> str:
        async with AsyncioRuntime.open():
            with pytest.raises(QueryloopError, match="mode='thread'"):
                await AsyncioRuntime.start()
            async with AsyncioRuntime.open(mode="thread") as second:
                session = await second.open_session(QueryOptions(provider=ScriptedModel([text_reply("beside")])))
                return (await session.query("hi").wait()).result

    assert run(main) == "beside"


def test_ctrl_c_under_asyncio_run_aborts_the_running_query() -> None:
    ended: list[Any] = []

    async def main() -> None:
        blocker = Blocker()
        async with AsyncioRuntime.open() as rt:
            session, query = await blocked_query(rt, blocker)
            try:
                async with query:
                    async for event in query:
                        if event.label == "assistant":
                            await blocker.running.wait()
                            signal.raise_signal(signal.SIGINT)  # asyncio.run cancels this task
            finally:
                ended.append((query.terminal, session.live_tasks(), blocker.cancelled))

    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    ((terminal, live, cancelled),) = ended
    assert terminal is not None and terminal.reason == "aborted_tools" and live == 0 and cancelled == 1


def test_a_cancelled_aclose_leaves_the_end_to_the_next_wait_as_a_shielded_cleanup_needs() -> None:
    async def main() -> None:
        blocker = Blocker()
        async with AsyncioRuntime.open() as rt:
            session, query = await blocked_query(rt, blocker)
            consumer = asyncio.create_task(labels_of(query))
            await blocker.running.wait()
            consumer.cancel()  # the abort is handed over in the cancelled wait
            first_cleanup = asyncio.create_task(query.aclose())
            await asyncio.sleep(0)
            first_cleanup.cancel()  # Starlette cancels every await of a cancelled response again
            await asyncio.gather(consumer, first_cleanup, return_exceptions=True)
            await assert_aborted_then_next(rt, session, query)

    run(main)
