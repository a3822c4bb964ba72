"""The cache: every file sharedml keeps between processes, one owner for all of it.

Layout and permission policy (POSIX; the one policy every kind of entry gets)::

    <cache_dir>/                    0700 when sharedml creates it; an existing one may be shared
    │                               only with the sticky bit (like /tmp), else CacheError
    ├── CACHEDIR.TAG                the marker: sharedml uses an existing folder only if it holds
    │                               this file, is empty, or holds nothing but sharedml's own
    ├── <kind>/                     0700, owned by this user, not a symlink: checked on every
    │   │                           use; a lax mode is repaired, another owner is refused
    │   ├── <key>/                  one published entry (0700), never modified after publishing
    │   │   ├── entry.json          what the entry holds: each file's size and SHA-256
    │   │   ├── .lock               not part of the entry: see "In use" below
    │   │   └── <files>             0444
    │   └── .<key prefix>-<owner>-XXXX.tmp/  an entry being built (or a killed build's): never
    │                               read; <owner> (host tag and pid) tells which is which
    ├── stamps/                     0700: "this file, unchanged since, has this digest"
    └── locks/                      0700: empty files that processes lock (:func:`held_lock`)

The kinds of entry (:data:`ENTRY_KINDS`): ``models`` (prepared models, keyed by content: see
:func:`prepared_model_for`), ``prepacked`` (ORT's prepacked form of a prepared model, see
:mod:`sharedml.weights._prepacked`) and ``demo`` (the built-in demo model).

Publishing (:func:`publish`): a builder writes an entry's files into a private temporary folder;
the cache hashes them into ``entry.json``, makes them read-only and renames the folder into
place. Readers therefore never see half an entry; of concurrent builders of one key one rename
wins and the others use the winner's entry. A crashed build leaves only a temporary folder, which
is never read and is removed by :func:`clear_stale` once the process its name records is gone
(or, where that cannot be told, once it is a day old).
Published files are never rewritten in place: a mapped file truncated under a running process
would crash it (SIGBUS).

Publishing needs no lock: losers of the race only waste their build. Where a build is worth
avoiding (replicas of a server starting together on a node, each about to prepare the same large
model), callers serialize on :func:`held_lock` and find the winner's entry once they hold it.

Opening (:func:`open_entry`): an entry is used only if its folder and files pass the policy above
and every file has the size ``entry.json`` records, and the SHA-256 for the files the caller
names. A damaged entry raises :class:`~sharedml.CacheError`; :func:`ensure_entry` moves it aside
and builds it again.

In use: a process that opens an entry takes a shared ``flock`` on its ``.lock`` file and holds
it while it may map the entry's files (:func:`hold_entry`: a weight store, a prepacked model),
touching the lock file's mtime: the entry's "last used". :func:`remove_entries` (``sharedml
cache prune`` and ``clear``) takes an exclusive lock without waiting and skips an entry it
cannot get, so no entry is removed under a live process; a holder that was waiting for the lock
while the entry went sees that its lock file is gone and builds the entry again. Where there is
no ``flock`` (Windows) a holder keeps the lock file open instead; the OS refuses to delete an
open or mapped file there, removal deletes the lock file first and skips the entry at the first
refusal, and stamps are not used (``st_ctime`` is the creation time there, which no write
moves). Removal never follows a symlink: a symlink in the cache is removed itself, its target
left alone; sizes are counted without following links, and a file that several entries
hard-link counts once. What sharedml did not make (in a kind folder: a name that is no key and
holds no ``entry.json``) is reported and never changed or removed.

Trust: the cache is trusted the way a Python ``site-packages`` is. Whoever can write to it can
make every pool run their graph, hence the policy; ``docs/security.md`` has the threat model.

Stamps spare the work that start-up would otherwise repeat in every process: hashing a source
model to find its entry and hashing a weights file to verify it. A stamp records each file's
path as named, the path it resolves to, and its device, inode, size, mtime and ctime; any write
to a file changes its ctime, which no unprivileged process can set back, so a stamp that still
matches names the same bytes. Every path is resolved again when a stamp is recalled, so a
symlink retargeted since (``current.bin -> v2.bin``) misses. The files are snapshotted *before*
their bytes are read (:func:`snapshot`) and a stamp is recorded only if they are unchanged
after, so a write that lands while a file is hashed is never stamped as good. No stamp is
written for a file changed in the last :data:`_RACY_WINDOW_NS` (a write within the timestamp
granularity could leave mtime and ctime as they were; git's index has the same rule).
``SHAREDML_STAMPS=0`` turns stamps off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from sharedml import _host
from sharedml._errors import CacheError, SharedMLError
from sharedml._host import fsync_dir

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCKING = fcntl is not None
"""Whether entries in use are locked with ``flock`` here (POSIX). Windows has none: there a
process holds an entry's lock file open, which the OS then refuses to delete, and only an
attempt to remove an entry tells whether it is in use."""

__all__ = [
    "ENTRY_FILE",
    "ENTRY_KINDS",
    "KEY_CHARS",
    "LOCKING",
    "MARKER_FILE",
    "Built",
    "CacheEntry",
    "Snapshot",
    "CacheSummary",
    "EntryHold",
    "EntryStatus",
    "Removal",
    "cache_dir",
    "cache_summary",
    "check_entries",
    "clear_cache",
    "clear_stale",
    "disk_bytes",
    "ensure_entry",
    "hold_entry",
    "held_lock",
    "iter_entries",
    "kind_folder",
    "lend_hold",
    "list_entries",
    "open_entry",
    "prune_cache",
    "publish",
    "recall_stamp",
    "record_stamp",
    "snapshot",
    "remove_entries",
    "select_entries",
    "temp_is_stale",
    "temp_owner",
    "verified_sha256",
    "verify_entries",
]

ENTRY_KINDS = ("models", "prepacked", "demo")
ENTRY_FILE = "entry.json"
_ENTRY_FORMAT = 1
# seconds: a temporary this old is a dead process's, whoever made it (a pid may be reused)
_STALE_TMP_SECONDS = 24 * 3600
_PRIVATE_DIR_MODE = stat.S_IRWXU  # 0700: other users can neither read nor plant entries
_READ_ONLY_FILE_MODE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # 0444: never rewritten
_TMP_SUFFIX = ".tmp"
_RACY_WINDOW_NS = 3_000_000_000  # a file changed this recently gets no stamp (FAT: 2 s mtimes)
_STAMP_VERSION = 2  # 2: paths as named, resolved again at recall
_LOCK_POLL_S = 0.05  # seconds between attempts while another process holds a lock

CacheDir = str | os.PathLike[str] | None
"""A cache folder argument: a path, or None for :func:`cache_dir`'s default."""

