"""Confined file access: open what a path names beneath a root folder whose contents are hostile.

The model names a path; the folder's files may have been planted (symlinks, hard links, FIFOs,
huge files) or may change while a tool runs. `open_beneath` answers with a descriptor, and every
later step works on that descriptor, never on the path again, so what was checked is what is read:

- Beneath the root: the path is walked from a descriptor of the root, `..` is applied by name
  (climbing above the root is refused) and an absolute path is refused. No symbolic link is
  followed at any component, whenever it appeared: the kernel resolves the path with `openat2`
  and `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS` where it has that call; elsewhere (a kernel before
  5.6, a seccomp filter that refuses it) each component is opened with `O_NOFOLLOW` from the
  descriptor of the one before. A directory swapped for a symlink at any moment is refused.
- Regular files only, with one link: the open is non-blocking (a FIFO would block it until a
  writer comes) and the descriptor is then checked with `fstat`: a FIFO, a device, a socket is
  refused, and so is a file with more than one hard link (a link planted inside the folder to a
  file outside it reads as any other file; its link count is what gives it away). Directories
  (`directory=True`) are opened the same way, with `O_DIRECTORY`.
- Bounded reads: `read_head` reads at most four bytes per character it returns, `count_newlines`
  reads in fixed-size chunks into one buffer, up to a limit, and calls a checkpoint between chunks
  (so an abandoned worker thread stops), `list_names` takes at most `limit + 1` entries.
- Refusals (`Refused`) name the path as the model gave it (`repr`, so its control characters are
  escaped) and say why, never the root's absolute path: the model and whoever reads the
  transcript learn nothing of the machine's layout from an error.

The functions block (file system calls): run them in a worker thread (`trio.to_thread.run_sync`
with `abandon_on_cancel=True`). Linux only: `openat2`, `O_PATH` and `O_NOFOLLOW` semantics.
"""

from __future__ import annotations

import codecs
import ctypes
import errno
import functools
import itertools
import os
import platform
import stat
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from queryloop.runtime.loop.tools import ToolError

OPENAT2_SYSCALL: dict[str, int] = {"x86_64": 437, "aarch64": 437}
"""The number of the `openat2` system call by machine (Python has no binding for it)."""
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
COUNT_CHUNK = 256 * 1024
"""The bytes `count_newlines` reads at a time: its memory, whatever the file's size."""


class Refused(ToolError):
    """A path the confined access does not open or read: the message names the path as given, and why.

    A `ToolError`: raised from a tool, it is the error result the model sees, as is.
    """


