"""The cache folder: where it is, whether it is sharedml's, and the policy every folder gets.

:class:`Cache` is the folder resolved once (``cache_dir=``, ``$SHAREDML_CACHE_DIR``, or the
user's cache folder as :mod:`platformdirs` names it) and checked once when first written: created
0700, or, if it exists, adopted only if it is sharedml's (its ``CACHEDIR.TAG`` marker, or nothing
but what sharedml makes) and nobody else may replace what is in it. Every kind folder
(``models/``, ``prepacked/``, ``demo/``, ``stamps/``, ``locks/``) is checked on each use: a real
folder of this user, 0700 (a lax mode is repaired, another owner refused). The layout and the
policy as a whole: :mod:`sharedml.cache`.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
import threading
from pathlib import Path

import platformdirs

from sharedml._errors import CacheError
from sharedml._host import _files
from sharedml.cache._files import PRIVATE_DIR_MODE, TMP_SUFFIX, temp_owner, temp_owner_of

__all__ = [
    "ENTRY_FILE",
    "ENTRY_KINDS",
    "MARKER_FILE",
    "OWN_FOLDERS",
    "STAMP_NAME",
    "Cache",
    "CacheDir",
    "cache_dir",
    "is_own_item",
    "is_private_dir",
]

ENTRY_KINDS = ("models", "prepacked", "demo")
ENTRY_FILE = "entry.json"

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
OWN_FOLDERS = (*ENTRY_KINDS, "stamps", "locks")
# Names sharedml gives what it creates in a kind folder, stamps/ and locks/. Anything else there
# is not sharedml's: it is reported, never changed or removed.
_KEY_NAMES = {
    "models": re.compile(r"[0-9a-f]{64}"),  # sharedml.prepared._prepare: a SHA-256
    "prepacked": re.compile(r"[0-9a-f]{32}"),  # sharedml.weights._prepacked: half a SHA-256
    "demo": re.compile(r"mlp-v[0-9]+"),  # sharedml.inspection._demo
}
STAMP_NAME = re.compile(r"[a-z0-9_]+-[0-9a-f]{40}\.json")
_LOCK_FILE_NAME = re.compile(r"[^.].*\.lock")


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache folder: ``override``, ``$SHAREDML_CACHE_DIR``, or the user's cache folder.

    The user's cache folder is :func:`platformdirs.user_cache_dir`'s for ``sharedml``:
    ``$XDG_CACHE_HOME/sharedml`` or ``~/.cache/sharedml`` on Linux, ``%LOCALAPPDATA%/sharedml``
    on Windows, ``~/Library/Caches/sharedml`` on macOS. Nothing is created or checked here: see
    :class:`Cache`.
    """
    if override is not None:
        return Path(override)
    env = os.environ.get("SHAREDML_CACHE_DIR")
    if env:
        return Path(env)
    # opinion=False: no "Cache" folder below the application's on Windows (sharedml's cache is
    # %LOCALAPPDATA%/sharedml, as before platformdirs chose it).
    return Path(platformdirs.user_cache_dir("sharedml", appauthor=False, opinion=False))


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


def is_own_item(folder: str, child: os.DirEntry[str] | Path) -> bool:
    """Whether ``child`` of the cache's ``folder`` (a kind, stamps, locks) is sharedml's.

    An entry is named by its key, or holds an ``entry.json`` (keys given to ``publish``
    directly); stamps and locks have names of their own; temporary names end in ``.tmp``.
    """
    name = child.name
    if name.startswith("."):
        return temp_owner_of(name) is not False
    if folder == "stamps":
        return STAMP_NAME.fullmatch(name) is not None
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
        if child.name.startswith(".") and temp_owner_of(child.name) is not False:
            continue  # a marker being written
        if child.name == MARKER_FILE:
            if not _is_own_marker(Path(child.path)):
                return child.path  # another program's cache folder
            continue
        if child.name not in OWN_FOLDERS or child.is_symlink() or not child.is_dir():
            if child.name in OWN_FOLDERS and child.is_symlink():
                continue  # refused by the policy, with its own message; never followed
            return child.path
        try:
            if os.name == "posix" and child.stat(follow_symlinks=False).st_uid != os.geteuid():
                continue
            grandchildren = list(os.scandir(child.path))
        except OSError:
            continue
        for grandchild in grandchildren:
            if not is_own_item(child.name, grandchild):
                return grandchild.path
    return None


