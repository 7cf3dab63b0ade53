"""`ResponseAssembler`: raw Messages API events in, completed content blocks out.

Pure and synchronous, so the wire's quirks are tested without an actor:
`input_json_delta` fragments (of any block that has an `input`: client and
server tool uses) are joined and parsed at `content_block_stop`
(`""` alone means `{}`); `ping` and unknown event or delta types change
nothing; a block still open when the stream stops (`max_tokens` inside a
`tool_use` sends no `content_block_stop`) is returned by `close_truncated()` so
its tool is answered with an error and never run; `stop_reason` stays None
until a `message_delta` says otherwise, so a stream cut before
`message_stop` is recognised as incomplete.

The server's bytes are checked, not trusted (a proxy may send anything): an event before
`message_start` (a lone `message_stop` is no success), and a usage count that is not a
non-negative integer, raise `ValueError` (a malformed stream, for the ModelCaller); a usage with
`iterations[]` (server-side compaction's passes) counts their sum, as it is billed; a second
`tool_use` with an id already seen in the response is dropped (`duplicate_tool_use_ids`), so it
never runs twice nor is sent back twice.

Linear in a reply's length: text, thinking and compaction deltas are collected as pieces and
joined once, when their block completes (appending to the block's string at every delta would
copy the whole text each time: quadratic in a 64k-token reply).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import Any

from queryloop.runtime._frozen import EMPTY_LIST, EMPTY_SET, empty_list, empty_set
from queryloop.runtime.loop.events import Block, Usage, usage_of
from queryloop.runtime.loop.json_text import loads
from queryloop.runtime.loop.model import ModelError, ModelProvider, ModelRequest, reported_usage

MALFORMED = (KeyError, TypeError, ValueError, AttributeError)
"""What `ResponseAssembler.feed` raises for an event it cannot read: a malformed stream, for its callers."""

STREAMED_FIELD: dict[str, str] = {"text_delta": "text", "thinking_delta": "thinking", "compaction_delta": "content"}
"""The deltas that extend a block's string, and which field they extend (a compaction's summary, the server's,
must be sent back intact: it is joined like a text)."""


@dataclass(slots=True)
class CompletedBlock:
    index: int
    block: Block
    input_error: str | None = None
    """Why a tool_use's input could not be used (invalid JSON, cut off); None when it is fine."""


