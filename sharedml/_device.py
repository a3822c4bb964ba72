"""Weights on the accelerator: each weight uploaded once per device and lent to every session.

A plain CUDA session copies every initializer to the GPU for itself (2.2x the weight bytes per
session on onnxruntime-gpu 1.31.1: the copy, then an arena extension as large at the first
run). ORT uses an initializer given through ``SessionOptions.add_initializer`` *in place* when
the buffer is owned by the caller and lives on the device that ORT planned for that weight
(``session_state_utils.cc``); otherwise it warns and loads a copy of its own. So one upload per
device, registered in every session, gives N sessions one copy of the weights.

What ORT accepts as "owned by the caller" is the catch: an ``OrtValue`` that ORT allocated
(``ortvalue_from_numpy(arr, "cuda", 0)``) is refused ("Buffer containing the initializer must
be owned by the user"), while one imported through DLPack is not, because the imported tensor
does not own its buffer. The routes below make such values without a torch dependency; which
one works depends on the installed ORT, so :func:`select_route` *probes* them, each in a child
process, best first, and keeps the first that really borrows (a probe session's output must
change when the device buffer changes). A route that raises or crashes (an earlier attempt
with ``add_external_initializers`` and DLPack buffers segfaulted) only costs its child.

``ort-slab``
    ORT allocates one device buffer the size of the weights file
    (``OrtValue.ortvalue_from_shape_and_type``) and copies the file into it in one transfer, so
    the device holds the file's layout and its aligned offsets. Each tensor becomes a DLPack
    view of the slab: the capsule ORT exports for the slab is retargeted (data pointer, shape,
    dtype) before ``OrtValue.from_dlpack`` imports it. Every view keeps a reference to the
    slab, so the slab is freed only after the last session that borrows it.
``ort-per-tensor``
    One ORT allocation per tensor, re-imported through DLPack. Public API only; one transfer
    per tensor.
``cupy-slab``
    Like ``ort-slab`` with the slab allocated by CuPy (CUDA only, if CuPy is installed).

Measured on an NVIDIA H200 with onnxruntime-gpu 1.31.1 (``benchmarks/gpu_cuda.py``, 1 GiB of
fp32 weights): all three routes work and take the same device memory; 8 sessions of a pool
take 2808 MiB against 18144 for 8 plain sessions, at the same throughput and with bitwise
equal outputs. What remains per session is cuBLAS workspace and streams: see ``docs/gpu.md``
for the settings that bring 8 sessions to 1.1-1.6x the weights.

The environment variable ``SHAREDML_DEVICE_ROUTE`` names the route to use *without* probing
(for deployments and benchmarks that measured it), or ``none`` to use none.

DirectML: the same code runs with device ``"dml"``. Whether the installed
onnxruntime-directml can export a DML tensor through DLPack decides it; ORT's DLPack converter
knows only CPU and CUDA-like devices, so expect the probe to refuse every route there and the
pool to fall back to host-shared weights (each DML session then uploads its own copy). This
has not run on Windows from this repository; see ``docs/gpu.md``.

Tensor types DLPack cannot carry into ORT (bfloat16, float8, 4-bit, bool, strings) stay in the
weights file, and ORT loads them per session as for a plain model.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import numpy as np
import onnx
from onnx import TensorProto

from sharedml._errors import ProviderError
from sharedml._providers import CPU, CUDA, DML
from sharedml._weights import TensorSlot, WeightStore

__all__ = [
    "DEVICE_TYPES",
    "USE_ENV_ALLOCATORS_KEY",
    "ROUTES",
    "ROUTE_ENV",
    "DeviceWeightStore",
    "RouteProbe",
    "device_mechanism_available",
    "probe_routes",
    "register_shared_arena",
    "select_route",
]

ROUTES = ("ort-slab", "ort-per-tensor", "cupy-slab")
ROUTE_ENV = "SHAREDML_DEVICE_ROUTE"
# The device name ORT's Python API uses for each provider's memory. CPU is here so that the
# whole upload / view / register path runs (and is tested) on machines without an accelerator.
DEVICE_TYPES: Mapping[str, str] = {CUDA: "cuda", DML: "dml", CPU: "cpu"}
_ARENA_NAMES = {CUDA: "Cuda", DML: "DML"}  # OrtMemoryInfo names of the device allocators
_PROBE_TIMEOUT_S = 300.0  # seconds: a first CUDA initialization can take a minute
_PROBE_MARKER = "SHAREDML-DEVICE-PROBE:"
# What a probe child runs: ``provider device_id route`` follow in sys.argv.
_PROBE_CODE = (
    "import sys; from sharedml._device import _probe_main; sys.exit(_probe_main(sys.argv[1:]))"
)

# DLPack type codes (dlpack.h) and the ONNX types ORT's DLPack importer maps them back to.
_DL_INT, _DL_UINT, _DL_FLOAT = 0, 1, 2
_DLPACK_TYPES: Mapping[int, tuple[int, int]] = {
    TensorProto.FLOAT: (_DL_FLOAT, 32),
    TensorProto.FLOAT16: (_DL_FLOAT, 16),
    TensorProto.DOUBLE: (_DL_FLOAT, 64),
    TensorProto.INT8: (_DL_INT, 8),
    TensorProto.INT16: (_DL_INT, 16),
    TensorProto.INT32: (_DL_INT, 32),
    TensorProto.INT64: (_DL_INT, 64),
    TensorProto.UINT8: (_DL_UINT, 8),
    TensorProto.UINT16: (_DL_UINT, 16),
    TensorProto.UINT32: (_DL_UINT, 32),
    TensorProto.UINT64: (_DL_UINT, 64),
    # BOOL travels as uint8 and comes back as bool only if the importer is told so, which the
    # capsule path of OrtValue.from_dlpack does not do on every version: left in the file.
}


class _RouteError(RuntimeError):
    """A route cannot produce values ORT borrows (raised inside uploads and probes)."""


# --------------------------------------------------------------------------------------------
# DLPack: the stable C ABI of dlpack.h (unversioned ``DLManagedTensor``, capsule "dltensor")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _export_capsule(value: Any) -> Any:
    """A fresh DLPack capsule for an ORT ``OrtValue``; it holds a reference to the buffer."""
    c_value = value._get_c_value()
    if hasattr(c_value, "to_dlpack"):
        return c_value.to_dlpack()
    if hasattr(c_value, "__dlpack__"):
        return c_value.__dlpack__()
    raise _RouteError("this onnxruntime build cannot export OrtValues through DLPack")


def _retargeted_view(slab: Any, base: int, offset: int, slot: TensorSlot, device: str) -> Any:
    """An ``OrtValue`` for ``slot`` that points into ``slab`` at ``offset`` and borrows it.

    ORT's DLPack export of the slab gives a ``DLManagedTensor`` whose deleter releases one
    reference to the slab. Changing only the fields that describe the tensor (data pointer,
    shape, type) before ORT imports it again gives a view with ORT's own lifetime handling:
    the view holds the slab until the view is destroyed. ORT copies the shape at import, so
    the shape array only has to outlive the call.
    """
    import onnxruntime as ort

    capsule = _export_capsule(slab)
    if not _capsule_is_valid(capsule, b"dltensor"):
        raise _RouteError("onnxruntime exported a DLPack capsule that is not a 'dltensor'")
    managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    tensor = managed.dl_tensor
    dtype = tensor.dtype
    if (
        tensor.data != base
        or tensor.ndim != 1
        or (dtype.code, dtype.bits, dtype.lanes) != (_DL_UINT, 8, 1)
        or tensor.byte_offset != 0
    ):
        raise _RouteError(
            "onnxruntime's DLPack export of a 1-D uint8 buffer has an unexpected layout "
            f"(ndim={tensor.ndim}, dtype=({dtype.code}, {dtype.bits}, {dtype.lanes}))"
        )
    code, bits = _DLPACK_TYPES[slot.data_type]
    shape = (ctypes.c_int64 * max(len(slot.dims), 1))(*slot.dims)
    tensor.data = base + offset
    tensor.ndim = len(slot.dims)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None  # contiguous
    tensor.dtype = _DLDataType(code, bits, 1)
    view = ort.OrtValue.from_dlpack(capsule)
    _check_view(view, base + offset, slot, device)
    return view


def _check_view(view: Any, address: int, slot: TensorSlot, device: str) -> None:
    if view.data_ptr() != address:
        raise _RouteError(f"'{slot.name}': the imported value does not point at its buffer")
    if tuple(view.shape()) != tuple(slot.dims):
        raise _RouteError(f"'{slot.name}': the imported value has shape {view.shape()}")
    if str(view.device_name()).lower() != device:
        # E.g. a DML buffer imported as "cuda": ORT would copy it, or worse, read it as CUDA.
        raise _RouteError(
            f"'{slot.name}': the imported value lives on '{view.device_name()}', not '{device}'"
        )


# --------------------------------------------------------------------------------------------
# Uploads: the device values of one weights buffer, made by one route


class HostWeights(Protocol):
    """What an upload reads: a contiguous uint8 buffer and the tensors in it."""

    @property
    def buffer(self) -> np.ndarray: ...

    @property
    def slots(self) -> tuple[TensorSlot, ...]: ...


def _np_dtype(slot: TensorSlot) -> np.dtype[Any]:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(slot.data_type))


def _on_device(slot: TensorSlot) -> bool:
    if slot.data_type not in _DLPACK_TYPES or slot.length == 0:
        return False
    return slot.length == int(np.prod(slot.dims, dtype=np.int64)) * _np_dtype(slot).itemsize


@dataclasses.dataclass
class _Upload:
    values: dict[str, Any]  # tensor name -> onnxruntime.OrtValue on the device
    device_bytes: int
    reload: Callable[[np.ndarray], None]  # copy a host buffer of the same layout again
    keepalive: list[Any] = dataclasses.field(default_factory=list)


def _span(slots: Sequence[TensorSlot]) -> tuple[int, int]:
    return min(s.offset for s in slots), max(s.offset + s.length for s in slots)


def _upload_ort_slab(host: HostWeights, device: str, device_id: int) -> _Upload:
    import onnxruntime as ort

    slots = [s for s in host.slots if _on_device(s)]
    if not slots:
        return _Upload({}, 0, lambda _buffer: None)
    lo, hi = _span(slots)
    # One allocation, one transfer; the file's alignment (4096 bytes) carries over.
    slab = ort.OrtValue.ortvalue_from_shape_and_type([hi - lo], np.uint8, device, device_id)

    def reload(buffer: np.ndarray) -> None:
        slab.update_inplace(np.ascontiguousarray(buffer[lo:hi]))

    reload(host.buffer)
    base = int(slab.data_ptr())
    values = {s.name: _retargeted_view(slab, base, s.offset - lo, s, device) for s in slots}
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
        value = ort.OrtValue.from_dlpack(_export_capsule(owned[s.name]))
        _check_view(value, int(owned[s.name].data_ptr()), s, device)
        values[s.name] = value
    return _Upload(values, sum(s.length for s in slots), reload, [owned])


def _upload_cupy_slab(host: HostWeights, device: str, device_id: int) -> _Upload:
    if device != "cuda":
        raise _RouteError("the cupy-slab route needs CUDA")
    try:
        cupy = importlib.import_module("cupy")  # optional: not a dependency of sharedml
    except ImportError as exc:
        raise _RouteError("CuPy is not installed") from exc
    import onnxruntime as ort

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
            value = ort.OrtValue.from_dlpack(view)
            _check_view(value, base + start, s, device)
            values[s.name] = value
    return _Upload(values, hi - lo, reload, [slab])


_UPLOADERS: Mapping[str, Callable[[HostWeights, str, int], _Upload]] = {
    "ort-slab": _upload_ort_slab,
    "ort-per-tensor": _upload_ort_per_tensor,
    "cupy-slab": _upload_cupy_slab,
}


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

    def __init__(self, host: HostWeights, provider: str, device_id: int, *, route: str) -> None:
        """Upload ``host``'s tensors to ``provider``'s device ``device_id`` by ``route``.

        Prefer :meth:`for_store`, which reuses a live upload.

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
            self._upload: _Upload | None = _UPLOADERS[route](host, self.device, device_id)
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
        route: str | None = None,
    ) -> DeviceWeightStore:
        """The device copy of ``store``'s weights for ``provider`` on ``device_id``.

        Args:
            store: The host weights (from :meth:`WeightStore.open`).
            provider: ``"CUDAExecutionProvider"`` or ``"DmlExecutionProvider"``
                (``"CPUExecutionProvider"`` works too, for tests).
            device_id: The device, as in the provider's ``device_id`` option.
            route: One of :data:`ROUTES`; default: :func:`select_route`.

        Returns:
            The live store for these arguments, created (and uploaded) if there is none.

        Raises:
            ProviderError: no route works for this provider here, or the upload failed.
        """
        chosen = route if route is not None else select_route(provider, device_id)
        if chosen is None:
            reasons = "; ".join(f"{p.route}: {p.reason}" for p in probe_routes(provider, device_id))
            raise ProviderError(
                f"No way to lend device buffers to {provider} sessions works with onnxruntime "
                f"{_ort_version()} on device {device_id} ({reasons or 'nothing to try'}). Share "
                "the weights in host memory instead (SessionPool mechanism 'auto')."
            )
        key = (str(store.path), store.manifest.sha256, provider, device_id, chosen)
        with cls._registry_lock:
            live = cls._registry.get(key)
            if live is not None and live._upload is not None:
                return live
            created = cls(store, provider, device_id, route=chosen)
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