# Cache folders checked in this process: (path, device, inode). The path too: a folder removed
# frees its inode, which the file system soon gives to another (someone's data folder) that a
# (device, inode) key alone would take for the cache it already checked.
_ADOPTED: set[tuple[str, int, int]] = set()


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
    key = (str(root), st.st_dev, st.st_ino)
    if key in _ADOPTED:
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
            fd, tmp = tempfile.mkstemp(prefix=f".{temp_owner()}-", suffix=TMP_SUFFIX, dir=root)
            try:
                with os.fdopen(fd, "w") as fh:
                    fh.write(_MARKER_TEXT)
                os.chmod(tmp, 0o644)
                os.replace(tmp, marker)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    _ADOPTED.add(key)


def _check_root(root: Path) -> None:
    """Create the cache folder (0700) or check that other users cannot replace what is in it.

    An existing folder is adopted only if it is sharedml's (:func:`_adopt`).
    """
    try:
        if not root.exists():
            with contextlib.suppress(FileExistsError):
                root.mkdir(mode=PRIVATE_DIR_MODE, parents=True)
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


def is_private_dir(path: Path) -> bool:
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
            path.mkdir(mode=PRIVATE_DIR_MODE)
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
    if stat.S_IMODE(st.st_mode) != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)  # other users must not read or plant entries


class Cache:
    """sharedml's cache folder, resolved once and checked once, passed to what uses it.

    Create one with :meth:`at` (which also accepts a :class:`Cache`, returned as it is). The
    folder's path is fixed at creation: a later change of ``$SHAREDML_CACHE_DIR`` does not move
    a pool's cache under it. The folder itself is created and checked against the policy the
    first time something is written (:meth:`folder`); reading what it holds (:meth:`adopted`)
    creates nothing.

    Attributes:
        root: The cache folder.

    Thread safety: one object may be used from any number of threads.
    """

    __slots__ = ("_checked", "_lock", "root")

    def __init__(self, root: str | os.PathLike[str]) -> None:
        """Use ``root`` as the cache folder (nothing is created or checked yet)."""
        self.root = Path(root)
        self._checked = False
        self._lock = threading.Lock()

    @classmethod
    def at(cls, where: CacheDir = None) -> Cache:
        """The cache at ``where``: a path, a :class:`Cache` (returned as it is), or None.

        None means ``$SHAREDML_CACHE_DIR``, else the user's cache folder (:func:`cache_dir`).
        """
        if isinstance(where, Cache):
            return where
        return cls(cache_dir(where))

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cache) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def checked_root(self) -> Path:
        """The cache folder, created (0700) or checked against the policy: once per object.

        Raises:
            CacheError: it cannot be created, is not a folder, others may write it without
                the sticky bit, or it holds what sharedml did not make.
        """
        if not self._checked:
            with self._lock:
                if not self._checked:
                    _check_root(self.root)
                    self._checked = True
        return self.root

    def folder(self, kind: str) -> Path:
        """The folder of one kind of entry (or ``stamps``, ``locks``), created and checked.

        The kind folder is checked on every call (an lstat): a real folder of this user, mode
        0700 (repaired if laxer).

        Raises:
            CacheError: the cache folder or the kind's folder fails the policy.
        """
        root = self.checked_root()
        folder = root / kind
        if not os.path.lexists(root):  # removed since it was checked: create it again
            with self._lock:
                self._checked = False
            root = self.checked_root()
        _private_dir(folder)
        return folder

    def adopted(self) -> Path:
        """The cache folder, checked to be sharedml's if it exists (nothing is created).

        Raises:
            CacheError: it exists and holds what sharedml did not create, or it is not a
                folder (``--cache-dir /dev/null``: read as "no entries", a typo would pass
                unnoticed).
        """
        try:
            st = self.root.stat()
        except NotADirectoryError:  # a path through a file: /dev/null/cache
            raise CacheError(
                f"The sharedml cache folder '{self.root}' cannot exist: a part of its path is a "
                "file, not a folder. Point --cache-dir or SHAREDML_CACHE_DIR at a folder."
            ) from None
        except OSError:
            return self.root
        if not stat.S_ISDIR(st.st_mode):
            raise CacheError(
                f"The sharedml cache folder '{self.root}' is {_files.file_kind(st.st_mode)}, not a "
                "folder. Point --cache-dir or SHAREDML_CACHE_DIR at a folder."
            )
        _adopt(self.root, st, mark=False)
        return self.root


CacheDir = str | os.PathLike[str] | Cache | None
"""A cache folder argument: a path, a :class:`Cache`, or None for :func:`cache_dir`'s default."""
