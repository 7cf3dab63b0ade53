"""The `queryloop` command: `demo`, `scenario FILE`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import trio

from runtime._runtime import Runtime
from runtime.demo import demo_model, demo_tools
from runtime.events import AssistantMessage, ProgressEvent, QueryEvent, ResultMessage, UserMessage
from runtime.options import QueryOptions
from runtime.scenario import ScenarioError, run_scenario_file


def describe(event: QueryEvent) -> str | None:
    """One line for an event worth showing in a plain log (raw stream events are skipped)."""
    if isinstance(event, AssistantMessage):
        block = event.content[0]
        if block.get("type") == "tool_use":
            return f"  tool call   {block['name']}({json.dumps(block.get('input', {}))})"
        return f"  assistant   {block.get('text', '')}"
    if isinstance(event, UserMessage) and isinstance(event.content, list):
        for block in event.content:
            if block.get("type") == "tool_result":
                first = str(block.get("content", "")).splitlines()[:1]
                flag = " (error)" if block.get("is_error") else ""
                return f"  result{flag}  {block['tool_use_id']}: {first[0] if first else ''}"
        return None
    if isinstance(event, ProgressEvent):
        return f"  progress    {event.tool_use_id}: {event.data}"
    if isinstance(event, ResultMessage):
        return (
            f"  result      {event.subtype}: {event.num_turns} turns, {event.usage.input_tokens} in / "
            f"{event.usage.output_tokens} out tokens, ${event.total_cost_usd:.4f}"
        )
    if event.type in ("stream_request_start", "system", "tombstone", "attachment", "tool_use_summary"):
        return f"  {event.label}"
    return None


async def _demo(root: Path) -> None:
    async with Runtime.open() as runtime:
        session = await runtime.open_session(QueryOptions(provider=demo_model(), tools=demo_tools(root)))
        handle = session.query("Tell me about this project")
        print("queryloop demo (offline, scripted model, real tools confined to the working directory)")
        async for event in handle:
            line = describe(event)
            if line is not None:
                print(line, flush=True)
        assert handle.terminal is not None
        print(f"terminal: {handle.terminal.reason}; transitions: {', '.join(handle.transitions) or '-'}")
        await session.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="queryloop", description="Claude-Code-style agent loops as actors")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run the offline demo (no API key needed)")
    scenario = commands.add_parser("scenario", help="run a scenario file and print its JSON verdict")
    scenario.add_argument("file")
    args: Any = parser.parse_args(argv)
    if args.command == "demo":
        trio.run(_demo, Path.cwd())
        return 0
    try:
        verdict = run_scenario_file(Path(args.file))
    except (ScenarioError, OSError) as error:
        print(f"queryloop scenario: {error}", file=sys.stderr)
        return 2
    print(json.dumps(verdict))
    return 0


if __name__ == "__main__":
    sys.exit(main())
