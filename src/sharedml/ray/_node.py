"""Once per node: the model prepared into the node's cache, and the pools that map it.

The pieces a Ray Serve replica (or any process among several on one host) needs before it can
serve, in one place, with no Ray import:

- :func:`prepare_on_node` puts the prepared model in this node's cache. Replicas that start
  together on a node take turns on a per-model lock of that cache
  (:func:`sharedml.cache._locks.held_lock`), so one of them prepares and the others find its entry:
  the cache's atomic publish alone would give them all the same entry, but each would have
  prepared the model first.
- A model that is already prepared is used where it lies, unless its files sit on a network file
  system: then it is copied into the node's cache (``local_copy``), so that the node's page
  cache, not the network, serves the pages every replica maps.
- :func:`create_pool` holds the same lock while it opens the pool, so the derived entries the
  pool builds on first use (the CPU prepacked model, :mod:`sharedml.weights._prepacked`) are built
  once
  per node too. Replicas of one node therefore open their pools one at a time; the first one
  pays for the builds, the others only map what it built.
- Decisions for a pool inside a replica: batching on wherever the model can be batched (a server
  holds many callers' requests at once), and the replica's Ray CPUs shared among its sessions as
  intra-op threads (N replicas each using every core would oversubscribe the node).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from sharedml._host._filesystems import filesystem_type, is_remote_filesystem
from sharedml.cache._locks import held_lock
from sharedml.cache._root import Cache, CacheDir
from sharedml.pool._batching import BatchingSetting
from sharedml.pool._options import DEFAULT_SESSIONS, PoolOptions
from sharedml.pool._pool import SessionPool, open_pool
from sharedml.prepared._prepare import (
    prepared_model_for,
    prepared_model_from_bytes,
    weights_path_for,
)

__all__ = [
    "BatchingSetting",
    "NodeModel",
    "create_pool",
    "mapped_files",
    "prepare_on_node",
]

_BUILT_KINDS = ("models", "prepacked")  # the cache entries a pool may build on first use


@dataclasses.dataclass(frozen=True)
class NodeModel:
    """Where this node's replicas get a model's weights from.

    Attributes:
        source: The model as given (``<model bytes>`` for bytes).
        path: The prepared model the node's pools open: in the node's cache, or the source
            itself where it was already prepared on local disk.
        weights_path: The weights file every pool on the node maps.
        cache_dir: The node's cache folder.
        published: The cache entries this call built (empty: the node had them already).
        copied: Whether the source, already prepared, was copied into the node's cache (it
            sits on a network file system, or ``local_copy=True``).
        waited_s: Seconds spent waiting for another process of the node to finish its turn.
    """

    source: str
    path: Path
    weights_path: Path
    cache_dir: Path
    published: tuple[Path, ...] = ()
    copied: bool = False
    waited_s: float = 0.0

    @property
    def built(self) -> bool:
        """Whether this call prepared or derived anything (False: it only mapped)."""
        return bool(self.published)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: paths as strings, plus :attr:`built`."""
        return {
            "source": self.source,
            "path": str(self.path),
            "weights_path": str(self.weights_path),
            "cache_dir": str(self.cache_dir),
            "published": [str(p) for p in self.published],
            "copied": self.copied,
            "waited_s": self.waited_s,
            "built": self.built,
        }


def _lock_name(model: str | os.PathLike[str] | bytes) -> str:
    if isinstance(model, bytes):
        identity = b"bytes\0" + hashlib.sha256(model).digest()
    else:
        identity = b"path\0" + os.fsencode(os.path.realpath(model))
    return "prepare-" + hashlib.sha256(identity).hexdigest()[:32]


def _entries(cache: Cache) -> set[Path]:
    return {
        child
        for kind in _BUILT_KINDS
        for child in cache.folder(kind).iterdir()
        if not child.name.startswith(".")
    }


def _on_remote_storage(*paths: Path) -> bool:
    return any(is_remote_filesystem(filesystem_type(p)) for p in paths)


def _warn_if_cache_is_remote(folder: Path) -> None:
    fstype = filesystem_type(folder)
    if is_remote_filesystem(fstype):
        warnings.warn(
            f"sharedml: the cache folder '{folder}' is on a network file system ({fstype}), so "
            "every replica maps the weights through the network and nodes share one cache. Set "
            "SHAREDML_CACHE_DIR on each node to a folder on local disk (e.g. /tmp/sharedml).",
            RuntimeWarning,
            stacklevel=4,
        )