# --------------------------------------------------------------------------------------------
# Shared device arena (opt-in; see docs/gpu.md for what it measured)

_SHARED_ARENAS: set[tuple[str, int]] = set()
_SHARED_ARENAS_LOCK = threading.Lock()
USE_ENV_ALLOCATORS_KEY = "session.use_env_allocators"


def register_shared_arena(provider: str, device_id: int = 0) -> bool:
    """Register one device arena in ORT's environment for every session of this process.

    Sessions use it for their activations and scratch memory when their options carry
    ``session.use_env_allocators=1`` (:data:`USE_ENV_ALLOCATORS_KEY`), instead of an arena each.
    The arena grows by what is requested (``kSameAsRequested``), not in powers of two. Opt-in:
    it saved nothing for 8 pool sessions of a 1 GiB MLP on an H200 (2792 against 2808 MiB),
    whose activations are small; models with large activations may differ.

    Returns:
        Whether the arena is registered (now or before). ``False``: this provider or this
        onnxruntime cannot register one; sessions then keep their own arenas.

    Thread safety: may be called from any thread; registers at most once per device.
    """
    if provider not in _ARENA_NAMES:
        return False
    import onnxruntime as ort

    with _SHARED_ARENAS_LOCK:
        if (provider, device_id) in _SHARED_ARENAS:
            return True
        try:
            info = ort.OrtMemoryInfo(
                _ARENA_NAMES[provider],
                ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR,
                device_id,
                ort.OrtMemType.DEFAULT,
            )
            arena = ort.OrtArenaCfg({"arena_extend_strategy": 1})  # 1: kSameAsRequested
            ort.create_and_register_allocator_v2(
                provider, info, {"device_id": str(device_id)}, arena
            )
        except Exception:
            return False
        _SHARED_ARENAS.add((provider, device_id))
        return True