# The cache folder's marker: a cache directory tag (https://bford.info/cachedir/), which backup
# tools also know to skip. sharedml adopts a folder as its cache only when it made it (this
# file, written by sharedml) or the folder is empty: it makes its folders private and removes
# entries, which must never happen to a folder of other data (SHAREDML_CACHE_DIR=/data).
MARKER_FILE = "CACHEDIR.TAG"
_MARKER_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
_MARKER_TEXT = (
    f"{_MARKER_SIGNATURE}\n"
    "# This file is a cache directory tag created by sharedml: this folder is its cache.\n"
    "# For information about cache directory tags, see https://bford.info/cachedir/\n"
)
_OWN_FOLDERS = (*ENTRY_KINDS, "stamps", "locks")
# Names sharedml gives what it creates in a kind folder, stamps/ and locks/. Anything else there
# is not sharedml's: it is reported, never changed or removed.
_KEY_NAMES = {
    "models": re.compile(r"[0-9a-f]{64}"),  # sharedml.prepared._prepare: a SHA-256
    "prepacked": re.compile(r"[0-9a-f]{32}"),  # sharedml.weights._prepacked: half a SHA-256
    "demo": re.compile(r"mlp-v[0-9]+"),  # sharedml.inspection._demo
}
_STAMP_NAME = re.compile(r"[a-z0-9_]+-[0-9a-f]{40}\.json")
_LOCK_FILE_NAME = re.compile(r"[^.].*\.lock")
# Temporary names: ``.<label>-<owner>-<random>.tmp``, where the owner (host tag and pid, see
# temp_owner) tells a dead build's leftovers from a live one's; older sharedml wrote none.
_TEMP_NAME = re.compile(
    r"\.(?P<label>[^/]{0,16}?)-?(?:(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)-)?[a-z0-9_]+\.tmp"
)


def cache_dir(override: CacheDir = None) -> Path:
    """The cache folder: ``override``, ``$SHAREDML_CACHE_DIR``, or the user's cache folder."""
    if override is not None:
        return Path(override)
    env = os.environ.get("SHAREDML_CACHE_DIR")
    if env:
        return Path(env)
    if os.name == "nt":
        base = Path(os.environ.get("LOCALAPPDATA", Path.home() / "AppData" / "Local"))
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "sharedml"


