"""Stamps: "this file, unchanged since, has this digest", so start-up need not hash it again.

A stamp records each file's path as named, the path it resolves to, and its device, inode,
size, mtime and ctime; any write to a file changes its ctime, which no unprivileged process can
set back, so a stamp that still matches names the same bytes. Every path is resolved again when
a stamp is recalled, so a symlink retargeted since (``current.bin -> v2.bin``) misses. The files
are snapshotted *before* their bytes are read (:func:`snapshot`) and a stamp is recorded only
if they are unchanged after, so a write that lands while a file is hashed is never stamped as
good. No stamp is written for a file changed in the last :data:`RACY_WINDOW_NS` (a write within
the timestamp granularity could leave mtime and ctime as they were; git's index has the same
rule). ``SHAREDML_STAMPS=0`` turns stamps off, and Windows gets none (its ``st_ctime`` is the
creation time, which no write moves).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import stat
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from sharedml._errors import CacheError
from sharedml._host import _hashing
from sharedml.cache._files import TMP_SUFFIX, temp_owner
from sharedml.cache._root import Cache, is_private_dir

__all__ = [
    "RACY_WINDOW_NS",
    "Snapshot",
    "recall_stamp",
    "record_stamp",
    "snapshot",
    "verified_sha256",
]

RACY_WINDOW_NS = 3_000_000_000  # a file changed this recently gets no stamp (FAT: 2 s mtimes)
_STAMP_VERSION = 2  # 2: paths as named, resolved again at recall


_Stamp = tuple[int, ...]
_FileState = tuple[str, str, _Stamp | None]  # path as named, resolved path, its stamp


def _file_stamp(path: Path) -> _Stamp | None:
    """Device, inode, size, mtime and ctime of ``path`` (following links); None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _file_state(path: str | os.PathLike[str]) -> _FileState:
    named = str(Path(path).absolute())  # not normalized: "a/link/../b" resolves as the OS does
    try:
        real = os.path.realpath(named)
    except OSError:  # a link changed while it was resolved: record_stamp refuses this state
        return named, "", None
    return named, real, _file_stamp(Path(real))


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Files as they were before their bytes were read: what a stamp may vouch for.

    Take it with :func:`snapshot` *before* reading the files, compute the value, then pass it
    to :func:`record_stamp`, which records the value only if every file is still as it was.

    Attributes:
        files: ``(path as named, the path it resolved to, its stamp or None if absent)`` for
            the file the value describes, then for each companion file.
    """

    files: tuple[_FileState, ...]

    def extended(self, companions: Iterable[str | os.PathLike[str]]) -> Snapshot:
        """This snapshot plus ``companions``, taken now (before they are read)."""
        return Snapshot(self.files + tuple(_file_state(c) for c in companions))

    def taken_again(self) -> Snapshot:
        """The same files now, every path resolved again."""
        return Snapshot(tuple(_file_state(named) for named, _real, _stamp in self.files))


def snapshot(
    path: str | os.PathLike[str], companions: Iterable[str | os.PathLike[str]] = ()
) -> Snapshot:
    """Snapshot ``path`` and ``companions`` (present or absent) before reading them."""
    return Snapshot((_file_state(path),)).extended(companions)


def _stamp_path(folder: Path, kind: str, named: str, params: str) -> Path:
    name = hashlib.sha256(f"{kind}\0{named}\0{params}".encode()).hexdigest()
    return folder / f"{kind}-{name[:40]}.json"


def _stamps_trusted() -> bool:
    """Whether a stamp can prove a file unchanged here.

    Not on Windows: its ``st_ctime`` is the file's creation time, which no write moves, so a
    file rewritten in place with its mtime put back would keep its stamp. Nor where
    ``$SHAREDML_STAMPS`` is ``0`` (file systems whose ctime does not move on writes).
    """
    return os.name != "nt" and os.environ.get("SHAREDML_STAMPS") != "0"


def recall_stamp(
    kind: str,
    path: str | os.PathLike[str],
    params: str = "",
    *,
    cache: Cache,
) -> str | None:
    """The value recorded for ``path`` (and its companion files) if none of them changed since.

    Every path is resolved again: one that resolves elsewhere now (a retargeted symlink, in
    any component) is a change.

    Args:
        kind: What the value is (``"sha256"``, ``"prepared"``).
        path: The file the value describes, as the caller names it.
        params: Anything else the value depends on (settings), part of the stamp's name.
        cache: The cache.

    Returns:
        The value, or None: no stamp, a file changed, the stamps folder is not private to this
        user (a stamp there could have been planted), or ``$SHAREDML_STAMPS`` is ``0`` (for
        filesystems whose ctime does not move on writes). Never raises.
    """
    if not _stamps_trusted():
        return None
    named = _file_state(path)[0]
    try:
        root = cache.checked_root()
        if not is_private_dir(root / "stamps"):
            return None
        record = json.loads(_stamp_path(root / "stamps", kind, named, params).read_text())
        if record.get("version") != _STAMP_VERSION or not record.get("files"):
            return None
        recorded = Snapshot(
            tuple(
                (str(n), str(r), tuple(int(v) for v in st) if st is not None else None)
                for n, r, st in record["files"]
            )
        )
        if recorded.files[0][0] != named or recorded.taken_again() != recorded:
            return None
        value = record["value"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, CacheError):
        return None
    return value if isinstance(value, str) else None


def record_stamp(
    kind: str,
    before: Snapshot,
    value: str,
    params: str = "",
    *,
    cache: Cache,
) -> bool:
    """Remember ``value`` for the files of ``before``, if they are still as ``before`` saw them.

    ``before`` must have been taken before the bytes ``value`` was computed from were read: a
    file written, replaced or re-linked since then gets no stamp (its next use computes the
    value again). Nothing is recorded either for a file changed within the last
    :data:`RACY_WINDOW_NS`, nor when the cache folder cannot be written. Never raises.

    Returns:
        True if the stamp was written.
    """
    if not _stamps_trusted():
        return False
    if not before.files or before.files[0][2] is None or before.taken_again() != before:
        return False
    if any(not real for _named, real, _stamp in before.files):  # a path that did not resolve
        return False
    now = time.time_ns()
    for _named, _real, st in before.files:
        if st is not None and now - max(st[3], st[4]) < RACY_WINDOW_NS:
            return False
    record = {
        "version": _STAMP_VERSION,
        "files": [[named, real, st] for named, real, st in before.files],
        "value": value,
    }
    try:
        folder = cache.folder("stamps")
        target = _stamp_path(folder, kind, before.files[0][0], params)
        fd, tmp = tempfile.mkstemp(prefix=f".{temp_owner()}-", suffix=TMP_SUFFIX, dir=folder)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, CacheError):
        return False
    return True


# Digests this process computed, by (path, file stamp): a file verified a moment ago (by the
# cache, then by the weight store) is not read again while its stamp is unchanged, also within
# the racy window in which no stamp is persisted.
_DIGESTS: dict[tuple[str, _Stamp], str] = {}


def verified_sha256(path: Path, expected: str, *, cache: Cache) -> bool:
    """Whether ``path`` has the SHA-256 ``expected``; a stamp spares reading an unchanged file."""
    before = snapshot(path)  # before the read: a write during the hash must not be stamped
    _named, real, st = before.files[0]
    memo = (real, st) if st is not None else None
    if memo is not None and _DIGESTS.get(memo) == expected:
        return True
    if recall_stamp("sha256", path, cache=cache) == expected:
        return True
    digest = _hashing.sha256_file(path)
    record_stamp("sha256", before, digest, cache=cache)
    if memo is not None and before.taken_again() == before:  # unchanged while it was read
        _DIGESTS[memo] = digest
    return digest == expected
