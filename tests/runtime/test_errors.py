"""ORT's run failures map to sharedml's errors at the runtime boundary, and nowhere else."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import sharedml
from sharedml.runtime._errors import is_session_lost, mapped_run_errors, run_error


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