# --------------------------------------------------------------------------------------------
# Temporary files and folders: whose they are, and when they are a dead build's


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
    older_than_s: float = _STALE_TMP_SECONDS,
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
        :data:`_STALE_TMP_SECONDS` (its pid may have been reused by another process).
    """
    alive = _owner_alive(*owner) if owner is not None else None
    if alive is False:
        return True
    try:
        age = (time.time() if now is None else now) - os.lstat(path).st_mtime
    except OSError:
        return False
    return age > (_STALE_TMP_SECONDS if alive else older_than_s)


def _temp_owner_of(name: str) -> tuple[str, int] | Literal[False] | None:
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


# --------------------------------------------------------------------------------------------
# Adopting a folder as the cache


def _is_own_marker(path: Path) -> bool:
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return False
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(4096)
    except OSError:
        return False
    return text.startswith(_MARKER_SIGNATURE) and "created by sharedml" in text


def _is_own_item(folder: str, child: os.DirEntry[str] | Path) -> bool:
    """Whether ``child`` of the cache's ``folder`` (a kind, stamps, locks) is sharedml's.

    An entry is named by its key, or holds an ``entry.json`` (keys given to :func:`publish`
    directly); stamps and locks have names of their own; temporary names end in ``.tmp``.
    """
    name = child.name
    if name.startswith("."):
        return _temp_owner_of(name) is not False
    if folder == "stamps":
        return _STAMP_NAME.fullmatch(name) is not None
    if folder == "locks":
        return _LOCK_FILE_NAME.fullmatch(name) is not None
    shape = _KEY_NAMES.get(folder)
    if shape is not None and shape.fullmatch(name):
        return True
    try:
        return stat.S_ISDIR(os.lstat(child).st_mode) and stat.S_ISREG(
            os.lstat(os.path.join(child, ENTRY_FILE)).st_mode
        )
    except OSError:
        return False


def _foreign_item(root: Path) -> str | None:
    """Something in ``root`` that sharedml did not create (a path), or None if there is none.

    A folder of another user among the kind folders is not looked into: the policy refuses it
    anyway, with its own message (and sharedml changes nothing there).
    """
    try:
        children = list(os.scandir(root))
    except OSError:
        return None  # unreadable: creating or opening anything in it fails with its own error
    for child in children:
        if child.name.startswith(".") and _temp_owner_of(child.name) is not False:
            continue  # a marker being written
        if child.name == MARKER_FILE:
            if not _is_own_marker(Path(child.path)):
                return child.path  # another program's cache folder
            continue
        if child.name not in _OWN_FOLDERS or child.is_symlink() or not child.is_dir():
            if child.name in _OWN_FOLDERS and child.is_symlink():
                continue  # refused by the policy, with its own message; never followed
            return child.path
        try:
            if os.name == "posix" and child.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            grandchildren = list(os.scandir(child.path))
        except OSError:
            continue
        for grandchild in grandchildren:
            if not _is_own_item(child.name, grandchild):
                return grandchild.path
    return None


_ADOPTED: set[tuple[int, int]] = set()  # (device, inode) of cache folders checked in this process


def _adopt(root: Path, st: os.stat_result, *, mark: bool) -> None:
    """Check that ``root`` is sharedml's cache (its marker, or nothing but sharedml's files).

    Args:
        root: The cache folder (it exists).
        st: Its ``stat``.
        mark: Write the marker where it is missing (the folder was empty, or holds only what
            sharedml makes: a cache of a sharedml that wrote no marker).

    Raises:
        CacheError: it holds something sharedml did not create; nothing was changed.
    """
    if (st.st_dev, st.st_ino) in _ADOPTED:
        return
    marker = root / MARKER_FILE
    if not _is_own_marker(marker):
        foreign = _foreign_item(root)
        if foreign is not None:
            raise CacheError(
                f"The folder '{root}' holds '{foreign}', which sharedml did not create, so it "
                "is not used as sharedml's cache: sharedml makes its cache folders private and "
                "removes entries, which must not happen to other data. Point SHAREDML_CACHE_DIR "
                f"at an empty or new folder (e.g. '{root / 'sharedml'}'). Nothing was changed."
            )
        if not mark:
            return
        with contextlib.suppress(OSError):
            fd, tmp = tempfile.mkstemp(prefix=f".{temp_owner()}-", suffix=_TMP_SUFFIX, dir=root)
            try:
                with os.fdopen(fd, "w") as fh:
                    fh.write(_MARKER_TEXT)
                os.chmod(tmp, 0o644)
                os.replace(tmp, marker)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    _ADOPTED.add((st.st_dev, st.st_ino))


def _check_adopted(cache_dir: CacheDir) -> Path:
    """The cache folder, checked to be sharedml's if it exists (nothing is created).

    Raises:
        CacheError: it exists and holds what sharedml did not create.
    """
    root = _root_of(cache_dir)
    try:
        st = root.stat()
    except OSError:
        return root
    if stat.S_ISDIR(st.st_mode):
        _adopt(root, st, mark=False)
    return root


# --------------------------------------------------------------------------------------------
# The permission policy


def _check_root(root: Path) -> None:
    """Create the cache folder (0700) or check that other users cannot replace what is in it.

    An existing folder is adopted only if it is sharedml's (:func:`_adopt`).
    """
    try:
        if not root.exists():
            with contextlib.suppress(FileExistsError):
                root.mkdir(mode=_PRIVATE_DIR_MODE, parents=True)
        st = root.stat()
    except OSError as exc:
        raise CacheError(
            f"The sharedml cache folder '{root}' cannot be created or read ({exc.strerror or exc})."
            " Point SHAREDML_CACHE_DIR at a folder you can write."
        ) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(f"The sharedml cache folder '{root}' is not a folder. Remove it.")
    shared_write = os.name == "posix" and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    # A folder others can write is safe only with the sticky bit (like /tmp): without it,
    # another user could rename our kind folders away and put their own in their place.
    if shared_write and not st.st_mode & stat.S_ISVTX:
        raise CacheError(
            f"The sharedml cache folder '{root}' is writable by other users (mode "
            f"{stat.filemode(st.st_mode)}), who could plant weights that every pool would run. "
            f"Run 'chmod go-w {root}' or choose another folder with SHAREDML_CACHE_DIR."
        )
    _adopt(root, st, mark=True)


def _is_private_dir(path: Path) -> bool:
    """Whether ``path`` is a real folder owned by this user that nobody else may write."""
    if os.name != "posix":
        return path.is_dir()
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _private_dir(path: Path) -> None:
    """Create ``path`` as a 0700 folder, or check that an existing one is ours, and repair it."""
    try:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=_PRIVATE_DIR_MODE)
    except OSError as exc:
        raise CacheError(
            f"Cannot create the sharedml cache folder '{path}' ({exc.strerror or exc}). Check "
            "its parent's permissions and free disk space, or set SHAREDML_CACHE_DIR."
        ) from exc
    if os.name != "posix":
        return
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheError(
            f"The sharedml cache folder '{path}' is not a folder (a symlink or a file). "
            "Remove it; sharedml recreates it."
        )
    if st.st_uid != os.geteuid():
        raise CacheError(
            f"The sharedml cache folder '{path}' belongs to user id {st.st_uid}, not to this "
            f"process's user ({os.geteuid()}): its entries cannot be trusted. Remove it, or point "
            "SHAREDML_CACHE_DIR at a folder of your own."
        )
    if stat.S_IMODE(st.st_mode) != _PRIVATE_DIR_MODE:
        os.chmod(path, _PRIVATE_DIR_MODE)  # other users must not read or plant entries


def kind_folder(kind: str, cache_dir: CacheDir = None) -> Path:
    """The folder of one kind of entry (or ``stamps``, ``locks``), created and checked.

    Raises:
        CacheError: the cache folder or the kind's folder fails the policy.
    """
    root = _root_of(cache_dir)
    _check_root(root)
    folder = root / kind
    _private_dir(folder)
    return folder


def _root_of(override: CacheDir) -> Path:
    return cache_dir(override)


# --------------------------------------------------------------------------------------------
# Entries


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


def _damaged(path: Path, why: str) -> CacheError:
    return CacheError(
        f"The cache entry '{path}' is damaged: {why}. sharedml builds it again; if this "
        "repeats, remove the folder (or run 'sharedml cache clear')."
    )


def _read_entry(kind: str, key: str, path: Path) -> CacheEntry:
    """Parse an entry's record and check its folder and files against the policy (no hashing)."""
    if not _is_private_dir(path):
        raise _damaged(path, "its folder is not a private folder of this user")
    try:
        record = json.loads((path / ENTRY_FILE).read_text())
        if record.get("format") != _ENTRY_FORMAT or record.get("key") != key:
            raise ValueError("written for another key or by another sharedml version")
        files = {str(n): (int(v["bytes"]), str(v["sha256"])) for n, v in record["files"].items()}
        meta = dict(record.get("meta") or {})
        created = float(record.get("created", 0.0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _damaged(path, f"its {ENTRY_FILE} is unreadable ({exc})") from None
    for name, (size, _digest) in files.items():
        if Path(name).name != name or name == ENTRY_FILE:
            raise _damaged(path, f"its record names the file {name!r}")
        try:
            st = os.lstat(path / name)
        except OSError:
            raise _damaged(path, f"'{name}' is missing") from None
        if not stat.S_ISREG(st.st_mode) or (os.name == "posix" and st.st_uid != os.geteuid()):
            raise _damaged(path, f"'{name}' is not a regular file of this user")
        if st.st_size != size:
            raise _damaged(path, f"'{name}' has {st.st_size} bytes, {size} were published")
    return CacheEntry(kind, key, path, files, meta, created)


def open_entry(
    kind: str,
    key: str,
    *,
    cache_dir: CacheDir = None,
    verify: bool | Collection[str] = True,
) -> CacheEntry | None:
    """The published entry ``key`` of ``kind``, checked, or None if there is none.

    Args:
        kind: One of :data:`ENTRY_KINDS`.
        key: The entry's key.
        cache_dir: The cache folder (default: :func:`cache_dir`).
        verify: Which files to check against their recorded SHA-256: all (True), none
            (False: sizes only), or the names given. A stamp spares re-reading a file that
            was verified before and has not changed since.

    Raises:
        CacheError: the entry exists but is damaged, or the cache fails the policy.
    """
    path = kind_folder(kind, cache_dir) / key
    if not os.path.lexists(path):
        return None
    held = _entry_folder(path / ENTRY_FILE)
    hold = _hold(held) if held is not None else None  # not a loan's end: see hold_entry
    if LOCKING and hold is None and not os.path.lexists(path):
        return None  # removed while we waited for its lock
    entry = dataclasses.replace(_read_entry(kind, key, path), hold=hold)
    names = entry.files if verify is True else () if verify is False else verify
    for name in names:
        _size, digest = entry.files[name]
        if not verified_sha256(path / name, digest, cache_dir=cache_dir):
            raise _damaged(path, f"'{name}' does not match the SHA-256 recorded when it was built")
    return entry


def publish(
    kind: str,
    key: str,
    build: Builder,
    *,
    cache_dir: CacheDir = None,
) -> CacheEntry:
    """Build an entry in a private temporary folder and publish it atomically.

    Args:
        kind: One of :data:`ENTRY_KINDS`.
        key: The entry's key, unless the builder names another (:attr:`Built.key`).
        build: Writes the entry's files into the folder it is given; returns metadata to record
            (JSON-ready, or a :class:`Built`) or None. Anything it raises is raised here, with
            nothing published.
        cache_dir: The cache folder (default: :func:`cache_dir`).

    Returns:
        The published entry: ours, or the one another process published first under its key.

    Raises:
        CacheError: the cache fails the policy, or the entry cannot be published.
    """
    folder = kind_folder(kind, cache_dir)
    final = folder / key
    try:
        tmp = Path(
            tempfile.mkdtemp(prefix=f".{key[:16]}-{temp_owner()}-", suffix=_TMP_SUFFIX, dir=folder)
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
            digest = built.sha256.get(produced.name) or _host.sha256_file(produced)
            files[produced.name] = {"bytes": produced.stat().st_size, "sha256": digest}
            os.chmod(produced, _READ_ONLY_FILE_MODE)
        record = {
            "format": _ENTRY_FORMAT,
            "kind": kind,
            "key": key,
            "created": time.time(),
            "files": files,
            "meta": dict(built.meta),
        }
        (tmp / ENTRY_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        os.chmod(tmp / ENTRY_FILE, _READ_ONLY_FILE_MODE)
        try:
            os.rename(tmp, final)  # atomic; fails if another process published first
        except OSError as exc:
            existing = _open_or_none(kind, key, cache_dir)
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
            _rmtree(tmp, ignore_errors=True)
    entry = _open_or_none(kind, key, cache_dir)
    if entry is None:  # pragma: no cover - only if someone deletes the entry meanwhile
        raise CacheError(f"The cache entry '{final}' vanished right after it was published.")
    with contextlib.suppress(OSError):
        clear_stale(cache_dir)  # a new entry is a good moment to sweep dead builds away
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


def _open_or_none(kind: str, key: str, cache_dir: CacheDir) -> CacheEntry | None:
    try:
        return open_entry(kind, key, cache_dir=cache_dir, verify=False)
    except CacheError:
        return None


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
            os.chmod(path, _READ_ONLY_FILE_MODE)
        raise


def _rmtree(path: Path, *, ignore_errors: bool = False) -> None:
    """``shutil.rmtree`` that also deletes the read-only files of an entry on Windows."""
    try:
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_writable_then)
        else:
            shutil.rmtree(path, onerror=_writable_then)
    except OSError:
        if not ignore_errors:
            raise


def _move_aside(path: Path, folder: Path) -> None:
    """Move a damaged entry out of the way (processes that map its files keep their maps)."""
    grave = Path(
        tempfile.mkdtemp(prefix=f".damaged-{temp_owner()}-", suffix=_TMP_SUFFIX, dir=folder)
    )
    os.replace(path, grave / "entry")
    _rmtree(grave, ignore_errors=True)


def ensure_entry(
    kind: str,
    key: str,
    build: Builder,
    *,
    cache_dir: CacheDir = None,
    verify: bool | Collection[str] = True,
) -> CacheEntry:
    """The entry ``key`` of ``kind``: opened and checked if published, else built and published.

    A damaged entry is moved aside (with a warning) and built again. A builder that names
    another key (:attr:`Built.key`) publishes there, and that entry is returned.

    Raises:
        CacheError: the cache fails the policy, or the entry cannot be published.
    """
    try:
        entry = open_entry(kind, key, cache_dir=cache_dir, verify=verify)
    except CacheError as exc:
        path = kind_folder(kind, cache_dir) / key
        if not os.path.lexists(path) or "is damaged" not in str(exc):
            raise
        warnings.warn(str(exc), RuntimeWarning, stacklevel=3)
        _move_aside(path, path.parent)
        entry = None
    if entry is not None:
        return entry
    return publish(kind, key, build, cache_dir=cache_dir)


def iter_entries(kind: str, *, cache_dir: CacheDir = None) -> Iterator[CacheEntry | CacheError]:
    """Every published entry of ``kind`` (unverified), or the error that makes one unusable."""
    folder = kind_folder(kind, cache_dir)
    for child in sorted(folder.iterdir()):
        if child.name.startswith("."):
            continue
        try:
            yield _read_entry(kind, child.name, child)
        except CacheError as exc:
            yield exc


def clear_stale(cache_dir: CacheDir = None, *, older_than_s: float = _STALE_TMP_SECONDS) -> int:
    """Remove temporary folders and files left by builds that were killed; returns how many.

    A temporary is a killed build's when the process its name records is gone from this host
    (:func:`temp_owner`), or when it is older than ``older_than_s`` (names of older sharedml
    record no process; a pid may be reused). A live build's temporary is never removed, in this
    process or another. Only names sharedml gives its temporaries are looked at.

    Args:
        cache_dir: The cache folder (default: :func:`cache_dir`).
        older_than_s: Temporaries untouched for this long are removed whoever made them.
    """
    root = _check_adopted(cache_dir)
    removed = 0
    now = time.time()
    for name in _OWN_FOLDERS:
        folder = root / name
        if not _is_private_dir(folder):
            continue
        for child in folder.iterdir():
            owner = _temp_owner_of(child.name) if child.name.startswith(".") else False
            if owner is False:
                continue
            if not temp_is_stale(child, owner, older_than_s=older_than_s, now=now):
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(os.lstat(child).st_mode):
                    _rmtree(child)
                else:
                    child.unlink()
                removed += 1
    return removed


# --------------------------------------------------------------------------------------------
# In use: entry locks


_LOCK_NAME = ".lock"


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


def _entry_folder(path: Path) -> Path | None:
    """The published entry folder that holds ``path`` (a file of it, or itself), or None."""
    for folder in (path.parent, path):
        if folder.parent.name in ENTRY_KINDS and (folder / ENTRY_FILE).is_file():
            return folder
    return None


def _lock(folder: Path, *, exclusive: bool) -> int | None:
    """A descriptor holding ``folder``'s lock file locked, or None if the entry is gone.

    Shared locks wait; an exclusive lock does not (``BlockingIOError``: the entry is in use).
    The lock file may be removed, with its entry, while we wait for it: then the lock we got
    protects nothing, and the check of the path against the descriptor says so.
    """
    assert LOCKING
    lock = folder / _LOCK_NAME
    flags = os.O_RDONLY | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    while True:
        try:
            fd = os.open(lock, flags, _READ_ONLY_FILE_MODE)
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
    folder = _entry_folder(Path(path))
    hold = _hold(folder) if folder is not None else None
    if hold is not None:
        _end_loan(str(hold.folder))
    return hold


def _hold(folder: Path) -> EntryHold | None:
    if not LOCKING:
        return _hold_open(folder)
    fd = _lock(folder, exclusive=False)
    if fd is None:
        return None
    with contextlib.suppress(OSError):
        os.utime(fd) if os.utime in os.supports_fd else os.utime(folder / _LOCK_NAME)
    return EntryHold(fd, folder)


_LOAN_S = 60.0  # seconds a lent hold waits for the hold that takes it over (see lend_hold)
_loans: dict[str, list[tuple[float, EntryHold]]] = {}  # entry folder -> (deadline, hold)
_loans_lock = threading.Lock()


def lend_hold(entry: CacheEntry) -> None:
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
    _end_expired_loans()


def _end_expired_loans() -> None:
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
    _end_expired_loans()


def _hold_open(folder: Path) -> EntryHold | None:
    """Where there is no ``flock`` (Windows): hold the entry's lock file open instead.

    Windows refuses to delete a file that another handle has open (Python opens files without
    ``FILE_SHARE_DELETE``), and removal deletes the lock file first
    (:func:`_remove_unlocked`), so it stops there while any process holds the entry: also one
    whose files ORT read and closed (a prepacked model it may load again for a new session).
    The last use is recorded first: while a handle is open the lock file's times cannot be set.
    """
    lock = folder / _LOCK_NAME
    with contextlib.suppress(OSError):
        lock.touch()
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, stat.S_IREAD | stat.S_IWRITE)
    except OSError:
        return None  # the entry is gone, or not ours to write
    return EntryHold(fd, folder)


# --------------------------------------------------------------------------------------------
# What the cache holds, and removing it (``sharedml cache ...``)

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
        busy: A live process holds it (None: this platform cannot tell, see :data:`LOCKING`).
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
        locking: :data:`LOCKING`.
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


def _is_busy(folder: Path) -> bool | None:
    """Whether a live process holds ``folder``'s entry (None where this cannot be known)."""
    if not LOCKING:
        return None
    try:
        fd = _lock(folder, exclusive=True)
    except BlockingIOError:
        return True
    if fd is not None:
        os.close(fd)
    return False


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
    if not _is_own_item(kind, child):
        return _foreign_status(kind, child)
    inodes = _tree_inodes(child)
    size = _disk_bytes([inodes])
    try:
        entry = _read_entry(kind, child.name, child)
    except CacheError as exc:
        problem = str(exc)
        if os.path.islink(child):
            problem = f"'{child}' is a symlink, not an entry"
        return EntryStatus(
            kind, child.name, child, size, None, None, None, None, None, problem, inodes=inodes
        )
    try:
        last_used: float | None = os.stat(child / _LOCK_NAME).st_mtime
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
        _is_busy(child),
        linked=linked,
        uses=tuple(sorted({str(u) for u in uses})),
        inodes=inodes,
    )


def _kind_folders(cache_dir: CacheDir) -> Iterator[tuple[str, Path]]:
    """The kind folders that exist and pass the policy; nothing is created.

    Raises:
        CacheError: the cache folder exists and is not sharedml's (see :func:`_adopt`).
    """
    root = _check_adopted(cache_dir)
    for kind in ENTRY_KINDS:
        folder = root / kind
        if _is_private_dir(folder):
            yield kind, folder


def list_entries(*, cache_dir: CacheDir = None) -> list[EntryStatus]:
    """Every entry of the cache, damaged ones included (with their ``problem``), oldest use first.

    What sharedml did not make is listed too, as :attr:`EntryStatus.foreign`. Reads only:
    creates no folder, hashes no file.

    Raises:
        CacheError: the cache folder exists and is not sharedml's.
    """
    _end_expired_loans()  # a loan nobody took must not show its entry as in use
    found = [
        _status(kind, child)
        for kind, folder in _kind_folders(cache_dir)
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
    root = _root_of(cache_dir)
    kinds: dict[str, tuple[int, int]] = {kind: (0, 0) for kind in ENTRY_KINDS}
    seen: set[_Inode] = set()

    def new_bytes(inodes: Mapping[_Inode, tuple[int, int]]) -> int:
        fresh = {i: size for i, (size, _links) in inodes.items() if i not in seen}
        seen.update(fresh)
        return sum(fresh.values())

    temporary = [0, 0]
    foreign = [0, 0]
    for kind, folder in _kind_folders(cache_dir):
        count = size = 0
        for child in folder.iterdir():
            inodes = _tree_inodes(child)
            if not _is_own_item(kind, child):
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
    if _is_private_dir(stamps_folder):
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
            entry = _read_entry(status.kind, status.key, status.path)
            for name, (_size, digest) in sorted(entry.files.items()):
                if _host.sha256_file(status.path / name) != digest:
                    status = dataclasses.replace(
                        status,
                        problem=str(
                            _damaged(
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
            fd = _lock(path, exclusive=True)
        except BlockingIOError:
            return "busy"
        if fd is None:
            return None  # removed meanwhile
        try:
            grave = Path(
                tempfile.mkdtemp(
                    prefix=f".removed-{temp_owner()}-", suffix=_TMP_SUFFIX, dir=path.parent
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
    first: every process that holds the entry keeps it open (:func:`_hold_open`), so removal
    stops at the first refusal with the entry whole ("busy"). Then the largest files (a map
    outside any hold would be of those), ``entry.json`` last. (Moving the folder aside first,
    as where entries are locked, proves nothing here: Wine renames a folder whose files are
    open.) A process opening the entry after its lock file went finds it damaged or gone and
    builds it again.
    """
    names = sorted(
        os.listdir(path),
        key=lambda n: (n != _LOCK_NAME, n == ENTRY_FILE, -os.lstat(path / n).st_size, n),
    )
    for name in names:
        try:
            _rmtree(path / name) if os.path.isdir(path / name) else _unlink(path / name)
        except PermissionError:
            return "busy"
    os.rmdir(path)
    return None


def _unlink(path: Path) -> None:
    """``os.unlink``, which on Windows also deletes a read-only file (entry files are 0444)."""
    try:
        os.unlink(path)
    except PermissionError as exc:
        _writable_then(os.unlink, str(path), exc)


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
    killed builds are removed too (:func:`clear_stale`). What sharedml did not make is left.

    Raises:
        ValueError: neither limit given, or a negative one.
        CacheError: the cache folder exists and is not sharedml's.
    """
    if older_than_s is None and max_bytes is None:
        raise ValueError("Give --older-than DAYS, --max-size SIZE or both.")
    if (older_than_s is not None and older_than_s < 0) or (max_bytes is not None and max_bytes < 0):
        raise ValueError("--older-than and --max-size must not be negative.")
    listed = list_entries(cache_dir=cache_dir)  # least recently used first
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
            clear_stale(cache_dir)
    return result


def clear_cache(*, dry_run: bool = False, cache_dir: CacheDir = None) -> Removal:
    """Remove every entry not in use, every stamp, and what killed builds left.

    What sharedml did not make is left as it was, and reported (``Removal.left``).

    Raises:
        CacheError: the cache folder exists and is not sharedml's.
    """
    result = remove_entries(list_entries(cache_dir=cache_dir), dry_run=dry_run)
    stamps = _root_of(cache_dir) / "stamps"
    if dry_run:
        return result
    if _is_private_dir(stamps):
        for stamp in stamps.iterdir():
            if _STAMP_NAME.fullmatch(stamp.name):
                with contextlib.suppress(OSError):
                    stamp.unlink()
    with contextlib.suppress(OSError):
        clear_stale(cache_dir)  # whether or not there is a stamps/ folder
    return result


# Locks


@contextlib.contextmanager
def held_lock(
    name: str, *, cache_dir: CacheDir = None, timeout_s: float | None = None
) -> Iterator[float]:
    """Hold the cache's cross-process lock ``name`` for the ``with`` block.

    An advisory ``flock`` on ``locks/<name>.lock``: the kernel releases it when its holder exits
    or is killed, so a crashed holder never leaves it taken. Lock files are never removed
    (removing one while a process waits on it would let two processes hold "the" lock). Where
    ``flock`` does not exist (Windows) the block runs unlocked: the cache's atomic publish still
    gives every caller a complete entry, at the cost of duplicate builds.

    Args:
        name: Which lock: a plain file name (letters, digits, ``-``, ``_``, ``.``).
        cache_dir: The cache folder (default: :func:`cache_dir`).
        timeout_s: Give up after waiting this long (None: wait as long as the holder holds it).

    Yields:
        Seconds spent waiting for another holder.

    Raises:
        ValueError: ``name`` is not a plain file name.
        CacheError: the lock cannot be created, or was not free within ``timeout_s``.
    """
    if not name or Path(name).name != name or name.startswith("."):
        raise ValueError(f"A lock name must be a plain file name, not {name!r}.")
    path = kind_folder("locks", cache_dir) / f"{name}.lock"
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise CacheError(
            f"Cannot open the lock file '{path}' ({exc.strerror or exc}). Remove it if it is "
            "not a regular file, or set SHAREDML_CACHE_DIR to a folder of your own."
        ) from exc
    try:
        yield _lock_fd(fd, path, timeout_s)
    finally:
        os.close(fd)  # releases the lock


def _lock_fd(fd: int, path: Path, timeout_s: float | None) -> float:
    """Take an exclusive ``flock`` on ``fd``; returns the seconds waited."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return 0.0
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return time.monotonic() - start
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CacheError(f"Cannot lock '{path}' ({exc.strerror or exc}).") from exc
        waited = time.monotonic() - start
        if timeout_s is not None and waited >= timeout_s:
            raise CacheError(
                f"Another process has held the lock '{path}' for more than {timeout_s} s. It is "
                "probably still preparing the model; raise the timeout, or find that process "
                "('lslocks' on Linux shows it). A dead process holds no lock."
            )
        time.sleep(_LOCK_POLL_S)


# --------------------------------------------------------------------------------------------
# Stamps


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
    cache_dir: CacheDir = None,
) -> str | None:
    """The value recorded for ``path`` (and its companion files) if none of them changed since.

    Every path is resolved again: one that resolves elsewhere now (a retargeted symlink, in
    any component) is a change.

    Args:
        kind: What the value is (``"sha256"``, ``"prepared"``).
        path: The file the value describes, as the caller names it.
        params: Anything else the value depends on (settings), part of the stamp's name.
        cache_dir: The cache folder (default: :func:`cache_dir`).

    Returns:
        The value, or None: no stamp, a file changed, the stamps folder is not private to this
        user (a stamp there could have been planted), or ``$SHAREDML_STAMPS`` is ``0`` (for
        filesystems whose ctime does not move on writes). Never raises.
    """
    if not _stamps_trusted():
        return None
    root = _root_of(cache_dir)
    named = _file_state(path)[0]
    try:
        _check_root(root)
        if not _is_private_dir(root / "stamps"):
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
    cache_dir: CacheDir = None,
) -> bool:
    """Remember ``value`` for the files of ``before``, if they are still as ``before`` saw them.

    ``before`` must have been taken before the bytes ``value`` was computed from were read: a
    file written, replaced or re-linked since then gets no stamp (its next use computes the
    value again). Nothing is recorded either for a file changed within the last
    :data:`_RACY_WINDOW_NS`, nor when the cache folder cannot be written. Never raises.

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
        if st is not None and now - max(st[3], st[4]) < _RACY_WINDOW_NS:
            return False
    record = {
        "version": _STAMP_VERSION,
        "files": [[named, real, st] for named, real, st in before.files],
        "value": value,
    }
    try:
        folder = kind_folder("stamps", cache_dir)
        target = _stamp_path(folder, kind, before.files[0][0], params)
        fd, tmp = tempfile.mkstemp(prefix=f".{temp_owner()}-", suffix=_TMP_SUFFIX, dir=folder)
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


def verified_sha256(path: Path, expected: str, *, cache_dir: CacheDir = None) -> bool:
    """Whether ``path`` has the SHA-256 ``expected``; a stamp spares reading an unchanged file."""
    before = snapshot(path)  # before the read: a write during the hash must not be stamped
    _named, real, st = before.files[0]
    memo = (real, st) if st is not None else None
    if memo is not None and _DIGESTS.get(memo) == expected:
        return True
    if recall_stamp("sha256", path, cache_dir=cache_dir) == expected:
        return True
    digest = _host.sha256_file(path)
    record_stamp("sha256", before, digest, cache_dir=cache_dir)
    if memo is not None and before.taken_again() == before:  # unchanged while it was read
        _DIGESTS[memo] = digest
    return digest == expected
