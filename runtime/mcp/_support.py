"""The connection's small parts that need no connection: errors in one line, pagination, the client's name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import trio
from mcp_types import Implementation, PromptArgument

LIST_PAGES = 100
"""At most this many pages of `tools/list` (a server whose cursor never ends cannot hang `open`)."""


def failure(error: BaseException) -> Exception | None:
    """What failed besides cancellation (the SDK's task groups may mix the two), if anything."""
    if isinstance(error, BaseExceptionGroup):
        _, error = error.split(trio.Cancelled)  # type: ignore[assignment]
    return error if isinstance(error, Exception) else None


def describe(error: BaseException) -> str:
    """An error in one line: an exception group by its leaves (the SDK's task groups wrap what failed)."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(describe(inner) for inner in error.exceptions)
    if isinstance(error, trio.TooSlowError):
        return "timed out"
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _client_info() -> Implementation:
    try:
        return Implementation(name="queryloop", version=version("queryloop"))
    except PackageNotFoundError:
        return Implementation(name="queryloop", version="0+unknown")


CLIENT = _client_info()


def prompt_argument(argument: PromptArgument) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": argument.name, "required": bool(argument.required)}
    if argument.description:
        entry["description"] = argument.description
    return entry


async def every_page(list_page: Callable[..., Awaitable[Any]], field: str) -> list[Any]:
    """The items (`field` of each page) of a paginated list request, page after page up to `LIST_PAGES`."""
    items: list[Any] = []
    cursor: str | None = None
    for _ in range(LIST_PAGES):
        page = await list_page(cursor=cursor)
        items += getattr(page, field)
        cursor = page.next_cursor
        if cursor is None:
            break
    return items
