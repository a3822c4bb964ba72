"""The weights of a prepared model, mapped once per process and lent to every session.

A :class:`WeightStore` maps a prepared model's weights file read-only and registers it with a
session's ``SessionOptions`` so that ORT uses the mapped bytes in place. Which ORT mechanism does
that without a copy depends on the ORT version, so the store *measures* it once per process
(:func:`zero_copy_mechanisms`) instead of trusting a version table:

``in-memory-file``
    ``add_external_initializers_from_files_in_memory`` with the config key
    ``session.use_external_initializer_file_buffers_directly=1``. One call registers the whole
    file, so every tensor that refers to it, in subgraphs too, is borrowed. Without the config
    key (or on ORT versions that predate it) ORT copies the data into each session.
``add-initializer``
    ``SessionOptions.add_initializer`` per tensor, with an ``OrtValue`` over a slice of the map.
    ORT documents these buffers as user-owned and uses them in place.
``ort-mmap``
    Let ORT open the file itself: it maps external data files, so sessions share the page
    cache, but every session maps the file again and no verification happens in between.

Each of the three gives N sessions one copy of the weights in total; the test suite asserts it
(``tests/test_pool_memory.py``) and ``docs/cpu-prepacking.md`` has the figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import mmap
import os
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from sharedml._errors import (
    ExternalDataError,
    InvalidModelError,
    UnsafePathError,
    WeightsMismatchError,
)
from sharedml.cache._locks import hold_entry
from sharedml.cache._root import Cache, CacheDir
from sharedml.cache._stamps import verified_sha256
from sharedml.model import _dtypes, _proto
from sharedml.model._graph import ExternalData, Placement, iter_tensors, load_graph, tensor_nbytes
from sharedml.prepared._format import WeightsManifest, read_manifest

if TYPE_CHECKING:
    import onnx

__all__ = [
    "HOST_MECHANISMS",
    "TensorSlot",
    "WeightStore",
    "zero_copy_mechanisms",
]

HOST_MECHANISMS = ("in-memory-file", "add-initializer", "ort-mmap")
_DIRECT_BUFFERS_KEY = "session.use_external_initializer_file_buffers_directly"


@dataclasses.dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a prepared model lives in its weights file."""

    name: str
    data_type: int
    dims: tuple[int, ...]
    offset: int
    length: int
    file: str = ""
    """The weights file it sits in (a name in the model's folder; "" for the only one)."""


def _slots(
    model: onnx.ModelProto, model_path: Path, manifest: WeightsManifest, sizes: dict[str, int]
) -> tuple[TensorSlot, ...]:
    """Every tensor's place in its weights file, checked against the file as prepare wrote it.

    The graph is not covered by the recorded hash (the hash lives in it), so a changed graph
    must not make the store hand ORT a slice other than the tensor's own bytes.
    """
    slots = []
    for ref in iter_tensors(model.graph):
        info = ExternalData.of(ref.tensor)
        if ref.placement is not Placement.INITIALIZER or info is None:
            continue
        tensor = ref.tensor
        weights_file = info.location
        size = sizes.get(weights_file)
        if size is None:
            raise ExternalDataError(
                f"Tensor '{tensor.name}' of '{model_path}' refers to '{info.location}', not to "
                f"the prepared weights file '{manifest.file}'. Prepare the model again."
            )
        offset, length = info.offset, info.length if info.length is not None else -1
        expected = tensor_nbytes(tensor)
        # prepare's layout rule: an offset off it (a changed graph) could hand ORT or a DLPack
        # view a buffer misaligned for its element type.
        alignment = manifest.alignment_for(max(length, 0))
        if (
            info.malformed
            or length < 0
            or offset + length > size
            or offset % alignment
            or (expected is not None and length != expected)
        ):
            raise ExternalDataError(
                f"Tensor '{tensor.name}' of prepared model '{model_path}' claims bytes "
                f"{info.get('offset')}..+{info.get('length')} of weights file "
                f"'{weights_file}' ({size} bytes, a tensor of that length aligned to "
                f"{alignment}, its shape needs {expected} bytes): the graph was changed after "
                "prepare. Prepare the model again."
            )
        slots.append(
            TensorSlot(
                name=tensor.name,
                data_type=tensor.data_type,
                dims=tuple(tensor.dims),
                offset=offset,
                length=length,
                file=weights_file,
            )
        )
    return tuple(slots)