class _OpenHow(ctypes.Structure):
    """`struct open_how` of `openat2(2)`."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _NoOpenat2(Exception):
    """This kernel (or a seccomp filter in front of it) has no `openat2`: walk the path instead."""


def components(relative: str) -> list[str]:
    """The names `relative` walks through beneath the root: `.` and empty names dropped, `..` applied by name.

    By name is where it leads, since no symlink is followed. Raises `Refused` for an absolute path,
    one that climbs above the root, and one no file name can hold (a NUL, an unencodable character).
    An empty list is the root itself.
    """
    if "\0" in relative:
        msg = f"{relative!r} is not a valid path (it holds a NUL character)"
        raise Refused(msg)
    try:
        relative.encode(sys.getfilesystemencoding(), "surrogateescape")
    except UnicodeEncodeError:
        msg = f"{relative!r} is not a valid path (it holds a character no file name can hold)"
        raise Refused(msg) from None
    if relative.startswith("/"):
        raise _outside(relative)
    names: list[str] = []
    for name in relative.split("/"):
        if name == "..":
            if not names:
                raise _outside(relative)
            names.pop()
        elif name not in ("", "."):
            names.append(name)
    return names


def _outside(relative: str) -> Refused:
    return Refused(f"{relative!r} is outside the working directory")


@functools.cache
def _openat2_syscall() -> Callable[[int, bytes, _OpenHow], int] | None:
    """`openat2(dir_fd, path, how)` through libc's `syscall` (-1 and errno on failure), or None where this
    machine has no known number for it."""
    number = OPENAT2_SYSCALL.get(platform.machine())
    if sys.platform != "linux" or number is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_OpenHow), ctypes.c_size_t]

    def openat2(dir_fd: int, path: bytes, how: _OpenHow) -> int:
        return int(syscall(number, dir_fd, path, ctypes.byref(how), ctypes.sizeof(how)))

    return openat2


def _openat2(dir_fd: int, path: str, flags: int) -> int:
    """`openat2(dir_fd, path, flags, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`: a descriptor, or `OSError`.

    Raises `_NoOpenat2` when the kernel has no such call (ENOSYS) or a seccomp filter refuses it
    (EPERM: a plain read-only open has no other reason to answer that; the walk then says what is).
    `path` holds no NUL (`components` refuses one): a C string would end there.
    """
    openat2 = _openat2_syscall()
    if openat2 is None:
        raise _NoOpenat2
    how = _OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
    encoded = os.fsencode(path)
    while True:
        fd = openat2(dir_fd, encoded, how)
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code == errno.EINTR:  # os.open retries a signal's interruption (PEP 475); a raw syscall must too
            continue
        if code in (errno.ENOSYS, errno.EPERM):
            raise _NoOpenat2
        raise OSError(code, os.strerror(code))


def openat2_available() -> bool:
    """Whether `open_beneath` can have the kernel resolve paths (`openat2`) here, rather than walk them."""
    try:
        os.close(_openat2(-100, "/", os.O_PATH | os.O_CLOEXEC))  # AT_FDCWD; "/" is beneath nothing
    except _NoOpenat2:
        return False
    except OSError:
        return True  # answered (EXDEV): the call exists
    return True


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_component(dir_fd: int, name: str, flags: int) -> int:
    """`name` opened in `dir_fd` without following it; a symlink is refused as ELOOP (as `openat2` does)."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except NotADirectoryError:
        # O_NOFOLLOW with O_DIRECTORY refuses a symlink as "not a directory": the look is only for the message.
        if _is_symlink(dir_fd, name):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP)) from None
        raise


