"""Locks: entries in use (shared ``flock``), and named cross-process locks (``filelock``).

An entry in use: a process that opens an entry takes a shared ``flock`` on its ``.lock`` file
and holds it while it may map the entry's files (:func:`hold_entry`), touching the lock file's
mtime (the entry's "last used"). Removal takes the exclusive lock without waiting
(:func:`lock_entry`) and skips an entry it cannot get. A waiter whose lock file was removed with
its entry meanwhile sees that the path no longer names the inode it locked: no library offers
this shared lock with the inode check, so it is written here. Where there is no ``flock``
(Windows) a holder keeps the lock file open instead, which the OS then refuses to delete.

A named lock (:func:`held_lock`) serializes work across processes, such as replicas about to
prepare the same model: a plain exclusive lock, taken with :mod:`filelock`.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import filelock

from sharedml._errors import CacheError
from sharedml.cache._files import READ_ONLY_FILE_MODE
from sharedml.cache._root import ENTRY_FILE, ENTRY_KINDS, Cache

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCKING = fcntl is not None
"""Whether entries in use are locked with ``flock`` here (POSIX). Windows has none: there a
process holds an entry's lock file open, which the OS then refuses to delete, and only an
attempt to remove an entry tells whether it is in use."""

__all__ = [
    "LOCKING",
    "LOCK_NAME",
    "EntryHold",
    "end_expired_loans",
    "entry_folder",
    "held_lock",
    "hold_entry",
    "hold_folder",
    "is_busy",
    "lend_hold",
    "lock_entry",
]

_LOCK_POLL_S = 0.05  # seconds between attempts while another process holds a lock


class _Held(Protocol):
    """An opened entry as :func:`lend_hold` needs it (``sharedml.cache._entries.CacheEntry``)."""

    @property
    def path(self) -> Path: ...

    @property
    def hold(self) -> EntryHold | None: ...


LOCK_NAME = ".lock"


class EntryHold:
    """A shared lock on one cache entry: it is not removed while this object is open.

    Where there is no ``flock`` (Windows) the lock file is held open instead: the OS refuses
    to delete it, and removal starts with it.

    Closed by :meth:`release`, or when the object is collected (the file descriptor closes
    with it). Thread safety: :meth:`release` may be called from any thread, more than once.
    """

    def __init__(self, fd: int, folder: Path) -> None:
        self.folder = folder
        self._fd: int | None = fd
        self._lock = threading.Lock()

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        self.release()


def entry_folder(path: Path) -> Path | None:
    """The published entry folder that holds ``path`` (a file of it, or itself), or None."""
    for folder in (path.parent, path):
        if folder.parent.name in ENTRY_KINDS and (folder / ENTRY_FILE).is_file():
            return folder
    return None


def lock_entry(folder: Path, *, exclusive: bool) -> int | None:
    """A descriptor holding ``folder``'s lock file locked, or None if the entry is gone.

    Shared locks wait; an exclusive lock does not (``BlockingIOError``: the entry is in use).
    The lock file may be removed, with its entry, while we wait for it: then the lock we got
    protects nothing, and the check of the path against the descriptor says so.
    """
    assert LOCKING
    lock = folder / LOCK_NAME
    flags = os.O_RDONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        try:
            fd = os.open(lock, flags, READ_ONLY_FILE_MODE)
        except OSError:
            return None  # the folder is gone (or not ours to write)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB if exclusive else fcntl.LOCK_SH)
            try:
                current = os.stat(lock, follow_symlinks=False).st_ino
            except OSError:
                current = None
            if current == os.fstat(fd).st_ino:
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def hold_entry(path: str | os.PathLike[str]) -> EntryHold | None:
    """Keep the cache entry that holds ``path`` from removal while the result lives.

    Takes a shared lock on the entry's lock file and touches it (the entry's "last used"). A
    hold that :func:`lend_hold` lent for this entry is given back once this one is taken.

    Args:
        path: A file of a published entry, or the entry's folder. Other paths are ignored.

    Returns:
        The hold, or None: ``path`` is not in a cache entry, the entry was removed meanwhile,
        or this platform has no ``flock`` (:data:`LOCKING`).
    """
    folder = entry_folder(Path(path))
    hold = hold_folder(folder) if folder is not None else None
    if hold is not None:
        _end_loan(str(hold.folder))
    return hold


def hold_folder(folder: Path) -> EntryHold | None:
    """A hold on the published entry ``folder`` (see :func:`hold_entry`), or None if it is gone."""
    if not LOCKING:
        return _hold_open(folder)
    fd = lock_entry(folder, exclusive=False)
    if fd is None:
        return None
    with contextlib.suppress(OSError):
        os.utime(fd) if os.utime in os.supports_fd else os.utime(folder / LOCK_NAME)
    return EntryHold(fd, folder)


_LOAN_S = 60.0  # seconds a lent hold waits for the hold that takes it over (see lend_hold)
_loans: dict[str, list[tuple[float, EntryHold]]] = {}  # entry folder -> (deadline, hold)
_loans_lock = threading.Lock()


def lend_hold(entry: _Held) -> None:
    """Keep ``entry`` from removal after its caller drops it, until this process holds it again.

    :func:`sharedml.prepared_model_for` returns the path of an entry's model, not the entry,
    and the weight store that maps it takes its own hold (:func:`hold_entry`) a moment later.
    A ``sharedml cache clear`` in that moment removed the entry, and the pool failed with
    ``ModelNotFoundError``. The entry's hold is lent here instead: the next
    :func:`hold_entry` of the entry in this process gives it back. One that nobody took is
    given back after :data:`_LOAN_S`, at this process's next use of the cache (no thread
    waits for it).

    Thread safety: may be called from any thread.
    """
    if entry.hold is None:
        return
    with _loans_lock:
        _loans.setdefault(str(entry.path), []).append((time.monotonic() + _LOAN_S, entry.hold))
    end_expired_loans()


def end_expired_loans() -> None:
    """Give back the loans nobody took in time (never waits: also safe in a finalizer)."""
    if not _loans_lock.acquire(blocking=False):
        return
    now = time.monotonic()
    try:
        expired = [hold for loans in _loans.values() for d, hold in loans if d <= now]
        for folder in list(_loans):
            _loans[folder] = [(d, hold) for d, hold in _loans[folder] if d > now]
            if not _loans[folder]:
                del _loans[folder]
    finally:
        _loans_lock.release()
    for hold in expired:
        hold.release()


def _end_loan(folder: str) -> None:
    """Give back the oldest hold lent for the entry ``folder`` (its new holder holds it)."""
    with _loans_lock:
        loans = _loans.get(folder)
        if not loans:
            return
        _deadline, hold = loans.pop(0)
        if not loans:
            del _loans[folder]
    hold.release()
    end_expired_loans()


def _hold_open(folder: Path) -> EntryHold | None:
    """Where there is no ``flock`` (Windows): hold the entry's lock file open instead.

    Windows refuses to delete a file that another handle has open (Python opens files without
    ``FILE_SHARE_DELETE``), and removal deletes the lock file first
    (``remove_entries``), so it stops there while any process holds the entry: also one
    whose files ORT read and closed (a prepacked model it may load again for a new session).
    The last use is recorded first: while a handle is open the lock file's times cannot be set.
    """
    lock = folder / LOCK_NAME
    with contextlib.suppress(OSError):
        lock.touch()
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, stat.S_IREAD | stat.S_IWRITE)
    except OSError:
        return None  # the entry is gone, or not ours to write
    return EntryHold(fd, folder)


def is_busy(folder: Path) -> bool | None:
    """Whether a live process holds ``folder``'s entry (None where this cannot be known)."""
    if not LOCKING:
        return None
    try:
        fd = lock_entry(folder, exclusive=True)
    except BlockingIOError:
        return True
    if fd is not None:
        os.close(fd)
    return False


