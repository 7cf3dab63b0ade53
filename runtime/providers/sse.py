"""`SSEReader`: a `text/event-stream` body's bytes, chunk by chunk, to its events, in time linear in its length.

What it guarantees:

- **The WHATWG rules** for lines and for the two fields the runtime reads: a line ends at CRLF, LF or CR
  (a CR that ends a chunk ends its line, and an LF that starts the next chunk is its CRLF's, not a blank
  line); a line that starts with `:` is a comment; `name: value` loses one space after the colon, and a
  line without a colon is a field with an empty value; the `data` lines of one event are joined by `\\n`;
  a blank line dispatches the event if it has a `data` line, and forgets its `event` name either way.
  `id`, `retry` and unknown fields are ignored (the runtime reads neither). Bytes are UTF-8, anything
  invalid replaced (U+FFFD). A byte-order mark is not stripped (the API sends none; httpx2's
  `EventSource` does not strip one either).
- **One extension:** `finish()` dispatches an event the body left without its blank line (a recording,
  a proxy), its last line ended or not; the caller decides whether it is whole (its data parses).
- **Linear time.** Each byte is scanned a bounded number of times, whatever chunks it comes in: a line
  split over many chunks is kept as the list of its pieces and joined once, when its end arrives (the
  reader this replaced joined and rescanned the whole pending line at each chunk: 4 s of the trio
  thread for one 4 MB line).
- **Bounded memory.** At most `max_event_bytes` of body between two dispatched events (the event's own
  lines, and whatever comments, blank lines or ignored fields came before it); past it the reader raises
  an `api_error` `ModelError` naming the cap, as soon as the chunk that crossed it is read. A line still
  open counts; an event dispatched whole from one chunk is checked too. Line ends count one byte each.

The events are `(name, data)` pairs: `name` the `event` field's value (None when it had none, or an empty
one: the spec's "message"), `data` the joined `data` lines.
"""

from __future__ import annotations

from queryloop.runtime.loop.model import ModelError

__all__ = ["MAX_EVENT_BYTES", "SSEReader", "WireDefenceError", "event_too_large"]

MAX_EVENT_BYTES = 16 * 1024 * 1024
"""The cap on one server-sent event (with whatever precedes it since the last event). The API's events are
deltas of a few hundred bytes; the largest legitimate ones (a server tool's result, a compaction block, a
whole message echoed in `message_start`) stay well under a megabyte, and a request is itself capped at
32 MB (api-facts §2). 16 MiB leaves a wide margin and bounds what a hostile or broken server can make a
session hold: three attempts of a call, one event each."""

_COLON = 0x3A  # b":"[0]


class WireDefenceError(ModelError):
    """A `ModelError` of a wire defence (the watchdog, this cap, an unreadable `Content-Encoding`): the response
    was refused, not merely cut. Classified as any `ModelError` (its `kind`); the provider logs it and reads no
    further."""


def event_too_large(cap: int) -> WireDefenceError:
    """The error of a body that sent more than `cap` bytes without completing an event."""
    return WireDefenceError(
        "api_error",
        f"malformed stream: a server-sent event over the {cap:,}-byte cap (SSEReader.max_event_bytes; "
        "the server sent that much without ending an event)",
    )


class SSEReader:
    """Incremental `text/event-stream` decoding (the module docstring says what it guarantees)."""

    __slots__ = ("_cr", "_data", "_name", "_pending", "_pending_size", "_size", "max_event_bytes")

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.max_event_bytes = max_event_bytes
        self._pending: list[bytes] = []
        """The pieces of the line not yet ended, in order."""
        self._pending_size = 0
        self._cr = False
        """The last chunk ended on a CR: an LF that starts the next one is the same line end."""
        self._name: str | None = None
        self._data: list[bytes | memoryview] = []
        self._size = 0
        """Bytes of the lines ended since the last dispatched event."""

    def feed(self, chunk: bytes) -> list[tuple[str | None, str]]:
        """The events completed by `chunk` (none until a blank line ends one); raises past the size cap."""
        if self._cr and chunk:
            self._cr = False
            if chunk[0] == 0x0A:
                chunk = chunk[1:]  # the LF of a CRLF split between two chunks
        if not chunk:
            return []
        if b"\r" in chunk:  # rare on the wire: one pass makes every line end an LF
            self._cr = chunk[-1] == 0x0D
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if b"\n" not in chunk:  # inside a long line: kept as a piece, nothing scanned twice
            self._pending.append(chunk)
            self._pending_size += len(chunk)
            self._check_size()
            return []
        lines = chunk.split(b"\n")
        tail = lines.pop()  # after the last line end: the start of a line still open (b"" if none)
        events: list[tuple[str | None, str]] = []
        if self._pending:  # the first line ends a line begun in earlier chunks
            self._pending.append(lines[0])
            joined = b"".join(self._pending)
            self._pending = []
            self._pending_size = 0
            del lines[0]
            self._joined_line(joined)
        self._lines(lines, events)
        if tail:
            self._pending.append(tail)
            self._pending_size += len(tail)
        self._check_size()
        return events

    def finish(self) -> list[tuple[str | None, str]]:
        """At the end of the body: its last line ended, and the event left without a blank line dispatched."""
        events = self.feed(b"\n") if self._pending else []  # pending is empty after a CR: that line is ended
        if self._data:
            events.append(self._dispatch())
        self._name, self._size = None, 0
        return events

    def _lines(self, lines: list[bytes], events: list[tuple[str | None, str]]) -> None:
        """Whole lines, in order: fields stored, events dispatched (the hot loop: a few lines per event)."""
        size = self._size
        for line in lines:
            if not line:
                if self._data:
                    if size > self.max_event_bytes:  # a whole oversized event in one chunk is refused too
                        raise event_too_large(self.max_event_bytes)
                    events.append(self._dispatch())
                    size = 0
                else:
                    size += 1
                self._name = None
                continue
            size += len(line) + 1
            if line[0] == _COLON:
                continue  # a comment (`: ping` keep-alives of proxies)
            field, _, value = line.partition(b":")
            if value[:1] == b" ":
                value = value[1:]
            if field == b"data":
                self._data.append(value)
            elif field == b"event":
                self._name = value.decode("utf-8", "replace") or None
        self._size = size

    def _joined_line(self, line: bytes) -> None:
        """A line joined from the pieces of several chunks (never blank), perhaps megabytes long: its value is
        kept as a view of it, not copied (`_lines` slices, which costs nothing for a short line)."""
        self._size += len(line) + 1
        if line[0] == _COLON:
            return
        colon = line.find(b":")
        if colon < 0:
            field, start = line, len(line)
        else:
            field, start = line[:colon], colon + 1
            if line[start : start + 1] == b" ":
                start += 1
        if field == b"data":
            self._data.append(memoryview(line)[start:])
        elif field == b"event":
            self._name = str(memoryview(line)[start:], "utf-8", "replace") or None

    def _check_size(self) -> None:
        if self._size + self._pending_size > self.max_event_bytes:
            raise event_too_large(self.max_event_bytes)

    def _dispatch(self) -> tuple[str | None, str]:
        data = self._data
        # Decoded once per event, not per line: a line end is ASCII, so no UTF-8 sequence spans one, and
        # decoding the joined lines replaces exactly what decoding each would.
        text = str(data[0] if len(data) == 1 else b"\n".join(data), "utf-8", "replace")
        self._data = []
        return self._name, text
