"""The `queryloop` command: `run PROMPT` (the live view), `demo`, `scenario FILE`, `bench ...`.

`run` and `demo` exit with a status that says how the query ended (`EXIT_STATUS`). The command owns
its process: it opens its runtime with the collector tuned (`Runtime.open(tune_gc=True)`), handles
SIGINT itself (a first Ctrl+C aborts the query, a second one exits), and may end the process at once
when a second Ctrl+C finds the shutdown stuck.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import trio
from pydantic import ValidationError
from rich.console import Console, Group
from rich.live import Live
from rich.padding import Padding
from rich.spinner import Spinner
from rich.text import Text

from queryloop import __version__
from queryloop.runtime.cli.demo import DEMO_AGENTS, demo_folder, demo_model, demo_tools
from queryloop.runtime.cli.printable import printable
from queryloop.runtime.cli.scenario import ScenarioError, run_scenario_file
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.host.session import QueryHandle, Session
from queryloop.runtime.loop.events import (
    AssistantMessage,
    Block,
    ProgressEvent,
    QueryEvent,
    ResultMessage,
    StreamEvent,
    SystemMessage,
    ToolUseSummaryEvent,
    UserMessage,
)
from queryloop.runtime.loop.options import QueryOptions
from queryloop.runtime.loop.pricing import PRICES, UnknownModelPrice, pricing_for
from queryloop.runtime.providers.anthropic_model import AnthropicModel

DEMO_PROMPT = "Tell me about this project"

EXIT_OK = 0
"""The query completed: its result is not an error."""
EXIT_ERROR = 1
"""The query ended in error: its result's `is_error` is true (an API error, a limit reached)."""
EXIT_USAGE = 2
"""The command was not run: a bad flag, an unknown model, a missing API key, a malformed scenario."""
EXIT_ABORTED = 130
"""Aborted by the user with Ctrl+C (128 + SIGINT, as a shell reports a process Ctrl+C ended)."""

EXIT_STATUS = f"""\
exit status of run and demo:
  {EXIT_OK:<4} the query completed
  {EXIT_ERROR:<4} the query ended in error (an API or connection error, --max-turns reached, ...)
  {EXIT_USAGE:<4} usage error: a bad flag, an unknown model, no ANTHROPIC_API_KEY
  {EXIT_ABORTED:<4} aborted with Ctrl+C: a first Ctrl+C aborts the query and shows its end,
       a second one exits at once
scenario exits {EXIT_OK} once it has printed its verdict, {EXIT_USAGE} for a malformed or missing scenario file.
"""

ABORTED_TERMINALS = frozenset({"aborted_streaming", "aborted_tools"})

FORCE_EXIT_AFTER_S = 2.0
"""After a second Ctrl+C, how long the shutdown may take before the process ends regardless."""

API_CLOSE_S = 1.0
"""How long closing the API client's connections may take once the query has ended."""


@dataclass
class _ToolRow:
    name: str
    arguments: str
    progress: str = ""
    result: str | None = None
    is_error: bool = False
    agent: LiveView | None = None
    """A subagent's own view, when this row is an `Agent` call: its events, nested under the row."""