def _prepare(
    model: str | os.PathLike[str] | bytes,
    *,
    folder: Cache,
    local_copy: bool | None,
    size_threshold_bytes: int | None,
) -> tuple[Path, bool]:
    """The prepared model for this node, and whether it was copied off remote storage."""
    kwargs: dict[str, Any] = {"cache_dir": folder}
    if size_threshold_bytes is not None:
        kwargs["size_threshold_bytes"] = size_threshold_bytes
    if isinstance(model, bytes):
        return prepared_model_from_bytes(model, **kwargs), False
    path = Path(model)
    copy = local_copy
    if copy is None:
        # A weights file beside the model means it is (almost surely) prepared; parsing it to be
        # sure would cost every replica a read of the graph, which the cache's stamps spare.
        # Asking for a copy of a model that is not prepared changes nothing: it is prepared
        # into the cache anyway.
        weights = weights_path_for(path)
        copy = weights.is_file() and _on_remote_storage(path, weights)
    prepared = prepared_model_for(path, copy_prepared=copy, **kwargs)
    return prepared, copy and prepared != path


class _Turn:
    """This process's turn on a model's node lock: what it prepared and what it published."""

    def __init__(self, model: str | os.PathLike[str] | bytes, cache: Cache) -> None:
        self.model = model
        self.cache = cache
        self.folder = cache.root
        self.before = _entries(cache)
        self.path = Path()
        self.copied = False
        self.node: NodeModel | None = None

    def finish(self, waited_s: float) -> NodeModel:
        source = "<model bytes>" if isinstance(self.model, bytes) else str(self.model)
        self.node = NodeModel(
            source=source,
            path=self.path,
            weights_path=weights_path_for(self.path),
            cache_dir=self.folder,
            published=tuple(sorted(_entries(self.cache) - self.before)),
            copied=self.copied,
            waited_s=waited_s,
        )
        return self.node


@contextlib.contextmanager
def _node_turn(
    model: str | os.PathLike[str] | bytes,
    *,
    cache_dir: CacheDir,
    local_copy: bool | None,
    size_threshold_bytes: int | None,
    lock_timeout_s: float | None,
) -> Iterator[_Turn]:
    """Hold the node's lock for ``model``, prepared; ``turn.node`` is set once the block ends."""
    cache = Cache.at(cache_dir)  # resolved once for the lock, the prepare and the pool
    with held_lock(_lock_name(model), cache=cache, timeout_s=lock_timeout_s) as waited:
        turn = _Turn(model, cache)
        turn.path, turn.copied = _prepare(
            model,
            folder=cache,
            local_copy=local_copy,
            size_threshold_bytes=size_threshold_bytes,
        )
        yield turn
        turn.finish(waited)
    _warn_if_cache_is_remote(turn.folder)


def prepare_on_node(
    model: str | os.PathLike[str] | bytes,
    *,
    cache_dir: CacheDir = None,
    local_copy: bool | None = None,
    size_threshold_bytes: int | None = None,
    lock_timeout_s: float | None = None,
) -> NodeModel:
    """Prepare ``model`` into this node's cache, once per node however many processes ask.

    Call it in each replica (or once per node in a setup task); every call on the node returns
    the same prepared file, and only the first one prepares it.

    Args:
        model: Path of any ONNX model (on local disk or shared storage), or its bytes.
        cache_dir: This node's cache folder (default: :func:`sharedml.cache_dir`, from
            ``$SHAREDML_CACHE_DIR``). It should be on local disk.
        local_copy: Copy a model that is already prepared into the cache: True, False, or None
            (default) to copy it only where its files are on a network file system.
        size_threshold_bytes: Passed to :func:`sharedml.prepare` (None: its default).
        lock_timeout_s: Wait at most this long for another process of the node that is
            preparing the same model (None: as long as it takes).

    Returns:
        Where the node's pools get the weights from, and what this call built.

    Raises:
        ModelError: the model or its external data cannot be used.
        CacheError: the cache fails sharedml's permission policy, or the lock's timeout passed.
    """
    with _node_turn(
        model,
        cache_dir=cache_dir,
        local_copy=local_copy,
        size_threshold_bytes=size_threshold_bytes,
        lock_timeout_s=lock_timeout_s,
    ) as turn:
        pass
    assert turn.node is not None
    return turn.node


