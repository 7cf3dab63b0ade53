"""The offline demo: a scripted model driving real, safe tools confined to a root directory.

The demo brings its own files: `demo_folder()` makes a temporary folder holding `DEMO_FILES`, and
the demo's tools are confined to it, so the demo behaves the same from whatever directory it is
run. Its model is scripted, but its last answer is built from what the tools actually returned:
it reports a failed tool as a failure, never as done. Its first turn also hands `stand.py` to a
subagent (`DEMO_AGENTS`, the `checker`), which reads it with its own tool and reports back: the live
view nests the checker's steps under its `Agent` call.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path
from typing import Any

import trio
from pydantic import BaseModel, Field

from queryloop.runtime.cli import confined
from queryloop.runtime.loop.agents import AGENT_TOOL_NAME, AgentDefinition
from queryloop.runtime.loop.model import ModelRequest
from queryloop.runtime.loop.tools import Tool, ToolContext, tool
from queryloop.runtime.providers.scripted import ScriptedModel, ScriptedReply

DEMO_FILES: dict[str, str] = {
    "README.md": (
        "# lemonade-stand\n"
        "\n"
        "A tiny project for the queryloop demo: the demo's tools list, read and count it.\n"
        "\n"
        "- `stand.py` sells lemonade\n"
        "- `TODO.txt` says what is left\n"
    ),
    "stand.py": (
        "PRICE_CENTS = 150\n"
        "\n"
        "\n"
        "def sell(cups: int) -> int:\n"
        '    """The price of `cups` cups, in cents."""\n'
        "    return cups * PRICE_CENTS\n"
    ),
    "TODO.txt": "- more ice\n- a sign\n",
}
"""The files of the demo's folder, by name."""


class PathArgs(BaseModel):
    path: str = Field(default=".", description="A path relative to the working directory")


READ_CHARS = 2000
"""What `read_file` shows of a file: its first characters, this many (and it reads no more than they need)."""
LIST_ENTRIES = 1000
"""What `list_files` shows of a directory: this many entries at most."""
COUNT_BYTES = 1 << 30
"""What `count_lines` reads of a file at most: a larger one is counted in its first GiB (and says so)."""


def write_demo_files(folder: Path) -> None:
    """Write `DEMO_FILES` into `folder`."""
    for name, text in DEMO_FILES.items():
        (folder / name).write_text(text)


@contextmanager
def demo_folder() -> Iterator[Path]:
    """A temporary folder holding the demo's files, removed on leaving."""
    with tempfile.TemporaryDirectory(prefix="queryloop-demo-") as name:
        folder = Path(name)
        write_demo_files(folder)
        yield folder


def demo_tools(root: Path, delay_s: float = 0.0, *, use_openat2: bool = True) -> list[Tool]:
    """`list_files`, `read_file` and `count_lines`, confined to `root` (see `queryloop.runtime.cli.confined`).

    Each opens what its path names beneath `root` once, after its pacing, and works on that descriptor
    only: no symlink is followed, a FIFO, a device or a file with several hard links is refused, a
    read never goes beyond what the result shows, and an abort abandons the work at once. Errors name
    the path as the model gave it, never `root`.

    `delay_s` makes each tool take that long (with progress), to watch them run and to try Ctrl+C.
    `use_openat2=False` walks paths component by component even where the kernel has `openat2`.
    """

    async def pace(ctx: ToolContext, what: str) -> None:
        steps = 4
        for step in range(steps):
            await ctx.progress(f"{what} {100 * step // steps}%")
            await trio.sleep(delay_s / steps)

    @tool(concurrency_safe=True, description="List the entries of a directory")
    async def list_files(args: PathArgs, ctx: ToolContext) -> str:
        confined.components(args.path)  # what is plainly outside is refused before the pacing; the open checks
        await pace(ctx, f"listing {args.path}")
        return await _in_thread(functools.partial(listing, root, args.path, use_openat2=use_openat2))

    @tool(concurrency_safe=True, description=f"Read a text file (first {READ_CHARS:,} characters)")
    async def read_file(args: PathArgs, ctx: ToolContext) -> str:
        confined.components(args.path)
        await pace(ctx, f"reading {args.path}")
        return await _in_thread(functools.partial(head, root, args.path, use_openat2=use_openat2))

    @tool(concurrency_safe=False, description="Count the lines of a text file")
    async def count_lines(args: PathArgs, ctx: ToolContext) -> str:
        confined.components(args.path)
        await pace(ctx, f"counting {args.path}")
        return await _in_thread(functools.partial(line_count, root, args.path, use_openat2=use_openat2))

    return [list_files, read_file, count_lines]


async def _in_thread(work: Callable[[], str]) -> str:
    """`work`'s result, from a worker thread that an abort or a timeout abandons at once.

    The thread then ends on its own (closing what it opened): its reads are bounded, and a long count
    stops at its next checkpoint. Nothing it does can hold `session.close()`.
    """
    return await trio.to_thread.run_sync(work, abandon_on_cancel=True)


def listing(root: Path, path: str, *, use_openat2: bool = True) -> str:
    """`list_files`'s result: the names of the directory, one a line (at most `LIST_ENTRIES`). Blocks."""
    with confined.opened(root, path, directory=True, use_openat2=use_openat2) as fd:
        names, more = confined.list_names(fd, LIST_ENTRIES)
    # A name holding a newline would pass for two entries, one with a stray byte could not be sent: repr them.
    shown = [name if name.isprintable() else repr(name) for name in names]
    if more:
        shown.append(f"(only {LIST_ENTRIES} of its entries are listed)")
    return "\n".join(shown)