@contextlib.contextmanager
def held_lock(name: str, *, cache: Cache, timeout_s: float | None = None) -> Iterator[float]:
    """Hold the cache's cross-process lock ``name`` for the ``with`` block.

    An exclusive OS lock on ``locks/<name>.lock`` (:class:`filelock.FileLock`: ``flock`` on
    POSIX, ``LockFileEx`` on Windows): the OS releases it when its holder exits or is killed,
    so a crashed holder never leaves it taken. Lock files are never removed (removing one while
    a process waits on it would let two processes hold "the" lock). The lock file is opened
    without following a symlink, in the private ``locks/`` folder.

    Args:
        name: Which lock: a plain file name (letters, digits, ``-``, ``_``, ``.``).
        cache: The cache.
        timeout_s: Give up after waiting this long (None: wait as long as the holder holds it).

    Yields:
        Seconds spent waiting for another holder.

    Raises:
        ValueError: ``name`` is not a plain file name.
        CacheError: the lock cannot be created, or was not free within ``timeout_s``.
    """
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"A lock name must be a plain file name, not {name!r}.")
    path = cache.folder("locks") / f"{name}.lock"
    lock = filelock.FileLock(
        path,
        timeout=-1 if timeout_s is None else timeout_s,
        mode=0o600,
        thread_local=False,
        poll_interval=_LOCK_POLL_S,
    )
    start = time.monotonic()
    try:
        lock.acquire()
    except filelock.Timeout:
        raise CacheError(
            f"Another process has held the lock '{path}' for more than {timeout_s} s. It is "
            "probably still preparing the model; raise the timeout, or find that process "
            "('lslocks' on Linux shows it). A dead process holds no lock."
        ) from None
    except OSError as exc:
        raise CacheError(
            f"Cannot open the lock file '{path}' ({exc.strerror or exc}). Remove it if it is "
            "not a regular file, or set SHAREDML_CACHE_DIR to a folder of your own."
        ) from exc
    try:
        yield time.monotonic() - start
    finally:
        lock.release()