def _replica_cpus() -> float | None:
    """The CPUs Ray assigned to this process (a replica's ``num_cpus``), or None outside Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except Exception:  # a driver has no assigned resources on some Ray versions
        return None
    return float(cpus) if cpus else None


def _session_options(sessions: int, cpus: float) -> Any:
    """A template giving each of ``sessions`` sessions its share of ``cpus`` intra-op threads."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = max(1, math.floor(cpus / sessions))
    return so


def _replica_options(options: PoolOptions, cpus: float | None, cache: Cache) -> PoolOptions:
    """The pool's options on this node: the node's cache, and the replica's CPUs shared out.

    ``sessions="auto"`` splits the CPUs itself (``cores``); a count of sessions gets a template
    of ``cpus / sessions`` intra-op threads each. A caller's own ``cores`` or ``sess_options``
    stands.
    """
    session = options.session
    if cpus is not None and options.auto_sessions:
        if session.cores is None:
            session = dataclasses.replace(session, cores=max(1, math.floor(cpus)))
    elif cpus is not None and session.sess_options is None:
        count = options.sessions if isinstance(options.sessions, int) else None
        sessions = options.max_sessions or count or DEFAULT_SESSIONS
        session = dataclasses.replace(session, sess_options=_session_options(sessions, cpus))
    weights = dataclasses.replace(options.weights, cache_dir=cache)
    return dataclasses.replace(options, session=session, weights=weights)


def create_pool(
    model: str | os.PathLike[str] | bytes,
    *,
    sessions: int | Literal["auto"] | None = None,
    batching: BatchingSetting = "auto",
    providers: Any = None,
    cache_dir: CacheDir = None,
    local_copy: bool | None = None,
    cpus: float | None = None,
    lock_timeout_s: float | None = None,
    **pool_options: Any,
) -> tuple[SessionPool, NodeModel]:
    """A :class:`~sharedml.SessionPool` over ``model`` as this node holds it: the replica's pool.

    Prepares the model into the node's cache (:func:`prepare_on_node`) and opens the pool while
    holding the node's lock for the model, so the entries a pool derives on first use are built
    once per node too.

    Args:
        model: Path of any ONNX model (local disk or shared storage), or its bytes.
        sessions: Sessions in the pool (default: the pool's), or ``"auto"``: the pool splits
            ``cpus`` (at least one) into sessions x threads by measuring, as
            ``SessionPool(sessions="auto")`` does with its cores.
        batching: ``"auto"`` (default): merge waiting requests wherever the analysis proves it;
            else as ``SessionPool(batching=...)``.
        providers: As for ``SessionPool``.
        cache_dir: This node's cache folder (default: ``$SHAREDML_CACHE_DIR``, then the user's).
        local_copy: See :func:`prepare_on_node`.
        cpus: CPUs this process may use, shared among the sessions as intra-op threads (at least
            one each) unless ``sess_options`` is given. Default: the CPUs Ray assigned to this
            process in a Ray worker, else the pool's default (cores / sessions).
        lock_timeout_s: See :func:`prepare_on_node`.
        **pool_options: Any other ``SessionPool`` argument.

    Returns:
        The open pool (close it when the replica shuts down), and where the node's weights come
        from: :attr:`NodeModel.published` lists what this call built.

    Raises:
        SharedMLError: as :func:`prepare_on_node` and ``SessionPool`` raise.
    """
    options = PoolOptions.from_arguments(  # checked before the node's turn is taken
        sessions=sessions, batching=batching, providers=providers, **pool_options
    )
    with _node_turn(
        model,
        cache_dir=cache_dir,
        local_copy=local_copy,
        size_threshold_bytes=options.weights.size_threshold_bytes,
        lock_timeout_s=lock_timeout_s,
    ) as turn:
        share = cpus if cpus is not None else _replica_cpus()
        pool = open_pool(turn.path, _replica_options(options, share, turn.cache))
    assert turn.node is not None
    return pool, turn.node


def mapped_files(pid: int | None = None) -> list[Path]:
    """The files a process maps, from Linux's ``/proc/<pid>/maps`` (empty elsewhere).

    What a replica's :meth:`~sharedml.ray.ModelServer.info` reports, to show which node cache
    entry its weights come from.
    """
    try:
        text = Path(f"/proc/{pid or 'self'}/maps").read_text()
    except OSError:
        return []
    found: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/"):
            found.setdefault(parts[5].removesuffix(" (deleted)"))
    return [Path(p) for p in found]
