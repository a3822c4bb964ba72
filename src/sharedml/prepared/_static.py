"""Static int8: weights *and* activations in 8 bits, at scales calibrated once on given inputs.

Weight-only compression (:mod:`sharedml.prepared._compress`) leaves convolutions float and
computes in float, so on CPUs with int8 dot products (VNNI, AMX) it cannot reach a runtime that
computes in reduced precision. Static quantization can: onnxruntime's ``quantize_static`` runs
the float model on calibration inputs, records each activation's range (min/max), and writes a
QDQ model (``QuantizeLinear``/``DequantizeLinear`` around every op it quantizes: Conv, MatMul,
Gemm, Add, pooling...), which ORT's CPU provider fuses into int8 kernels (``QLinearConv``,
``MatMulIntegerToFloat``...) at load.

Why this keeps callers apart in a batch: every activation's scale and zero point are constants
of the written model, fixed by the calibration, so a row is quantized the same whether it runs
alone or beside other callers' rows (the row-independence analysis treats ``QuantizeLinear``
with constant parameters as row-wise). Dynamic quantization would not: ``DynamicQuantizeLinear``
takes its scale from the whole tensor, every row of the batch (the analysis refuses to batch it).

The cost is accuracy, and it depends on the calibration: inputs unlike the real ones give
scales that clip or waste range. So the inputs are the caller's, never generated, and the result
says how far the quantized model's outputs are from the float model's on the inputs checked.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sharedml import _host
from sharedml._errors import CompressError, missing_package
from sharedml.model._accuracy import OutputAccuracy, compare_outputs, worst_of
from sharedml.model._graph import iter_graphs, load_graph, tensor_nbytes
from sharedml.prepared._compress import root_logging_kept
from sharedml.prepared._files import check_outputs, source_files
from sharedml.prepared._prepare import PrepareResult, output_paths, prepare

__all__ = ["StaticCompressResult", "compress_static"]

_log = logging.getLogger("sharedml")

_SCRATCH_MODEL = "static.onnx"
_INT8_TYPES = (2, 3)  # TensorProto.UINT8, INT8


@dataclasses.dataclass(frozen=True)
class StaticCompressResult:
    """What :func:`compress_static` wrote, and what it cost in accuracy.

    Attributes:
        model_path: The quantized, prepared graph.
        weights_path: Its weights file.
        quantized_weights: How many weight tensors are stored as int8.
        float_bytes: The model's float weights' bytes before.
        compressed_bytes: All its weights' bytes after (int8 weights, their scales, the
            tensors left float).
        per_channel: Whether the weights have a scale per output channel (else one per tensor:
            a model of an opset before 13 that onnx's version converter could not convert).
        calibration_feeds: How many feeds calibrated the activations' scales.
        checked_feeds: How many feeds ``accuracy`` was measured on.
        accuracy: Per float output, the largest absolute and relative difference from the
            float model over the checked feeds, and the top-1 agreement of classifier-like
            outputs.
        prepared: What prepare wrote for the quantized model.
    """

    model_path: Path
    weights_path: Path
    quantized_weights: int
    float_bytes: int
    compressed_bytes: int
    per_channel: bool
    calibration_feeds: int
    checked_feeds: int
    accuracy: tuple[OutputAccuracy, ...]
    prepared: PrepareResult

    @property
    def max_rel_diff(self) -> float | None:
        """The largest relative difference (to each output's scale) over every output."""
        return max((o.max_rel_diff for o in self.accuracy), default=None)


class _Feeds:
    """The calibration inputs as ORT's ``CalibrationDataReader`` reads them."""

    def __init__(self, feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        feed = next(self._feeds, None)
        return None if feed is None else dict(feed)


def _feeds(value: Iterable[Mapping[str, Any]] | None, what: str) -> list[dict[str, np.ndarray]]:
    if value is None or isinstance(value, Mapping):
        raise TypeError(f"{what} must be a list of feeds (dicts of input name -> array).")
    feeds = [{str(k): np.asarray(v) for k, v in feed.items()} for feed in value]
    if not feeds:
        raise ValueError(f"{what} is empty: give at least one feed, like the model's real inputs.")
    return feeds


def _check_names(feeds: Sequence[Mapping[str, Any]], wanted: set[str], what: str) -> None:
    for i, feed in enumerate(feeds):
        if set(feed) != wanted:
            missing, extra = sorted(wanted - set(feed)), sorted(set(feed) - wanted)
            raise ValueError(
                f"{what}[{i}] does not feed the model's inputs: missing {missing}, unknown {extra}."
            )


def _quantize_static() -> Any:
    try:
        with root_logging_kept():
            from onnxruntime.quantization import (
                CalibrationMethod,
                QuantFormat,
                QuantType,
                quantize_static,
            )
    except ModuleNotFoundError as exc:  # the tools' own dependency (onnx-ir on recent ones)
        package = (exc.name or "onnxruntime.quantization").replace("_", "-")
        feature = "Static int8 (onnxruntime's quantization tools)"
        raise CompressError(str(missing_package(feature, package, "compress"))) from None

    def run(
        src: Path, dst: Path, feeds: Sequence[Mapping[str, np.ndarray]], per_channel: bool
    ) -> None:
        root = logging.getLogger()
        root.addFilter(_quantizer_advice)
        try:
            with root_logging_kept():
                _call(src, dst, feeds, per_channel)
        finally:
            root.removeFilter(_quantizer_advice)

    def _call(
        src: Path, dst: Path, feeds: Sequence[Mapping[str, np.ndarray]], per_channel: bool
    ) -> None:
        quantize_static(
            str(src),
            str(dst),
            _Feeds(feeds),
            quant_format=QuantFormat.QDQ,
            # Weights: int8, symmetric, a scale per output channel (accuracy at no run cost).
            # Activations: uint8 with a zero point, one scale per tensor: what MLAS's u8s8
            # kernels take, and constant, so rows stay independent.
            per_channel=per_channel,
            weight_type=QuantType.QInt8,
            activation_type=QuantType.QUInt8,
            calibrate_method=CalibrationMethod.MinMax,
            use_external_data_format=True,
            extra_options={"WeightSymmetric": True, "ActivationSymmetric": False},
        )

    return run


def _quantizer_advice(record: logging.LogRecord) -> bool:
    """Drop the quantizer's advice to pre-process the model, logged on the root logger.

    It comes at every call, and a caller of compress_static cannot act on it; errors still pass.
    """
    quantizer = f"onnxruntime{os.sep}quantization" in record.pathname
    return not (quantizer and record.levelno < logging.ERROR)


def _weights(model: Any) -> dict[str, Any]:
    return {t.name: t for g, _ in iter_graphs(model.graph) for t in g.initializer}


def _run_all(path: Path, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, Any]]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return [dict(zip(names, session.run(None, dict(feed)), strict=True)) for feed in feeds]


# Per-channel weight scales need DequantizeLinear's `axis`, which is new in opset 13.
_PER_CHANNEL_OPSET = 13


def _per_channel_source(float_path: Path, scratch: Path) -> tuple[Path, bool]:
    """The model to quantize, and whether its weights can take a scale per output channel.

    Models of opsets before 13 (common among exported CNNs) are converted to opset 13 with
    onnx's version converter; where it cannot convert them, their weights get one scale per
    tensor instead (valid in every opset, less accurate).
    """
    import onnx
    from onnx import version_converter

    model = onnx.load(str(float_path), load_external_data=False)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset >= _PER_CHANNEL_OPSET:
        return float_path, True
    model = onnx.load(str(float_path))  # the converter rewrites some constants: every tensor
    try:
        converted = version_converter.convert_version(model, _PER_CHANNEL_OPSET)
    except Exception:  # the converter raises anything; per-tensor scales work in any opset
        _log.info("onnx cannot convert %s to opset 13: per-tensor weight scales", float_path)
        return float_path, False
    target = scratch / "float-opset13.onnx"
    onnx.save_model(
        converted,
        str(target),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=target.with_suffix(".data").name,
    )
    return target, True


def _inputs_of(path: Path) -> set[str]:
    model = load_graph(path)
    initializers = {t.name for t in model.graph.initializer}
    return {i.name for i in model.graph.input if i.name not in initializers}


def compress_static(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    calibration: Iterable[Mapping[str, Any]],
    check: Iterable[Mapping[str, Any]] | None = None,
) -> StaticCompressResult:
    """Write a prepared copy of ``src`` with int8 weights and int8 activations (static, QDQ).

    The source is prepared first (prepare's checks apply), then quantized by onnxruntime's
    ``quantize_static``: per-channel symmetric int8 weights, per-tensor uint8 activations whose
    ranges are the min/max seen over ``calibration``. The result is prepared at ``dst``; a pool
    given ``dst`` shares and batches it like any model (its scales are constants, so no row's
    values depend on another's).

    On CPUs with int8 dot products (AVX-512 VNNI, AMX) this runs convolutions and matrix
    products in int8; elsewhere MLAS's int8 kernels still ran a ResNet-50-like model 2x faster
    than float on AVX2 (docs/compress.md). Accuracy depends on the calibration inputs: give
    real ones, as many as cover the inputs the model will see.

    Args:
        src: Any ONNX model with float weights.
        dst: The graph file to write (an existing folder: ``<dst>/<src stem>.onnx``); its
            weights go to ``<dst stem>.weights`` beside it. Neither may be, or be another name
            for, ``src`` or one of its data files.
        calibration: Feeds (input name -> array) of real inputs, one or more.
        check: Feeds to measure the accuracy on (default: ``calibration``; held-out inputs
            say more).

    Returns:
        What was written, with the accuracy against the float model on ``check``.

    Raises:
        TypeError: ``calibration`` or ``check`` is not a sequence of feeds.
        ValueError: an empty ``calibration``, or a feed that is not the model's inputs.
        CompressError: onnxruntime's quantization tools are missing or failed, or they found
            nothing to quantize.
        PrepareError: ``dst`` or its weights file is (or aliases) a source file, or is not a
            regular file: refused before any work.
        ModelError, PrepareError: from :func:`sharedml.prepare`.

    Thread safety: safe to call concurrently (each call has its own temporary folder).
    """
    import onnx

    calibrating = _feeds(calibration, "calibration")
    checking = calibrating if check is None else _feeds(check, "check")
    src_path = Path(src)
    dst_path, weights_path = output_paths(src_path, dst)
    # Before any work: the result is prepared at dst last, and would replace the source there.
    check_outputs(
        (dst_path, weights_path),
        source_files(src_path, load_graph(src_path).graph),
        writer="compress_static",
        fix="write the int8 model to another path",
    )
    run_quantizer = _quantize_static()
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".sharedml-static-", dir=dst_path.parent) as tmp:
        scratch = Path(tmp)
        float_path = prepare(src, scratch / "float.onnx").model_path
        wanted = _inputs_of(float_path)
        _check_names(calibrating, wanted, "calibration")
        _check_names(checking, wanted, "check")
        quantized_path = scratch / _SCRATCH_MODEL
        source, per_channel = _per_channel_source(float_path, scratch)
        try:
            run_quantizer(source, quantized_path, calibrating, per_channel)
        except Exception as exc:  # ORT's tools raise anything from ValueError to RuntimeError
            raise CompressError(
                f"onnxruntime's quantize_static failed on '{src}': {type(exc).__name__}: {exc}"
            ) from exc
        before = _weights(onnx.load(str(float_path), load_external_data=False))
        after_model = onnx.load(str(quantized_path), load_external_data=False)
        after = _weights(after_model)
        quantized = [t for t in after.values() if t.data_type in _INT8_TYPES and len(t.dims) >= 2]
        if not quantized:
            raise CompressError(
                f"onnxruntime's quantize_static quantized no weight of '{src}' (it quantizes "
                "Conv, MatMul, Gemm and the like): nothing to gain from int8."
            )
        prepared = prepare(quantized_path, dst_path)
        reference = _run_all(float_path, checking)
        try:
            got = _run_all(prepared.model_path, checking)
        except Exception as exc:  # the quantizer wrote a model this onnxruntime refuses
            for written in (prepared.model_path, prepared.weights_path):
                written.unlink(missing_ok=True)
            raise CompressError(
                f"onnxruntime's quantize_static wrote a model of '{src}' that onnxruntime cannot "
                f"run: {type(exc).__name__}: {exc}"
            ) from exc
        _host.release_freed_heap()
    float_bytes = sum(
        tensor_nbytes(t) or 0 for t in before.values() if t.data_type in (1, 10, 11, 16)
    )
    return StaticCompressResult(
        model_path=prepared.model_path,
        weights_path=prepared.weights_path,
        quantized_weights=len(quantized),
        float_bytes=float_bytes,
        compressed_bytes=sum(tensor_nbytes(t) or 0 for t in after.values()),
        per_channel=per_channel,
        calibration_feeds=len(calibrating),
        checked_feeds=len(checking),
        accuracy=worst_of([compare_outputs(r, g) for r, g in zip(reference, got, strict=True)]),
        prepared=prepared,
    )