class WeightStore:
    """A prepared model's weights file, mapped read-only once per process.

    Use :meth:`open`, which returns the store already open for the same file (same path, size
    and modification time) while anyone still holds it, so that several pools over one model in
    one process share one mapping.

    Thread safety: ``open`` and ``register`` may be called from any thread.
    """

    _registry: ClassVar[weakref.WeakValueDictionary[tuple[Any, ...], WeightStore]] = (
        weakref.WeakValueDictionary()
    )
    _registry_lock = threading.Lock()

    def __init__(
        self,
        model_path: Path,
        manifest: WeightsManifest,
        *,
        verify: bool,
        model: onnx.ModelProto | None = None,
        cache_dir: CacheDir = None,
    ) -> None:
        self.model_path = model_path
        self.manifest = manifest
        self.path = model_path.parent / manifest.file
        # ORT refuses external data that resolves outside the model's folder; the store hands
        # ORT the bytes itself, so it must refuse the same (a symlink to another file).
        real_folder = os.path.realpath(model_path.parent)
        sizes: dict[str, int] = {}
        for weights in manifest.files:
            path = model_path.parent / weights.file
            real = os.path.realpath(path)
            if os.path.commonpath([real_folder, real]) != real_folder:
                raise UnsafePathError(
                    f"Weights file '{path}' of prepared model '{model_path}' resolves to "
                    f"'{real}', outside the model's folder '{real_folder}'. Weights are read "
                    "only from the model's own folder: prepare the model again."
                )
            if not path.is_file():
                raise WeightsMismatchError(
                    f"Weights file '{path}' of prepared model '{model_path}' is missing. "
                    "Prepare the model again."
                )
            size = path.stat().st_size
            if size != weights.size_bytes:
                raise WeightsMismatchError(
                    f"Weights file '{path}' has {size} bytes, but prepare wrote "
                    f"{weights.size_bytes}: it was truncated or replaced. Prepare the model "
                    "again."
                )
            sizes[weights.file] = size
        self._cache = Cache.at(cache_dir)  # resolved once: where this store's stamps live
        graph = model if model is not None else load_graph(model_path)  # open() parsed it already
        self.slots = _slots(graph, model_path, manifest, sizes)
        # A cache entry is not removed (sharedml cache prune) while a store over it lives; the
        # files it shares with other entries are held by the mappings too.
        self._hold = hold_entry(model_path)
        # One mapping per weights FILE per process, whichever graph (or hard link) names it:
        # the members of a family (sharedml.prepare_family([...])) and cache entries that share
        # tensors (sharedml.prepared._dedupe) share it, and so share its pages.
        self._files: dict[str, _MappedFile] = {}
        try:
            for weights in manifest.files:
                path = model_path.parent / weights.file
                self._files[weights.file] = _MappedFile.acquire(path, weights.sha256)
        except BaseException:
            self._release_all(tuple(self._files.values()), self._hold)
            raise
        # Released once: by close(), or when the store is collected without it.
        self._release = weakref.finalize(
            self, self._release_all, tuple(self._files.values()), self._hold
        )
        if verify:
            self._verify()
        self.buffers: dict[str, np.ndarray] = {n: f.buffer for n, f in self._files.items()}
        """Each weights file's mapping, by its name in the model's folder."""
        self.buffer: np.ndarray = self.buffers[manifest.file]
        self._ortvalues: dict[str, Any] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _release_all(files: tuple[_MappedFile, ...], hold: Any) -> None:
        for mapped in files:
            mapped.release()
        if hold is not None:
            hold.release()

    @property
    def verified(self) -> bool:
        """Whether every weights file was checked against its SHA-256 in this process."""
        return bool(self._files) and all(f.verified for f in self._files.values())

    @property
    def file_key(self) -> tuple[Any, ...]:
        """The main weights file's identity (device, inode, size, mtime, SHA-256)."""
        return self.file_keys[self.manifest.file]

    @property
    def file_keys(self) -> dict[str, tuple[Any, ...]]:
        """Each weights file's identity, by its name in the model's folder."""
        assert self._files, "closed"
        return {name: f.key for name, f in self._files.items()}

    @property
    def mapping_id(self) -> int:
        """Identifies the process-wide mapping of the main file (equal: the same pages)."""
        assert self._files, "closed"
        return id(self._files[self.manifest.file])

    def _verify(self) -> None:
        for weights in self.manifest.files:
            mapped = self._files[weights.file]
            with mapped.lock:
                if mapped.verified:
                    continue
                # A stamp from an earlier hash of this very file spares reading it in every
                # process.
                path = self.model_path.parent / weights.file
                if not verified_sha256(path, weights.sha256, cache=self._cache):
                    self._release()
                    self._files = {}
                    raise WeightsMismatchError(
                        f"Weights file '{path}' does not match the SHA-256 that prepare "
                        f"recorded in '{self.model_path}': it was modified. Prepare the model "
                        "again."
                    )
                mapped.verified = True

    @classmethod
    def open(
        cls,
        model_path: str | os.PathLike[str],
        *,
        verify: bool = True,
        cache_dir: CacheDir = None,
        model: onnx.ModelProto | None = None,
    ) -> WeightStore:
        """Map the weights of the prepared model at ``model_path`` (or reuse the live mapping).

        Args:
            model_path: A model written by :func:`sharedml.prepare`.
            verify: Check the whole file against the SHA-256 that prepare recorded (the size is
                always checked). Costs one read of the file, once per process, unless a stamp
                in the cache shows the file unchanged since an earlier check (see
                :mod:`sharedml.cache`).
            cache_dir: The cache holding those stamps: a path, a :class:`sharedml.cache.Cache`
                (as a pool's recipe carries it), or None for :func:`sharedml.cache_dir`.
            model: The graph at ``model_path`` (external data not loaded) where the caller parsed
                it already (the route planner: once per pool); None: read it here.

        Raises:
            InvalidModelError: ``model_path`` was not written by prepare.
            WeightsMismatchError: the weights file is missing, truncated or modified.
        """
        path = Path(model_path).resolve()
        if model is None:
            model = load_graph(path)
        manifest = read_manifest(model)
        if manifest is None:
            raise InvalidModelError(
                f"'{path}' was not written by sharedml.prepare; prepare it first (or pass it to "
                "SessionPool, which prepares it into its cache)."
            )
        stat = (
            (path.parent / manifest.file).stat() if (path.parent / manifest.file).exists() else None
        )
        key = (
            str(path),
            manifest.sha256,
            stat.st_size if stat else -1,
            stat.st_mtime_ns if stat else -1,
        )
        with cls._registry_lock:
            store = cls._registry.get(key)
            if store is None:
                store = cls(path, manifest, verify=verify, model=model, cache_dir=cache_dir)
                cls._registry[key] = store
            elif verify and not store.verified:
                store._verify()  # first opened with verify=False: check the hash now
            return store

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(slot.length for slot in self.slots)

    def _ortvalue(self, slot: TensorSlot) -> Any:
        import onnxruntime as ort

        with self._lock:
            value = self._ortvalues.get(slot.name)
            if value is None:
                dtype = _dtypes.np_dtype(slot.data_type)
                buffer = self.buffers[slot.file]
                view = buffer[slot.offset : slot.offset + slot.length].view(dtype)
                value = ort.OrtValue.ortvalue_from_numpy(view.reshape(slot.dims))
                self._ortvalues[slot.name] = value
            return value

    def register(self, so: Any, mechanism: str) -> None:
        """Make the sessions created with ``so`` use this store's bytes in place.

        Args:
            so: An ``onnxruntime.SessionOptions`` dedicated to this model.
            mechanism: One of :data:`HOST_MECHANISMS`; see the module docstring.
        """
        if mechanism == "in-memory-file":
            names = list(self.buffers)
            buffers = [self.buffers[n] for n in names]
            so.add_external_initializers_from_files_in_memory(
                names, buffers, [int(b.size) for b in buffers]
            )
            so.add_session_config_entry(_DIRECT_BUFFERS_KEY, "1")
        elif mechanism == "add-initializer":
            for slot in self.slots:
                so.add_initializer(slot.name, self._ortvalue(slot))
        elif mechanism == "ort-mmap":
            pass  # ORT maps the file named in the graph itself.
        else:
            raise ValueError(
                f"Unknown weight mechanism {mechanism!r}; use one of {HOST_MECHANISMS}."
            )

    def close(self) -> None:
        """Drop this store's use of the mapping; the last user unmaps it.

        Sessions that use it must be gone first.
        """
        self._ortvalues.clear()
        self.buffer = np.empty(0, np.uint8)
        self.buffers = {}
        self._release()
        self._files = {}


