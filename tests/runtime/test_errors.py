"""ORT's failures map to sharedml's errors at the runtime boundary, and nowhere else."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml.runtime._errors import (
    is_model_refused,
    is_session_lost,
    mapped_run_errors,
    run_error,
)


def _named(name: str) -> type[Exception]:
    return type(name, (Exception,), {})  # ORT's binding names its exceptions; no common base


@pytest.mark.parametrize(
    ("name", "cls", "lost"),
    [
        ("InvalidArgument", sharedml.InvalidInputError, False),
        ("ValueError", sharedml.InvalidInputError, False),
        ("Fail", sharedml.RunError, False),
        ("RuntimeException", sharedml.RunError, False),
        ("EPFail", sharedml.RunError, True),
        ("EngineError", sharedml.RunError, True),
    ],
)
def test_each_ort_failure_becomes_a_run_error_keeping_its_name_message_and_cause(
    name: str, cls: type[Exception], lost: bool
) -> None:
    original = _named(name)("  the   message\n of ORT ")
    with pytest.raises(cls) as caught, mapped_run_errors():
        raise original
    error = caught.value
    assert type(error) is cls and error.ort_type == name  # type: ignore[attr-defined]
    assert str(error) == f"onnxruntime raised {name}: the message of ORT"
    assert error.__cause__ is original
    assert error.session_lost is lost and is_session_lost(error) is lost  # type: ignore[attr-defined]
    assert is_session_lost(original) is lost  # a checked-out session's caller raises ORT's own


def test_sharedml_errors_pass_through_unchanged() -> None:
    mine = sharedml.InvalidInputError("a feed of sharedml's own checks")
    assert run_error(mine) is mine
    with pytest.raises(sharedml.InvalidInputError) as caught, mapped_run_errors():
        raise mine
    assert caught.value is mine


def test_a_real_ort_failure_of_a_pool_run_is_an_invalid_input_error(tmp_path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "m.onnx"
    path.write_bytes(model.SerializeToString())
    with (
        sharedml.SessionPool(path, sessions=1) as pool,
        pytest.raises(sharedml.InvalidInputError) as caught,
    ):
        pool.run(None, {"x": np.zeros((2, 5), np.float32)})  # 5 columns for 4
    assert caught.value.ort_type == "InvalidArgument"
    assert type(caught.value.__cause__).__module__ == ort.capi.onnxruntime_pybind11_state.__name__


def _refused(kind: str) -> onnx.ModelProto:
    """A one-MatMul model that ORT refuses for ``kind``, the same for a plain session."""
    op, domain, opset, ir, x_type = "MatMul", "", 17, 8, TensorProto.FLOAT
    if kind == "ir-version":
        ir = 99
    elif kind == "unknown-op":
        op = "NoSuchOp"
    elif kind == "unknown-domain":
        op, domain = "Foo", "example.unknown"
    elif kind == "opset":
        opset = 99
    elif kind == "types":
        x_type = TensorProto.DOUBLE  # MatMul of double by a float weight
    weight = numpy_helper.from_array(np.ones((8, 8), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w"], ["y"], domain=domain)],
        "g",
        [helper.make_tensor_value_info("x", x_type, ["N", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])],
        [weight],
    )
    imports = [helper.make_opsetid("", opset)]
    if domain:
        imports.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=imports, ir_version=ir)


@pytest.mark.parametrize("prepacking", ["auto", "off"])
@pytest.mark.parametrize("kind", ["ir-version", "unknown-op", "unknown-domain", "opset", "types"])
def test_a_model_ort_refuses_is_an_unsupported_model_error_and_no_route_is_tried_instead(
    tmp_path, kind: str, prepacking: str
) -> None:
    path = tmp_path / "refused.onnx"
    onnx.save(_refused(kind), path)
    with pytest.raises(Exception) as plain:  # the oracle: plain ORT refuses it too
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert is_model_refused(plain.value)
    with (
        warnings.catch_warnings(record=True) as warned,
        pytest.raises(sharedml.UnsupportedModelError) as caught,
    ):
        warnings.simplefilter("always")
        sharedml.SessionPool(path, cache_dir=tmp_path / "cache", prepacking=prepacking)
    # Nothing blames prepacking or falls back to another route for what is the model's.
    assert not [w for w in warned if "sharedml" in str(w.message)], [str(w.message) for w in warned]
    error = caught.value
    assert isinstance(error, sharedml.SessionCreationError)  # what callers caught before
    assert isinstance(error, sharedml.ModelError)
    assert f"'{path}'" in str(error) and "as a plain session would" in str(error)
    assert type(error.__cause__).__name__ == type(plain.value).__name__
    if kind == "ir-version":
        assert "IR version 99" in str(error) and "ir_version=" in str(error)


@pytest.mark.parametrize(
    ("error", "refused"),
    [
        (_named("Fail")("Load model from m.onnx failed: Unsupported model IR version: 11"), True),
        (_named("InvalidGraph")("This is an invalid model"), True),
        (_named("NotImplemented")("Could not find an implementation for Foo(1)"), True),
        (_named("Fail")("Failed to save the optimized model"), False),  # prepacking's own
        (_named("InvalidArgument")("Load model from m.onnx failed"), False),
        ("Fail: [ONNXRuntimeError] : 1 : FAIL : Load model from m.onnx failed: opset", True),
        ("InvalidProtobuf: cannot parse", True),
        ("Fail: out of memory", False),
    ],
)
def test_only_ort_refusals_of_the_model_itself_count_as_refused(
    error: Exception | str, refused: bool
) -> None:
    assert is_model_refused(error) is refused
