"""How prepare's outputs reach disk: temporary files, atomic replaces, and clear write errors.

Every output is written to a hidden temporary file beside it, made durable, and renamed over
the final name, so that a reader sees the old file or the new one, never half of one. A killed
prepare leaves its temporary files behind; the next prepare into the folder removes them
(:func:`remove_dead_temps`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
from pathlib import Path

from sharedml._errors import OutputError, PrepareError
from sharedml.cache._files import temp_is_stale, temp_owner

__all__ = [
    "COPY_CHUNK_BYTES",
    "create_temp",
    "keep_a_link",
    "output_error",
    "remove_dead_temps",
    "replace_file",
    "same_file",
    "write_temp",
]

COPY_CHUNK_BYTES = 16 * 1024 * 1024  # bytes copied at a time: bounds prepare's peak memory
_NAME_MAX_BYTES = 255  # bytes in one file name (NAME_MAX on Linux, macOS and NTFS)
# Temporary outputs: ``.<output name>.<owner>-<12 hex>.tmp`` beside the output (the owner, see
# sharedml.cache._files.temp_owner; older ones have none).
_TEMP_NAME = re.compile(
    r"\.(?P<name>.+)\.(?:(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)-)?[0-9a-f]{12}\.tmp"
)
_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)
_WINDOWS_IN_USE = (5, 32)  # ERROR_ACCESS_DENIED, ERROR_SHARING_VIOLATION


def create_temp(final: Path) -> tuple[int, Path]:
    """A new temporary file beside ``final``: read-only for everyone the umask lets read it.

    The mode is 0444 less the umask (``tempfile.mkstemp`` would make it 0600, so a prepared
    model would be unreadable by the other users a deployment often runs its workers as).
    Read-only because the weights file is mapped by running pools: a ``cp`` over it (an
    in-place rewrite) would crash them with SIGBUS, and read-only makes ``cp`` fail for
    everyone but root, while the renames that prepare itself replaces files with still work.
    Windows: 0666, since there a read-only file cannot be replaced by a rename.

    The name records this process (:func:`sharedml.cache._files.temp_owner`), so that the next
    prepare into the folder removes what a killed one left (:func:`remove_dead_temps`), and
    keeps at most what fits NAME_MAX with its owner and random part, so that an output name of
    up to 255 bytes works.

    Returns:
        The open file descriptor (write-only) and the file's path.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    mode = 0o444 if os.name == "posix" else 0o666
    for _ in range(100):
        suffix = f".{temp_owner()}-{secrets.token_hex(6)}.tmp"
        keep = final.name
        while len(os.fsencode(f".{keep}{suffix}")) > _NAME_MAX_BYTES:
            keep = keep[:-1]
        path = final.with_name(f".{keep}{suffix}")
        try:
            return os.open(path, flags, mode), path
        except FileExistsError:
            continue
    raise PrepareError(f"Could not create a temporary file beside '{final}'.")  # pragma: no cover


def write_temp(final: Path, data: bytes) -> Path:
    """Write ``data`` durably to a new temporary file beside ``final``; returns its path.

    The caller renames it into place (or removes it): :func:`replace_file` does the first.
    """
    fd, tmp = create_temp(final)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return tmp


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file and rename it over ``path``.

    ``path`` may be a file prepare wrote read-only (0444): rewriting it in place works only for
    root, and a rename is what prepare itself replaces its outputs with.
    """
    tmp = write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def remove_dead_temps(folder: Path) -> tuple[Path, ...]:
    """Remove the temporary outputs that killed prepares left in ``folder``.

    A ``kill -9`` while prepare writes leaves its hidden temporary files (a weights file's
    worth each), which nothing else ever removes. Only files named as :func:`create_temp`
    names them, owned by this user, and stale (their process is gone from this host, or they
    are a day old: see :func:`sharedml.cache._files.temp_is_stale`) are removed: never a live
    prepare's, in this process or another.

    Returns:
        The files removed.
    """
    removed = []
    try:
        children = list(os.scandir(folder))
    except OSError:
        return ()
    for child in children:
        match = _TEMP_NAME.fullmatch(child.name)
        if match is None:
            continue
        try:
            st = child.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (os.name == "posix" and st.st_uid != os.geteuid()):
            continue
        owner = (match["host"], int(match["pid"])) if match["host"] else None
        if temp_is_stale(Path(child.path), owner):
            with contextlib.suppress(OSError):
                os.unlink(child.path)
                removed.append(Path(child.path))
    return tuple(removed)


def keep_a_link(path: Path) -> Path | None:
    """A hard link to an existing ``path`` under a temporary name, to restore it from; else None.

    None too where the filesystem has no hard links: a failure then loses the old weights file
    (the old graph, still in place, refuses the new one by its recorded hash).
    """
    if not path.is_file() or path.is_symlink():
        return None
    for _ in range(100):
        link = path.with_name(f".{path.name[:200]}.{secrets.token_hex(6)}.old")
        try:
            os.link(path, link)
            return link
        except FileExistsError:
            continue
        except OSError:
            return None
    return None  # pragma: no cover


def same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` both exist and are one file (False where that cannot be told)."""
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _in_use_on_windows(path: Path, exc: OSError) -> bool:
    """Whether Windows refused to replace ``path`` because a process has it open or mapped.

    There the old file cannot be replaced while it is mapped; on POSIX the rename lands and
    processes keep the old inode.
    """
    return (
        os.name == "nt"
        and getattr(exc, "winerror", None) in _WINDOWS_IN_USE
        and os.path.lexists(path)
    )


def output_error(path: Path, exc: OSError) -> OutputError:
    """An :class:`OutputError` that names ``path``, the OS's reason and the fix."""
    code = exc.errno
    folder = path.parent
    if code in (errno.ENOSPC, _EDQUOT):
        fix = f"free space on the filesystem of '{folder}', or write the prepared model elsewhere"
    elif code == errno.EFBIG:
        fix = (
            "the file outgrew the filesystem's or this process's file size limit ('ulimit -f'); "
            "raise the limit or write the prepared model elsewhere"
        )
    elif _in_use_on_windows(path, exc):
        fix = (
            "it is in use: Windows refuses to replace a file that a process has open or mapped "
            "(a SessionPool over this prepared model); close those pools first, or prepare to a "
            "new path and point new pools at it"
        )
    elif code in (errno.EACCES, errno.EPERM):
        fix = f"this user may not write in '{folder}'; fix its permissions or write elsewhere"
    elif code == errno.EROFS:
        fix = f"'{folder}' is on a read-only filesystem; write the prepared model elsewhere"
    elif code == errno.ENAMETOOLONG:
        fix = "the name is longer than the filesystem allows; choose a shorter output name"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        fix = f"a part of '{folder}' is a file, not a folder; choose another output path"
    else:
        fix = f"check '{folder}', or write the prepared model elsewhere"
    error = OutputError(
        f"prepare could not write '{path}' ({exc.strerror or exc}): {fix}. The source is "
        "unchanged and no temporary file was left."
    )
    error.errno = code
    return error
