"""Temporaries and removal: whose a temporary file is, and deleting what the cache made.

Every part of the cache writes through private temporary names (``.<label>-<owner>-XXXX.tmp``,
the owner being this host and process: :func:`temp_owner`), so that a killed build's leftovers
can be told from a live one's (:func:`temp_is_stale`), and removes through :func:`remove_tree`
and :func:`unlink_file`, which also delete the read-only files of an entry on Windows.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import socket
import stat
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "PRIVATE_DIR_MODE",
    "READ_ONLY_FILE_MODE",
    "STALE_TMP_SECONDS",
    "TMP_SUFFIX",
    "remove_tree",
    "temp_is_stale",
    "temp_owner",
    "temp_owner_of",
    "unlink_file",
]

# seconds: a temporary this old is a dead process's, whoever made it (a pid may be reused)
STALE_TMP_SECONDS = 24 * 3600
PRIVATE_DIR_MODE = stat.S_IRWXU  # 0700: other users can neither read nor plant entries
READ_ONLY_FILE_MODE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # 0444: never rewritten
TMP_SUFFIX = ".tmp"
# Temporary names: ``.<label>-<owner>-<random>.tmp``, where the owner (host tag and pid, see
# temp_owner) tells a dead build's leftovers from a live one's; older sharedml wrote none.
_TEMP_NAME = re.compile(
    r"\.(?P<label>[^/]{0,16}?)-?(?:(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)-)?[a-z0-9_]+\.tmp"
)


@functools.cache
def _host_tag() -> str:
    """8 hex digits naming this host and PID namespace: a pid means a process only there."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def temp_owner() -> str:
    """The owner part of a temporary name this process makes: ``<host tag>.<pid>``.

    A temporary file or folder named with it is a killed process's once that pid is gone on
    this host (:func:`temp_is_stale`), so its leftovers go at once, without waiting a day.
    """
    return f"{_host_tag()}.{os.getpid()}"


def _owner_alive(host: str, pid: int) -> bool | None:
    """Whether the process named by a temporary name lives; None where this process cannot tell."""
    if host != _host_tag() or os.name != "posix":  # os.kill(pid, 0) is Ctrl-C on Windows
        return None
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    except OSError:
        return None
    return True


def temp_is_stale(
    path: Path,
    owner: tuple[str, int] | None,
    *,
    older_than_s: float = STALE_TMP_SECONDS,
    now: float | None = None,
) -> bool:
    """Whether a temporary file or folder is a killed process's, to remove.

    Args:
        path: The file or folder.
        owner: ``(host tag, pid)`` from its name (:func:`temp_owner`), or None for a name
            without one (older sharedml).
        older_than_s: Where the owner cannot be told (no owner in the name, another host),
            untouched this long means stale.
        now: The time to measure age against (default: now).

    Returns:
        True when its owner is known dead, or, owner unknown, it is older than
        ``older_than_s``. A live owner's temporary (this process's too) is stale only after
        :data:`STALE_TMP_SECONDS` (its pid may have been reused by another process).
    """
    alive = _owner_alive(*owner) if owner is not None else None
    if alive is False:
        return True
    try:
        age = (time.time() if now is None else now) - os.lstat(path).st_mtime
    except OSError:
        return False
    return age > (STALE_TMP_SECONDS if alive else older_than_s)


def temp_owner_of(name: str) -> tuple[str, int] | Literal[False] | None:
    """The owner ``(host, pid)`` of a sharedml temporary name.

    Returns None for a temporary name that records no owner, and False for a name that is not
    one of sharedml's temporary names.
    """
    match = _TEMP_NAME.fullmatch(name)
    if match is None:
        return False
    if match["host"] is None:
        return None
    return match["host"], int(match["pid"])


def _writable_then(func: Callable[..., Any], path: str, error: Any) -> None:
    """``shutil.rmtree``'s error handler: make ``path`` writable and try again (Windows).

    Entry files are read-only (0444), and Windows refuses to delete a read-only file; POSIX
    only asks for a writable folder. Where it still fails (Windows: the file is open or
    mapped), the file is made read-only again and that error raised.

    Args:
        func: The call that failed.
        path: Its path.
        error: The exception (``onexc``) or its ``sys.exc_info()`` (``onerror``).
    """
    exc = error[1] if isinstance(error, tuple) else error
    if os.name != "nt" or not isinstance(exc, PermissionError):
        raise exc
    os.chmod(path, stat.S_IWRITE | stat.S_IREAD)
    try:
        func(path)
    except OSError:
        with contextlib.suppress(OSError):
            os.chmod(path, READ_ONLY_FILE_MODE)
        raise


def remove_tree(path: Path, *, ignore_errors: bool = False) -> None:
    """``shutil.rmtree`` that also deletes the read-only files of an entry on Windows."""
    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_writable_then)
        else:
            shutil.rmtree(path, onerror=_writable_then)
    except OSError:
        if not ignore_errors:
            raise


def unlink_file(path: Path) -> None:
    """``os.unlink``, which on Windows also deletes a read-only file (entry files are 0444)."""
    try:
        os.unlink(path)
    except PermissionError as exc:
        _writable_then(os.unlink, str(path), exc)
