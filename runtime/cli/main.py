"""The `queryloop` command: `run PROMPT` (the live view), `demo`, `scenario FILE`, `bench ...`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.text import Text

from queryloop.runtime.cli.demo import demo_model, demo_tools
from queryloop.runtime.cli.scenario import ScenarioError, run_scenario_file
from queryloop.runtime.host.runtime import Runtime
from queryloop.runtime.loop.events import (
    AssistantMessage,
    ProgressEvent,
    QueryEvent,
    ResultMessage,
    StreamEvent,
    SystemMessage,
    ToolUseSummaryEvent,
    UserMessage,
)
from queryloop.runtime.loop.options import QueryOptions

DEMO_PROMPT = "Tell me about this project"


@dataclass
class _ToolRow:
    name: str
    arguments: str
    progress: str = ""
    result: str | None = None
    is_error: bool = False


@dataclass
class LiveView:
    """What the terminal shows of one query, rebuilt from its events."""

    lines: list[Text | _ToolRow] = field(default_factory=list)
    streaming: str = ""
    tools: dict[str, _ToolRow] = field(default_factory=dict)
    footer: Text | None = None

    def apply(self, event: QueryEvent) -> None:
        if isinstance(event, StreamEvent):
            delta = event.event.get("delta") or {}
            if delta.get("type") == "text_delta":
                self.streaming += delta.get("text", "")
        elif isinstance(event, AssistantMessage):
            self._assistant(event)
        elif isinstance(event, UserMessage) and isinstance(event.content, list):
            for block in event.content:
                row = self.tools.get(block.get("tool_use_id", ""))
                if block.get("type") == "tool_result" and row is not None:
                    row.result = str(block.get("content", "")).splitlines()[0][:100] if block.get("content") else ""
                    row.is_error = bool(block.get("is_error"))
        elif isinstance(event, ProgressEvent) and event.tool_use_id in self.tools:
            self.tools[event.tool_use_id].progress = str(event.data)
        elif isinstance(event, ToolUseSummaryEvent):
            self.lines.append(Text(f"  ↳ {event.summary}", style="dim"))
        elif isinstance(event, SystemMessage):
            self.lines.append(Text(f"  [{event.subtype}] {event.content}", style="yellow"))
        elif isinstance(event, ResultMessage):
            style = "red" if event.is_error else "green"
            self.footer = Text(
                f"{event.subtype}: {event.num_turns} turns, {event.usage.input_tokens} in / "
                f"{event.usage.output_tokens} out tokens, ${event.total_cost_usd:.4f}",
                style=style,
            )

    def _assistant(self, message: AssistantMessage) -> None:
        block = message.content[0]
        if block.get("type") == "text":
            self.streaming = ""
            if message.is_api_error:
                self.lines.append(Text(block.get("text", ""), style="red"))
            else:
                self.lines.append(Text(block.get("text", ""), style="bold"))
        elif block.get("type") == "tool_use":
            row = _ToolRow(block["name"], json.dumps(block.get("input", {}))[:80])
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
        if self.streaming:
            parts.append(Text(self.streaming))
        if self.footer is not None:
            parts.append(self.footer)
        return Group(*parts)


def _options(args: Any, console: Console) -> QueryOptions | None:
    root = Path.cwd()
    if args.model is None:
        return QueryOptions(provider=demo_model(), tools=demo_tools(root, args.demo_tool_delay))
    key = os.environ.get("ANTHROPIC_API_KEY")
    if not key:
        console.print(
            "[red]--model needs ANTHROPIC_API_KEY in the environment.[/red] "
            "Set it, or leave out --model to run the offline demo."
        )
        return None
    from queryloop.runtime.providers.anthropic_model import AnthropicModel

    return QueryOptions(provider=AnthropicModel(api_key=key), model=args.model, tools=demo_tools(root))


async def _run(args: Any) -> int:
    console = Console()
    options = _options(args, console)
    if options is None:
        return 2
    view = LiveView()
    async with Runtime.open() as runtime:
        session = await runtime.open_session(options)
        handle = session.query(args.prompt)
        async with trio.open_nursery() as nursery:

            async def on_ctrl_c() -> None:
                # First Ctrl+C aborts the query (its end is still shown); a second one exits.
                with trio.open_signal_receiver(signal.SIGINT) as signals:
                    async for _ in signals:
                        if handle.done or handle._control.abort_reason is not None:  # noqa: SLF001
                            raise KeyboardInterrupt
                        view.lines.append(Text("^C: aborting (press again to exit)", style="yellow"))
                        await session.abort("user")

            nursery.start_soon(on_ctrl_c)
            with Live(view.render(), console=console, refresh_per_second=12, transient=False) as live:
                async for event in handle:
                    view.apply(event)
                    live.update(view.render())
                reason = handle.terminal.reason if handle.terminal else "unknown"
                transitions = ", ".join(handle.transitions) or "-"
                view.lines.append(Text(f"terminal: {reason}; transitions: {transitions}"))
                live.update(view.render())
            nursery.cancel_scope.cancel()
        await session.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="queryloop", description="Claude-Code-style agent loops as actors")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run one query with a live view (offline demo unless --model)")
    run.add_argument("prompt", nargs="?", default=DEMO_PROMPT)
    run.add_argument("--model", help="a Claude model id: uses the Anthropic API (needs ANTHROPIC_API_KEY)")
    run.add_argument("--demo-tool-delay", type=float, default=0.0, help="seconds each demo tool takes")
    demo = commands.add_parser("demo", help="the offline demo with its live view (no API key needed)")
    demo.add_argument("--demo-tool-delay", type=float, default=0.3, help="seconds each demo tool takes")
    scenario = commands.add_parser("scenario", help="run a scenario file and print its JSON verdict")
    scenario.add_argument("file")
    commands.add_parser("bench", help="benchmarks: queryloop bench kernel|loops|abort|scale ...", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return _bench(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("run", "demo"):
        if args.command == "demo":
            args.prompt, args.model = DEMO_PROMPT, None
        try:
            return trio.run(_run, args)
        except KeyboardInterrupt:
            return 130
    try:
        verdict = run_scenario_file(Path(args.file))
    except (ScenarioError, OSError) as error:
        print(f"queryloop scenario: {error}", file=sys.stderr)
        return 2
    print(json.dumps(verdict))
    return 0


def _bench(argv: list[str]) -> int:
    """`python -m bench`: the benchmarks live in the checkout's `bench/`, beside `runtime/` (not installed)."""
    checkout = Path(__file__).resolve().parents[2]  # runtime/cli/main.py -> the checkout
    if not (checkout / "bench" / "__main__.py").is_file():
        print("queryloop bench: the benchmarks ship with the source checkout (bench/)", file=sys.stderr)
        return 2
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from bench.__main__ import main as bench_main

    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