@dataclass
class LiveView:
    """What the terminal shows of one query, rebuilt from its events.

    Every text it takes from an event goes through `printable` as it is taken (model text, tool
    names, input, results, progress, summaries, system messages, a subagent's too), and into a
    `Text`, never markup: nothing from outside reaches the terminal as a control sequence or as style.
    A subagent's events (`parent_tool_use_id` set) go to a view of their own, nested under the row
    of the `Agent` call that runs it (and a sub-subagent's under its parent's row, and so on)."""

    lines: list[Text | _ToolRow] = field(default_factory=list)
    streaming: str = ""
    tools: dict[str, _ToolRow] = field(default_factory=dict)
    """Every tool row of this view and of the nested ones, by tool_use id (shared with them)."""
    footer: Text | None = None

    def apply(self, event: QueryEvent) -> None:
        parent = getattr(event, "parent_tool_use_id", None)
        if parent is None:
            self._apply(event)
            return
        row = self.tools.get(parent)
        if row is not None:
            if row.agent is None:
                row.agent = LiveView(tools=self.tools)
            row.agent._apply(event)  # noqa: SLF001 - the same class

    def _apply(self, event: QueryEvent) -> None:
        if isinstance(event, StreamEvent):
            delta = event.event.get("delta") or {}
            if delta.get("type") == "text_delta":
                self.streaming += printable(str(delta.get("text", "")))
        elif isinstance(event, AssistantMessage):
            self._assistant(event)
        elif isinstance(event, UserMessage) and isinstance(event.content, list):
            self._results(event.content)
        elif isinstance(event, ProgressEvent) and event.tool_use_id in self.tools:
            self.tools[event.tool_use_id].progress = printable(str(event.data), multiline=False)
        elif isinstance(event, ToolUseSummaryEvent):
            self.lines.append(Text(f"  ↳ {printable(event.summary)}", style="dim"))
        elif isinstance(event, SystemMessage):
            said = f"  [{printable(event.subtype, multiline=False)}] {printable(event.content)}"
            self.lines.append(Text(said, style="yellow"))
        elif isinstance(event, ResultMessage):
            self.footer = _footer(event)

    def _results(self, blocks: list[Block]) -> None:
        """Each tool_result on its tool's row: the first line of its content (100 characters at most)."""
        for block in blocks:
            row = self.tools.get(block.get("tool_use_id", ""))
            if block.get("type") == "tool_result" and row is not None:
                first = str(block.get("content", "")).splitlines()[0][:100] if block.get("content") else ""
                row.result = printable(first, multiline=False)
                row.is_error = bool(block.get("is_error"))

    def _assistant(self, message: AssistantMessage) -> None:
        block = message.content[0]
        if block.get("type") == "text":
            self.streaming = ""
            text = printable(str(block.get("text", "")))
            self.lines.append(Text(text, style="red" if message.is_api_error else "bold"))
        elif block.get("type") == "tool_use":
            arguments = json.dumps(block.get("input", {}))[:80]
            row = _ToolRow(printable(str(block["name"]), multiline=False), printable(arguments, multiline=False))
            self.tools[block["id"]] = row
            self.lines.append(row)

    def render(self) -> Group:
        parts: list[Any] = []
        for line in self.lines:
            if isinstance(line, Text):
                parts.append(line)
            elif line.result is None:
                label = f" {line.name}({line.arguments}) {line.progress}"
                parts.append(Spinner("dots", text=Text(label, style="cyan")))
            else:
                mark, style = ("✗", "red") if line.is_error else ("✓", "green")
                parts.append(Text(f"{mark} {line.name}({line.arguments}) → {line.result}", style=style))
            if isinstance(line, _ToolRow) and line.agent is not None:
                parts.append(Padding(line.agent.render(), (0, 0, 0, 4)))  # the subagent's steps, indented
        if self.streaming:
            parts.append(Text(self.streaming))
        if self.footer is not None:
            parts.append(self.footer)
        return Group(*parts)


def _footer(result: ResultMessage) -> Text:
    """How the query ended, its turns, tokens and cost: green, or red for an error."""
    # An API error ends a query `success` with `is_error` (as Claude Code reports it): an error.
    label = "error" if result.is_error and result.subtype == "success" else result.subtype
    return Text(
        f"{label}: {result.num_turns} turns, {result.usage.input_tokens} in / "
        f"{result.usage.output_tokens} out tokens, ${result.total_cost_usd:.4f}",
        style="red" if result.is_error else "green",
    )


class _UsageError(Exception):
    """The command cannot run as asked: one line for stderr, exit status 2."""


@dataclass
class _Plan:
    """What `run` and `demo` will do, decided before the runtime starts."""

    prompt: str
    options: QueryOptions
    notes: list[Text] = field(default_factory=list)
    """Lines the live view starts with."""


def _plan(args: argparse.Namespace, stack: ExitStack) -> _Plan:
    """The query to run; raises `_UsageError` for what makes it impossible. Resources go on `stack`."""
    common: dict[str, Any] = {"max_turns": args.max_turns, "system_prompt": args.system}
    if args.model is not None and not (args.prompt or "").strip():
        # A prompt made up on the user's behalf would be sent, and billed, as theirs.
        msg = "--model needs a prompt: queryloop run --model ID 'what to ask'"
        raise _UsageError(msg)
    prompt = args.prompt if args.prompt is not None else DEMO_PROMPT
    if args.model is None:
        folder = stack.enter_context(demo_folder())
        tools = demo_tools(folder, args.demo_tool_delay)
        # The demo's checker subagent reads with `read_file` (a test may swap the demo's tools out).
        agents = DEMO_AGENTS if "read_file" in {t.name for t in tools} else {}
        options = _validated(provider=demo_model(), tools=tools, agents=agents, **common)
        return _Plan(prompt, options, [Text(f"(the demo works on files of its own, in {folder})", style="dim")])
    try:
        pricing_for(args.model)
    except UnknownModelPrice:
        known = ", ".join(sorted(PRICES))
        msg = f"unknown model {args.model!r}: the models known (with their prices) are {known}"
        raise _UsageError(msg) from None
    key = os.environ.get("ANTHROPIC_API_KEY")
    if not key:
        msg = "--model needs ANTHROPIC_API_KEY in the environment: set it, or leave out --model to run the offline demo"
        raise _UsageError(msg)
    # The key goes to the client only: nothing here prints or logs it.
    provider = AnthropicModel(api_key=key, base_url=args.base_url)
    return _Plan(prompt, _validated(provider=provider, model=args.model, tools=demo_tools(Path.cwd()), **common))


