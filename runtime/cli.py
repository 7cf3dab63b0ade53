"""The `queryloop` command."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import trio
import trio.lowlevel

from runtime import Runtime, TrioActor


class _Greeter(TrioActor):
    async def greet(self, name: str) -> str:
        await trio.lowlevel.checkpoint()
        return f"hello, {name}"


async def _demo() -> None:
    async with Runtime.open() as runtime:
        sessions = [await runtime.start_group() for _ in range(3)]
        for session in sessions:
            actors = [session.spawn(_Greeter) for _ in range(6)]
            replies = [await actor.proxy().greet(session.session_id) for actor in actors]
            print(f"session {session.session_id}: 6 actors answered ({replies[0]!r})")
        acks = await sessions[0].abort("user")
        print(f"abort of session {sessions[0].session_id}: {len(acks)} acks")
        for session in sessions:
            await session.close()
        print(f"open sessions after close: {len(runtime.groups)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="queryloop", description="Claude-Code-style agent loops as actors")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="run the offline demo (no API key needed)")
    args: Any = parser.parse_args(argv)
    if args.command == "demo":
        trio.run(_demo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
