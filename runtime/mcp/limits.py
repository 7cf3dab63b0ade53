"""Large MCP results, capped as Claude Code caps them: saved to a file past a size, cut past a token limit.

A server's answer is not ours to size: a tool that returns 5 MB would otherwise reach the consumer's
events, the transcript and the model whole. Two limits apply to every successful result, in order:

- **Size.** A result of text only longer than its tool's limit (`DEFAULT_MAX_RESULT_CHARS`, 50,000
  characters, or what the tool declares in its `_meta["anthropic/maxResultSizeChars"]`, at most
  500,000) is saved whole to a file, and the model gets a preview and the file's path: the
  `<persisted-output>` block the session's own budget makes (`runtime/loop/context.py`), so that
  budget never saves it again. The file is named by the project (`runtime/loop/spill.py`), never by
  an id from outside, in a `tool-results` folder.
- **Tokens.** A result over `MAX_MCP_OUTPUT_TOKENS` (the environment variable, 25,000 by default;
  estimated at 4 characters a token, an image at 1,600) is cut to fit, with a note that says so. A
  tool that declared its size has its text spared this (its declaration is the point), not its
  images. A result whose file could not be written is cut here too: never inline whole.

Before both, an image larger than the Messages API takes (`MAX_IMAGE_BYTES`, 5 MB) is left out with a
note: sent, it would make the API refuse the whole request, not just the image.

An `isError` result's text is cut at `MAX_ERROR_CHARS`. Only the mapping of `content` to blocks is
the SDK's; everything here is plain functions and one folder.

The folder is the server's `results_dir` (the host's: kept) or a temporary one made at the first
save, which the runtime removes when it closes its MCP connections (`LargeResults.close`).
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio
from loguru import logger

from queryloop.runtime.loop.spill import (
    UnsafeSpillPath,
    make_spill_folder,
    safe_file_stem,
    spill_file_name,
    spill_path,
    write_spilled,
)
from queryloop.runtime.loop.tools import ToolOutput

MAX_OUTPUT_TOKENS_ENV = "MAX_MCP_OUTPUT_TOKENS"
DEFAULT_MAX_OUTPUT_TOKENS = 25_000
"""Claude Code's default limit of an MCP tool's output, in tokens."""
CHARS_PER_TOKEN = 4
"""The estimate Claude Code (and `runtime/loop/context.py`) counts with between API counts."""
IMAGE_TOKENS = 1_600
"""What an image is counted as: the Messages API's cost of one at its largest size before it scales it."""
DEFAULT_MAX_RESULT_CHARS = 50_000
"""A result of text longer than this is saved to a file (Claude Code's persist-to-disk threshold)."""
MAX_RESULT_CHARS_CEILING = 500_000
"""The most a tool may declare in `_meta["anthropic/maxResultSizeChars"]` (Claude Code's ceiling)."""
RESULT_SIZE_META = "anthropic/maxResultSizeChars"
PREVIEW_CHARS = 2_000
"""The preview of a saved result the model gets (the session budget's `tool_result_preview_chars`)."""
MAX_ERROR_CHARS = 10_000
"""An `isError` result's text is cut here: an error needs no more to be understood."""
MAX_IMAGE_BYTES = 5 * 1024 * 1024
"""The largest image the Messages API takes in a request (5 MB); a larger one fails the request."""


def _image_bytes(block: dict[str, Any]) -> int:
    """The decoded size of a base64 image block (0 for anything else): 3 bytes per 4 characters."""
    source = block.get("source")
    if block.get("type") != "image" or not isinstance(source, dict) or source.get("type") != "base64":
        return 0
    data = source.get("data")
    return len(data) * 3 // 4 if isinstance(data, str) else 0


def without_oversized_images(output: ToolOutput) -> ToolOutput:
    """`output` with each image over `MAX_IMAGE_BYTES` replaced by a text block saying it was left out
    (`output` itself when there is none)."""
    if isinstance(output, str) or not any(_image_bytes(block) > MAX_IMAGE_BYTES for block in output):
        return output
    return [
        {"type": "text", "text": _image_note(size)} if (size := _image_bytes(block)) > MAX_IMAGE_BYTES else block
        for block in output
    ]