def _validated(**fields: Any) -> QueryOptions:
    try:
        return QueryOptions(**fields)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in error.errors())
        raise _UsageError(problems) from None


def _offline_note(args: argparse.Namespace) -> str:
    """What `run` without `--model` does instead of answering the prompt, in one line."""
    ignored = " and ignores your prompt" if args.prompt is not None else ""
    return (
        f"queryloop: no --model given, so the built-in scripted model replays the demo{ignored}; "
        "to ask Claude, pass --model (e.g. --model claude-sonnet-5-5) with ANTHROPIC_API_KEY set"
    )


class _CtrlC:
    """What Ctrl+C does during `run` and `demo`: the first aborts the query (its end is still shown),
    the next one exits with status 130.

    Exiting cancels the work: the live view stops and the runtime closes. A shutdown that takes
    longer than `FORCE_EXIT_AFTER_S` (a tool stuck in a thread cannot be cancelled), or one more
    Ctrl+C, ends the process there and then: the command owns its process.
    """

    def __init__(self, console: Console, cleanup: Callable[[], None]) -> None:
        self.console = console
        self.cleanup = cleanup
        """What must not outlive the process (the demo's folder), done before a forced exit."""
        self.work = trio.CancelScope()
        self.session: Session | None = None
        self.handle: QueryHandle | None = None
        self.on_abort: Callable[[], None] = lambda: None
        self.exiting = False

    async def watch(self, signals: AsyncIterator[int]) -> None:
        async for _ in signals:
            session, handle = self.session, self.handle
            if session is None or handle is None or handle.done or handle.abort_reason is not None:
                break
            session.abort_nowait("user")  # not awaited: the next Ctrl+C must be heard at once
            self.on_abort()
        self.exiting = True
        self.work.cancel()
        with trio.move_on_after(FORCE_EXIT_AFTER_S):
            async for _ in signals:
                break
        self.force_exit()

    def force_exit(self) -> NoReturn:
        self.console.show_cursor(True)
        with contextlib.suppress(Exception):
            self.cleanup()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_ABORTED)


@contextmanager
def _display(console: Console, view: LiveView) -> Iterator[Callable[[], None]]:
    """The live view on a terminal; elsewhere (a pipe, a file) the view once, at the end.

    Yields the function that redraws the view. Either way the output ends with a newline.
    """
    if console.is_terminal:
        with Live(view.render(), console=console, refresh_per_second=12, transient=False) as live:
            yield lambda: live.update(view.render())
        return
    try:
        yield lambda: None
    finally:
        console.print(view.render())


def exit_status(handle: QueryHandle) -> int:
    """The command's exit status for a query that has ended (see `EXIT_STATUS`)."""
    if handle.terminal is not None and handle.terminal.reason in ABORTED_TERMINALS:
        return EXIT_ABORTED
    if handle.result is None or handle.result.is_error:
        return EXIT_ERROR
    return EXIT_OK


async def _query(plan: _Plan, console: Console, ctrl_c: _CtrlC) -> int:
    view = LiveView(lines=list(plan.notes))
    try:
        async with Runtime.open(tune_gc=True) as runtime:
            session = await runtime.open_session(plan.options)
            handle = session.query(plan.prompt)
            ctrl_c.session, ctrl_c.handle = session, handle
            with _display(console, view) as redraw:

                def aborting() -> None:
                    view.lines.append(Text("^C: aborting (press again to exit)", style="yellow"))
                    redraw()

                ctrl_c.on_abort = aborting
                async for event in handle:
                    view.apply(event)
                    redraw()
                reason = handle.terminal.reason if handle.terminal else "unknown"
                transitions = ", ".join(handle.transitions) or "-"
                view.lines.append(Text(f"terminal: {reason}; transitions: {transitions}"))
                redraw()
            await session.close()
    finally:
        provider = plan.options.provider
        if isinstance(provider, AnthropicModel):
            with trio.move_on_after(API_CLOSE_S, shield=True):
                await provider.aclose()
    status = exit_status(handle)
    if status == EXIT_ERROR:
        result, terminal = handle.result, handle.terminal
        why = (
            printable("; ".join(result.errors), multiline=False)
            if result is not None and result.errors
            else "see above"
        )
        print(
            f"queryloop: the query ended in error ({terminal.reason if terminal else 'unknown'}): {why}",
            file=sys.stderr,
        )
    return status


