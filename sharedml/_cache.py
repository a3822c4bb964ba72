"""A content-keyed cache of prepared models, shared by pools and processes.

``prepared_model_for(path)`` returns a prepared model for any model path: the path itself when
prepare wrote it, otherwise an entry of the cache, created on first use. Entries are keyed by
the SHA-256 of the model file and of every external data file it refers to, so a changed source
gets a new entry and an unchanged one is reused by every later pool and process.

Layout::

    <cache_dir>/                       0700 when sharedml creates it
    ├── models/                        0700, owned by the user, checked on every use
    │   ├── <key>/                     one published entry (0700), never modified again
    │   │   ├── model.onnx             0444
    │   │   └── model.weights          0444
    │   └── .<key prefix>-XXXX.tmp/    a prepare in progress (or a crashed one): never read
    └── stamps/                        0700: "this file, unchanged since, has this digest"
        └── <name>.json                0600, rewritten atomically

Stamps spare the work that start-up would otherwise repeat in every process: hashing the
source model to find its entry (0.12 s per 100 MB) and hashing the weights file to verify it
(:class:`sharedml.WeightStore`). A stamp records each file's device, inode, size, mtime and
ctime; any write to a file changes its ctime, which no unprivileged process can set back, so a
stamp that still matches names the same bytes. A stamp is never written for a file changed in the
last :data:`_RACY_WINDOW_NS` (a write within the timestamp granularity could leave mtime and ctime
as they were; git's index has the same rule). ``SHAREDML_STAMPS=0`` turns stamps off.

Concurrency and crashes: an entry is prepared in a private temporary folder and published with
one ``rename`` of that folder. Two processes preparing the same model at once both succeed; one
rename wins and the other process uses the winner's entry. A process killed mid-prepare leaves
only a temporary folder, which is never read (and is removed by :func:`clear_stale` once it is
old enough to belong to a dead process). Published files are read-only and never rewritten in
place: a mapped file truncated under a running process would crash it (SIGBUS).

Trust: the cache is trusted the way a Python ``site-packages`` is. Whoever can write to it can
make every pool run their weights, so sharedml refuses a ``models/`` folder that another user
owns and a cache folder that other users may write to (see ``docs/security.md``). A weights file
changed or truncated after publication is still caught at load, by the size and SHA-256 that
prepare recorded in the entry's graph (:class:`sharedml.WeightStore`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from onnx import ModelProto

from sharedml._errors import PrepareError
from sharedml._prepare import (
    DEFAULT_SIZE_THRESHOLD_BYTES,
    iter_graphs,
    load_graph,
    prepare,
    read_manifest,
)

__all__ = [
    "cache_dir",
    "clear_stale",
    "content_key",
    "prepared_model_for",
    "recall_stamp",
    "record_stamp",
]

_KEY_VERSION = "1"  # bump when prepare's output format changes
_STALE_TMP_SECONDS = 24 * 3600  # seconds: a temporary folder this old is a dead process's
_PRIVATE_DIR_MODE = stat.S_IRWXU  # 0700: other users can neither read nor plant entries
_READ_ONLY_FILE_MODE = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH  # 0444: never rewritten
_TMP_SUFFIX = ".tmp"
_RACY_WINDOW_NS = 3_000_000_000  # a file changed this recently gets no stamp (FAT: 2 s mtimes)
_STAMP_VERSION = 1


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
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


def _hash_file(path: Path, sha: hashlib._Hash) -> None:
    with open(path, "rb") as fh:
        while chunk := fh.read(8 * 1024 * 1024):
            sha.update(chunk)


def _external_locations(model: ModelProto) -> set[str]:
    locations: set[str] = set()
    for graph in iter_graphs(model.graph):
        tensors = list(graph.initializer)
        for node in graph.node:
            for attr in node.attribute:
                tensors.append(attr.t)
                tensors.extend(attr.tensors)
        for tensor in tensors:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations.add(entry.value)
    return locations


def _content_key(
    path: Path, model: ModelProto, size_threshold_bytes: int
) -> tuple[str, list[Path]]:
    """The entry key, and the external data files it covers (existing or not)."""
    sha = hashlib.sha256(f"sharedml-cache:{_KEY_VERSION}:{size_threshold_bytes}\n".encode())
    _hash_file(path, sha)
    base = Path(os.path.realpath(path.parent))
    covered: list[Path] = []
    for location in sorted(_external_locations(model)):
        sha.update(f"\n{location}\n".encode())
        try:
            target = Path(os.path.realpath(base / location))
            inside = os.path.commonpath([base, target]) == str(base)
        except ValueError:  # NUL bytes, other drives: prepare reports these with its errors
            continue
        # Unsafe or missing locations are prepare's to report, with its clear errors.
        if inside:
            covered.append(target)
            if target.is_file():
                _hash_file(target, sha)
    return sha.hexdigest(), covered


def content_key(model_path: str | os.PathLike[str], *, size_threshold_bytes: int) -> str:
    """SHA-256 over the model file, its external data files and the prepare settings."""
    path = Path(model_path)
    return _content_key(path, load_graph(path), size_threshold_bytes)[0]


# --------------------------------------------------------------------------------------------
# Stamps


def _file_stamp(path: Path) -> list[int] | None:
    """Device, inode, size, mtime and ctime of ``path`` (following links); None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _stamp_path(root: Path, kind: str, path: Path, params: str) -> Path:
    name = hashlib.sha256(f"{kind}\0{os.path.realpath(path)}\0{params}".encode()).hexdigest()
    return root / "stamps" / f"{kind}-{name[:40]}.json"


