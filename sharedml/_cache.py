"""A content-keyed cache of prepared models, shared by pools and processes.

``prepared_model_for(path)`` returns a prepared model for any model path: the path itself when
prepare wrote it, otherwise an entry of the cache, created on first use. Entries are keyed by
the SHA-256 of the model file and of every external data file it refers to, so a changed source
gets a new entry and an unchanged one is reused by every later pool and process.

Concurrency and crashes: an entry is prepared in a private temporary folder and published with
one ``rename`` of that folder. Two processes preparing the same model at once both succeed; one
rename wins and the other process uses the winner's entry. A process killed mid-prepare leaves
only a temporary folder, which is never read (and is removed by :func:`clear_stale`). Published
files are read-only and never rewritten in place: a mapped file truncated under a running
process would crash it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from sharedml._prepare import (
    DEFAULT_SIZE_THRESHOLD_BYTES,
    iter_graphs,
    load_graph,
    prepare,
    read_manifest,
)

__all__ = ["cache_dir", "clear_stale", "content_key", "prepared_model_for"]

_KEY_VERSION = "1"  # bump when prepare's output format changes
_STALE_TMP_SECONDS = 24 * 3600  # temporary folders older than this belong to dead processes


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


def content_key(model_path: str | os.PathLike[str], *, size_threshold_bytes: int) -> str:
    """SHA-256 over the model file, its external data files and the prepare settings."""
    path = Path(model_path)
    model = load_graph(path)
    locations: set[str] = set()
    for graph in iter_graphs(model.graph):
        for tensor in graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    locations.add(entry.value)
        for node in graph.node:
            for attr in node.attribute:
                for entry in attr.t.external_data:
                    if entry.key == "location":
                        locations.add(entry.value)
    sha = hashlib.sha256(f"sharedml-cache:{_KEY_VERSION}:{size_threshold_bytes}\n".encode())
    _hash_file(path, sha)
    base = Path(os.path.realpath(path.parent))
    for location in sorted(locations):
        sha.update(f"\n{location}\n".encode())
        target = Path(os.path.realpath(base / location))
        # Unsafe or missing locations are prepare's to report, with its clear errors.
        if os.path.commonpath([base, target]) == str(base) and target.is_file():
            _hash_file(target, sha)
    return sha.hexdigest()


def _make_private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if os.name == "posix":
        with contextlib.suppress(OSError):
            os.chmod(path, stat.S_IRWXU)  # other users must not plant entries in our cache


def prepared_model_for(
    model_path: str | os.PathLike[str],
    *,
    cache: str | os.PathLike[str] | None = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
) -> Path:
    """A prepared model equivalent to ``model_path``: itself if prepared, else a cache entry.

    Thread and process safety: safe to call from many threads and processes at once.
    """
    path = Path(model_path)
    if read_manifest(load_graph(path)) is not None:
        return path
    root = cache_dir(cache)
    entries = root / "models"
    _make_private_dir(entries)
    key = content_key(path, size_threshold_bytes=size_threshold_bytes)
    final = entries / key
    model_file = final / "model.onnx"
    if model_file.is_file():
        return model_file
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", suffix=".tmp", dir=entries))
    try:
        prepare(path, tmp / "model.onnx", size_threshold_bytes=size_threshold_bytes)
        for produced in tmp.iterdir():
            os.chmod(produced, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        try:
            os.rename(tmp, final)  # atomic publish; fails if another process published first
        except OSError:
            if not model_file.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return model_file


def clear_stale(cache: str | os.PathLike[str] | None = None) -> int:
    """Remove temporary folders left by processes killed mid-prepare; returns how many."""
    entries = cache_dir(cache) / "models"
    removed = 0
    if not entries.is_dir():
        return 0
    now = time.time()
    for child in entries.iterdir():
        if child.name.startswith(".") and child.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                if now - child.stat().st_mtime > _STALE_TMP_SECONDS:
                    shutil.rmtree(child)
                    removed += 1
    return removed