# --------------------------------------------------------------------------------------------
# Which route works here: probed in child processes, so a crash costs only the child


@dataclasses.dataclass(frozen=True)
class RouteProbe:
    """What probing one route gave.

    Attributes:
        route: One of :data:`ROUTES`.
        provider: The execution provider probed.
        device_id: The device probed.
        ok: A probe session used the route's device buffers in place.
        reason: Why not (empty when ``ok``), e.g. the error or the signal that killed the probe.
        seconds: How long the probe took, the child's start included.
    """

    route: str
    provider: str
    device_id: int
    ok: bool
    reason: str = ""
    seconds: float = 0.0


_PROBE_ELEMENTS = 1024
_PROBE_STRIDE_BYTES = 4096  # the probe's second tensor sits at a non-zero, aligned offset


@dataclasses.dataclass
class _ProbeWeights:
    buffer: np.ndarray
    slots: tuple[TensorSlot, ...]


def _probe_weights(w0: float, w1: float) -> _ProbeWeights:
    buffer = np.zeros(2 * _PROBE_STRIDE_BYTES, np.uint8)
    buffer[: 4 * _PROBE_ELEMENTS].view(np.float32)[:] = w0
    buffer[_PROBE_STRIDE_BYTES : _PROBE_STRIDE_BYTES + 4 * _PROBE_ELEMENTS].view(np.float32)[:] = w1
    slots = tuple(
        TensorSlot(name, TensorProto.FLOAT, (_PROBE_ELEMENTS,), i * _PROBE_STRIDE_BYTES, 4096)
        for i, name in enumerate(("w0", "w1"))
    )
    return _ProbeWeights(buffer, slots)