def _image_note(size: int) -> str:
    return (
        f"[IMAGE LEFT OUT: the tool returned an image of {size / 1024 / 1024:.1f} MB, over the "
        f"{MAX_IMAGE_BYTES // 1024 // 1024} MB the Messages API takes for one image.]"
    )


def max_output_tokens(environ: Mapping[str, str] = os.environ) -> int:
    """`MAX_MCP_OUTPUT_TOKENS` as a positive integer; the default when unset or not one (read at each result)."""
    raw = environ.get(MAX_OUTPUT_TOKENS_ENV, "").strip()
    try:
        value = int(raw)
    except ValueError:
        return DEFAULT_MAX_OUTPUT_TOKENS
    return value if value > 0 else DEFAULT_MAX_OUTPUT_TOKENS


def declared_max_chars(meta: Mapping[str, Any] | None) -> int | None:
    """A tool's own size limit from its listed `_meta`, capped at `MAX_RESULT_CHARS_CEILING`; None if it
    declares none, or something that is not a positive integer."""
    value = (meta or {}).get(RESULT_SIZE_META)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 1:
        return None
    return int(min(value, MAX_RESULT_CHARS_CEILING))


def text_of(output: ToolOutput) -> str | None:
    """The output's text if it is text only (blocks joined by newlines); None if it holds an image."""
    if isinstance(output, str):
        return output
    if all(block.get("type") == "text" for block in output):
        return "\n".join(str(block.get("text", "")) for block in output)
    return None


