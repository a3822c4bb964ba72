"""One table of tensor element types, in every spelling sharedml meets.

ONNX's ``TensorProto.DataType`` (``1``), its lower-case name (``"float"``, which ORT writes as
its type text ``"tensor(float)"``), numpy's dtype (``"float32"``), the Open Inference
Protocol's datatype (``"FP32"``) and the DLPack type code that ORT's importer maps back to the
type. Every module that converts between two of these reads this table.

A row holds what sharedml uses today, not everything that exists: the protocol has no datatype
for complex or bfloat16 tensors here, and DLPack carries no bool (see :data:`ELEMENT_TYPES`).
Types that onnx 1.16, the oldest onnx sharedml takes, does not know are not rows either (the
4-bit float, the 8-bit exponent-only float and later ones); their names and numpy dtypes come
from the installed onnx (:func:`onnx_name`, :func:`np_dtype`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "ELEMENT_TYPES",
    "ElementType",
    "by_data_type",
    "dlpack_type",
    "np_dtype",
    "onnx_name",
    "ort_type",
]

# DLPack type codes (dlpack.h): kDLInt, kDLUInt, kDLFloat.
_DL_INT, _DL_UINT, _DL_FLOAT = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class ElementType:
    """One tensor element type, in each spelling.

    Attributes:
        data_type: ONNX's ``TensorProto.DataType`` value.
        name: ONNX's name of it, lower case (``"float"``): ORT's type text is
            ``tensor(<name>)``.
        numpy: numpy's dtype name where numpy has the type itself (``"object"`` for strings);
            None where the dtype is ml_dtypes' (bfloat16, float8, 4-bit), reached through onnx.
        datatype: The Open Inference Protocol's datatype (``"FP32"``); None where the wire
            formats here carry no such tensor.
        dlpack: ``(type code, bits)`` that ORT's DLPack importer maps back to this type; None
            where the device weight routes lend no such tensor through DLPack.
    """

    data_type: int
    name: str
    numpy: str | None
    datatype: str | None
    dlpack: tuple[int, int] | None

    @property
    def ort_type(self) -> str:
        """ORT's type text of a tensor of this type (``"tensor(float)"``)."""
        return f"tensor({self.name})"


# In this order the protocol lists its datatypes in messages (floats, signed, unsigned, bool,
# strings), then the types no wire format here carries.
ELEMENT_TYPES: tuple[ElementType, ...] = (
    ElementType(1, "float", "float32", "FP32", (_DL_FLOAT, 32)),
    ElementType(11, "double", "float64", "FP64", (_DL_FLOAT, 64)),
    ElementType(10, "float16", "float16", "FP16", (_DL_FLOAT, 16)),
    ElementType(3, "int8", "int8", "INT8", (_DL_INT, 8)),
    ElementType(5, "int16", "int16", "INT16", (_DL_INT, 16)),
    ElementType(6, "int32", "int32", "INT32", (_DL_INT, 32)),
    ElementType(7, "int64", "int64", "INT64", (_DL_INT, 64)),
    ElementType(2, "uint8", "uint8", "UINT8", (_DL_UINT, 8)),
    ElementType(4, "uint16", "uint16", "UINT16", (_DL_UINT, 16)),
    ElementType(12, "uint32", "uint32", "UINT32", (_DL_UINT, 32)),
    ElementType(13, "uint64", "uint64", "UINT64", (_DL_UINT, 64)),
    # BOOL travels as uint8 and comes back as bool only if the importer is told so, which the
    # capsule path of OrtValue.from_dlpack does not do on every version: left in the file.
    ElementType(9, "bool", "bool", "BOOL", None),
    ElementType(8, "string", "object", "BYTES", None),  # onnx.helper maps STRING to object too
    ElementType(14, "complex64", "complex64", None, None),
    ElementType(15, "complex128", "complex128", None, None),
    ElementType(16, "bfloat16", None, None, None),
    ElementType(17, "float8e4m3fn", None, None, None),
    ElementType(18, "float8e4m3fnuz", None, None, None),
    ElementType(19, "float8e5m2", None, None, None),
    ElementType(20, "float8e5m2fnuz", None, None, None),
    ElementType(21, "uint4", None, None, None),
    ElementType(22, "int4", None, None, None),
)

_BY_DATA_TYPE = {t.data_type: t for t in ELEMENT_TYPES}


def by_data_type(data_type: int) -> ElementType | None:
    """The row of an ONNX ``TensorProto.DataType``; None where the table has none."""
    return _BY_DATA_TYPE.get(data_type)


def onnx_name(data_type: int) -> str:
    """ONNX's name of ``data_type``, lower case (``"float"``, ``"int64"``).

    Raises:
        ValueError: neither the table nor the installed onnx knows the type.
    """
    row = _BY_DATA_TYPE.get(data_type)
    if row is not None:
        return row.name
    from sharedml.model._proto import pb2

    return str(pb2().TensorProto.DataType.Name(data_type)).lower()


def ort_type(data_type: int) -> str:
    """ORT's type text of a tensor of ``data_type`` (``"tensor(float)"``).

    Raises:
        ValueError: as :func:`onnx_name`.
    """
    return f"tensor({onnx_name(data_type)})"


def np_dtype(data_type: int) -> np.dtype[Any]:
    """The numpy dtype of an ONNX ``TensorProto.DataType`` (``onnx.helper``'s mapping).

    Raises:
        KeyError or ValueError: the type has no numpy dtype (``UNDEFINED``, unknown).
    """
    import numpy as np

    row = _BY_DATA_TYPE.get(data_type)
    if row is not None and row.numpy is not None:
        return np.dtype(row.numpy)
    import onnx  # the others (bfloat16, float8, 4-bit) are ml_dtypes', reached through onnx

    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))


def dlpack_type(data_type: int) -> tuple[int, int] | None:
    """``(DLPack type code, bits)`` that ORT maps back to ``data_type``; None: not lent so."""
    row = _BY_DATA_TYPE.get(data_type)
    return row.dlpack if row is not None else None
