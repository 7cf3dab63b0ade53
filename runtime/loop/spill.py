"""Where an oversized tool result goes on disk: names the project makes, checked to stay in their folder.

A tool_use id and a session id come from outside (a server, a transcript file): `../../x` or `/tmp/x`
as a file name would write anywhere the process may. So nothing from outside is ever a file name
here: a spilled result is named by a digest of its tool_use id (`spill_file_name`), a session id is
cleaned to a safe stem (`safe_file_stem`), and `spill_path` checks the resolved path is inside the
spill folder before anything is written. `write_spilled` writes without following a symlink planted
at that name.

A spill folder the runtime makes itself (`make_spill_folder`: a session without a folder of its own, an
MCP server without `results_dir`) is its maker's to remove (`remove_spill_folder`) when what spilled into
it ends: full tool outputs, megabytes of them, must not outlive the session or runtime that made them.
A folder a host gave, or a durable session's (beside its transcript), is never removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import trio
from loguru import logger

from queryloop.runtime.errors import QueryloopError

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9_-]+")
MAX_STEM = 48
"""The longest stem `safe_file_stem` makes (file systems allow 255 bytes a name; prefixes and suffixes join it)."""


class UnsafeSpillPath(QueryloopError):
    """A spill path resolved outside its folder (a symlinked folder, or a bug): nothing was written."""


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def safe_file_stem(text: str) -> str:
    """`text` as a part of a file name: ASCII letters, digits, `_` and `-` only, at most `MAX_STEM` long.

    A text that is already safe (and short) is kept as is, so names stay readable; any other one has
    its unsafe runs replaced by `_` and a digest of the whole text appended, so two different texts
    never clean up to the same stem (`a/b` and `a_b` differ). The empty text is a digest alone.
    """
    if text and len(text) <= MAX_STEM and all(_SAFE.fullmatch(c) for c in text):
        return text
    cleaned = _UNSAFE_RUN.sub("_", text).strip("_")
    digest = _digest(text)[:12]
    return f"{cleaned[: MAX_STEM - 13]}-{digest}" if cleaned else digest


def spill_file_name(tool_use_id: str) -> str:
    """The file a tool result over the budget is saved to: a digest of its tool_use id, never the id itself.

    Deterministic, so saving the same result again (a resumed session) rewrites the same file rather
    than adding one; tool_use ids are unique in a conversation (duplicates are dropped before tools run).
    """
    return f"tool-result-{_digest(tool_use_id)[:20]}.txt"


def spill_path(folder: Path, name: str) -> Path:
    """`folder / name`, resolved, refused with `UnsafeSpillPath` unless it is directly inside `folder`."""
    base = folder.resolve()
    path = (base / name).resolve()
    if path.parent != base:
        msg = f"a spilled tool result's file {name!r} would land outside its folder"
        raise UnsafeSpillPath(msg)
    return path


def write_spilled(path: Path, text: str, *, make_folder: bool = True) -> None:
    """Write `text` to `path`, never through a symlink at `path` (blocking).

    `make_folder`: its folder (and those above) made if missing. False for a folder of
    `make_spill_folder`, which exists until it is removed: a write that lands after the removal then
    fails (`OSError`) instead of making the folder again, where nothing would ever remove it.
    """
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8", errors="surrogatepass") as file:
        file.write(text)


def make_spill_folder(prefix: str) -> Path:
    """A new temporary folder (`tempfile.mkdtemp`: private to this user) with its `tool-results` folder
    made, for its maker to remove with `remove_spill_folder` (blocking, but two small calls)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    (folder / "tool-results").mkdir()
    return folder


async def remove_spill_folder(folder: Path) -> None:
    """Remove `folder` and everything in it, in a worker thread (a spill folder may hold megabytes, the
    trio thread never waits on that), shielded: the removal is what a closing session or runtime waits
    for, its own cancellation must not leave the folder half there. A failure is logged, not raised.

    `shutil.rmtree` never follows a symlink found in the folder: it unlinks the link. Where it works
    through file descriptors (`shutil.rmtree.avoids_symlink_attacks`, Linux) that holds even against a
    folder swapped for a symlink during the walk; elsewhere only this user could swap one in, since
    `mkdtemp` made the folder private to them.
    """
    with trio.CancelScope(shield=True):
        try:
            await trio.to_thread.run_sync(shutil.rmtree, folder)
        except FileNotFoundError:
            pass  # removed already: what was asked holds
        except OSError as error:
            logger.warning("the spill folder {} could not be removed: {}", folder, error)