def head(root: Path, path: str, *, use_openat2: bool = True) -> str:
    """`read_file`'s result: the file's first `READ_CHARS` characters, read and no more. Blocks."""
    with confined.opened(root, path, use_openat2=use_openat2) as fd:
        return confined.read_head(fd, READ_CHARS)


def line_count(root: Path, path: str, *, use_openat2: bool = True) -> str:
    """`count_lines`'s result: the file's newlines, counted in its first `COUNT_BYTES` at most. Blocks.

    Run by `_in_thread`: an abandoned count stops at its next chunk (`check_cancelled`).
    """
    with confined.opened(root, path, use_openat2=use_openat2) as fd:
        count, whole = confined.count_newlines(fd, COUNT_BYTES, trio.from_thread.check_cancelled)
    return str(count) if whole else f"at least {count} (counted in its first {COUNT_BYTES:,} bytes only)"


LOOK_AROUND = ScriptedReply(
    content=[
        {"type": "text", "text": "I'll look at the project first."},
        {"type": "tool_use", "id": "toolu_list", "name": "list_files", "input": {"path": "."}},
        {"type": "tool_use", "id": "toolu_read", "name": "read_file", "input": {"path": "README.md"}},
        {
            "type": "tool_use",
            "id": "toolu_agent",
            "name": AGENT_TOOL_NAME,
            "input": {
                "description": "Check stand.py",
                "prompt": "Read stand.py and say what sell() charges.",
                "subagent_type": "checker",
            },
        },
    ],
    stop_reason="tool_use",
    latency_ms=300,
)
CHECKER_PROMPT = "You check one Python file and report what it does, in one sentence."
DEMO_AGENTS = {
    "checker": AgentDefinition(
        description="Reads one file and reports what it does", prompt=CHECKER_PROMPT, tools=["read_file"]
    )
}
"""The demo's subagent: the first turn asks it about `stand.py`."""
CHECKER_READ = ScriptedReply(
    content=[
        {"type": "text", "text": "Reading stand.py."},
        {"type": "tool_use", "id": "toolu_check_read", "name": "read_file", "input": {"path": "stand.py"}},
    ],
    stop_reason="tool_use",
    latency_ms=300,
)
COUNT = ScriptedReply(
    content=[
        {"type": "text", "text": "Now the size of the README."},
        {"type": "tool_use", "id": "toolu_count", "name": "count_lines", "input": {"path": "README.md"}},
    ],
    stop_reason="tool_use",
    latency_ms=300,
)


class DemoModel:
    """Three calls: look around (two parallel reads), count, answer from what the tools returned.

    Which call a request is follows from its conversation (how many assistant turns it holds),
    so the script does not depend on how many requests came before.
    """

    def __init__(self) -> None:
        self.requests: list[ModelRequest] = []

    def __repr__(self) -> str:
        return f"<DemoModel: {len(self.requests)} requests>"

    async def stream(self, request: ModelRequest) -> AsyncGenerator[dict[str, Any], None]:
        self.requests.append(request)
        turns = sum(1 for message in request.messages if message.get("role") == "assistant")
        if any(block.get("text") == CHECKER_PROMPT for block in request.system):  # the subagent's request
            reply = CHECKER_READ if turns == 0 else checked(request.messages)
        else:
            reply = LOOK_AROUND if turns == 0 else COUNT if turns == 1 else answer(request.messages)
        async with aclosing(ScriptedModel([reply], name=f"demo{len(self.requests)}").stream(request)) as events:
            async for event in events:
                yield event


def checked(messages: list[dict[str, Any]]) -> ScriptedReply:
    """The checker's answer, from what its read returned."""
    text, is_error = tool_results(messages).get("toolu_check_read", ("no result", True))
    price = next((line.split("=")[1].strip() for line in text.splitlines() if "PRICE_CENTS =" in line), None)
    if is_error or price is None:
        said = f"I could not read stand.py: {text}"
    else:
        said = f"stand.py: sell(cups) charges {price} cents a cup."
    return ScriptedReply(content=[{"type": "text", "text": said}], latency_ms=300)


def tool_results(messages: list[dict[str, Any]]) -> dict[str, tuple[str, bool]]:
    """Every tool result of the conversation: its text and whether it is an error, by tool_use id."""
    results: dict[str, tuple[str, bool]] = {}
    for message in messages:
        content = message.get("content")
        if message.get("role") != "user" or not isinstance(content, list):
            continue
        for block in content:
            if block.get("type") == "tool_result":
                body = block.get("content", "")
                text = body if isinstance(body, str) else " ".join(str(b.get("text", "")) for b in body)
                results[block.get("tool_use_id", "")] = (text, bool(block.get("is_error")))
    return results


def answer(messages: list[dict[str, Any]]) -> ScriptedReply:
    """The demo's last word: what the tools (and the checker) found, or which of them failed."""
    results = tool_results(messages)
    names = {
        "toolu_list": "list_files",
        "toolu_read": "read_file",
        "toolu_agent": "the checker",
        "toolu_count": "count_lines",
    }
    failed = [
        f"{name}: {results[key][0] if key in results else 'no result'}"
        for key, name in names.items()
        if key not in results or results[key][1]
    ]
    if failed:
        text = f"The demo's tools failed, so I cannot describe the project: {'; '.join(failed)}"
    else:
        entries = results["toolu_list"][0].splitlines()
        first_line = next(iter(results["toolu_read"][0].splitlines()), "")
        text = (
            f"Done: the project holds {len(entries)} entries ({', '.join(entries)}); "
            f"its README.md has {results['toolu_count'][0]} lines and starts with {first_line!r}. "
            f"The checker says: {results['toolu_agent'][0]}"
        )
    return ScriptedReply(content=[{"type": "text", "text": text}], latency_ms=300)


def demo_model() -> DemoModel:
    """The demo's model: see `DemoModel`."""
    return DemoModel()
