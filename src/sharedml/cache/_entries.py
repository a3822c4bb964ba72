"""Entries: publishing an entry atomically, opening it checked, building it once.

Publishing (:func:`publish`): a builder writes an entry's files into a private temporary folder;
the cache hashes them into ``entry.json``, makes them read-only and renames the folder into
place. Readers therefore never see half an entry; of concurrent builders of one key one rename
wins and the others use the winner's entry. A crashed build leaves only a temporary folder, which
is never read and is removed by :func:`clear_stale` once the process its name records is gone
(or, where that cannot be told, once it is a day old). Published files are never rewritten in
place: a mapped file truncated under a running process would crash it (SIGBUS).

Opening (:func:`open_entry`): an entry is used only if its folder and files pass the policy and
every file has the size ``entry.json`` records, and the SHA-256 for the files the caller names.
A damaged entry raises :class:`~sharedml.CacheError`; :func:`ensure_entry` moves it aside and
builds it again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from sharedml._errors import CacheError, SharedMLError
from sharedml._host import _hashing
from sharedml._host._files import fsync_dir
from sharedml.cache._files import (
    READ_ONLY_FILE_MODE,
    STALE_TMP_SECONDS,
    TMP_SUFFIX,
    remove_tree,
    temp_is_stale,
    temp_owner,
    temp_owner_of,
)
from sharedml.cache._locks import LOCKING, EntryHold, entry_folder, hold_folder
from sharedml.cache._root import ENTRY_FILE, OWN_FOLDERS, Cache, is_private_dir
from sharedml.cache._stamps import verified_sha256

__all__ = [
    "Builder",
    "Built",
    "CacheEntry",
    "clear_stale",
    "damaged",
    "ensure_entry",
    "iter_entries",
    "open_entry",
    "publish",
    "read_entry",
]

_ENTRY_FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One published entry of the cache.

    Attributes:
        kind: One of :data:`ENTRY_KINDS`.
        key: Its key (a content hash for ``models`` and ``prepacked``).
        path: Its folder.
        files: ``{name: (size in bytes, hex SHA-256)}`` of every file it holds.
        meta: What its builder recorded (the source model, the ORT build, ...).
        created: When it was published (seconds since the epoch).
    """

    kind: str
    key: str
    path: Path
    files: Mapping[str, tuple[int, str]]
    meta: Mapping[str, Any]
    created: float
    hold: EntryHold | None = dataclasses.field(default=None, compare=False, repr=False)
    """The shared lock that keeps the entry from removal while this object lives."""

    def file(self, name: str) -> Path:
        """The path of one of its files."""
        if name not in self.files:
            raise KeyError(f"Cache entry '{self.path}' holds no file '{name}'.")
        return self.path / name

    @property
    def size_bytes(self) -> int:
        """Bytes of its files on disk."""
        return sum(size for size, _ in self.files.values())

    def link_file(self, name: str, folder: Path, prefix: str, suffix: str) -> str | None:
        """Hard-link its file ``name`` into ``folder`` (an entry being built) for sharing.

        The link is named by the file's recorded SHA-256 (``prefix + sha[:16] + suffix``), so
        one file linked for several tensors, or already linked, is linked once. Returns the
        link's name, or None where this file system makes no hard link (the caller keeps its
        own copy). The bytes are not checked here: the recorded hash is another entry's word.
        """
        _size, digest = self.files[name]
        link = f"{prefix}{digest[:16]}{suffix}"
        if not (folder / link).exists():
            try:
                os.link(self.file(name), folder / link)
            except OSError:
                return None
        return link


@dataclasses.dataclass(frozen=True)
class Built:
    """What an entry's builder may return: metadata to record, and digests it already knows.

    Attributes:
        meta: JSON-ready metadata recorded in ``entry.json``.
        sha256: Hex SHA-256 of files the builder computed while writing them, by file name;
            the cache hashes the others.
        key: The key the built files belong to, where the builder derived it from the very
            bytes it read; None: the key the entry was asked for. A builder whose source
            changed after its caller computed the key thus publishes under the new content's
            key, and no key ever names other bytes than its own.
    """

    meta: Mapping[str, Any]
    sha256: Mapping[str, str] = dataclasses.field(default_factory=dict)
    key: str | None = None


Builder = Callable[[Path], "Built | Mapping[str, Any] | None"]
"""Writes an entry's files into the folder it is given (see :func:`publish`)."""


def damaged(path: Path, why: str) -> CacheError:
    return CacheError(
        f"The cache entry '{path}' is damaged: {why}. sharedml builds it again; if this "
        "repeats, remove the folder (or run 'sharedml cache clear')."
    )


