"""The one dtype table: each spelling of each row agrees with the library that owns it."""

from __future__ import annotations

import ctypes

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from sharedml.model._dtypes import ELEMENT_TYPES, ElementType, dlpack_type, np_dtype, onnx_name

ROWS = {row.name: row for row in ELEMENT_TYPES}
DATA_TYPES = {row.data_type for row in ELEMENT_TYPES}


def test_each_type_has_one_row() -> None:
    for column in ("data_type", "name"):
        values = [getattr(row, column) for row in ELEMENT_TYPES]
        assert len(values) == len(set(values)), column
    datatypes = [row.datatype for row in ELEMENT_TYPES if row.datatype is not None]
    assert len(datatypes) == len(set(datatypes))


@pytest.mark.parametrize("row", ELEMENT_TYPES, ids=list(ROWS))
def test_names_and_numpy_dtypes_are_onnxs(row: ElementType) -> None:
    assert onnx.TensorProto.DataType.Name(row.data_type).lower() == row.name
    expected = np.dtype(helper.tensor_dtype_to_np_dtype(row.data_type))
    assert np_dtype(row.data_type) == expected
    # A row names a numpy dtype exactly where numpy has the type itself (not ml_dtypes').
    assert (row.numpy is not None) == (expected.type.__module__ == "numpy")
    if row.numpy is not None:
        assert np.dtype(row.numpy) == expected


@pytest.mark.parametrize(
    "row", [r for r in ELEMENT_TYPES if r.datatype is not None], ids=lambda r: r.name
)
def test_ort_names_every_wire_type_as_the_table_does(row: ElementType) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", row.data_type, [2])],
        [helper.make_tensor_value_info("y", row.data_type, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[0].type == row.ort_type


@pytest.mark.parametrize(
    "row", [r for r in ELEMENT_TYPES if r.datatype is not None], ids=lambda r: r.name
)
def test_protocol_datatypes_are_the_triton_clients(row: ElementType) -> None:
    tritonclient = pytest.importorskip("tritonclient.utils")
    assert row.numpy is not None
    assert tritonclient.np_to_triton_dtype(np.dtype(row.numpy)) == row.datatype
    assert np.dtype(tritonclient.triton_to_np_dtype(row.datatype)) == np.dtype(row.numpy)


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensorHead(ctypes.Structure):  # dlpack.h's DLTensor, up to its dtype
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", ctypes.c_int32 * 2),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
    ]


@pytest.mark.parametrize(
    "row", [r for r in ELEMENT_TYPES if r.dlpack is not None], ids=lambda r: r.name
)
def test_dlpack_codes_are_those_numpy_exports(row: ElementType) -> None:
    assert row.numpy is not None
    capsule = np.zeros(2, row.numpy).__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    dtype = _DLTensorHead.from_address(get(capsule, b"dltensor")).dtype
    assert (dtype.code, dtype.bits) == row.dlpack == dlpack_type(row.data_type)
    assert dtype.lanes == 1


def test_a_type_outside_the_table_is_named_by_onnx_and_an_unknown_one_refused() -> None:
    outside = [v for v in onnx.TensorProto.DataType.values() if v and v not in DATA_TYPES]
    for data_type in outside:  # newer than the oldest onnx sharedml takes
        assert onnx_name(data_type) == onnx.TensorProto.DataType.Name(data_type).lower()
    with pytest.raises(ValueError):
        onnx_name(max(onnx.TensorProto.DataType.values()) + 1)
