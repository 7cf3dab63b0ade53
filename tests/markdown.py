"""The fenced code blocks of the project's Markdown pages, for the tests that run them.

A ```python block is run as a program unless the line right above its fence is a
`<!-- readme-test: not run (REASON) -->` comment (then it is only compiled). A ```text block
that comes next, with nothing but prose between, is what the program prints, exactly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

NOT_RUN = re.compile(r"<!--\s*readme-test:\s*not run\b.*?-->")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    heading: str
    """The title of the section the block is in."""
    runs: bool = True
    """False for a block marked `readme-test: not run`."""
    output: str | None = None
    """The text block that follows a python block: what it prints."""

    @property
    def name(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-") or "top"
        return f"{self.page.name}:{self.line}:{slug}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, in order, python blocks with their expected output."""
    text = page.read_text(encoding="utf-8")
    found: list[Block] = []
    last_end = 0
    for match in FENCE.finditer(text):
        before = text[last_end : match.start()]
        headings = re.findall(r"^#{1,6}\s+(.+)$", text[: match.start()], re.MULTILINE)
        preceding = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        lang, code = match["lang"], match["body"]
        if lang == "text" and found and found[-1].lang == "python" and _only_prose(before):
            found[-1] = replace(found[-1], output=code)
        found.append(
            Block(
                page=page,
                line=text.count("\n", 0, match.start()) + 1,
                lang=lang,
                code=code,
                heading=headings[-1] if headings else "",
                runs=not NOT_RUN.search(preceding),
            )
        )
        last_end = match.end()
    return found


def _only_prose(between: str) -> bool:
    """No heading and no other block between a program and its output: at most one paragraph."""
    return not re.search(r"^#", between, re.MULTILINE) and between.strip().count("\n\n") == 0


def python_blocks(page: Path = README) -> list[Block]:
    return [block for block in blocks(page) if block.lang == "python"]


def quick_start() -> Block:
    """The README's first python block."""
    return python_blocks(README)[0]
