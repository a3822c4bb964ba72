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
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sharedml._errors import CompressError, missing_package
from sharedml._host import _platform
from sharedml.model._accuracy import OutputAccuracy, compare_outputs, worst_of
from sharedml.model._dtypes import np_dtype
from sharedml.model._graph import iter_graphs, load_graph, tensor_nbytes
from sharedml.prepared._files import check_outputs, scratch_folder, source_files
from sharedml.prepared._prepare import PrepareResult, output_paths, prepare
from sharedml.runtime._quantization import root_logging_kept

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
        checked_on: Where the checked feeds came from: ``"check"`` (the caller's),
            ``"held back"`` (calibration feeds, or rows of the one calibration feed, kept out
            of the calibration to check on) or ``"calibration"`` (nothing could be held back:
            the accuracy is measured on the very inputs the scales were fitted to).
        caveats: Why ``accuracy`` may say less than it seems to, one sentence each (empty
            where nothing is known against it): checked on the calibration inputs, or on
            inputs that are all constant.
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
    checked_on: str = "check"
    caveats: tuple[str, ...] = ()

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


# Held back from the calibration to check on, where the caller gives no check feeds: one feed
# in this many (at least one), spread over the list (calibration data often comes sorted).
_HOLD_BACK_EVERY = 4


@dataclasses.dataclass(frozen=True)
class _Input:
    """One model input: its numpy dtype (None: no numpy type) and its axes (size, name or None)."""

    name: str
    dtype: np.dtype[Any] | None
    axes: tuple[int | str | None, ...] | None  # None: no shape in the model


def _model_inputs(graph: Any) -> dict[str, _Input]:
    """The graph inputs a feed must give (initializers with defaults left out)."""
    initializers = {t.name for t in graph.initializer}
    found = {}
    for value in graph.input:
        if value.name in initializers:
            continue
        tensor = value.type.tensor_type
        try:
            dtype: np.dtype[Any] | None = np_dtype(tensor.elem_type)
        except (KeyError, ValueError):
            dtype = None
        axes = None
        if tensor.HasField("shape"):
            axes = tuple(
                int(d.dim_value)
                if d.HasField("dim_value") and d.dim_value > 0
                else (d.dim_param or None)
                for d in tensor.shape.dim
            )
        found[value.name] = _Input(value.name, dtype, axes)
    return found


def _check_feeds(
    feeds: Sequence[Mapping[str, np.ndarray]], inputs: Mapping[str, _Input], what: str
) -> None:
    """Refuse feeds that are not the model's inputs: names, dtypes, ranks, fixed sizes, values.

    Every input of every feed must hold at least one value, and a float input only finite
    ones: one infinity in the calibration makes an activation's range infinite, and the
    written model then computed NaN for every input (onnxruntime 1.32).

    Raises:
        ValueError: naming the feed (``calibration[3]``), the input, what is wrong, the fix.
    """
    wanted = set(inputs)
    for i, feed in enumerate(feeds):
        if set(feed) != wanted:
            missing, extra = sorted(wanted - set(feed)), sorted(set(feed) - wanted)
            raise ValueError(
                f"{what}[{i}] does not feed the model's inputs: missing {missing}, unknown {extra}."
            )
        for name, array in feed.items():
            spec = inputs[name]
            where = f"{what}[{i}]['{name}']"
            if spec.dtype is not None and array.dtype != spec.dtype:
                raise ValueError(
                    f"{where} is {array.dtype}, but the model's input '{name}' is "
                    f"{spec.dtype}: give {spec.dtype} arrays (array.astype(np.{spec.dtype}))."
                )
            if spec.axes is not None:
                if array.ndim != len(spec.axes):
                    raise ValueError(
                        f"{where} has shape {tuple(array.shape)}, but the model's input "
                        f"'{name}' has rank {len(spec.axes)} ({list(spec.axes)})."
                    )
                for axis, (size, want) in enumerate(zip(array.shape, spec.axes, strict=True)):
                    if isinstance(want, int) and size != want:
                        raise ValueError(
                            f"{where} has shape {tuple(array.shape)}, but the model's input "
                            f"'{name}' is {list(spec.axes)}: axis {axis} must be {want}."
                        )
            if array.size == 0:
                raise ValueError(
                    f"{where} holds no values (shape {tuple(array.shape)}): give at least one "
                    "row of real inputs."
                )
            if array.dtype.kind in "fc" and not np.isfinite(array).all():
                bad = int(array.size - np.count_nonzero(np.isfinite(array)))
                raise ValueError(
                    f"{where} holds {bad} NaN or infinite value(s): an activation calibrated "
                    "on them gets an infinite range, and the int8 model then computes NaN for "
                    "every input. Give finite inputs."
                )


def _constant(feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, Any] | None:
    """The one value of each input where every input holds one value in every feed; else None."""
    values: dict[str, Any] = {}
    for name in feeds[0]:
        arrays = [np.asarray(feed[name]) for feed in feeds]
        if arrays[0].dtype.kind not in "biuf":
            return None
        first = arrays[0].flat[0]
        if any(not np.all(a == first) for a in arrays):
            return None
        values[name] = first.item()
    return values


def _rows_apart(
    feed: Mapping[str, np.ndarray], inputs: Mapping[str, _Input]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None:
    """One feed split by rows into (calibrate, check); None where it cannot be.

    It can where every input's axis 0 is dynamic and of the same size, at least 2.
    """
    rows = {a.shape[0] if a.ndim else 0 for a in feed.values()}
    firsts = [spec.axes[0] if spec.axes else 0 for spec in inputs.values()]
    dynamic = all(not isinstance(a, int) for a in firsts)  # a name, or unnamed (None)
    names = {a for a in firsts if isinstance(a, str)}
    if len(rows) != 1 or not dynamic or len(names) > 1:
        return None
    (count,) = rows
    held = count // _HOLD_BACK_EVERY or (1 if count >= 2 else 0)
    if not held:
        return None
    keep = count - held
    return (
        {n: a[:keep] for n, a in feed.items()},
        {n: a[keep:] for n, a in feed.items()},
    )


def _held_back(
    feeds: list[dict[str, np.ndarray]], inputs: Mapping[str, _Input]
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], str] | None:
    """The calibration split into (calibrate, check), and what was held back; or None.

    One feed in :data:`_HOLD_BACK_EVERY` (at least one, spread over the list); with a single
    feed, its last rows where every input's rows can be split (a quarter, at least one).
    """
    if len(feeds) >= 2:
        held = max(1, len(feeds) // _HOLD_BACK_EVERY)
        step = len(feeds) / held
        picked = {int(step * (j + 1)) - 1 for j in range(held)}
        check = [f for i, f in enumerate(feeds) if i in picked]
        calibrate = [f for i, f in enumerate(feeds) if i not in picked]
        return calibrate, check, f"{held} of the {len(feeds)} calibration feeds"
    split = _rows_apart(feeds[0], inputs)
    if split is None:
        return None
    first, last = split
    rows = next(iter(last.values())).shape[0]
    total = next(iter(feeds[0].values())).shape[0]
    return [first], [last], f"the last {rows} of the {total} rows of the calibration feed"


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
        calibration: Feeds (input name -> array) of real inputs, one or more: each the
            model's inputs by name, of its dtypes, ranks and fixed sizes, at least one value
            each, floats finite, and not one constant value for every input.
        check: Feeds to measure the accuracy on. Default: a part of ``calibration`` held back
            from it (one feed in four, or with one feed a quarter of its rows), so that the
            accuracy is measured on inputs the scales were not fitted to; where nothing can be
            held back (one feed whose rows cannot be split), the calibration itself, with a
            ``RuntimeWarning`` and a caveat in the result.

    Returns:
        What was written, with the accuracy against the float model on the checked feeds,
        where they came from (``checked_on``) and what the figures cannot say (``caveats``:
        also warned).

    Raises:
        TypeError: ``calibration`` or ``check`` is not a sequence of feeds.
        ValueError: an empty ``calibration``, a feed that is not the model's inputs (names,
            dtypes, ranks, fixed sizes), an input with no values or with NaN or infinity, or a
            calibration that holds one constant value for every input.
        CompressError: onnxruntime's quantization tools are missing or failed, they found
            nothing to quantize, or the int8 model computes NaN or infinity where the float
            model does not (nothing is written then).
        PrepareError: ``dst`` or its weights file is (or aliases) a source file, or is not a
            regular file: refused before any work.
        ModelError, PrepareError: from :func:`sharedml.prepare`.

    Thread safety: safe to call concurrently (each call has its own temporary folder).
    """
    import onnx

    calibrating = _feeds(calibration, "calibration")
    checking = None if check is None else _feeds(check, "check")
    src_path = Path(src)
    dst_path, weights_path = output_paths(src_path, dst)
    source_graph = load_graph(src_path).graph
    # Before any work: the result is prepared at dst last, and would replace the source there.
    check_outputs(
        (dst_path, weights_path),
        source_files(src_path, source_graph),
        writer="compress_static",
        fix="write the int8 model to another path",
    )
    inputs = _model_inputs(source_graph)
    del source_graph
    _check_feeds(calibrating, inputs, "calibration")
    if checking is not None:
        _check_feeds(checking, inputs, "check")
    constant = _constant(calibrating)
    if constant is not None:
        raise ValueError(
            f"Every calibration input holds one value in every feed ({constant}): each "
            "activation's range would be one point, and the int8 model would be garbage for "
            "any other input. Calibrate on real inputs."
        )
    caveats: list[str] = []
    checked_on = "check"
    if checking is None:
        split = _held_back(calibrating, inputs)
        if split is None:
            checking, checked_on = calibrating, "calibration"
            caveats.append(
                "The accuracy was measured on the calibration inputs themselves (one feed whose "
                "rows cannot be split: nothing could be held back), the inputs the scales were "
                "fitted to: it says little about other inputs. Pass check= with other inputs."
            )
        else:
            calibrating, checking, held = split
            checked_on = "held back"
            _log.info("sharedml: compress_static holds back %s to check the accuracy on", held)
    one_value = _constant(checking)
    if one_value is not None:
        caveats.append(
            f"Every checked input holds one value ({one_value}): the accuracy says nothing "
            "about any other input. Check on real inputs."
        )
    run_quantizer = _quantize_static()
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    with scratch_folder(dst_path.parent, "static") as scratch:
        float_path = prepare(src, scratch / "float.onnx").model_path
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
        # Checked before anything reaches dst: a model that fails here must not replace what
        # dst held. Preparing changes where the weights sit, not what the model computes.
        reference = _run_all(float_path, checking)
        try:
            got = _run_all(quantized_path, checking)
        except Exception as exc:  # the quantizer wrote a model this onnxruntime refuses
            raise CompressError(
                f"onnxruntime's quantize_static wrote a model of '{src}' that onnxruntime cannot "
                f"run: {type(exc).__name__}: {exc}"
            ) from exc
        _refuse_non_finite(src, reference, got)
        prepared = prepare(quantized_path, dst_path)
        _platform.release_freed_heap()
    for caveat in caveats:
        warnings.warn(f"compress_static('{src}'): {caveat}", RuntimeWarning, stacklevel=2)
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
        checked_on=checked_on,
        caveats=tuple(caveats),
    )


def _refuse_non_finite(
    src: object, reference: Sequence[Mapping[str, Any]], got: Sequence[Mapping[str, Any]]
) -> None:
    """Raise where the int8 model computes NaN or infinity and the float model does not.

    Calibration inputs are checked to be finite; this catches what a finite calibration can
    still do (a range too wide for an activation's scale), before the model is written.
    """
    for i, (want, have) in enumerate(zip(reference, got, strict=True)):
        for name, w in want.items():
            h = have.get(name)
            if h is None or not isinstance(w, np.ndarray) or w.dtype.kind != "f":
                continue
            bad = int(np.count_nonzero(~np.isfinite(np.asarray(h)) & np.isfinite(w)))
            if bad:
                raise CompressError(
                    f"The int8 model of '{src}' computes NaN or infinity in {bad} value(s) of "
                    f"output '{name}' (checked feed {i}) where the float model does not: its "
                    "calibration gave an activation a range that int8 cannot hold. Nothing was "
                    "written; calibrate on inputs like the real ones."
                )