@dataclass(slots=True)
class ResponseAssembler:
    message_id: str = ""
    model: str = ""
    stop_reason: str | None = None
    stop_details: dict[str, Any] | None = None
    """What the API says of the stop (a `refusal`'s `category` and `explanation`), as it sent it."""
    stopped: bool = False
    started: bool = False
    """A `message_start` came: any event but a `ping` before it makes the stream malformed."""
    duplicate_tool_use_ids: list[str] = field(default_factory=empty_list)
    """The ids of `tool_use` blocks dropped for repeating an id of an earlier block of the response (the
    shared empty list until the first: most responses have none)."""
    _tool_use_ids: set[Any] = field(default_factory=empty_set)
    _input_tokens: int = 0
    _output_tokens: int = 0
    _cache_creation_input_tokens: int = 0
    _cache_read_input_tokens: int = 0
    _cache_creation_1h_input_tokens: int = 0
    """The usage counts as the stream reports them: plain ints, a `Usage` is made only when `usage` is read."""
    _usage: Usage | None = field(default=None, compare=False)
    _open: dict[int, Block] = field(default_factory=dict)
    _json: dict[int, list[str]] = field(default_factory=dict)
    _pieces: dict[int, list[str]] = field(default_factory=dict)
    """Per open block, the pieces of the string its deltas extend (`STREAMED_FIELD`), joined at completion."""
    _piece_field: dict[int, str] = field(default_factory=dict)
    _last_index: int = -1
    """The block the last string delta extended, its delta type, field and pieces: the next delta of the
    same block and type (nearly every event of a reply) is one append, without the lookups of `_delta`."""
    _last_kind: str = ""
    _last_key: str = ""
    _last_pieces: list[str] = field(default_factory=list)

    def feed(self, event: dict[str, Any]) -> CompletedBlock | None:
        """Take one raw event; return the block it completed, if any."""
        kind = event.get("type")
        if kind == "content_block_delta":
            delta = event["delta"]
            index = event["index"]
            if index == self._last_index and delta.get("type") == self._last_kind:
                self._last_pieces.append(delta.get(self._last_key, ""))
                return None
            self._delta(index, delta)
            return None
        if kind == "content_block_stop":
            return self._complete(event["index"])
        if kind == "content_block_start":
            self._start_block(event)
        elif kind == "message_start":
            self._start_message(event)
        elif kind == "message_delta":
            self._message_delta(event)
        elif kind == "message_stop":
            self._stop_message()
        return None  # a ping or an unknown event changes nothing

    def _start_block(self, event: dict[str, Any]) -> None:
        if not self.started:
            self._before_start("content_block_start")
        index = event["index"]
        block = self._open[index] = dict(event["content_block"])
        if "input" in block:  # tool_use, server_tool_use, mcp_tool_use: input streams as JSON
            self._json[index] = []
        if "citations" in block:  # extended by citations_delta: the event's own list must stay as it came
            block["citations"] = list(block["citations"] or ())

    def _start_message(self, event: dict[str, Any]) -> None:
        self.started = True
        self._last_index = -1
        message = event["message"]
        self.message_id = message.get("id", "")
        self.model = message.get("model", "")
        self._input_tokens = self._output_tokens = 0
        self._cache_creation_input_tokens = self._cache_read_input_tokens = 0
        self._cache_creation_1h_input_tokens = 0
        self._count(message.get("usage") or {})

    def _message_delta(self, event: dict[str, Any]) -> None:
        if not self.started:
            self._before_start("message_delta")
        delta = event.get("delta") or {}
        self.stop_reason = delta.get("stop_reason", self.stop_reason)
        self.stop_details = delta.get("stop_details", self.stop_details)
        self._count(event.get("usage") or {})

    def _stop_message(self) -> None:
        if not self.started:
            self._before_start("message_stop")
        self.stopped = True

    @staticmethod
    def _before_start(kind: str) -> None:
        msg = f"{kind} before message_start"
        raise ValueError(msg)

    @property
    def usage(self) -> Usage:
        """The usage reported so far (one `Usage` per change of the counts, shared by the blocks read meanwhile)."""
        usage = self._usage
        if usage is None:
            usage = self._usage = usage_of(
                self._input_tokens,
                self._output_tokens,
                self._cache_creation_input_tokens,
                self._cache_read_input_tokens,
            )
            if one_hour := self._cache_creation_1h_input_tokens:
                usage = self._usage = replace(usage, cache_creation_1h_input_tokens=one_hour)
        return usage

    def _count(self, raw: dict[str, Any]) -> None:
        # As `usage_from`: a non-zero count replaces the one before it, a zero leaves it.
        inputs, outputs, writes, reads, one_hour = reported_usage(raw)
        self._input_tokens = inputs or self._input_tokens
        self._output_tokens = outputs or self._output_tokens
        self._cache_creation_input_tokens = writes or self._cache_creation_input_tokens
        self._cache_read_input_tokens = reads or self._cache_read_input_tokens
        self._cache_creation_1h_input_tokens = one_hour or self._cache_creation_1h_input_tokens
        self._usage = None

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        block = self._open.get(index)
        if block is None:
            return
        kind = delta.get("type")
        key = STREAMED_FIELD.get(kind or "")
        if key is not None:  # text, thinking, compaction: a piece of the block's one growing string
            pieces = self._pieces.get(index)
            if pieces is None:
                pieces = self._pieces[index] = [block.get(key) or ""]  # what the block's start carried first
                self._piece_field[index] = key
            pieces.append(delta.get(key, ""))
            self._last_index, self._last_kind, self._last_key, self._last_pieces = index, kind, key, pieces  # type: ignore[assignment]
        elif kind == "input_json_delta":
            self._json[index].append(delta.get("partial_json", ""))
        elif kind == "signature_delta":
            block["signature"] = delta.get("signature", "")
        elif kind == "citations_delta":
            citations = block.get("citations")
            if citations is None:
                citations = block["citations"] = []
            citations.append(delta.get("citation"))

    def _join(self, index: int, block: Block) -> Block:
        if index == self._last_index:
            self._last_index = -1
        pieces = self._pieces.pop(index, None)
        if pieces is not None:
            block[self._piece_field.pop(index)] = "".join(pieces)
        return block

    def _complete(self, index: int) -> CompletedBlock | None:
        block = self._open.pop(index, None)
        if block is None:
            return None
        self._join(index, block)
        if block.get("type") == "tool_use" and not self._first_use(block):
            self._json.pop(index, None)
            return None
        fragments = self._json.pop(index, None)
        if fragments is None:
            return CompletedBlock(index, block)
        raw = "".join(fragments)
        if not raw.strip():  # no fragment (or only ""): the input is what the start carried, else {}
            block["input"] = block.get("input") or {}
            return CompletedBlock(index, block)
        try:
            parsed = loads(raw)
        except json.JSONDecodeError as error:
            block["input"] = {}
            return CompletedBlock(index, block, f"InputValidationError: the input is not valid JSON ({error})")
        if not isinstance(parsed, dict):
            block["input"] = {}
            return CompletedBlock(index, block, "InputValidationError: the input is not a JSON object")
        block["input"] = parsed
        return CompletedBlock(index, block)

    def _first_use(self, block: Block) -> bool:
        """Whether a `tool_use` block is the first of the response with its id: a repeat is run once and answered
        once (the API refuses a repeated id), so it is dropped and noted in `duplicate_tool_use_ids`."""
        tool_use_id = block.get("id")
        if tool_use_id in self._tool_use_ids:
            if self.duplicate_tool_use_ids is EMPTY_LIST:
                self.duplicate_tool_use_ids = []
            self.duplicate_tool_use_ids.append(str(tool_use_id))
            return False
        if self._tool_use_ids is EMPTY_SET:
            self._tool_use_ids = set()
        self._tool_use_ids.add(tool_use_id)
        return True

    def close_truncated(self) -> list[CompletedBlock]:
        """Blocks left open at the end of the stream: cut off, never to be run."""
        cut = []
        for index in sorted(self._open):
            block = self._join(index, self._open.pop(index))
            if block.get("type") == "tool_use":
                block["input"] = {}
                self._json.pop(index, None)
                if not self._first_use(block):  # its id was completed by another block: answered there
                    continue
                reason = f"the tool input was cut off by {self.stop_reason or 'the end of the stream'}"
                cut.append(CompletedBlock(index, block, f"InputValidationError: {reason}; the tool did not run"))
        return cut


