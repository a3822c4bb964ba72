"""Weights on the accelerator: each weight uploaded once per device and lent to every session.

A plain CUDA session copies every initializer to the GPU for itself. ORT uses an initializer
given through ``SessionOptions.add_initializer`` *in place* when the buffer is owned by the
caller and lives on the device that ORT planned for that weight (``session_state_utils.cc``);
otherwise it warns and loads a copy of its own. So one upload per device, registered in every
session, gives N sessions one copy of the weights.

What ORT accepts as "owned by the caller" is the catch: an ``OrtValue`` that ORT allocated is
refused, one imported through DLPack is not (:mod:`sharedml.weights._dlpack`). The routes below make
such values without a torch dependency; which one works depends on the installed ORT, so
:mod:`sharedml.weights._probe` probes them in child processes and the route planner passes the
winner to :meth:`DeviceWeightStore.for_store`.

``ort-slab``
    ORT allocates one device buffer the size of the weights file and copies the file into it in
    one transfer, so the device holds the file's layout and its aligned offsets. Each tensor is a
    DLPack view of the slab; every view keeps a reference to the slab, so the slab is freed only
    after the last session that borrows it.
``ort-per-tensor``
    One ORT allocation per tensor, re-imported through DLPack. Public API only; one transfer
    per tensor.
``cupy-slab``
    Like ``ort-slab`` with the slab allocated by CuPy (CUDA only, if CuPy is installed).

Tensor types DLPack cannot carry into ORT (bfloat16, float8, 4-bit, bool, strings) stay in the
weights file, and ORT loads them per session as for a plain model. DirectML: ORT's DLPack
converter knows only CPU and CUDA-like devices, so every route is expected to fail there and
the pool to keep host-shared weights. Figures, and what was verified where: ``docs/gpu.md``.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np

from sharedml._errors import ProviderError
from sharedml.model import _dtypes
from sharedml.runtime._providers import CPU, CUDA, DML
from sharedml.weights._dlpack import (
    RouteError,
    check_view,
    export_capsule,
    import_capsule,
    retargeted_view,
)
from sharedml.weights._store import TensorSlot, WeightStore

__all__ = [
    "DEVICE_TYPES",
    "ROUTES",
    "DeviceWeightStore",
    "HostWeights",
]

ROUTES = ("ort-slab", "ort-per-tensor", "cupy-slab")
# The device name ORT's Python API uses for each provider's memory. CPU is here so that the
# whole upload / view / register path runs (and is tested) on machines without an accelerator.
DEVICE_TYPES: Mapping[str, str] = {CUDA: "cuda", DML: "dml", CPU: "cpu"}

# --------------------------------------------------------------------------------------------
# Uploads: the device values of one weights buffer, made by one route


class HostWeights(Protocol):
    """What an upload reads: a contiguous uint8 buffer and the tensors in it."""

    @property
    def buffer(self) -> np.ndarray: ...

    @property
    def slots(self) -> tuple[TensorSlot, ...]: ...


def _np_dtype(slot: TensorSlot) -> np.dtype[Any]:
    return _dtypes.np_dtype(slot.data_type)


def _on_device(slot: TensorSlot) -> bool:
    if _dtypes.dlpack_type(slot.data_type) is None or slot.length == 0:
        return False
    return slot.length == int(np.prod(slot.dims, dtype=np.int64)) * _np_dtype(slot).itemsize


@dataclasses.dataclass
class _Upload:
    values: dict[str, Any]  # tensor name -> onnxruntime.OrtValue on the device
    device_bytes: int
    reload: Callable[[np.ndarray], None]  # copy a host buffer of the same layout again
    keepalive: list[Any] = dataclasses.field(default_factory=list)


# bytes: a slab starts at a file offset that is a multiple of this, so that every view keeps its
# file alignment as far as the allocation's own goes (cudaMalloc: 256 bytes; ORT's CPU: 64).
_SLAB_ALIGNMENT_BYTES = 256


def _span(slots: Sequence[TensorSlot]) -> tuple[int, int]:
    """The file range a slab must hold, its start rounded down to :data:`_SLAB_ALIGNMENT_BYTES`.

    Small tensors sit at 64-byte (or smaller, natural) alignment in the file; a slab starting
    at the first of them would shift every page-aligned view after it off its alignment.
    """
    lo = min(s.offset for s in slots)
    return lo - lo % _SLAB_ALIGNMENT_BYTES, max(s.offset + s.length for s in slots)


def _upload_ort_slab(host: HostWeights, device: str, device_id: int) -> _Upload:
    import onnxruntime as ort

    slots = [s for s in host.slots if _on_device(s)]
    if not slots:
        return _Upload({}, 0, lambda _buffer: None)
    lo, hi = _span(slots)
    # One allocation, one transfer; the file's alignment carries over (see _span).
    slab = ort.OrtValue.ortvalue_from_shape_and_type([hi - lo], np.uint8, device, device_id)

    def reload(buffer: np.ndarray) -> None:
        slab.update_inplace(np.ascontiguousarray(buffer[lo:hi]))

    reload(host.buffer)
    base = int(slab.data_ptr())
    values = {s.name: retargeted_view(slab, base, s.offset - lo, s, device) for s in slots}
    return _Upload(values, hi - lo, reload)


def _upload_ort_per_tensor(host: HostWeights, device: str, device_id: int) -> _Upload:
    import onnxruntime as ort

    slots = [s for s in host.slots if _on_device(s)]
    owned: dict[str, Any] = {}
    values: dict[str, Any] = {}

    def reload(buffer: np.ndarray) -> None:
        for s in slots:
            view = buffer[s.offset : s.offset + s.length].view(_np_dtype(s)).reshape(s.dims)
            owned[s.name].update_inplace(np.ascontiguousarray(view))

    for s in slots:
        owned[s.name] = ort.OrtValue.ortvalue_from_shape_and_type(
            list(s.dims), _np_dtype(s), device, device_id
        )
    reload(host.buffer)
    for s in slots:
        # The re-imported value does not own its buffer, so add_initializer accepts it; the
        # capsule's deleter keeps ORT's allocation alive for as long as the value lives.
        value = import_capsule(export_capsule(owned[s.name]))
        check_view(value, int(owned[s.name].data_ptr()), s, device)
        values[s.name] = value
    return _Upload(values, sum(s.length for s in slots), reload, [owned])


def _upload_cupy_slab(host: HostWeights, device: str, device_id: int) -> _Upload:
    if device != "cuda":
        raise RouteError("the cupy-slab route needs CUDA")
    try:
        cupy = importlib.import_module("cupy")  # optional: not a dependency of sharedml
    except ImportError as exc:
        raise RouteError("CuPy is not installed") from exc
    slots = [s for s in host.slots if _on_device(s)]
    if not slots:
        return _Upload({}, 0, lambda _buffer: None)
    lo, hi = _span(slots)
    with cupy.cuda.Device(device_id):
        slab = cupy.empty(hi - lo, dtype=cupy.uint8)

        def reload(buffer: np.ndarray) -> None:
            with cupy.cuda.Device(device_id):
                slab.set(np.ascontiguousarray(buffer[lo:hi]))
                cupy.cuda.Stream.null.synchronize()

        reload(host.buffer)
        base = int(slab.data.ptr)
        values = {}
        for s in slots:
            start = s.offset - lo
            view = slab[start : start + s.length].view(_np_dtype(s)).reshape(s.dims)
            value = import_capsule(view)
            check_view(value, base + start, s, device)
            values[s.name] = value
    return _Upload(values, hi - lo, reload, [slab])


_UPLOADERS: Mapping[str, Callable[[HostWeights, str, int], _Upload]] = {
    "ort-slab": _upload_ort_slab,
    "ort-per-tensor": _upload_ort_per_tensor,
    "cupy-slab": _upload_cupy_slab,
}


@dataclasses.dataclass(frozen=True)
class _Subset:
    """Some tensors of a host buffer: what an upload for a family member still lacks."""

    buffer: np.ndarray
    slots: tuple[TensorSlot, ...]


def _slot_key(slot: TensorSlot) -> tuple[int, int, int, tuple[int, ...]]:
    return (slot.offset, slot.length, slot.data_type, slot.dims)


@dataclasses.dataclass(eq=False)
class _FileValues:
    """The device values of one weights file, by place in the file: one per distinct tensor.

    Every model over the file (a family's members) borrows the values already uploaded and
    uploads only the tensors that are not on the device yet; each upload is kept alive here
    for as long as a store of any of those models lives.
    """

    by_slot: dict[tuple[int, int, int, tuple[int, ...]], Any] = dataclasses.field(
        default_factory=dict
    )
    uploads: list[_Upload] = dataclasses.field(default_factory=list)

    @property
    def device_bytes(self) -> int:
        return sum(u.device_bytes for u in self.uploads)

    def reload(self, buffer: np.ndarray) -> None:
        for upload in self.uploads:
            upload.reload(buffer)

    def upload_for(
        self,
        host: HostWeights,
        uploader: Callable[[HostWeights, str, int], _Upload],
        device: str,
        device_id: int,
    ) -> _Upload:
        missing: dict[tuple[int, int, int, tuple[int, ...]], TensorSlot] = {}
        for slot in host.slots:
            if _on_device(slot) and _slot_key(slot) not in self.by_slot:
                missing.setdefault(_slot_key(slot), slot)
        if missing:
            upload = uploader(_Subset(host.buffer, tuple(missing.values())), device, device_id)
            self.uploads.append(upload)
            for key, slot in missing.items():
                self.by_slot[key] = upload.values[slot.name]
        values = {s.name: self.by_slot[_slot_key(s)] for s in host.slots if _on_device(s)}
        return _Upload(values, self.device_bytes, self.reload, [self])


# --------------------------------------------------------------------------------------------
# The store


def _device_type(provider: str) -> str:
    try:
        return DEVICE_TYPES[provider]
    except KeyError:
        raise ProviderError(
            f"Weights cannot be kept on the device for '{provider}': sharedml knows how for "
            f"{', '.join(p for p in DEVICE_TYPES if p != CPU)} only. Use a host mechanism."
        ) from None


class DeviceWeightStore:
    """A prepared model's weights on one device, uploaded once and borrowed by every session.

    Get one with :meth:`for_store`, which returns the live store for the same weights file,
    provider, device and route, so that every pool over a model in a process shares one upload.

    The device buffers must outlive every session registered with them: whoever creates
    sessions (the pool) keeps a reference to the store for as long as its sessions exist.

    Thread safety: ``for_store`` and ``register`` may be called from any thread.
    """

    _registry: ClassVar[weakref.WeakValueDictionary[tuple[Any, ...], DeviceWeightStore]] = (
        weakref.WeakValueDictionary()
    )
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()
    _files: ClassVar[weakref.WeakValueDictionary[tuple[Any, ...], _FileValues]] = (
        weakref.WeakValueDictionary()
    )

    def __init__(
        self,
        host: HostWeights,
        provider: str,
        device_id: int,
        *,
        route: str,
        shared: Sequence[tuple[_FileValues, HostWeights]] | None = None,
    ) -> None:
        """Upload ``host``'s tensors to ``provider``'s device ``device_id`` by ``route``.

        Prefer :meth:`for_store`, which reuses a live upload, and shares the device copy of
        each distinct tensor of a weights file between the models that name it (``shared``:
        per weights file, its device values and the tensors of ``host`` in it, main file
        first; only tensors not on the device yet are uploaded).

        Raises:
            ProviderError: the provider has no device store, the route is unknown, or the
                upload failed (out of device memory, or the route does not work here).
        """
        self.provider = provider
        self.device_id = device_id
        self.device = _device_type(provider)
        if route not in _UPLOADERS:
            raise ProviderError(f"Unknown device weight route {route!r}; use one of {ROUTES}.")
        self.route = route
        start = time.perf_counter()
        try:
            if shared is None:
                self._upload: _Upload | None = _UPLOADERS[route](host, self.device, device_id)
            else:
                uploads = [
                    values.upload_for(part, _UPLOADERS[route], self.device, device_id)
                    for values, part in shared
                ]
                self._upload = _Upload(
                    {name: v for u in uploads for name, v in u.values.items()},
                    sum(values.device_bytes for values, _part in shared),
                    uploads[0].reload,  # the main file's layout (reload's contract)
                    [values for values, _part in shared],
                )
        except Exception as exc:
            raise ProviderError(
                f"Could not put {sum(s.length for s in host.slots)} bytes of weights on "
                f"{provider} device {device_id} by route '{route}': {exc}"
            ) from exc
        self.upload_seconds = time.perf_counter() - start
        on_device = set(self._upload.values)
        self.host_tensors: tuple[str, ...] = tuple(
            s.name for s in host.slots if s.name not in on_device
        )
        """Tensors left in the weights file (types DLPack cannot carry): ORT loads those."""

    @classmethod
    def for_store(
        cls,
        store: WeightStore,
        provider: str,
        device_id: int = 0,
        *,
        route: str,
    ) -> DeviceWeightStore:
        """The device copy of ``store``'s weights for ``provider`` on ``device_id``.

        Args:
            store: The host weights (from :meth:`WeightStore.open`).
            provider: ``"CUDAExecutionProvider"`` or ``"DmlExecutionProvider"``
                (``"CPUExecutionProvider"`` works too, for tests).
            device_id: The device, as in the provider's ``device_id`` option.
            route: One of :data:`ROUTES`, as :func:`sharedml.weights._probe.select_route`
                found working here (the caller probes; this method never starts a process).

        Returns:
            The live store for these arguments, created (and uploaded) if there is none.

        Raises:
            ProviderError: the route is unknown, or the upload failed.
        """
        # Per model (the tensor names are the model's), over device values per weights FILE:
        # the members of a family (sharedml.prepare_family([...])) name the same bytes differently.
        # Cache entries that share tensors (sharedml.prepared._dedupe) name one file by hard links:
        # the
        # file's identity is its inode, so their values are one set too.
        key = (str(store.model_path), store.manifest.sha256, provider, device_id, route)
        with cls._registry_lock:
            live = cls._registry.get(key)
            if live is not None and live._upload is not None:
                return live
            shared = []
            for name, file_key in store.file_keys.items():
                values = cls._files.get((file_key, provider, device_id, route))
                if values is None:
                    values = _FileValues()
                    cls._files[(file_key, provider, device_id, route)] = values
                slots = tuple(s for s in store.slots if s.file == name)
                shared.append((values, _Subset(store.buffers[name], slots)))
            created = cls(store, provider, device_id, route=route, shared=shared)
            cls._registry[key] = created
            return created

    def register(self, so: Any) -> None:
        """Make sessions created with ``so`` use the device buffers in place.

        Args:
            so: An ``onnxruntime.SessionOptions`` for this model, used with ``self.provider``
                on ``self.device_id``.

        Raises:
            ProviderError: the store is closed.
        """
        if self._upload is None:
            raise ProviderError("This DeviceWeightStore is closed; get a new one with for_store.")
        for name, value in self._upload.values.items():
            so.add_initializer(name, value)

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory the weights take (one copy, whatever the session count)."""
        return self._upload.device_bytes if self._upload is not None else 0

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The tensors lent from the device."""
        return tuple(self._upload.values) if self._upload is not None else ()

    def reload(self, buffer: np.ndarray) -> None:
        """Copy ``buffer`` (same layout as the weights file) to the device again, in place.

        Sessions see the new values at their next run; for tests and the route probe.
        """
        if self._upload is not None:
            self._upload.reload(buffer)

    def close(self) -> None:
        """Drop this store's references. Sessions registered with it must be gone first."""
        self._upload = None

    def __repr__(self) -> str:
        return (
            f"<DeviceWeightStore {self.provider} device={self.device_id} route={self.route!r} "
            f"tensors={len(self.tensor_names)} device_bytes={self.device_bytes}>"
        )
