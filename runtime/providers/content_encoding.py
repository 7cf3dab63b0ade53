"""A streamed body's `Content-Encoding` undone, in bounded pieces, or refused by name.

`AnthropicModel` reads the body raw (`aiter_raw`: the decoding iterators of httpx2 leave the transport's
body iterator to the garbage collector when closed early) and asks for `accept-encoding: identity`. A
proxy may compress anyway: before this module a gzipped stream read as no events at all ("stream ended
before message_stop"), retried in vain.

What it guarantees:

- `gzip` (and `x-gzip`), `deflate` (zlib-wrapped, or raw as some servers send it) and `br` (when a
  `brotli` or `brotlicffi` module is importable) are undone, several codings in the reverse of the order
  they are listed; `identity` and an empty header are no coding at all.
- Any other coding (`zstd`, `compress`, a typo) is refused before the body is read: an `api_error`
  `ModelError` naming it and the codings that can be read, which the server's retry would not change
  (`should_retry` False).
- A zlib coding inflates at most `PIECE_BYTES` per step, so a decompression bomb reaches the SSE reader,
  whose cap on one event stops it (`sse.MAX_EVENT_BYTES`), at most a piece past that cap: never inflated
  whole. Brotli's modules offer no such bound: one network read is inflated whole there.
- A body that is not valid in its coding is an `api_error` `ModelError` saying so.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType

from queryloop.runtime.providers.sse import WireDefenceError

__all__ = ["PIECE_BYTES", "BodyDecoder", "body_decoder", "readable_codings"]

PIECE_BYTES = 1 << 20
"""The most one zlib step inflates (1 MiB)."""


def _brotli() -> ModuleType | None:
    for name in ("brotli", "brotlicffi"):
        try:
            return __import__(name)
        except ImportError:
            continue
    return None


def readable_codings() -> tuple[str, ...]:
    """The codings this process can undo (`br` only with a brotli module)."""
    return ("gzip", "deflate", "br") if _brotli() is not None else ("gzip", "deflate")


class _Zlib:
    """One zlib coding (gzip or deflate), inflated `PIECE_BYTES` at most per step."""

    __slots__ = ("_inflater", "_name", "_raw_fallback", "_started")

    def __init__(self, name: str, wbits: int, *, raw_fallback: bool) -> None:
        self._name = name
        self._inflater = zlib.decompressobj(wbits)
        self._raw_fallback = raw_fallback
        """`deflate` is zlib-wrapped by the RFC, sent raw by some servers: a body that is not zlib is tried raw."""
        self._started = False

    def inflate(self, data: bytes) -> Iterator[bytes]:
        while True:
            try:
                out = self._inflater.decompress(data, PIECE_BYTES)
            except zlib.error as error:
                if self._raw_fallback and not self._started:
                    self._raw_fallback = False
                    self._inflater = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise _undecodable(self._name, error) from error
            self._started = True
            data = self._inflater.unconsumed_tail
            if out:
                yield out
            # A full piece may leave output inside zlib with no input left: ask again until a step is short.
            if not data and len(out) < PIECE_BYTES:
                return


class _Brotli:
    """`br`, through whichever brotli module is importable (their method names differ, as httpx2 notes)."""

    __slots__ = ("_error", "_inflate")

    def __init__(self, module: ModuleType) -> None:
        decompressor = module.Decompressor()
        # brotlicffi names it `decompress`, brotli `process`.
        self._inflate: Callable[[bytes], bytes] = getattr(decompressor, "decompress", None) or decompressor.process
        self._error: type[Exception] = getattr(module, "error", Exception)

    def inflate(self, data: bytes) -> Iterator[bytes]:
        try:
            out = self._inflate(data)
        except self._error as error:
            raise _undecodable("br", error) from error
        if out:
            yield out


_Step = _Zlib | _Brotli


class BodyDecoder:
    """A body's codings, undone chunk by chunk.

    Nothing is held back to the end of the body: zlib gives all it can inflate from the input so far once
    its unconsumed input is drained (as `_Zlib.inflate` does), and brotli's `process` does the same.
    """

    __slots__ = ("_steps",)

    def __init__(self, steps: list[_Step]) -> None:
        self._steps = steps
        """In the order they are undone (the reverse of the header's)."""

    def decode(self, chunk: bytes) -> Iterator[bytes]:
        """The decoded bytes of `chunk`, lazily: a piece is inflated only when the one before it is taken."""
        pieces: Iterable[bytes] = (chunk,)
        for step in self._steps:
            pieces = _through(step, pieces)
        return iter(pieces)


def _through(step: _Step, pieces: Iterable[bytes]) -> Iterator[bytes]:
    for piece in pieces:
        yield from step.inflate(piece)


def body_decoder(content_encoding: str | None) -> BodyDecoder | None:
    """The decoder of a body sent with this `Content-Encoding` header (None: nothing to undo).

    Raises the `api_error` `ModelError` naming a coding it cannot read.
    """
    if not content_encoding:
        return None
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return None
    steps: list[_Step] = []
    for coding in reversed(codings):  # the last coding applied is the first undone (RFC 9110 §8.4)
        step = _step(coding)
        if step is None:
            message = (
                f"the response's Content-Encoding {content_encoding!r} cannot be read: {coding!r} is not "
                f"one of {', '.join(readable_codings())} (the request asked for identity)"
            )
            raise WireDefenceError("api_error", message, should_retry=False)
        steps.append(step)
    return BodyDecoder(steps)


def _step(coding: str) -> _Step | None:
    if coding in ("gzip", "x-gzip"):
        return _Zlib(coding, 16 + zlib.MAX_WBITS, raw_fallback=False)
    if coding == "deflate":
        return _Zlib(coding, zlib.MAX_WBITS, raw_fallback=True)
    if coding == "br":
        module = _brotli()
        return None if module is None else _Brotli(module)
    return None


def _undecodable(coding: str, error: Exception) -> WireDefenceError:
    return WireDefenceError("api_error", f"malformed stream: the body is not valid {coding}: {error}")