def read_entry(kind: str, key: str, path: Path) -> CacheEntry:
    """Parse an entry's record and check its folder and files against the policy (no hashing)."""
    if not is_private_dir(path):
        raise damaged(path, "its folder is not a private folder of this user")
    try:
        record = json.loads((path / ENTRY_FILE).read_text())
        if record.get("format") != _ENTRY_FORMAT or record.get("key") != key:
            raise ValueError("written for another key or by another sharedml version")
        files = {str(n): (int(v["bytes"]), str(v["sha256"])) for n, v in record["files"].items()}
        meta = dict(record.get("meta") or {})
        created = float(record.get("created", 0.0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise damaged(path, f"its {ENTRY_FILE} is unreadable ({exc})") from None
    for name, (size, _digest) in files.items():
        if Path(name).name != name or name == ENTRY_FILE:
            raise damaged(path, f"its record names the file {name!r}")
        try:
            st = os.lstat(path / name)
        except OSError:
            raise damaged(path, f"'{name}' is missing") from None
        if not stat.S_ISREG(st.st_mode) or (os.name == "posix" and st.st_uid != os.geteuid()):
            raise damaged(path, f"'{name}' is not a regular file of this user")
        if st.st_size != size:
            raise damaged(path, f"'{name}' has {st.st_size} bytes, {size} were published")
    return CacheEntry(kind, key, path, files, meta, created)


def open_entry(
    kind: str,
    key: str,
    *,
    cache: Cache,
    verify: bool | Collection[str] = True,
) -> CacheEntry | None:
    """The published entry ``key`` of ``kind``, checked, or None if there is none.

    Args:
        kind: One of :data:`ENTRY_KINDS`.
        key: The entry's key.
        cache: The cache.
        verify: Which files to check against their recorded SHA-256: all (True), none
            (False: sizes only), or the names given. A stamp spares re-reading a file that
            was verified before and has not changed since.

    Raises:
        CacheError: the entry exists but is damaged, or the cache fails the policy.
    """
    path = cache.folder(kind) / key
    if not os.path.lexists(path):
        return None
    held = entry_folder(path / ENTRY_FILE)
    hold = hold_folder(held) if held is not None else None  # not a loan's end: see hold_entry
    if LOCKING and hold is None and not os.path.lexists(path):
        return None  # removed while we waited for its lock
    entry = dataclasses.replace(read_entry(kind, key, path), hold=hold)
    names = entry.files if verify is True else () if verify is False else verify
    for name in names:
        _size, digest = entry.files[name]
        if not verified_sha256(path / name, digest, cache=cache):
            raise damaged(path, f"'{name}' does not match the SHA-256 recorded when it was built")
    return entry


def publish(
    kind: str,
    key: str,
    build: Builder,
    *,
    cache: Cache,
) -> CacheEntry:
    """Build an entry in a private temporary folder and publish it atomically.

    Args:
        kind: One of :data:`ENTRY_KINDS`.
        key: The entry's key, unless the builder names another (:attr:`Built.key`).
        build: Writes the entry's files into the folder it is given; returns metadata to record
            (JSON-ready, or a :class:`Built`) or None. Anything it raises is raised here, with
            nothing published.
        cache: The cache.

    Returns:
        The published entry: ours, or the one another process published first under its key.

    Raises:
        CacheError: the cache fails the policy, or the entry cannot be published.
    """
    folder = cache.folder(kind)
    final = folder / key
    try:
        tmp = Path(
            tempfile.mkdtemp(prefix=f".{key[:16]}-{temp_owner()}-", suffix=TMP_SUFFIX, dir=folder)
        )
    except OSError as exc:
        raise CacheError(
            f"Cannot write to the sharedml cache folder '{folder}' ({exc.strerror or exc}). "
            "Free some disk space or set SHAREDML_CACHE_DIR."
        ) from exc
    try:
        built = build(tmp)
        if not isinstance(built, Built):
            built = Built(meta=built or {})
        if built.key is not None:
            if Path(built.key).name != built.key or built.key.startswith("."):
                raise CacheError(f"A cache builder named the entry key {built.key!r}.")
            key, final = built.key, folder / built.key
        files: dict[str, dict[str, Any]] = {}
        for produced in sorted(tmp.iterdir()):
            if not produced.is_file() or produced.is_symlink():
                raise CacheError(f"The cache builder left '{produced}', which is not a file.")
            digest = built.sha256.get(produced.name) or _hashing.sha256_file(produced)
            files[produced.name] = {"bytes": produced.stat().st_size, "sha256": digest}
            os.chmod(produced, READ_ONLY_FILE_MODE)
        record = {
            "format": _ENTRY_FORMAT,
            "kind": kind,
            "key": key,
            "created": time.time(),
            "files": files,
            "meta": dict(built.meta),
        }
        (tmp / ENTRY_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        os.chmod(tmp / ENTRY_FILE, READ_ONLY_FILE_MODE)
        try:
            os.rename(tmp, final)  # atomic; fails if another process published first
        except OSError as exc:
            existing = _open_or_none(kind, key, cache)
            if existing is not None:
                return existing
            if not os.path.lexists(final):
                raise CacheError(
                    f"Could not publish the cache entry '{final}': {exc.strerror or exc}."
                ) from exc
            _move_aside(final, folder)  # a damaged leftover: ours takes its place
            os.rename(tmp, final)
        fsync_dir(folder)
    except SharedMLError:
        raise  # the builder's own errors (some are OSErrors too: UnsafePathError)
    except OSError as exc:
        raise _write_error(final, exc) from exc
    finally:
        if tmp.exists():
            remove_tree(tmp, ignore_errors=True)
    entry = _open_or_none(kind, key, cache)
    if entry is None:  # pragma: no cover - only if someone deletes the entry meanwhile
        raise CacheError(f"The cache entry '{final}' vanished right after it was published.")
    with contextlib.suppress(OSError):
        clear_stale(cache)  # a new entry is a good moment to sweep dead builds away
    return entry


_EDQUOT = getattr(errno, "EDQUOT", errno.ENOSPC)


def _write_error(final: Path, exc: OSError) -> CacheError:
    """A :class:`CacheError` for a failed write: the file, the OS's reason and the fix for it."""
    what = f"'{exc.filename}'" if exc.filename else "a file"
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, _EDQUOT):
        fix = "free some disk space, or set SHAREDML_CACHE_DIR to a folder with room"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        fix = (
            f"check who owns '{final.parent}' and its files (sharedml writes only files of its "
            "own, so this is a bug if nobody changed them: please report it), or set "
            "SHAREDML_CACHE_DIR to a folder of your own"
        )
    elif exc.errno == errno.EROFS:
        fix = "the cache is on a read-only filesystem: set SHAREDML_CACHE_DIR to a writable folder"
    else:
        fix = "set SHAREDML_CACHE_DIR to another folder if this repeats"
    return CacheError(f"Writing the cache entry '{final}' failed at {what} ({reason}): {fix}.")


def _open_or_none(kind: str, key: str, cache: Cache) -> CacheEntry | None:
    try:
        return open_entry(kind, key, cache=cache, verify=False)
    except CacheError:
        return None


def _move_aside(path: Path, folder: Path) -> None:
    """Move a damaged entry out of the way (processes that map its files keep their maps)."""
    grave = Path(
        tempfile.mkdtemp(prefix=f".damaged-{temp_owner()}-", suffix=TMP_SUFFIX, dir=folder)
    )
    os.replace(path, grave / "entry")
    remove_tree(grave, ignore_errors=True)


def ensure_entry(
    kind: str,
    key: str,
    build: Builder,
    *,
    cache: Cache,
    verify: bool | Collection[str] = True,
) -> CacheEntry:
    """The entry ``key`` of ``kind``: opened and checked if published, else built and published.

    A damaged entry is moved aside (with a warning) and built again. A builder that names
    another key (:attr:`Built.key`) publishes there, and that entry is returned.

    Raises:
        CacheError: the cache fails the policy, or the entry cannot be published.
    """
    try:
        entry = open_entry(kind, key, cache=cache, verify=verify)
    except CacheError as exc:
        path = cache.folder(kind) / key
        if not os.path.lexists(path) or "is damaged" not in str(exc):
            raise
        warnings.warn(str(exc), RuntimeWarning, stacklevel=3)
        _move_aside(path, path.parent)
        entry = None
    if entry is not None:
        return entry
    return publish(kind, key, build, cache=cache)


def iter_entries(kind: str, *, cache: Cache) -> Iterator[CacheEntry | CacheError]:
    """Every published entry of ``kind`` (unverified), or the error that makes one unusable."""
    folder = cache.folder(kind)
    for child in sorted(folder.iterdir()):
        if child.name.startswith("."):
            continue
        try:
            yield read_entry(kind, child.name, child)
        except CacheError as exc:
            yield exc


def clear_stale(cache: Cache, *, older_than_s: float = STALE_TMP_SECONDS) -> int:
    """Remove temporary folders and files left by builds that were killed; returns how many.

    A temporary is a killed build's when the process its name records is gone from this host
    (:func:`temp_owner`), or when it is older than ``older_than_s`` (names of older sharedml
    record no process; a pid may be reused). A live build's temporary is never removed, in this
    process or another. Only names sharedml gives its temporaries are looked at.

    Args:
        cache: The cache.
        older_than_s: Temporaries untouched for this long are removed whoever made them.
    """
    root = cache.adopted()
    removed = 0
    now = time.time()
    for name in OWN_FOLDERS:
        folder = root / name
        if not is_private_dir(folder):
            continue
        for child in folder.iterdir():
            owner = temp_owner_of(child.name) if child.name.startswith(".") else False
            if owner is False:
                continue
            if not temp_is_stale(child, owner, older_than_s=older_than_s, now=now):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(child).st_mode):
                    remove_tree(child)
                else:
                    child.unlink()
                removed += 1
    return removed
