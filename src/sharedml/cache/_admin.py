"""What the cache holds, and removing it: the functions behind ``sharedml cache ...``.

Sizes never follow a symlink, and a file that several entries hard-link counts once (as ``du``
counts it). Removal never follows a symlink either (a symlink in the cache is removed itself,
its target left alone) and skips an entry a live process holds. What sharedml did not make (in
a kind folder: a name that is no key and holds no ``entry.json``) is reported and never changed
or removed. Reading functions create nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sharedml._errors import CacheError
from sharedml._host import _hashing
from sharedml.cache._entries import clear_stale, damaged, read_entry
from sharedml.cache._files import TMP_SUFFIX, remove_tree, temp_owner, unlink_file
from sharedml.cache._locks import LOCK_NAME, LOCKING, end_expired_loans, is_busy, lock_entry
from sharedml.cache._root import (
    ENTRY_FILE,
    ENTRY_KINDS,
    STAMP_NAME,
    Cache,
    CacheDir,
    is_own_item,
    is_private_dir,
)

__all__ = [
    "KEY_CHARS",
    "CacheSummary",
    "EntryStatus",
    "Removal",
    "cache_summary",
    "check_entries",
    "clear_cache",
    "disk_bytes",
    "list_entries",
    "prune_cache",
    "remove_entries",
    "select_entries",
    "verify_entries",
]

KEY_CHARS = 16
"""How many characters of a key ``sharedml cache`` shows (``--json`` gives whole keys)."""

_Inode = tuple[int, int]  # (device, inode): one file on disk, whatever links name it


@dataclasses.dataclass(frozen=True)
class EntryStatus:
    """One entry of the cache as ``sharedml cache list`` shows it.

    Attributes:
        kind: One of :data:`ENTRY_KINDS`.
        key: Its key (the folder's name).
        path: Its folder.
        size_bytes: Bytes of every file in its folder (symlinks not followed; a file that other
            entries link too is counted here in full, see ``linked``).
        created: When it was published (seconds since the epoch), None if unreadable.
        last_used: When a process last opened it (its lock file's mtime), else ``created``.
        source: The model it was made from, as its builder recorded it.
        ort: The onnxruntime version and build it is valid for (prepacked entries), else None.
        busy: A live process holds it (None: this platform cannot tell, see ``LOCKING``).
        problem: Why it is unusable (damaged, not private, a symlink), else None.
        linked: Its files that other entries hard-link too (identical weights shared across
            models), with the file's link count: removing this entry frees none of their bytes
            while another link remains.
        uses: The entries whose files this one hard-linked when it was built (by key).
        foreign: Not made by sharedml (no key-shaped name, no ``entry.json``): reported, never
            changed or removed.
        inodes: Each file's ``(device, inode)`` -> ``(bytes, links)``: what sizes and removals
            count once, however many entries link a file.
    """

    kind: str
    key: str
    path: Path
    size_bytes: int
    created: float | None
    last_used: float | None
    source: str | None
    ort: str | None
    busy: bool | None
    problem: str | None = None
    linked: Mapping[str, int] = dataclasses.field(default_factory=dict)
    uses: tuple[str, ...] = ()
    foreign: bool = False
    inodes: Mapping[_Inode, tuple[int, int]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``sharedml cache list --json``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["inodes"]
        return fields | {
            "path": str(self.path),
            "linked": dict(self.linked),
            "uses": list(self.uses),
        }


@dataclasses.dataclass(frozen=True)
class CacheSummary:
    """The cache at a glance (``sharedml cache info``).

    Every size counts each file once, however many entries hard-link it (as ``du`` does).

    Attributes:
        root: The cache folder.
        exists: Whether it exists yet.
        size_bytes: Bytes of everything in it (symlinks not followed).
        kinds: ``{kind: (entries, bytes)}`` for every kind of entry; a file linked from
            entries of one kind counts once.
        stamps: ``(files, bytes)`` of the stamps folder.
        temporary: ``(items, bytes)`` of builds in progress or left by killed builds.
        locking: ``sharedml.cache.LOCKING``.
        foreign: ``(items, bytes)`` in the kind folders that sharedml did not make (left alone).
    """

    root: Path
    exists: bool
    size_bytes: int
    kinds: Mapping[str, tuple[int, int]]
    stamps: tuple[int, int]
    temporary: tuple[int, int]
    locking: bool
    foreign: tuple[int, int] = (0, 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``sharedml cache info --json``)."""
        return {
            "root": str(self.root),
            "exists": self.exists,
            "size_bytes": self.size_bytes,
            "kinds": {k: {"entries": n, "bytes": b} for k, (n, b) in self.kinds.items()},
            "stamps": {"files": self.stamps[0], "bytes": self.stamps[1]},
            "temporary": {"folders": self.temporary[0], "bytes": self.temporary[1]},
            "foreign": {"items": self.foreign[0], "bytes": self.foreign[1]},
            "locking": self.locking,
        }


@dataclasses.dataclass(frozen=True)
class Removal:
    """What :func:`remove_entries` (and prune, clear) did.

    Attributes:
        removed: The entries removed (or that would be, with ``dry_run``).
        busy: Entries kept because a live process holds them.
        failed: ``(entry, why)`` for entries that could not be removed.
        freed_bytes: Bytes the removal freed on disk: each file once, and only where no link
            to it remains (a file another entry also links is not freed).
        left: What sharedml did not make, left as it was (see :attr:`EntryStatus.foreign`).
    """

    removed: tuple[EntryStatus, ...]
    busy: tuple[EntryStatus, ...]
    failed: tuple[tuple[EntryStatus, str], ...]
    freed_bytes: int = 0
    left: tuple[EntryStatus, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "removed": [e.to_dict() for e in self.removed],
            "busy": [e.to_dict() for e in self.busy],
            "failed": [e.to_dict() | {"error": why} for e, why in self.failed],
            "left": [e.to_dict() for e in self.left],
            "freed_bytes": self.freed_bytes,
        }


def _tree_inodes(path: Path) -> dict[_Inode, tuple[int, int]]:
    """``(device, inode) -> (bytes, links)`` of the files under ``path``.

    Never follows a symlink: one counts as itself.
    """
    found: dict[_Inode, tuple[int, int]] = {}
    try:
        st = os.lstat(path)
    except OSError:
        return found
    if not stat.S_ISDIR(st.st_mode):
        return {(st.st_dev, st.st_ino): (st.st_size, st.st_nlink)}
    for folder, dirs, files in os.walk(path, followlinks=False):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(folder, d))]:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                found[(st.st_dev, st.st_ino)] = (st.st_size, st.st_nlink)
    return found