class _MappedFile:
    """One weights file, mapped read-only once per process, shared by every store naming it.

    Keyed by the file's identity (device, inode, size, mtime: a hard link is the same file) and
    the SHA-256 the graphs record: a file replaced by a rename is a new inode, hence a new
    mapping, while pools over the old one keep theirs. Reference-counted by the stores that use
    it.
    """

    _registry: ClassVar[dict[tuple[Any, ...], _MappedFile]] = {}
    _registry_lock = threading.Lock()

    def __init__(self, path: Path, key: tuple[Any, ...], size: int) -> None:
        self.path = path
        self.key = key
        self.users = 0
        self.verified = False
        self.lock = threading.Lock()
        with open(path, "rb") as fh:
            # Read-only and shared: pages come from the page cache, one copy for every session
            # of every pool (and every process) that maps this file.
            self._mmap = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.buffer: np.ndarray = (
            np.frombuffer(self._mmap, dtype=np.uint8) if self._mmap else np.empty(0, np.uint8)
        )

    @classmethod
    def acquire(cls, path: Path, sha256: str) -> _MappedFile:
        st = path.stat()
        # The inode, not the path: a hard link in another cache entry is the same pages.
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, sha256)
        with cls._registry_lock:
            mapped = cls._registry.get(key)
            if mapped is None:
                mapped = cls(path, key, st.st_size)
                cls._registry[key] = mapped
            mapped.users += 1
            return mapped

    def release(self) -> None:
        with self._registry_lock:
            self.users -= 1
            if self.users > 0:
                return
            if self._registry.get(self.key) is self:
                del self._registry[self.key]
        self.buffer = np.empty(0, np.uint8)
        if self._mmap is not None:
            # Still exported (a live session's buffer): the OS unmaps it when the process exits.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None

    @classmethod
    def live(cls) -> int:
        """How many weights files this process maps now (for tests and inspect)."""
        with cls._registry_lock:
            return len(cls._registry)