def recall_stamp(
    kind: str,
    path: str | os.PathLike[str],
    params: str = "",
    *,
    cache: str | os.PathLike[str] | None = None,
) -> str | None:
    """The value recorded for ``path`` (and its companion files) if none of them changed since.

    Args:
        kind: What the value is (``"weights-sha256"``, ``"prepared"``).
        path: The file the value describes.
        params: Anything else the value depends on (settings), part of the stamp's name.
        cache: The cache folder (default: :func:`cache_dir`).

    Returns:
        The value, or None: no stamp, a file changed, the cache folder is not private to this
        user (a stamp there could have been planted), or ``$SHAREDML_STAMPS`` is ``0`` (for
        filesystems whose ctime does not move on writes). Never raises.
    """
    if os.environ.get("SHAREDML_STAMPS") == "0":
        return None
    root = cache_dir(cache)
    try:
        _check_cache_root(root)
        if not _is_private_dir(root / "stamps"):
            return None
        record = json.loads(_stamp_path(root, kind, Path(path), params).read_text())
        if record.get("version") != _STAMP_VERSION or not record.get("files"):
            return None
        if record["files"][0][0] != os.path.realpath(path):
            return None
        for name, stamp in record["files"]:
            if _file_stamp(Path(name)) != stamp:
                return None
        value = record["value"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, PrepareError):
        return None
    return value if isinstance(value, str) else None


def record_stamp(
    kind: str,
    path: str | os.PathLike[str],
    value: str,
    params: str = "",
    *,
    companions: list[Path] | tuple[Path, ...] = (),
    cache: str | os.PathLike[str] | None = None,
) -> bool:
    """Remember ``value`` for ``path`` as it is now (and ``companions``, present or absent).

    Call it right after computing ``value`` from the files' bytes. Nothing is recorded for a
    file changed within the last :data:`_RACY_WINDOW_NS` (its next use computes the value again
    and records it then), nor when the cache folder cannot be written. Never raises.

    Returns:
        True if the stamp was written.
    """
    files = [Path(os.path.realpath(path)), *(Path(os.path.realpath(c)) for c in companions)]
    stamps = [_file_stamp(f) for f in files]
    if stamps[0] is None:
        return False
    now = time.time_ns()
    for stamp in stamps:
        if stamp is not None and now - max(stamp[3], stamp[4]) < _RACY_WINDOW_NS:
            return False
    root = cache_dir(cache)
    record = {
        "version": _STAMP_VERSION,
        "files": [[str(f), st] for f, st in zip(files, stamps, strict=True)],
        "value": value,
    }
    try:
        _check_cache_root(root)
        _private_dir(root / "stamps")
        target = _stamp_path(root, kind, Path(path), params)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=_TMP_SUFFIX, dir=target.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, PrepareError):
        return False
    return True