def _disk_bytes(parts: Iterable[Mapping[_Inode, tuple[int, int]]]) -> int:
    """Bytes of the files of all ``parts`` together, each file counted once."""
    seen: dict[_Inode, int] = {}
    for inodes in parts:
        for inode, (size, _links) in inodes.items():
            seen[inode] = size
    return sum(seen.values())


def disk_bytes(entries: Iterable[EntryStatus]) -> int:
    """Bytes that ``entries`` take on disk together: a file linked by several counts once."""
    return _disk_bytes(e.inodes for e in entries)


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, each file once, never following a symlink."""
    return _disk_bytes([_tree_inodes(path)])


def _freed_bytes(entries: Iterable[EntryStatus]) -> int:
    """Bytes freed on disk by removing ``entries``: the files none of whose links remain."""
    links: dict[_Inode, int] = {}
    sizes: dict[_Inode, tuple[int, int]] = {}
    for e in entries:
        for inode, (size, nlink) in e.inodes.items():
            links[inode] = links.get(inode, 0) + 1
            sizes[inode] = (size, nlink)
    return sum(size for inode, (size, nlink) in sizes.items() if links[inode] >= nlink)


def _foreign_status(kind: str, child: Path) -> EntryStatus:
    inodes = _tree_inodes(child)
    problem = (
        f"'{child}' was not made by sharedml (no entry key as its name, no {ENTRY_FILE}): "
        "sharedml leaves it as it is; remove it yourself if it is not needed"
    )
    return EntryStatus(
        kind,
        child.name,
        child,
        _disk_bytes([inodes]),
        None,
        None,
        None,
        None,
        None,
        problem,
        foreign=True,
        inodes=inodes,
    )


def _status(kind: str, child: Path) -> EntryStatus:
    if not is_own_item(kind, child):
        return _foreign_status(kind, child)
    inodes = _tree_inodes(child)
    size = _disk_bytes([inodes])
    try:
        entry = read_entry(kind, child.name, child)
    except CacheError as exc:
        problem = str(exc)
        if os.path.islink(child):
            problem = f"'{child}' is a symlink, not an entry"
        return EntryStatus(
            kind, child.name, child, size, None, None, None, None, None, problem, inodes=inodes
        )
    try:
        last_used: float | None = os.stat(child / LOCK_NAME).st_mtime
    except OSError:
        last_used = entry.created
    key_material = entry.meta.get("key_material")
    ort = None
    if isinstance(key_material, Mapping) and key_material.get("ort_version"):
        ort = f"onnxruntime {key_material['ort_version']}"
        commit = [
            part.strip()
            for part in str(key_material.get("ort_build") or "").replace(":", ",").split(",")
            if part.strip().startswith("git-commit-id=")
        ]
        if commit:
            ort += f" ({commit[0]})"
    source = entry.meta.get("source") or entry.meta.get("model")
    linked = {}
    for name in entry.files:
        with contextlib.suppress(OSError):
            links = os.lstat(child / name).st_nlink
            if links > 1:
                linked[name] = links
    shared = entry.meta.get("shared")
    uses = shared.get("files", {}).values() if isinstance(shared, Mapping) else ()
    return EntryStatus(
        kind,
        entry.key,
        child,
        size,
        entry.created,
        last_used,
        str(source) if source is not None else None,
        ort,
        is_busy(child),
        linked=linked,
        uses=tuple(sorted({str(u) for u in uses})),
        inodes=inodes,
    )


def _kind_folders(cache: Cache) -> Iterator[tuple[str, Path]]:
    """The kind folders that exist and pass the policy; nothing is created.

    Raises:
        CacheError: the cache folder exists and is not sharedml's (see :class:`Cache`).
    """
    root = cache.adopted()
    for kind in ENTRY_KINDS:
        folder = root / kind
        if is_private_dir(folder):
            yield kind, folder


def list_entries(*, cache_dir: CacheDir = None) -> list[EntryStatus]:
    """Every entry of the cache, damaged ones included (with their ``problem``), oldest use first.

    What sharedml did not make is listed too, as :attr:`EntryStatus.foreign`. Reads only:
    creates no folder, hashes no file.

    Raises:
        CacheError: the cache folder exists and is not sharedml's.
    """
    end_expired_loans()  # a loan nobody took must not show its entry as in use
    cache = Cache.at(cache_dir)
    found = [
        _status(kind, child)
        for kind, folder in _kind_folders(cache)
        for child in sorted(folder.iterdir())
        if not child.name.startswith(".")
    ]
    # A prepacked entry records the prepared model it was built from: name the user's model.
    sources = {str(e.path): e.source for e in found if e.kind == "models"}
    found = [
        dataclasses.replace(e, source=f"{sources[str(Path(e.source).parent)]} (prepacked)")
        if e.kind == "prepacked" and e.source and sources.get(str(Path(e.source).parent))
        else e
        for e in found
    ]
    return sorted(found, key=lambda e: (e.last_used or 0.0, e.kind, e.key))


def select_entries(entries: Iterable[EntryStatus], keys: Iterable[str]) -> list[EntryStatus]:
    """The entries that ``keys`` name: each a unique prefix of a key, or ``kind/prefix``.

    Raises:
        ValueError: a key names no entry, or more than one.
    """
    entries = list(entries)
    chosen: list[EntryStatus] = []
    for wanted in keys:
        kind, _, prefix = wanted.rpartition("/")
        matches = [
            e
            for e in entries
            if not e.foreign and e.key.startswith(prefix) and kind in ("", e.kind)
        ]
        if not prefix or not matches:
            raise ValueError(
                f"No cache entry has a key starting with {wanted!r}: 'sharedml cache list' "
                "shows the keys."
            )
        if len(matches) > 1:
            names = ", ".join(f"{e.kind}/{e.key[: len(prefix) + 4]}" for e in matches[:4])
            raise ValueError(
                f"{len(matches)} cache entries have keys starting with {wanted!r} ({names}): "
                "give more of the key."
            )
        if matches[0] not in chosen:
            chosen.append(matches[0])
    return chosen


def cache_summary(*, cache_dir: CacheDir = None) -> CacheSummary:
    """The cache's location and what it holds, by kind, each file counted once. Reads only.

    Raises:
        CacheError: the cache folder exists and is not sharedml's.
    """
    cache = Cache.at(cache_dir)
    root = cache.root
    kinds: dict[str, tuple[int, int]] = {kind: (0, 0) for kind in ENTRY_KINDS}
    seen: set[_Inode] = set()

    def new_bytes(inodes: Mapping[_Inode, tuple[int, int]]) -> int:
        fresh = {i: size for i, (size, _links) in inodes.items() if i not in seen}
        seen.update(fresh)
        return sum(fresh.values())

    temporary = [0, 0]
    foreign = [0, 0]
    for kind, folder in _kind_folders(cache):
        count = size = 0
        for child in folder.iterdir():
            inodes = _tree_inodes(child)
            if not is_own_item(kind, child):
                foreign[0] += 1
                foreign[1] += new_bytes(inodes)
            elif child.name.startswith("."):
                temporary[0] += 1
                temporary[1] += new_bytes(inodes)
            else:
                count += 1
                size += new_bytes(inodes)
        kinds[kind] = (count, size)
    stamps_folder = root / "stamps"
    stamps = (0, 0)
    if is_private_dir(stamps_folder):
        names = list(stamps_folder.iterdir())
        stamps = (len(names), sum(new_bytes(_tree_inodes(p)) for p in names))
    return CacheSummary(
        root=root,
        exists=root.is_dir(),
        size_bytes=_tree_bytes(root) if root.is_dir() else 0,
        kinds=kinds,
        stamps=stamps,
        temporary=(temporary[0], temporary[1]),
        locking=LOCKING,
        foreign=(foreign[0], foreign[1]),
    )


def verify_entries(*, cache_dir: CacheDir = None) -> list[EntryStatus]:
    """Every entry, each file read again and checked against its recorded SHA-256.

    Returns:
        The entries as :func:`list_entries` gives them, with ``problem`` set for each one that
        is damaged (no stamp is trusted here: every byte is read). What sharedml did not
        make is listed as :attr:`EntryStatus.foreign`, and not read.
    """
    return check_entries(list_entries(cache_dir=cache_dir))


def check_entries(entries: Iterable[EntryStatus]) -> list[EntryStatus]:
    """``entries`` (from :func:`list_entries`), each file read again and checked."""
    checked = []
    for status in entries:
        if status.problem is None:
            entry = read_entry(status.kind, status.key, status.path)
            for name, (_size, digest) in sorted(entry.files.items()):
                if _hashing.sha256_file(status.path / name) != digest:
                    status = dataclasses.replace(
                        status,
                        problem=str(
                            damaged(
                                status.path,
                                f"'{name}' does not match the SHA-256 recorded when it was built",
                            )
                        ),
                    )
                    break
        checked.append(status)
    return checked


def _remove(status: EntryStatus) -> str | None:
    """Remove one entry unless it is in use: None when removed, "busy", or why it failed."""
    path = status.path
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)  # a symlink (or a stray file) goes itself; its target stays
            return None
        if not LOCKING:
            return _remove_unlocked(path)
        try:
            fd = lock_entry(path, exclusive=True)
        except BlockingIOError:
            return "busy"
        if fd is None:
            return None  # removed meanwhile
        try:
            grave = Path(
                tempfile.mkdtemp(
                    prefix=f".removed-{temp_owner()}-", suffix=TMP_SUFFIX, dir=path.parent
                )
            )
            os.rename(path, grave / "entry")
        finally:
            os.close(fd)
        shutil.rmtree(grave)
        return None
    except PermissionError as exc:
        # Windows refuses to delete a file that a process has mapped: in use.
        return "busy" if not LOCKING else f"{exc.strerror or exc}"
    except OSError as exc:
        return f"{exc.strerror or exc}"


def _remove_unlocked(path: Path) -> str | None:
    """Remove an entry where there is no ``flock`` (Windows): its files in place.

    Windows refuses to delete a file that a process has open or mapped. The lock file goes
    first: every process that holds the entry keeps it open (``hold_entry``), so removal
    stops at the first refusal with the entry whole ("busy"). Then the largest files (a map
    outside any hold would be of those), ``entry.json`` last. (Moving the folder aside first,
    as where entries are locked, proves nothing here: Wine renames a folder whose files are
    open.) A process opening the entry after its lock file went finds it damaged or gone and
    builds it again.
    """
    names = sorted(
        os.listdir(path),
        key=lambda n: (n != LOCK_NAME, n == ENTRY_FILE, -os.lstat(path / n).st_size, n),
    )
    for name in names:
        try:
            remove_tree(path / name) if os.path.isdir(path / name) else unlink_file(path / name)
        except PermissionError:
            return "busy"
    os.rmdir(path)
    return None


def remove_entries(entries: Collection[EntryStatus], *, dry_run: bool = False) -> Removal:
    """Remove ``entries`` (as :func:`list_entries` gives them), skipping those in use.

    Each entry is moved out of its kind folder under its exclusive lock, then deleted: a
    process opening it meanwhile finds no entry and builds it again. What sharedml did not
    make (:attr:`EntryStatus.foreign`) is never removed: it is reported in ``left``.

    Args:
        entries: What to remove.
        dry_run: Report what would be removed; remove nothing.
    """
    removed: list[EntryStatus] = []
    busy: list[EntryStatus] = []
    failed: list[tuple[EntryStatus, str]] = []
    left: list[EntryStatus] = []
    for status in entries:
        if status.foreign:
            left.append(status)
            continue
        if dry_run:
            (busy if status.busy else removed).append(status)
            continue
        outcome = _remove(status)
        if outcome is None:
            removed.append(status)
        elif outcome == "busy":
            busy.append(status)
        else:
            failed.append((status, outcome))
    return Removal(tuple(removed), tuple(busy), tuple(failed), _freed_bytes(removed), tuple(left))


def _by_size(
    entries: list[EntryStatus], chosen: list[EntryStatus], max_bytes: int
) -> list[EntryStatus]:
    """The least recently used entries to remove so that the rest take at most ``max_bytes``.

    Each file counts once, however many entries link it: removing an entry whose files other
    entries still link frees nothing of them. Entries are taken oldest use first until the
    rest fit; then each taken entry that the target did not need (newest first) is given back.
    Busy entries are taken too (to report them as kept) but free nothing.
    """
    gone = {id(e) for e in chosen}
    kept = [e for e in entries if id(e) not in gone]

    def disk(group: list[EntryStatus]) -> int:
        return _disk_bytes(e.inodes for e in group)

    taken: list[EntryStatus] = []
    for e in entries:
        if disk(kept) <= max_bytes:
            break
        if id(e) in gone:
            continue
        taken.append(e)
        if not e.busy:
            kept.remove(e)
    for e in reversed(list(taken)):
        if not e.busy and disk([*kept, e]) <= max_bytes:
            kept.append(e)
            taken.remove(e)
    return taken


def prune_cache(
    *,
    older_than_s: float | None = None,
    max_bytes: int | None = None,
    dry_run: bool = False,
    cache_dir: CacheDir = None,
) -> Removal:
    """Remove damaged entries and old ones, then the least recently used down to a size.

    Damaged entries go first, then entries unused for ``older_than_s``, then the least
    recently used until the entries take at most ``max_bytes`` on disk (each file once, as
    ``du`` counts it), and no more than that needs; entries in use are kept. Temporaries of
    killed builds are removed too (``clear_stale``). What sharedml did not make is left.

    Raises:
        ValueError: neither limit given, or a negative one.
        CacheError: the cache folder exists and is not sharedml's.
    """
    if older_than_s is None and max_bytes is None:
        raise ValueError("Give --older-than DAYS, --max-size SIZE or both.")
    if older_than_s is not None and not 0 <= older_than_s < math.inf:  # NaN too
        raise ValueError(
            f"--older-than must be a finite number of days, at least 0, not {older_than_s!r} "
            "(older_than_s)."
        )
    if max_bytes is not None and max_bytes < 0:
        raise ValueError("--max-size must not be negative.")
    cache = Cache.at(cache_dir)
    listed = list_entries(cache_dir=cache)  # least recently used first
    entries = [e for e in listed if not e.foreign]
    now = time.time()
    chosen = [
        e
        for e in entries
        if e.problem is not None
        or (older_than_s is not None and now - (e.last_used or 0.0) > older_than_s)
    ]
    if max_bytes is not None:
        taken = {id(e) for e in chosen + _by_size(entries, chosen, max_bytes)}
        chosen = [e for e in entries if id(e) in taken]
    # What sharedml did not make is passed on only to be reported as left alone.
    result = remove_entries(chosen + [e for e in listed if e.foreign], dry_run=dry_run)
    if not dry_run:
        with contextlib.suppress(OSError):
            clear_stale(cache)
    return result


def clear_cache(*, dry_run: bool = False, cache_dir: CacheDir = None) -> Removal:
    """Remove every entry not in use, every stamp, and what killed builds left.

    What sharedml did not make is left as it was, and reported (``Removal.left``).

    Raises:
        CacheError: the cache folder exists and is not sharedml's.
    """
    cache = Cache.at(cache_dir)
    result = remove_entries(list_entries(cache_dir=cache), dry_run=dry_run)
    stamps = cache.root / "stamps"
    if dry_run:
        return result
    if is_private_dir(stamps):
        for stamp in stamps.iterdir():
            if STAMP_NAME.fullmatch(stamp.name):
                with contextlib.suppress(OSError):
                    stamp.unlink()
    with contextlib.suppress(OSError):
        clear_stale(cache)  # whether or not there is a stamps/ folder
    return result
