"""DLPack's stable C ABI, for lending device buffers to ONNX Runtime without torch.

ORT uses an initializer in place only when the caller owns its buffer. An ``OrtValue`` that ORT
allocated is refused as "owned by ORT", but the same buffer re-imported through DLPack is not,
because the imported tensor does not own it. These helpers export an ``OrtValue`` as a DLPack
capsule, retarget a capsule at a slice of its buffer (data pointer, shape, dtype), and check
that ORT's import points where it should. The structures follow ``dlpack.h`` (the unversioned
``DLManagedTensor`` in a capsule named ``"dltensor"``).
"""

from __future__ import annotations

import ctypes
from typing import Any

from sharedml.model._dtypes import dlpack_type
from sharedml.runtime._capabilities import ort_version
from sharedml.weights._store import TensorSlot

__all__ = [
    "probe_dlpack",
    "RouteError",
    "check_view",
    "export_capsule",
    "import_capsule",
    "retargeted_view",
]

_UINT8 = dlpack_type(2)  # (type code, bits) of TensorProto.UINT8: a weights buffer's bytes


class RouteError(RuntimeError):
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


def export_capsule(value: Any) -> Any:
    """A fresh DLPack capsule for an ORT ``OrtValue``; it holds a reference to the buffer."""
    c_value = value._get_c_value()
    if hasattr(c_value, "to_dlpack"):
        return c_value.to_dlpack()
    if hasattr(c_value, "__dlpack__"):
        return c_value.__dlpack__()
    raise RouteError("this onnxruntime build cannot export OrtValues through DLPack")


def import_capsule(data: Any) -> Any:
    """An ``onnxruntime.OrtValue`` over a DLPack capsule (or an object with ``__dlpack__``).

    ``OrtValue.from_dlpack`` is new in onnxruntime 1.26; from 1.21 to 1.25 only the binding's C
    class has it (``from_dlpack(capsule, is_bool_tensor)``), which is what the Python method
    calls, so its value is wrapped the same way. 1.20's CPU build has neither.

    Raises:
        RouteError: this onnxruntime cannot import DLPack tensors.
    """
    import onnxruntime as ort

    importer = getattr(ort.OrtValue, "from_dlpack", None)
    if importer is not None:
        return importer(data)
    from onnxruntime.capi import _pybind_state

    native = getattr(_pybind_state.OrtValue, "from_dlpack", None)
    if native is None:
        raise RouteError(
            f"onnxruntime {ort.__version__} cannot import DLPack tensors (no OrtValue.from_dlpack)"
        )
    capsule = data.__dlpack__() if hasattr(data, "__dlpack__") else data
    return ort.OrtValue(native(capsule, False))


def retargeted_view(slab: Any, base: int, offset: int, slot: TensorSlot, device: str) -> Any:
    """An ``OrtValue`` for ``slot`` that points into ``slab`` at ``offset`` and borrows it.

    ORT's DLPack export of the slab gives a ``DLManagedTensor`` whose deleter releases one
    reference to the slab. Changing only the fields that describe the tensor (data pointer,
    shape, type) before ORT imports it again gives a view with ORT's own lifetime handling:
    the view holds the slab until the view is destroyed. ORT copies the shape at import, so
    the shape array only has to outlive the call.
    """
    capsule = export_capsule(slab)
    if not _capsule_is_valid(capsule, b"dltensor"):
        raise RouteError("onnxruntime exported a DLPack capsule that is not a 'dltensor'")
    managed = _DLManagedTensor.from_address(_capsule_pointer(capsule, b"dltensor"))
    tensor = managed.dl_tensor
    dtype = tensor.dtype
    if (
        tensor.data != base
        or tensor.ndim != 1
        or (dtype.code, dtype.bits) != _UINT8
        or dtype.lanes != 1
        or tensor.byte_offset != 0
    ):
        raise RouteError(
            "onnxruntime's DLPack export of a 1-D uint8 buffer has an unexpected layout "
            f"(ndim={tensor.ndim}, dtype=({dtype.code}, {dtype.bits}, {dtype.lanes}))"
        )
    dl_type = dlpack_type(slot.data_type)
    if dl_type is None:
        raise KeyError(slot.data_type)  # callers lend only the types the table has a code for
    code, bits = dl_type
    shape = (ctypes.c_int64 * max(len(slot.dims), 1))(*slot.dims)
    tensor.data = base + offset
    tensor.ndim = len(slot.dims)
    tensor.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None  # contiguous
    tensor.dtype = _DLDataType(code, bits, 1)
    view = import_capsule(capsule)
    check_view(view, base + offset, slot, device)
    return view


def check_view(view: Any, address: int, slot: TensorSlot, device: str) -> None:
    if view.data_ptr() != address:
        raise RouteError(f"'{slot.name}': the imported value does not point at its buffer")
    if tuple(view.shape()) != tuple(slot.dims):
        raise RouteError(f"'{slot.name}': the imported value has shape {view.shape()}")
    if str(view.device_name()).lower() != device:
        # E.g. a DML buffer imported as "cuda": ORT would copy it, or worse, read it as CUDA.
        raise RouteError(
            f"'{slot.name}': the imported value lives on '{view.device_name()}', not '{device}'"
        )


def probe_dlpack() -> str:
    """Why DLPack export and import of OrtValues cannot be used here; "" where they can.

    The capability ``dlpack`` (:mod:`sharedml.runtime._capabilities`): a CPU value's round
    trip must point at the same buffer.
    """
    import numpy as np
    import onnxruntime as ort
    from onnxruntime.capi import _pybind_state

    native = _pybind_state.OrtValue
    missing = [
        what
        for what, found in (
            ("export", hasattr(native, "to_dlpack") or hasattr(native, "__dlpack__")),
            ("import", hasattr(ort.OrtValue, "from_dlpack") or hasattr(native, "from_dlpack")),
        )
        if not found
    ]
    if missing:
        return (
            f"onnxruntime {ort_version()} has no DLPack {' or '.join(missing)} of OrtValues "
            "(the CPU build has both from 1.21)"
        )
    value = ort.OrtValue.ortvalue_from_numpy(np.arange(16, dtype=np.float32))
    try:
        view = import_capsule(export_capsule(value))
    except RouteError as exc:
        return f"onnxruntime {ort_version()}: {exc}"
    if view.data_ptr() != value.data_ptr() or not np.array_equal(view.numpy(), value.numpy()):
        return (
            f"onnxruntime {ort_version()}'s DLPack round trip of a CPU value did not point at "
            "the same buffer"
        )
    return ""