# --------------------------------------------------------------------------------------------
# Which mechanisms really borrow the caller's bytes on the installed ORT


_PROBE_ELEMENTS = 1024  # ORT inlines external tensors under 128 bytes: probe well above that


def _probe_model(external: bool) -> onnx.ModelProto:
    """Y = x * w over 1024 floats (built from the messages: no onnx import on a pool's path)."""
    pb = _proto.pb2()
    w = pb.TensorProto(name="w", data_type=pb.TensorProto.FLOAT, dims=[_PROBE_ELEMENTS])
    if external:
        w.data_location = pb.TensorProto.EXTERNAL
        for key, value in (
            ("location", "probe.bin"),
            ("offset", "0"),
            ("length", str(4 * _PROBE_ELEMENTS)),
        ):
            entry = w.external_data.add()
            entry.key, entry.value = key, value
    else:
        w.raw_data = np.zeros(_PROBE_ELEMENTS, np.float32).tobytes()
    model: onnx.ModelProto = pb.ModelProto(
        ir_version=8, opset_import=[pb.OperatorSetIdProto(domain="", version=17)]
    )
    graph = model.graph
    graph.name = "probe"
    # Mul: no kernel prepacks its operand, so a borrowed buffer stays visible.
    graph.node.add(op_type="Mul", input=["x", "w"], output=["y"])
    for values, name in ((graph.input, "x"), (graph.output, "y")):
        info = values.add(name=name)
        info.type.tensor_type.elem_type = pb.TensorProto.FLOAT
        info.type.tensor_type.shape.dim.add(dim_value=_PROBE_ELEMENTS)
    graph.initializer.append(w)
    return model


def _borrows(mechanism: str) -> bool:
    """Create a session whose weight is our buffer, then change the buffer: borrowed if seen."""
    import onnxruntime as ort

    buffer = np.ones(_PROBE_ELEMENTS, np.float32)
    raw = buffer.view(np.uint8)
    value = (
        None  # ORT does not own an OrtValue given to add_initializer: it must outlive the session
    )
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if mechanism == "in-memory-file":
        if not hasattr(so, "add_external_initializers_from_files_in_memory"):
            return False
        so.add_external_initializers_from_files_in_memory(["probe.bin"], [raw], [raw.size])
        so.add_session_config_entry(_DIRECT_BUFFERS_KEY, "1")
    elif mechanism == "add-initializer":
        value = ort.OrtValue.ortvalue_from_numpy(buffer)
        so.add_initializer("w", value)
    else:
        return False
    try:
        sess = ort.InferenceSession(
            _probe_model(mechanism == "in-memory-file").SerializeToString(),
            so,
            providers=["CPUExecutionProvider"],
        )
        x = np.ones(_PROBE_ELEMENTS, np.float32)
        before = sess.run(None, {"x": x})[0].copy()
        buffer[:] = 7.0
        after = sess.run(None, {"x": x})[0]
    except Exception:
        return False
    finally:
        sess = None
        del value
    return bool(before[0] == 1.0 and after[0] == 7.0)


@functools.cache
def zero_copy_mechanisms() -> tuple[str, ...]:
    """The mechanisms that lend bytes to ORT without a copy, best first, measured once.

    ``ort-mmap`` is always last: it shares through the page cache without a probe.
    """
    found = [m for m in ("in-memory-file", "add-initializer") if _borrows(m)]
    return (*found, "ort-mmap")
