"""Elicitation: an MCP server asking the user for input in the middle of one of its tools' calls.

A server that needs a confirmation, a choice or a link followed sends `elicitation/create` (before the
2026-07-28 protocol, a request of its own during the call; from it on, an `input_required` answer to the
call, which the client answers by calling again). There is no user at a runtime's end, so the host
answers: `Runtime.open_mcp(name, server, on_elicitation=handler)` gives the server a handler that gets
each request as an `McpElicitation` and returns an `McpElicitationAnswer` (accept with the form's
content, decline or cancel), as Claude Code's Elicitation hook does. Without a handler the runtime
refuses every elicitation, and the server answers the call as it sees fit.

A handler never outlives the call that asked: when that call ends (answered, aborted, timed out) a
handler still waiting is cancelled and the server told `cancel`, whether or not the server itself
cancels its request (`queryloop.runtime.mcp.calls`).

Plain data, importable without the `mcp` SDK.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, model_validator


class McpElicitation(BaseModel):
    """One server's request for the user's input, as its handler gets it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    server: str
    """The name the server was opened under."""
    message: str
    """What the server asks, for a person to read."""
    mode: Literal["form", "url"] = "form"
    """`form`: answer with `content` matching `requested_schema`; `url`: have the user visit `url`, then accept."""
    requested_schema: dict[str, Any] | None = None
    """A form's JSON schema: an object of flat properties (strings, numbers, booleans, enums)."""
    url: str | None = None
    tool_use_id: str | None = None
    """The tool_use_id of the call that asked. On the 2026-07-28 protocol always (the question is that
    call's own answer); before it, the server's request names no call, so it is the one call of this
    server in flight when the request came, and None when there were several (or none). The handler is
    cancelled once the call that asked has ended (of several, once all of them have)."""


class McpElicitationAnswer(BaseModel):
    """The user's answer, as the handler gives it: `content` only with `accept`, in a form's shape."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    action: Literal["accept", "decline", "cancel"]
    content: dict[str, str | int | float | bool | list[str] | None] | None = None

    @model_validator(mode="after")
    def _content_only_with_accept(self) -> Self:
        if self.content is not None and self.action != "accept":
            msg = f"content is given with {self.action!r}: only 'accept' carries content"
            raise ValueError(msg)
        return self


ElicitationHandler = Callable[[McpElicitation], Awaitable[McpElicitationAnswer]]
"""A host's answerer of one server's elicitations (`Runtime.open_mcp(..., on_elicitation=)`)."""
