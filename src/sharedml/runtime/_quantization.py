"""ONNX Runtime's weight-only quantizer, and whether its block-quantized kernels work here.

``com.microsoft.MatMulNBits`` (written by ORT's own ``MatMulNBitsQuantizer``) and
``com.microsoft.GatherBlockQuantized`` hold weights as blocks of a few bits. Which onnxruntime
writes and runs which format is measured by running tiny models here, not read from version
numbers: a kernel that loads but computes garbage is caught too.

The formats and the graph rewrites belong to the prepare stage
(:mod:`sharedml.prepared._compress`); it describes a format to these functions as data
(:class:`BlockFormat`), and caches their answers once per process and format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from sharedml._errors import CompressError, missing_package

__all__ = [
    "BlockFormat",
    "gather_block_quantized_unavailable",
    "matmul_nbits_quantizer",
    "matmul_nbits_unavailable",
    "quantize_matmuls",
    "root_logging_kept",
]


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-quantized weights format, as ORT's quantizer and kernels take it.

    Attributes:
        name: What users call it (``"int8"``, ``"int4"``), for messages.
        bits: Bits per quantized value.
        block_size: Values that share one scale and zero point.
        accuracy_level: ``MatMulNBits``'s ``accuracy_level`` (None: ORT's default).
        symmetric: Whether blocks have no zero point (ORT's ``is_symmetric``).
    """

    name: str
    bits: int
    block_size: int
    accuracy_level: int | None
    symmetric: bool


@contextlib.contextmanager
def root_logging_kept() -> Iterator[None]:
    """Undo what importing ORT's quantizer does to the application's root logger.

    Its module calls ``logging.basicConfig(level=logging.INFO)`` at import (1.32), which adds a
    handler to an application's unconfigured root logger and lowers its level: every library's
    INFO lines would then print. The root logger's handlers and level are put back.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def matmul_nbits_quantizer(fmt: BlockFormat) -> Any:
    """ORT's weight-only quantizer class for ``fmt``.

    Raises:
        CompressError: the installed onnxruntime has no quantizer that writes ``fmt``, or the
            quantizer's own dependency (``onnx-ir`` on recent versions) is not installed.
    """
    import onnxruntime

    version = onnxruntime.__version__
    try:
        with root_logging_kept():
            from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("onnxruntime"):  # the tool's own dependency
            package = exc.name.replace("_", "-")
            feature = "Compressed weights (onnxruntime's quantization tools)"
            raise CompressError(str(missing_package(feature, package, "compress"))) from None
        return _older_quantizer(fmt, version)
    if fmt.bits != 4 and "bits" not in inspect.signature(MatMulNBitsQuantizer).parameters:
        raise _needs_newer(fmt, version)
    return MatMulNBitsQuantizer


def _needs_newer(fmt: BlockFormat, version: str) -> CompressError:
    return CompressError(
        f"onnxruntime {version}'s quantization tools write 4-bit blocks only: "
        f"weights='{fmt.name}' needs onnxruntime 1.22 or later. Use weights='int4', or "
        "upgrade onnxruntime."
    )


def _older_quantizer(fmt: BlockFormat, version: str) -> Any:
    """Before 1.22: ``MatMul4BitsQuantizer``, the 4-bit-only tool of the same design."""
    if fmt.bits != 4:
        raise _needs_newer(fmt, version)
    try:
        with root_logging_kept():
            from onnxruntime.quantization.matmul_4bits_quantizer import MatMul4BitsQuantizer
    except ImportError:
        raise CompressError(
            f"onnxruntime {version} has no weight-only quantization tools "
            "(onnxruntime.quantization.matmul_nbits_quantizer): install onnxruntime 1.22 or "
            "later, or use weights='float'."
        ) from None
    return MatMul4BitsQuantizer


def quantize_matmuls(model: Any, fmt: BlockFormat, quantizer: Any) -> Any:
    """Run ORT's ``quantizer`` (:func:`matmul_nbits_quantizer`) over ``model`` for ``fmt``.

    Every ``MatMul`` whose weight is a constant float matrix becomes ``MatMulNBits``.

    Returns:
        The quantized model, as the quantizer hands it back.
    """
    kwargs: dict[str, Any] = {
        "block_size": fmt.block_size,
        "is_symmetric": fmt.symmetric,
        "accuracy_level": fmt.accuracy_level,
    }
    if fmt.bits != 4:  # only 1.22+ takes bits (checked by the lookup); 4 is every version's
        kwargs["bits"] = fmt.bits
    q = quantizer(model, **kwargs)
    q.process()
    return q.model.model


def _probe_model() -> Any:
    """A tiny float MatMul model (x @ W, W fixed by a seed) for the capability probe."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 16])],
        [numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _weights_of(model: Any) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def matmul_nbits_unavailable(fmt: BlockFormat) -> str | None:
    """Why the installed onnxruntime cannot make or run ``fmt`` matrices here; None if it can.

    A tiny MatMul is quantized with ORT's own tool and run on the CPU provider, and its output
    compared with the float product. Measured at every call: callers keep the answer.
    """
    try:
        quantizer = matmul_nbits_quantizer(fmt)
    except CompressError as exc:
        return str(exc)
    import onnxruntime

    try:
        float_model = _probe_model()
        want = np.ones((2, 64), np.float32) @ _weights_of(float_model)["w"]
        quantized = quantize_matmuls(_probe_model(), fmt, quantizer)
        sess = onnxruntime.InferenceSession(
            quantized.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        got = sess.run(None, {"x": np.ones((2, 64), np.float32)})[0]
    except Exception as exc:
        return (
            f"onnxruntime {onnxruntime.__version__} could not build or run {fmt.name} "
            f"MatMulNBits weights ({type(exc).__name__}: {exc})"
        )
    error = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    if not error <= 0.1 * scale:  # 4 bits err by a few percent of the scale, not more
        return (
            f"onnxruntime {onnxruntime.__version__}'s {fmt.name} MatMulNBits kernel gave "
            f"wrong results on a probe (largest difference {error:.3g} of a scale of {scale:.3g})"
        )
    return None


def gather_block_quantized_unavailable(
    fmt: BlockFormat,
    quantize: Callable[[Any], int],
    dequantize: Callable[[np.ndarray], np.ndarray],
) -> str | None:
    """Why the installed onnxruntime cannot look up ``fmt`` tables here; None if it can.

    The layout of a quantized table is the caller's (its rewrite writes the blocks), so the
    caller passes it: ``quantize`` rewrites a model's embedding tables in place and returns
    how many it quantized; ``dequantize`` gives what a table's blocks stand for. A small table
    with an odd number of blocks per row is quantized so and looked up on the CPU provider;
    the rows must equal the table's dequantized rows exactly. Measured at every call: callers
    keep the answer.
    """
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    width = 3 * fmt.block_size
    table = np.random.default_rng(0).standard_normal((8, width)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)],
        "probe",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", width])],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    ids = np.array([5, 0, 7], np.int64)
    try:
        if quantize(model) != 1:
            return "the probe's table was not quantized"
        want = dequantize(table)[ids]
        sess = onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        got = sess.run(None, {"ids": ids})[0]
    except Exception as exc:
        return (
            f"onnxruntime {onnxruntime.__version__} could not run {fmt.name} "
            f"GatherBlockQuantized tables ({type(exc).__name__}: {_first_line(exc)})"
        )
    if got.shape != want.shape or not np.array_equal(got, want):
        return (
            f"onnxruntime {onnxruntime.__version__}'s {fmt.name} GatherBlockQuantized "
            "kernel gave other rows than the table's on a probe"
        )
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""