def _is_private_dir(path: Path) -> bool:
    if os.name != "posix":
        return path.is_dir()
    st = os.lstat(path)
    return (
        stat.S_ISDIR(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _check_cache_root(root: Path) -> None:
    """Create the cache folder (0700) or check that other users cannot write to it."""
    if not root.exists():
        with contextlib.suppress(FileExistsError):
            root.mkdir(mode=_PRIVATE_DIR_MODE, parents=True)
    if os.name != "posix":
        return
    st = root.stat()
    shared_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    # A world-writable folder is safe only with the sticky bit (like /tmp): without it, another
    # user could rename our models/ away and put their own in its place.
    if shared_write and not st.st_mode & stat.S_ISVTX:
        raise PrepareError(
            f"The sharedml cache folder '{root}' is writable by other users (mode "
            f"{stat.filemode(st.st_mode)}), who could plant weights that every pool would run. "
            f"Run 'chmod go-w {root}' or choose another folder with SHAREDML_CACHE_DIR."
        )


def _private_dir(path: Path) -> None:
    """Create ``path`` as a 0700 folder, or check that an existing one is ours and private."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=_PRIVATE_DIR_MODE)
    if os.name != "posix":
        return
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PrepareError(
            f"The sharedml cache folder '{path}' is not a folder (a symlink or a file). "
            "Remove it; sharedml recreates it."
        )
    if st.st_uid != os.geteuid():
        raise PrepareError(
            f"The sharedml cache folder '{path}' belongs to user id {st.st_uid}, not to this "
            f"process's user ({os.geteuid()}): its entries cannot be trusted. Remove it, or point "
            "SHAREDML_CACHE_DIR at a folder of your own."
        )
    if stat.S_IMODE(st.st_mode) != _PRIVATE_DIR_MODE:
        os.chmod(path, _PRIVATE_DIR_MODE)  # other users must not read or plant entries


def _fsync_dir(path: Path) -> None:
    if os.name != "posix":
        return
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def prepared_model_for(
    model_path: str | os.PathLike[str],
    *,
    cache: str | os.PathLike[str] | None = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
) -> Path:
    """A prepared model equivalent to ``model_path``: itself if prepared, else a cache entry.

    Args:
        model_path: Any ONNX model.
        cache: The cache folder (default: :func:`cache_dir`).
        size_threshold_bytes: Passed to :func:`sharedml.prepare`; part of the cache key.

    Returns:
        ``model_path`` when :func:`sharedml.prepare` wrote it, else ``<cache>/models/<key>/
        model.onnx``.

    Raises:
        ModelError: from :func:`sharedml.prepare`: the model or its external data is unusable.
        PrepareError: the cache folder is not private to this user, or an entry is damaged.

    Thread and process safety: safe to call from many threads and processes at once; every
    caller gets a complete entry, and no entry is ever modified after it is published.
    """
    path = Path(model_path)
    root = cache_dir(cache)
    params = f"{_KEY_VERSION}:{size_threshold_bytes}"
    known = recall_stamp("prepared", path, params, cache=cache)
    if known is not None:  # the source is unchanged since it was hashed: skip parse and hash
        _private_dir(root / "models")
        model_file = root / "models" / known / "model.onnx"
        if model_file.is_file():
            return model_file
    model = load_graph(path)
    if read_manifest(model) is not None:
        return path
    _check_cache_root(root)
    entries = root / "models"
    _private_dir(entries)
    key, covered = _content_key(path, model, size_threshold_bytes)
    del model  # the graph can be large; prepare loads its own copy
    final = entries / key
    model_file = final / "model.onnx"
    if model_file.is_file():
        record_stamp("prepared", path, key, params, companions=covered, cache=cache)
        return model_file
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", suffix=_TMP_SUFFIX, dir=entries))
    try:
        prepare(path, tmp / "model.onnx", size_threshold_bytes=size_threshold_bytes)
        for produced in tmp.iterdir():
            os.chmod(produced, _READ_ONLY_FILE_MODE)
        try:
            os.rename(tmp, final)  # atomic publish; fails if another process published first
        except OSError as exc:
            if not model_file.is_file():
                raise PrepareError(
                    f"Could not publish the prepared model into the cache entry '{final}': "
                    f"{exc}. If that folder is damaged, remove it and try again."
                ) from exc
        else:
            _fsync_dir(entries)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    record_stamp("prepared", path, key, params, companions=covered, cache=cache)
    with contextlib.suppress(OSError):
        clear_stale(cache)
    return model_file


def clear_stale(
    cache: str | os.PathLike[str] | None = None, *, older_than_s: float = _STALE_TMP_SECONDS
) -> int:
    """Remove temporary folders left by processes killed mid-prepare; returns how many.

    Args:
        cache: The cache folder (default: :func:`cache_dir`).
        older_than_s: Only folders untouched for this long are removed: a younger one may
            belong to a prepare still running in another process.
    """
    entries = cache_dir(cache) / "models"
    removed = 0
    if not entries.is_dir():
        return 0
    now = time.time()
    for child in entries.iterdir():
        if child.name.startswith(".") and child.name.endswith(_TMP_SUFFIX):
            with contextlib.suppress(OSError):
                if now - child.stat().st_mtime > older_than_s:
                    shutil.rmtree(child)
                    removed += 1
    return removed