def usage_from(raw: dict[str, Any], previous: Usage) -> Usage:
    """The usage after a `message_start` / `message_delta` usage object, given the usage before it
    (`ValueError` for a count that is not a non-negative integer: see `reported_usage`)."""
    # message_delta usage is cumulative: a non-zero field replaces the previous value. A zero
    # leaves it, as Claude Code's updateUsage does (deltas report 0 for counts they omit).
    inputs, outputs, writes, reads, one_hour = reported_usage(raw)
    return Usage(
        input_tokens=inputs or previous.input_tokens,
        output_tokens=outputs or previous.output_tokens,
        cache_creation_input_tokens=writes or previous.cache_creation_input_tokens,
        cache_read_input_tokens=reads or previous.cache_read_input_tokens,
        cache_creation_1h_input_tokens=one_hour or previous.cache_creation_1h_input_tokens,
    )


async def complete_text(provider: ModelProvider, request: ModelRequest) -> tuple[str, Usage]:
    """The text of one whole response and its usage (the runtime's own small calls: summaries, compaction).

    Raises the provider's `ModelError`, or a `connection` one if the stream stopped before `message_stop`.
    """
    assembler = ResponseAssembler()
    texts: list[str] = []
    async with aclosing(provider.stream(request)) as stream:
        async for raw in stream:
            try:
                completed = assembler.feed(raw)
            except MALFORMED as error:
                msg = f"malformed {request.purpose} stream event: {type(error).__name__}: {error} in {raw!r:.200}"
                raise ModelError("api_error", msg) from error
            if completed is not None and completed.block.get("type") == "text":
                texts.append(completed.block.get("text", ""))
    if not assembler.stopped:
        raise ModelError("connection", f"the {request.purpose} stream ended before message_stop")
    return "".join(texts).strip(), assembler.usage


class SeenResponse:
    """What a call's stream said of its response, as it passed (telemetry's `chat` span reads it): its
    `message_start`, stop reason and usage."""

    def __init__(self) -> None:
        self.usage = Usage()
        self.stop_reason: str | None = None
        self.stopped = False
        self.response: dict[str, Any] = {}

    def see(self, raw: Any) -> None:
        """One stream event; a malformed one is let through (the ModelCaller raises its own error for it)."""
        kind = raw.get("type") if raw.__class__ is dict else None
        try:
            if kind == "message_start":
                self.response = raw["message"]
                self.usage = usage_from(self.response.get("usage") or {}, self.usage)
            elif kind == "message_delta":
                self.stop_reason = raw["delta"].get("stop_reason") or self.stop_reason
                self.usage = usage_from(raw.get("usage") or {}, self.usage)
            elif kind == "message_stop":
                self.stopped = True
        except (AttributeError, KeyError, TypeError, ValueError):
            pass