def estimated_tokens(output: ToolOutput) -> int:
    """The output's size in tokens as estimated (`CHARS_PER_TOKEN`, `IMAGE_TOKENS`)."""
    return -(-_chars(output) // CHARS_PER_TOKEN)


def _chars(output: ToolOutput) -> int:
    if isinstance(output, str):
        return len(output)
    return sum(_block_chars(block) for block in output)


def _block_chars(block: dict[str, Any]) -> int:
    if block.get("type") == "text":
        return len(str(block.get("text", "")))
    return IMAGE_TOKENS * CHARS_PER_TOKEN


def truncated(output: ToolOutput, max_tokens: int) -> ToolOutput:
    """`output` if it fits in `max_tokens`; else its beginning that fits, and a note saying it was cut.

    Blocks are kept in order while they fit; the text block that does not is cut, what follows it is
    left out (an image is never cut). The note names the estimate, the limit and what was kept.
    """
    total = estimated_tokens(output)
    if total <= max_tokens:
        return output
    budget = max_tokens * CHARS_PER_TOKEN
    if isinstance(output, str):
        return output[:budget] + _note(total, max_tokens, f"its first {budget:,} characters")
    kept: list[dict[str, Any]] = []
    cut = False
    for block in output:
        size = _block_chars(block)
        if size > budget:
            if block.get("type") == "text" and budget > 0:
                kept.append({**block, "text": str(block.get("text", ""))[:budget]})
                cut = True
            break
        kept.append(block)
        budget -= size
    shown = f"{len(kept)} of its {len(output)} blocks" + (", the last of them cut" if cut else "")
    return [*kept, {"type": "text", "text": _note(total, max_tokens, shown).lstrip()}]


def _note(total: int, max_tokens: int, shown: str) -> str:
    return (
        f"\n\n[OUTPUT TRUNCATED: this result was about {total:,} tokens, over the {max_tokens:,}-token limit "
        f"of an MCP tool's output ({MAX_OUTPUT_TOKENS_ENV}); shown: {shown}. If the tool can return less "
        "(pagination, filters, a range), ask it for the part you need.]"
    )


def persisted(text: str, path: str, preview_chars: int = PREVIEW_CHARS) -> str:
    """What the model gets of a result saved to `path`: its size, the path and a preview (the session
    budget's `<persisted-output>` block, which that budget never saves again)."""
    return (
        f"<persisted-output>\nOutput too large ({len(text)} characters). "
        f"Full output saved to: {path}\n\nPreview (first {preview_chars} characters):\n"
        f"{text[:preview_chars]}\n</persisted-output>"
    )


def capped_error(text: str) -> str:
    """An `isError` result's text, cut at `MAX_ERROR_CHARS` with a note that says how much there was."""
    if len(text) <= MAX_ERROR_CHARS:
        return text
    note = f"[error message truncated: {len(text):,} characters, the first {MAX_ERROR_CHARS:,} shown]"
    return f"{text[:MAX_ERROR_CHARS]}\n{note}"


class LargeResults:
    """One server's results capped (`capped`): the folder a result over its size limit is saved in.

    `folder` is a directory whose `tool-results` folder takes the files (a session's `session_dir` has
    the same layout, so the two may be one); None: a temporary directory, made at the first save and
    handed to whoever closes this (`close`) for removal.
    """

    def __init__(self, server: str, folder: Path | None) -> None:
        self._server = server
        self._folder = None if folder is None else folder / "tool-results"
        self._temporary: Path | None = None
        """The temporary directory made here, until `close` hands it over; never the server's `results_dir`."""
        self._made_here = False
        self._closed = False
        self._making = threading.Lock()
        self._log = logger.bind(mcp_server=server)

    def close(self) -> Path | None:
        """Save nothing from now on; the temporary directory made here (None if none was), for the caller
        to remove (`remove_spill_folder`: in a worker thread). A save still running fails after it is gone
        and its result is cut, as one that could not be saved: nothing makes the directory again."""
        with self._making:  # held by a save only while it makes the directory: two small calls
            self._closed = True
            folder, self._temporary = self._temporary, None
        return folder

    async def capped(self, output: ToolOutput, tool_use_id: str, declared: int | None) -> ToolOutput:
        """`output` within both limits (module docstring): saved and previewed, cut, or as it came."""
        output = without_oversized_images(output)
        text = text_of(output)
        if text is not None and len(text) > (DEFAULT_MAX_RESULT_CHARS if declared is None else declared):
            try:
                path = await trio.to_thread.run_sync(self._save, tool_use_id, text)
            except (OSError, UnsafeSpillPath) as error:
                self._log.warning(
                    "MCP server {}: a large result could not be saved ({}); it is cut", self._server, error
                )
            else:
                self._log.info("MCP server {}: a result of {} characters saved to {}", self._server, len(text), path)
                return persisted(text, str(path))
        elif text is not None and declared is not None:
            return output  # the tool declared its size: Claude Code spares its text the token limit too
        limit = max_output_tokens()
        capped = truncated(output, limit)
        if capped is not output:
            self._log.warning(
                "MCP server {}: a result of about {} tokens cut to the {}-token limit ({})",
                self._server,
                estimated_tokens(output),
                limit,
                MAX_OUTPUT_TOKENS_ENV,
            )
        return capped

    def _save(self, tool_use_id: str, text: str) -> Path:
        """Write `text` to a new file of the folder (a worker thread): named by the project, never overwritten.

        The folder serves every session of the runtime (and maybe other runs), where tool_use ids need not
        be unique: a random part makes each name new."""
        with self._making:  # saves run in worker threads, side by side: one temporary directory for them all
            if self._folder is None:
                if self._closed:  # a temporary directory made now would never be removed
                    msg = f"MCP server {self._server}: its connection is closed"
                    raise OSError(msg)
                stem = safe_file_stem(self._server)
                self._temporary = make_spill_folder(f"queryloop-mcp-{stem}-")
                self._folder = self._temporary / "tool-results"
                self._made_here = True
            folder = self._folder
        path = spill_path(folder, spill_file_name(f"{tool_use_id}/{secrets.token_hex(8)}"))
        # The temporary directory's folder exists until it is removed, and is never made again after.
        write_spilled(path, text, make_folder=not self._made_here)
        return path