async def _run(plan: _Plan, cleanup: Callable[[], None]) -> int:
    console = Console()
    ctrl_c = _CtrlC(console, cleanup)
    status = EXIT_ABORTED
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ctrl_c.watch, signals)
            with ctrl_c.work:
                status = await _query(plan, console, ctrl_c)
            nursery.cancel_scope.cancel()
    return EXIT_ABORTED if ctrl_c.exiting else status


def _run_command(args: argparse.Namespace) -> int:
    """`run` and `demo`: plan the query, run it, and turn how it ended into the exit status."""
    if args.command == "run" and args.model is None:
        print(_offline_note(args), file=sys.stderr)
    with ExitStack() as stack:
        try:
            plan = _plan(args, stack)
        except _UsageError as error:
            print(f"queryloop: {error}", file=sys.stderr)
            return EXIT_USAGE
        try:
            return trio.run(_run, plan, stack.close)
        except KeyboardInterrupt:
            # Ctrl+C before the command listens for it, or after (trio raises it in the main task).
            return EXIT_ABORTED
        except BaseExceptionGroup as group:
            _, rest = group.split(KeyboardInterrupt)
            if rest is None:
                return EXIT_ABORTED
            raise


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        msg = f"not a whole number: {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if value < 1:
        msg = f"must be at least 1, not {value}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        msg = f"not a number of seconds: {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if not 0 <= value < float("inf"):
        msg = f"must be 0 or more seconds, not {text}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="queryloop",
        description="Claude-Code-style agent loops as actors",
        epilog=EXIT_STATUS,
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"queryloop {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run one query with a live view (the offline demo unless --model)",
        description="Run one query with a live view.\n\nWithout --model, the built-in scripted model replays "
        "the offline demo\n(the prompt is not used); with --model, the prompt goes to the Messages API.",
        epilog=EXIT_STATUS,
        formatter_class=formatter,
    )
    run.add_argument("prompt", nargs="?", help="what to ask (with --model)")
    run.add_argument("--model", help="a Claude model id: uses the Messages API (needs ANTHROPIC_API_KEY)")
    run.add_argument(
        "--base-url",
        default=os.environ.get("ANTHROPIC_BASE_URL"),
        help="the Messages API base URL (default: $ANTHROPIC_BASE_URL, else the SDK's, https://api.anthropic.com)",
    )
    run.add_argument("--system", help="the system prompt, instead of the default one")
    run.add_argument("--max-turns", type=_positive_int, help="end the query (in error) after this many turns")
    run.add_argument("--demo-tool-delay", type=_seconds, default=0.0, help="seconds each demo tool takes")
    demo = commands.add_parser(
        "demo",
        help="the offline demo with its live view (no API key needed)",
        epilog=EXIT_STATUS,
        formatter_class=formatter,
    )
    demo.add_argument("--demo-tool-delay", type=_seconds, default=0.3, help="seconds each demo tool takes")
    demo.set_defaults(prompt=None, model=None, base_url=None, system=None, max_turns=None)
    scenario = commands.add_parser("scenario", help="run a scenario file and print its JSON verdict")
    scenario.add_argument("file")
    if _checkout_with_bench() is not None:
        commands.add_parser(
            "bench", help="benchmarks: queryloop bench kernel|loops|abort|scale|stream ...", add_help=False
        )
    return parser


def _checkout_with_bench() -> Path | None:
    """The source checkout this command runs from, when it has the benchmarks (`bench/` is not installed)."""
    checkout = Path(__file__).resolve().parents[2]  # runtime/cli/main.py -> the checkout
    return checkout if (checkout / "bench" / "__main__.py").is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench" and (checkout := _checkout_with_bench()) is not None:
        return _bench(checkout, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("run", "demo"):
        return _run_command(args)
    try:
        verdict = run_scenario_file(Path(args.file))
    except (ScenarioError, OSError) as error:
        print(f"queryloop scenario: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(verdict))
    return EXIT_OK


def _bench(checkout: Path, argv: list[str]) -> int:
    """`python -m bench`: the benchmarks live in the checkout's `bench/`, beside `runtime/` (not installed)."""
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from bench.__main__ import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