def _probe_model() -> bytes:
    from onnx import helper

    zeros = np.zeros(_PROBE_ELEMENTS, np.float32)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w0"], ["t"]), helper.make_node("Add", ["t", "w1"], ["y"])],
        "sharedml_device_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [_PROBE_ELEMENTS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [_PROBE_ELEMENTS])],
        # Zeros in the graph: a session that ignored the registered buffers outputs zeros.
        initializer=[onnx.numpy_helper.from_array(zeros, n) for n in ("w0", "w1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def _probe_here(provider: str, device_id: int, route: str) -> None:
    """Raise unless ``route`` lends buffers that a ``provider`` session uses in place."""
    import onnxruntime as ort

    if provider == CUDA and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()  # as a CUDA user's process does; harmless where torch loaded them
    if provider not in ort.get_available_providers():
        raise _RouteError(f"{provider} is not available in this onnxruntime build")
    store = DeviceWeightStore(_probe_weights(1.0, 2.0), provider, device_id, route=route)
    if set(store.tensor_names) != {"w0", "w1"}:
        raise _RouteError("the route left probe tensors on the host")
    so = ort.SessionOptions()
    so.log_severity_level = 3
    store.register(so)
    providers: list[Any] = [(provider, {"device_id": str(device_id)}) if provider != CPU else CPU]
    if provider != CPU:
        providers.append(CPU)
    sess = ort.InferenceSession(_probe_model(), so, providers=providers)
    x = np.ones(_PROBE_ELEMENTS, np.float32)
    first = float(sess.run(None, {"x": x})[0][-1])
    if first != 3.0:
        raise _RouteError(f"the probe session computed {first}, not 3.0: it ignored the buffers")
    store.reload(_probe_weights(3.0, 4.0).buffer)
    second = float(sess.run(None, {"x": x})[0][-1])
    if second != 7.0:
        raise _RouteError(
            f"the probe session computed {second} after the device buffers changed, not 7.0: "
            "ORT copied the weights instead of borrowing them"
        )


def _probe_main(argv: Sequence[str]) -> int:
    """Entry point of a probe child: ``provider device_id route``; prints one result line."""
    provider, device_id, route = argv[0], int(argv[1]), argv[2]
    try:
        _probe_here(provider, device_id, route)
        result = {"ok": True, "reason": ""}
    except BaseException as exc:  # the child reports anything; the parent decides
        result = {"ok": False, "reason": f"{type(exc).__name__}: {exc}".strip()[:2000]}
    print(_PROBE_MARKER + json.dumps(result), flush=True)
    return 0


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The child must import this very sharedml and onnxruntime, wherever they came from.
    paths = [p for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _run_probe(provider: str, device_id: int, route: str, timeout_s: float) -> RouteProbe:
    """Probe one route in a child process."""
    start = time.perf_counter()

    def done(ok: bool, reason: str) -> RouteProbe:
        return RouteProbe(route, provider, device_id, ok, reason, time.perf_counter() - start)

    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE, provider, str(device_id), route],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_child_env(),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return done(False, f"the probe did not finish within {timeout_s:.0f} s")
    except OSError as exc:
        return done(False, f"the probe could not start: {exc}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_PROBE_MARKER):
            result = json.loads(line[len(_PROBE_MARKER) :])
            return done(bool(result["ok"]), str(result["reason"]))
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        reason = f"the probe crashed ({name}): this route would crash the process"
    else:
        reason = f"the probe exited with status {proc.returncode} and no result"
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    return done(False, reason + (f"; stderr: {' | '.join(tail)}" if tail else ""))


_PROBES: dict[tuple[str, int], tuple[RouteProbe, ...]] = {}
_PROBES_LOCK = threading.Lock()


def _ort_version() -> str:
    try:
        import onnxruntime as ort

        return str(ort.__version__)
    except Exception:  # pragma: no cover - onnxruntime is a dependency
        return "unknown"


def _provider_available(provider: str) -> bool:
    import onnxruntime as ort

    return provider in ort.get_available_providers()


def probe_routes(
    provider: str,
    device_id: int = 0,
    *,
    routes: Sequence[str] = ROUTES,
    stop_at_first: bool = True,
    refresh: bool = False,
    timeout_s: float = _PROBE_TIMEOUT_S,
) -> tuple[RouteProbe, ...]:
    """Probe device weight routes for ``provider`` on ``device_id``, each in a child process.

    The default call (every route, stopping at the first that works) is cached for the process.

    Args:
        provider: An execution provider name.
        device_id: The device to probe.
        routes: Which routes, in order of preference.
        stop_at_first: Stop after the first route that works.
        refresh: Probe again even if cached.
        timeout_s: Give up on a probe after this many seconds (counted as a failure).

    Returns:
        One result per route probed, in order; empty if the provider is not available or has
        no device store.

    Thread safety: may be called from any thread; concurrent callers wait for one probe.
    """
    cacheable = tuple(routes) == ROUTES and stop_at_first
    key = (provider, device_id)
    with _PROBES_LOCK:
        if cacheable and not refresh and key in _PROBES:
            return _PROBES[key]
        if provider not in DEVICE_TYPES or not _provider_available(provider):
            results: tuple[RouteProbe, ...] = ()
        else:
            found: list[RouteProbe] = []
            for route in routes:
                found.append(_run_probe(provider, device_id, route, timeout_s))
                if stop_at_first and found[-1].ok:
                    break
            results = tuple(found)
        if cacheable:
            _PROBES[key] = results
        return results


def select_route(provider: str, device_id: int = 0) -> str | None:
    """The device weight route to use for ``provider`` on ``device_id``, or ``None``.

    ``SHAREDML_DEVICE_ROUTE`` (:data:`ROUTE_ENV`) set to a route uses it without probing, set
    to ``none`` uses none; otherwise the first route that :func:`probe_routes` finds working.

    Raises:
        ProviderError: ``SHAREDML_DEVICE_ROUTE`` names no route.
    """
    forced = os.environ.get(ROUTE_ENV, "").strip()
    if forced:
        if forced.lower() == "none":
            return None
        if forced not in ROUTES:
            raise ProviderError(
                f"{ROUTE_ENV}={forced!r} is not a device weight route; use one of {ROUTES} "
                "or 'none'."
            )
        return forced
    for probe in probe_routes(provider, device_id):
        if probe.ok:
            return probe.route
    return None


def device_mechanism_available(provider: str, device_id: int = 0) -> bool:
    """Whether sessions of ``provider`` can borrow weights from a :class:`DeviceWeightStore`.

    Probed once per process and provider (each route in a child process), so it never
    crashes the caller. ``False`` for providers without a device store (CPU included: its
    sessions share host memory directly).
    """
    if provider not in DEVICE_TYPES or provider == CPU:
        return False
    try:
        return select_route(provider, device_id) is not None
    except Exception:
        return False
