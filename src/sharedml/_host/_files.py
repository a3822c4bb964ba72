"""Opening files below a folder without following symlinks, telling file kinds, durable renames."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "LinkSwappedError",
    "file_kind",
    "fsync_dir",
    "open_below",
]


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable, where the platform and filesystem allow it.

    Best effort by design: the rename has already happened and is visible; some filesystems
    refuse ``fsync`` on a folder (EINVAL), and failing the whole operation for that would turn
    a durability nicety into an outage.
    """
    if os.name != "posix":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISREG, "a regular file"),
)


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, for messages: ``"a FIFO (named pipe)"``, ``"a folder"``, ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


# Flags that are absent on some platforms (Windows has none of these): 0 leaves them out.
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not wait for a writer
_O_BINARY = getattr(os, "O_BINARY", 0)


class LinkSwappedError(OSError):
    """A path below the folder became a symlink (or another file) while it was being opened."""


def open_below(folder: Path, target: Path) -> int:
    """Open ``target``, a resolved path inside the resolved ``folder``, without following links.

    The caller has checked ``target`` (``os.path.realpath``) against ``folder``; a symlink
    swapped into any component below ``folder`` between that check and this open would make a
    plain ``open`` read another file. Where the platform allows it (POSIX), every component is
    opened from its parent's descriptor with ``O_NOFOLLOW``, so the walk cannot leave
    ``folder``; elsewhere (Windows: no ``O_NOFOLLOW``, no ``dir_fd``) the file is opened by
    path and the descriptor's own path (``GetFinalPathNameByHandle``) must be ``target``, which
    refuses a link followed by the open whatever happens to the path after it. (Comparing the
    path's ``stat`` after the open is not enough: measured, it leaked.) The file is opened
    non-blocking so that
    a FIFO swapped in cannot hang the caller; callers ``fstat`` the descriptor for its kind.

    Returns:
        A read-only descriptor, owned by the caller.

    Raises:
        LinkSwappedError: a component is now a symlink, or the opened file is not ``target``.
        OSError: the file cannot be opened (missing, permissions).
    """
    parts = target.relative_to(folder).parts
    if not parts:
        raise IsADirectoryError(f"'{target}' is the folder itself")
    if not (_O_NOFOLLOW and os.open in os.supports_dir_fd):
        return _open_and_compare(target)
    dir_fd = os.open(folder, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in parts[:-1]:
            next_fd = _open_component(part, os.O_RDONLY | _O_DIRECTORY, dir_fd, target)
            os.close(dir_fd)
            dir_fd = next_fd
        return _open_component(parts[-1], os.O_RDONLY | _O_NONBLOCK, dir_fd, target)
    finally:
        os.close(dir_fd)


def _open_component(name: str, flags: int, dir_fd: int, target: Path) -> int:
    try:
        return os.open(name, flags | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        # ELOOP: a symlink where O_NOFOLLOW forbids one (EMLINK on FreeBSD); ENOTDIR: a
        # folder component replaced by a file or a link.
        if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
            raise LinkSwappedError(
                exc.errno, f"'{name}' became a symlink or changed while being opened", str(target)
            ) from None
        raise


def _open_and_compare(target: Path) -> int:
    """Open by path, then check that the descriptor's own path is ``target`` (no link followed).

    Comparing ``stat`` results of the path after the open is not enough: the path can change
    between those calls too (measured: a flipper leaked through such a check on try 23). The
    descriptor's path is a property of the open file itself, so no later swap can change it.
    """
    fd = os.open(target, os.O_RDONLY | _O_BINARY | _O_NONBLOCK)
    try:
        opened = _descriptor_path(fd)
        if opened is None:  # no way to ask: the best the path can tell (racy, see above)
            same = os.path.samestat(os.fstat(fd), os.lstat(target))
            same = same and os.path.realpath(target) == str(target)
        else:
            # realpath brings the descriptor's path (which holds no link) to the form `target`
            # already has; `target` itself must not be resolved again, or a link swapped in
            # now would resolve to the file opened through it (measured: it leaked).
            same = _canonical(opened) == os.path.normcase(str(target))
        if not same:
            raise LinkSwappedError(
                errno.ELOOP, f"the file opened is '{opened}', not the one checked", str(target)
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _canonical(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


def _descriptor_path(fd: int) -> str | None:
    """The path of the file open at ``fd`` (Windows, Linux, macOS), or None where unknown."""
    if sys.platform == "win32":
        import msvcrt

        handle = msvcrt.get_osfhandle(fd)
        kernel32: Any = ctypes.WinDLL("kernel32", use_last_error=True)
        buffer = ctypes.create_unicode_buffer(32768)
        if not kernel32.GetFinalPathNameByHandleW(handle, buffer, len(buffer), 0):
            return None
        path = str(buffer.value)
        if path.startswith("\\\\?\\UNC\\"):
            return "\\\\" + path[8:]
        return path[4:] if path.startswith("\\\\?\\") else path
    if sys.platform == "darwin":
        import fcntl

        raw = fcntl.fcntl(fd, 50, b"\0" * 1024)  # F_GETPATH
        return os.fsdecode(raw.split(b"\0", 1)[0])
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