def _walk(root_fd: int, names: list[str], flags: int) -> int:
    """`names` opened beneath `root_fd` one component at a time, each from the descriptor of the one before.

    No path is looked up twice: a directory swapped for a symlink after a step is refused by the
    next one (`O_NOFOLLOW`), and `names` holds no `..` to climb back with.
    """
    current = root_fd
    try:
        for name in names[:-1]:
            # O_PATH: a directory passed through needs no read permission, as in the kernel's own walk.
            following = _open_component(current, name, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            if current != root_fd:
                os.close(current)
            current = following
        return _open_component(current, names[-1] if names else ".", flags)
    finally:
        if current != root_fd:
            os.close(current)


def _open_names(root_fd: int, names: list[str], flags: int, *, use_openat2: bool) -> int:
    if use_openat2:
        try:
            return _openat2(root_fd, "/".join(names) or ".", flags)
        except _NoOpenat2:
            pass
    return _walk(root_fd, names, flags)


def _refusal(relative: str, code: int | None, *, directory: bool) -> Refused:
    """Why `relative` could not be opened, from the error's number alone (its text would hold a path)."""
    if code == errno.ELOOP:
        why = "is, or passes through, a symbolic link (links are not followed)"
    elif code == errno.EXDEV:
        return _outside(relative)
    elif code == errno.ENOENT:
        why = "does not exist"
    elif code == errno.ENOTDIR:
        why = "is not a directory" if directory else "passes through a file as if it were a directory"
    elif code == errno.ENXIO:  # a socket
        why = "is not a regular file"
    elif code == errno.EACCES:
        why = "cannot be opened: permission denied"
    else:
        why = f"cannot be opened: {os.strerror(code) if code is not None else 'unknown error'}"
    return Refused(f"{relative!r} {why}")


def _check(relative: str, status: os.stat_result, *, directory: bool) -> None:
    """Refuse what was opened unless it is a directory (`directory`) or a regular file with one link."""
    mode = status.st_mode
    if directory:
        if not stat.S_ISDIR(mode):
            raise Refused(f"{relative!r} is not a directory")
        return
    if stat.S_ISDIR(mode):
        raise Refused(f"{relative!r} is a directory, not a file")
    if not stat.S_ISREG(mode):  # a FIFO, a device, a socket: reading one may block, or never end
        raise Refused(f"{relative!r} is not a regular file")
    if status.st_nlink > 1:  # the same file under another name, perhaps one outside the folder
        raise Refused(f"{relative!r} has more than one hard link")


def open_beneath(root: Path, relative: str, *, directory: bool = False, use_openat2: bool = True) -> int:
    """A descriptor of what `relative` names beneath `root` (see the module docstring); the caller closes it.

    The file is a regular file with one link, opened read-only (`directory`: a directory), reached
    without following any symlink and without leaving `root`. Anything else raises `Refused`, naming
    `relative`, never `root`. `use_openat2=False` walks the path even where the kernel could resolve it.
    The root itself is trusted: it is opened by its path, symlinks followed.
    """
    names = components(relative)
    # O_NONBLOCK: a FIFO would block the open until a writer comes; for a regular file it changes nothing.
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK | (os.O_DIRECTORY if directory else 0)
    try:
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        msg = f"the working directory cannot be opened: {os.strerror(error.errno or 0)}"
        raise Refused(msg) from None
    try:
        fd = _open_names(root_fd, names, flags, use_openat2=use_openat2)
    except OSError as error:
        raise _refusal(relative, error.errno, directory=directory) from None
    finally:
        os.close(root_fd)
    try:
        _check(relative, os.fstat(fd), directory=directory)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextmanager
def opened(root: Path, relative: str, *, directory: bool = False, use_openat2: bool = True) -> Iterator[int]:
    """`open_beneath`, closed on leaving; an `OSError` while using it is refused without its path."""
    fd = open_beneath(root, relative, directory=directory, use_openat2=use_openat2)
    try:
        yield fd
    except OSError as error:
        msg = f"{relative!r} could not be read: {os.strerror(error.errno or 0)}"
        raise Refused(msg) from None
    finally:
        os.close(fd)


def read_head(fd: int, chars: int) -> str:
    """At most the first `chars` characters of the file (UTF-8; undecodable bytes as U+FFFD).

    Reads at most `4 * chars` bytes, whatever the file's size: a character takes at most four, and
    an undecodable byte becomes one character, so that many always hold `chars` characters.
    """
    budget = 4 * chars
    data = bytearray()
    at_end = False
    while len(data) < budget:
        chunk = os.read(fd, budget - len(data))
        if not chunk:
            at_end = True
            break
        data += chunk
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    # Before the end, a character cut by the budget is held back, never shown as U+FFFD.
    return decoder.decode(bytes(data), final=at_end)[:chars]


def count_newlines(fd: int, limit: int, checkpoint: Callable[[], None] = lambda: None) -> tuple[int, bool]:
    """The `\\n` bytes in the file's first `limit` bytes, and whether that was the whole file.

    Constant memory: chunks of `COUNT_CHUNK` bytes read into one buffer. `checkpoint` is called
    before each chunk: `trio.from_thread.check_cancelled` makes an abandoned thread stop there.
    In UTF-8 a `\\n` byte is always the character (no other character's bytes contain it).
    """
    buffer = bytearray(COUNT_CHUNK)
    view = memoryview(buffer)
    count = done = 0
    while done < limit:
        checkpoint()
        got = os.readv(fd, [view[: min(COUNT_CHUNK, limit - done)]])
        if got == 0:
            return count, True
        count += buffer.count(b"\n", 0, got)
        done += got
    return count, os.read(fd, 1) == b""


def list_names(fd: int, limit: int) -> tuple[list[str], bool]:
    """The names of at most `limit` entries of the directory `fd` (sorted), and whether it holds more.

    Reads at most `limit + 1` entries: which ones, of a larger directory, is the file system's order.
    """
    with os.scandir(fd) as entries:
        names = [entry.name for entry in itertools.islice(entries, limit + 1)]
    return sorted(names[:limit]), len(names) > limit
