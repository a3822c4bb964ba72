"""Compressed weights: MatMul and Gemm weights quantized to blocks of 8 or 4 bits, then prepared.

Weight-only quantization with ONNX Runtime's own tools: ``MatMulNBitsQuantizer`` turns every
``MatMul`` whose weight is a constant matrix into ORT's ``com.microsoft.MatMulNBits``, which
holds the weight as blocks of ``bits``-bit integers with a scale and zero point per block (along
K, per output column). Activations stay float and nothing is quantized across rows, so a
compressed model batches like its float original (``MatMulNBits`` is a row-wise rule of the
row-independence analysis). ``Gemm`` nodes with a constant weight are first rewritten to
``MatMul`` (+ ``Add`` of the bias), which is what the quantizer reads.

The compressed model is then prepared like any model (one aligned weights file), so every
session and process that asks for the same (model, format) maps the same file: the cache keys
the entry by the prepared float model's graph file (which records its weights' SHA-256) and the
format, builds it once and reuses it.

Formats (:class:`WeightsFormat`, one meaning per spelling):

- ``"float"``: the model as it is (no compression).
- ``"int8"``: 8-bit blocks of 128 values along K, asymmetric (uint8 + a float scale and a uint8
  zero point per block): about 0.27x the float matrices. Needs onnxruntime 1.22 or later (its
  quantizer writes 8 bits from then on, and its CPU kernels run them).
- ``"int4"``: 4-bit blocks of 32 values, asymmetric: about 0.16x the float matrices. Smaller
  blocks than ORT's default of 128 keep more accuracy for a few percent more bytes.

Embedding tables (a ``Gather`` on axis 0 of a constant float matrix, by indices the model is
fed) are compressed too, in 8-bit blocks of 128 along their width whatever the format, into
ORT's ``com.microsoft.GatherBlockQuantized``: for a small transformer they are most of the
weights (paraphrase-MiniLM-L3: 47 of its 66 MiB). The row-independence analysis treats that
lookup as it treats ``Gather`` (each row's ids pick their own table rows). Where the
installed onnxruntime cannot run such a table (measured once per process), tables stay float.

What is neither (convolutions, norms, biases) stays float.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import hashlib
import inspect
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from sharedml import _host
from sharedml._errors import CacheError, CompressError, missing_package
from sharedml.cache._entries import Built, ensure_entry, open_entry
from sharedml.cache._locks import lend_hold
from sharedml.cache._root import Cache, CacheDir
from sharedml.model._graph import iter_graphs, load_graph
from sharedml.prepared._files import check_outputs, scratch_folder, source_files
from sharedml.prepared._plan import DEFAULT_SIZE_THRESHOLD_BYTES, check_threshold
from sharedml.prepared._prepare import PrepareResult, output_paths, prepare, prepared_model_for

__all__ = [
    "CompressResult",
    "WeightsFormat",
    "compress",
    "compressed_model_for",
    "compression_unavailable",
]

_log = logging.getLogger("sharedml")

# Bump when what a compressed entry holds changes (block sizes, the Gemm rewrite, symmetry,
# embedding tables).
_KEY_VERSION = "2"
_PREPARED_NAME = "model.onnx"  # as in the models entries prepare builds
_SCRATCH_MODEL = "quantized.onnx"  # the quantizer's output, before it is prepared
_SCRATCH_DATA = "quantized.data"
_FLOAT_TYPES = (1, 10)  # TensorProto.FLOAT, FLOAT16: what ORT's quantizer reads
_INDEX_TYPES = (6, 7)  # TensorProto.INT32, INT64: a Gather's indices
_MS_DOMAIN = "com.microsoft"


class WeightsFormat(enum.Enum):
    """How a pool's MatMul and Gemm weights are stored: float, or blocks of 8 or 4 bits."""

    FLOAT = "float"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int | None:
        """Bits per quantized value (None for float)."""
        return {WeightsFormat.INT8: 8, WeightsFormat.INT4: 4}.get(self)

    @property
    def block_size(self) -> int:
        """Values along K that share one scale and zero point (0 for float)."""
        # int4: 32 as llama.cpp's Q4 formats use, for accuracy (ORT's default is 128); int8
        # keeps ORT's 128, where a block's rounding error is already small.
        return {WeightsFormat.INT8: 128, WeightsFormat.INT4: 32}.get(self, 0)

    @property
    def accuracy_level(self) -> int | None:
        """``MatMulNBits``'s ``accuracy_level``: what type its CPU kernel computes in.

        int8 computes in int8 (4): each row's activations are quantized on their own, block by
        block along K, so rows stay independent (a merged batch gave bitwise the solo rows).
        At the default (float compute) this AVX2 CPU's 8-bit kernel dequantized the weights
        into float scratch on every run: a process with 64 MiB of float matrices (17 MiB as
        int8) grew by 72 MiB, 24 MiB once glibc gave the freed heap back; in int8, 25 MiB
        either way. int4 keeps float compute: its int8-compute kernel gave merged rows 1.7%
        away from solo rows (another kernel for one row), float compute 5e-6.
        """
        return 4 if self is WeightsFormat.INT8 else None

    @classmethod
    def parse(cls, value: object) -> WeightsFormat:
        """The format named by ``value`` (a :class:`WeightsFormat` or its string).

        Raises:
            ValueError: an unknown name (the message lists the known ones).
        """
        if isinstance(value, WeightsFormat):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(f.value) for f in cls)
            raise ValueError(f"weights must be one of {names}, not {value!r}.") from None


# Embedding tables are stored in 8-bit blocks whatever the matrices' format: a table's error
# goes straight into every token's state, unlike a matrix's, which sums out over K. On
# paraphrase-MiniLM-L3 (64 rows of 32 random token ids), int4 matrices kept sentence
# embeddings at cosine 0.974 or more to the float ones; int4 tables as well brought that to
# 0.949 (the file 10.7 MiB), 8-bit tables kept 0.974 (15.2 MiB). Float tables: 48.9 MiB.
_TABLES = WeightsFormat.INT8


@dataclasses.dataclass(frozen=True)
class CompressResult:
    """What :func:`compress` wrote.

    Attributes:
        model_path: The compressed, prepared graph.
        weights_path: Its weights file.
        weights: The format.
        matrices: How many MatMul/Gemm weights were quantized.
        float_bytes: Their bytes (and the tables') before, as float.
        compressed_bytes: Their bytes (and the tables') after (quantized values, scales and
            zero points).
        prepared: What prepare wrote for the compressed model.
        tables: How many embedding tables were quantized.
    """

    model_path: Path
    weights_path: Path
    weights: WeightsFormat
    matrices: int
    float_bytes: int
    compressed_bytes: int
    prepared: PrepareResult
    tables: int = 0


# --------------------------------------------------------------------------------------------
# What the installed onnxruntime can do


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


def _quantizer(fmt: WeightsFormat) -> Any:
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


def _needs_newer(fmt: WeightsFormat, version: str) -> CompressError:
    return CompressError(
        f"onnxruntime {version}'s quantization tools write 4-bit blocks only: "
        f"weights='{fmt.value}' needs onnxruntime 1.22 or later. Use weights='int4', or "
        "upgrade onnxruntime."
    )


def _older_quantizer(fmt: WeightsFormat, version: str) -> Any:
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


@functools.cache
def tables_unavailable(weights: WeightsFormat) -> str | None:
    """Why the installed onnxruntime cannot run ``weights`` embedding tables; None if it can.

    Measured once per process and format: a small table with an odd number of blocks per row
    is quantized as :func:`_quantize_tables` does and looked up on the CPU provider; the rows
    must equal the table's dequantized rows exactly.
    """
    if weights is WeightsFormat.FLOAT:
        return None
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    width = 3 * weights.block_size
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
        if _quantize_tables(model, weights) != 1:
            return "the probe's table was not quantized"
        want = _dequantized(table, weights)[ids]
        sess = onnxruntime.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        got = sess.run(None, {"ids": ids})[0]
    except Exception as exc:
        return (
            f"onnxruntime {onnxruntime.__version__} could not run {weights.value} "
            f"GatherBlockQuantized tables ({type(exc).__name__}: {_first_line(exc)})"
        )
    if got.shape != want.shape or not np.array_equal(got, want):
        return (
            f"onnxruntime {onnxruntime.__version__}'s {weights.value} GatherBlockQuantized "
            "kernel gave other rows than the table's on a probe"
        )
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else ""


@functools.cache
def compression_unavailable(weights: WeightsFormat) -> str | None:
    """Why the installed onnxruntime cannot make or run ``weights`` here; None if it can.

    Measured once per process and format: a tiny MatMul is quantized with ORT's own tool and
    run on the CPU provider, and its output compared with the float product (a kernel that
    loads but computes garbage is caught too).
    """
    if weights is WeightsFormat.FLOAT:
        return None
    try:
        quantizer = _quantizer(weights)
    except CompressError as exc:
        return str(exc)
    import onnxruntime

    try:
        float_model = _probe_model()
        want = np.ones((2, 64), np.float32) @ _weights_of(float_model)["w"]
        quantized, _ = _quantize(_probe_model(), weights, quantizer, tables=False)
        sess = onnxruntime.InferenceSession(
            quantized.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        got = sess.run(None, {"x": np.ones((2, 64), np.float32)})[0]
    except Exception as exc:
        return (
            f"onnxruntime {onnxruntime.__version__} could not build or run {weights.value} "
            f"MatMulNBits weights ({type(exc).__name__}: {exc})"
        )
    error = float(np.max(np.abs(got - want)))
    scale = float(np.max(np.abs(want)))
    if not error <= 0.1 * scale:  # 4 bits err by a few percent of the scale, not more
        return (
            f"onnxruntime {onnxruntime.__version__}'s {weights.value} MatMulNBits kernel gave "
            f"wrong results on a probe (largest difference {error:.3g} of a scale of {scale:.3g})"
        )
    return None


# --------------------------------------------------------------------------------------------
# The graph: what can be compressed, and the rewrite


def _graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every subgraph (``If``/``Loop``/``Scan`` bodies) at any depth."""
    return (g for g, _ in iter_graphs(graph))


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _compressible(model: Any) -> list[str]:
    """Names of the nodes whose weight the quantizer will take (read from the graph alone).

    A ``MatMul`` whose B is a float initializer of rank 2 (or N-D with leading ones), or a
    ``Gemm`` whose B is one and whose A is not transposed.
    """
    found = []
    for graph in _graphs(model.graph):
        inits = {t.name: t for t in graph.initializer}
        for node in graph.node:
            if node.domain not in ("", "ai.onnx") or len(node.input) < 2:
                continue
            b = inits.get(node.input[1])
            if b is None or b.data_type not in _FLOAT_TYPES or len(b.dims) < 2:
                continue
            matmul = node.op_type == "MatMul" and all(d == 1 for d in b.dims[:-2])
            gemm = node.op_type == "Gemm" and len(b.dims) == 2 and not _attrs(node).get("transA")
            if matmul or gemm:
                found.append(node.name or node.output[0])
    return found


def _weights_of(model: Any) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _gemms_to_matmuls(graph: Any) -> int:
    """Rewrite each ``Gemm`` with a constant weight as ``MatMul`` (+ ``Add``); returns how many.

    ``alpha`` and ``transB`` are folded into a new weight, ``beta`` into a constant bias; a
    non-constant bias with ``beta`` other than 1 keeps its Gemm (float, uncompressed).
    """
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in graph.initializer}
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {i.name for i in graph.input}

    def fresh(base: str) -> str:
        name, i = base, 0
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        taken.add(name)
        return name

    nodes = []
    rewritten = 0
    for node in graph.node:
        attrs = _attrs(node) if node.op_type == "Gemm" else {}
        b = inits.get(node.input[1]) if node.op_type == "Gemm" else None
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        beta = float(attrs.get("beta", 1.0))
        if (
            b is None
            or node.domain not in ("", "ai.onnx")
            or b.data_type not in _FLOAT_TYPES
            or len(b.dims) != 2
            or attrs.get("transA")
            or (bias is not None and beta != 1.0 and bias not in inits)
        ):
            nodes.append(node)
            continue
        w = numpy_helper.to_array(b)
        if attrs.get("transB"):
            w = w.T
        alpha = float(attrs.get("alpha", 1.0))
        if alpha != 1.0:
            w = (w * alpha).astype(w.dtype)
        w_name = fresh(f"{b.name}_matmul")
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), w_name))
        prefix = node.name or node.output[0]
        product = fresh(f"{prefix}_product") if bias is not None else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], w_name], [product], name=prefix))
        if bias is not None:
            if beta != 1.0:
                c = numpy_helper.to_array(inits[bias])
                scaled = fresh(f"{bias}_beta")
                graph.initializer.append(
                    numpy_helper.from_array((c * beta).astype(c.dtype), scaled)
                )
                bias = scaled
            nodes.append(
                helper.make_node("Add", [product, bias], [node.output[0]], name=f"{prefix}_bias")
            )
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


def _block_quantized(table: np.ndarray, weights: WeightsFormat) -> tuple[np.ndarray, ...]:
    """``table`` [rows, width] as unsigned ``bits``-bit blocks along its width, asymmetric.

    Returns the values ``q`` [rows, width], the float32 ``scales`` and the ``zero_points``
    [rows, blocks], unpacked: ``table ~= (q - zero_point) * scale`` block by block. Each
    block's range includes 0, so a zero stays exactly zero.
    """
    bits, block = weights.bits or 8, weights.block_size
    levels = (1 << bits) - 1
    rows, width = table.shape
    blocks = table.astype(np.float32).reshape(rows, width // block, block)
    low = np.minimum(blocks.min(axis=-1), 0.0)
    high = np.maximum(blocks.max(axis=-1), 0.0)
    scales = ((high - low) / levels).astype(np.float32)
    scales[scales == 0] = 1.0
    zero_points = np.clip(np.rint(-low / scales), 0, levels).astype(np.uint8)
    q = np.clip(np.rint(blocks / scales[..., None]) + zero_points[..., None], 0, levels)
    return np.asarray(q, np.uint8).reshape(rows, width), scales, zero_points


def _dequantized(table: np.ndarray, weights: WeightsFormat) -> np.ndarray:
    """What :func:`_block_quantized`'s blocks stand for, as float32 (the probe's expectation)."""
    q, scales, zero_points = _block_quantized(table, weights)
    rows, width = table.shape
    blocks = q.reshape(rows, -1, weights.block_size).astype(np.float32) - zero_points[..., None]
    return np.asarray(blocks * scales[..., None], np.float32).reshape(rows, width)


def _nibbles(values: np.ndarray) -> np.ndarray:
    """Two 4-bit values per byte along the last axis, the first in the low half (ORT's order).

    An odd count gets a zero high half.
    """
    if values.shape[-1] % 2:
        pad = np.zeros((*values.shape[:-1], 1), np.uint8)
        values = np.concatenate([values, pad], axis=-1)
    return np.asarray(values[..., 0::2] | (values[..., 1::2] << 4), np.uint8)


def _quantize_tables(model: Any, weights: WeightsFormat) -> int:
    """Replace each embedding lookup's float table with a ``GatherBlockQuantized`` one.

    A table is a float32 initializer of rank 2 that only ``Gather`` nodes on axis 0 read, by
    indices that are not constant and whose type shape inference knows, whose width is a whole
    number of blocks. Returns how many tables were quantized (in place).

    ``GatherBlockQuantized`` does not check its indices (onnxruntime 1.32 returned memory
    beyond a table for an index past its end, where ``Gather`` fails the run), so each lookup's
    indices first pass through a plain ``Gather`` of a one-byte-per-row table of zeros: an index
    out of range fails the run as the float model's would, and adding the zeros changes
    nothing.
    """
    from onnx import helper, numpy_helper, shape_inference

    if weights.bits is None:
        return 0
    block = weights.block_size
    try:  # the indices' element types, for the bounds check's Cast
        inferred = shape_inference.infer_shapes(model).graph
        types = {
            v.name: v.type.tensor_type.elem_type
            for v in (*inferred.input, *inferred.value_info, *inferred.output)
        }
    except Exception:  # a graph shape inference cannot read: no table is touched
        return 0
    readers: dict[str, list[Any]] = {}
    for graph in _graphs(model.graph):
        for node in graph.node:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        for output in graph.output:  # a table that is also an output stays as it is
            readers.setdefault(output.name, []).append(None)
    done = 0
    for graph in _graphs(model.graph):
        inits = {t.name: t for t in graph.initializer}
        constant = set(inits)
        for table in list(graph.initializer):
            users = readers.get(table.name, [])
            if (
                table.data_type != 1  # float32
                or len(table.dims) != 2
                or table.dims[1] % block
                or not users
                or any(
                    u is None
                    or u.op_type != "Gather"
                    or u.domain not in ("", "ai.onnx")
                    or u not in graph.node
                    or u.input[0] != table.name
                    or u.input[1] in constant
                    or types.get(u.input[1]) not in _INDEX_TYPES
                    or _attrs(u).get("axis", 0) != 0
                    for u in users
                )
            ):
                continue
            q, scales, zero_points = _block_quantized(numpy_helper.to_array(table), weights)
            if weights.bits == 4:
                q, zero_points = _nibbles(q), _nibbles(zero_points)
            names = [f"{table.name}_q{weights.bits}", f"{table.name}_scales"]
            names.append(f"{table.name}_zero_points")
            names.append(f"{table.name}_rows")
            graph.initializer.remove(table)
            rows = np.zeros(table.dims[0], np.uint8)
            for array, name in zip((q, scales, zero_points, rows), names, strict=True):
                graph.initializer.append(numpy_helper.from_array(array, name))
            for k, user in enumerate(users):
                at = list(graph.node).index(user)
                checked = f"{names[3]}_checked_{k}"
                zeros = [f"{names[3]}_zeros_{k}", f"{names[3]}_zeros_cast_{k}"]
                guard = [
                    helper.make_node("Gather", [names[3], user.input[1]], [zeros[0]], axis=0),
                    helper.make_node("Cast", [zeros[0]], [zeros[1]], to=types[user.input[1]]),
                    helper.make_node("Add", [user.input[1], zeros[1]], [checked]),
                ]
                for offset, node in enumerate(guard):
                    graph.node.insert(at + offset, node)
                lookup = helper.make_node(
                    "GatherBlockQuantized",
                    [names[0], checked, names[1], names[2]],
                    list(user.output),
                    name=user.name,
                    domain=_MS_DOMAIN,
                    gather_axis=0,
                    quantize_axis=1,
                    block_size=block,
                    bits=weights.bits,
                )
                graph.node.insert(list(graph.node).index(user), lookup)
                graph.node.remove(user)
            done += 1
    if done and not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    return done


def _nbits_bytes(model: Any) -> int:
    """Bytes of each ``MatMulNBits`` weight and ``GatherBlockQuantized`` table, quantized.

    The packed values, scales and zero points, each initializer once.
    """
    total = 0
    for graph in _graphs(model.graph):
        sizes = {t.name: len(t.raw_data) or _tensor_bytes(t) for t in graph.initializer}
        counted: set[str] = set()
        for node in graph.node:
            if node.domain != _MS_DOMAIN:
                continue
            if node.op_type == "MatMulNBits":
                names = node.input[1:4]
            elif node.op_type == "GatherBlockQuantized":
                names = [node.input[0], *node.input[2:4]]
            else:
                continue
            for name in names:
                if name and name not in counted:
                    counted.add(name)
                    total += sizes.get(name, 0)
    return total


def _tensor_bytes(tensor: Any) -> int:
    from onnx import numpy_helper

    return int(numpy_helper.to_array(tensor).nbytes)


def _quantize(
    model: Any, fmt: WeightsFormat, quantizer: Any, *, tables: bool = True
) -> tuple[Any, int]:
    """Quantize ``model``'s MatMul and Gemm weights, and its embedding tables.

    Tables only with ``tables`` and where this onnxruntime runs them. Returns the model and the
    float bytes replaced.
    """
    before = {n.name: n for g in _graphs(model.graph) for n in g.initializer}
    for graph in _graphs(model.graph):
        _gemms_to_matmuls(graph)
    kwargs: dict[str, Any] = {
        "block_size": fmt.block_size,
        "is_symmetric": False,
        "accuracy_level": fmt.accuracy_level,
    }
    if fmt.bits != 4:  # only 1.22+ takes bits (checked by _quantizer); 4 is every version's
        kwargs["bits"] = fmt.bits
    q = quantizer(model, **kwargs)
    q.process()
    out = q.model.model
    quantized = [n for g in _graphs(out.graph) for n in g.node if n.op_type == "MatMulNBits"]
    if tables and tables_unavailable(_TABLES) is None:
        _quantize_tables(out, _TABLES)
    after = {n.name for g in _graphs(out.graph) for n in g.initializer}
    float_bytes = sum(
        len(t.raw_data) or _tensor_bytes(t) for name, t in before.items() if name not in after
    )
    return out, float_bytes if quantized else 0


def _refuse_if_nothing(model_path: Path, source: object) -> None:
    if not _compressible(load_graph(model_path)):
        raise CompressError(
            f"The model '{source}' has no MatMul or Gemm with a constant float weight matrix, "
            "so there is nothing to compress (convolutions and norms stay float): "
            "use weights='float'."
        )


# --------------------------------------------------------------------------------------------
# Writing a compressed, prepared model


def _write(float_path: Path, dst: Path, fmt: WeightsFormat, scratch: Path) -> CompressResult:
    """Quantize the prepared float model ``float_path`` and prepare the result at ``dst``.

    The quantizer's output goes to ``scratch`` (a folder) first, as a model with external data
    (so that any size can be written), and is removed once prepared.
    """
    import onnx

    why = compression_unavailable(fmt)
    if why is not None:
        raise CompressError(f"Cannot compress '{float_path}' to {fmt.value}: {why.rstrip('.')}.")
    model = onnx.load(str(float_path))  # a prepared model: its weights file, read whole
    quantized, float_bytes = _quantize(model, fmt, _quantizer(fmt))
    matrices = sum(
        1 for g in _graphs(quantized.graph) for n in g.node if n.op_type == "MatMulNBits"
    )
    tables = len(
        {
            n.input[0]
            for g in _graphs(quantized.graph)
            for n in g.node
            if n.op_type == "GatherBlockQuantized"
        }
    )
    compressed_bytes = _nbits_bytes(quantized)
    source, data = scratch / _SCRATCH_MODEL, scratch / _SCRATCH_DATA
    try:
        onnx.save_model(
            quantized,
            str(source),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=data.name,
            size_threshold=DEFAULT_SIZE_THRESHOLD_BYTES,
        )
        del model, quantized
        prepared = prepare(source, dst)
    finally:
        for leftover in (source, data):
            with contextlib.suppress(OSError):
                leftover.unlink()
        # The float model was read and parsed whole: glibc keeps those pages unless trimmed.
        _host.release_freed_heap()
    return CompressResult(
        model_path=prepared.model_path,
        weights_path=prepared.weights_path,
        weights=fmt,
        matrices=matrices,
        float_bytes=float_bytes,
        compressed_bytes=compressed_bytes,
        prepared=prepared,
        tables=tables,
    )


def compress(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    weights: WeightsFormat | str = WeightsFormat.INT4,
) -> CompressResult:
    """Write a compressed, prepared copy of ``src``: its MatMul/Gemm weights in 8- or 4-bit blocks.

    The source is prepared first (into a temporary folder: prepare's checks of external data
    apply), its MatMul and Gemm weights are quantized with onnxruntime's
    ``MatMulNBitsQuantizer``, and the result is prepared at ``dst`` (graph + weights file, as
    :func:`sharedml.prepare` writes them). A pool given ``dst`` maps it like any prepared model.

    Args:
        src: Any ONNX model.
        dst: The graph file to write (an existing folder: ``<dst>/<src stem>.onnx``); its
            weights go to ``<dst stem>.weights`` beside it. Neither may be, or be another name
            for, ``src`` or one of its data files.
        weights: ``"int8"`` or ``"int4"`` (see :class:`WeightsFormat`).

    Returns:
        What was written, with the bytes of the matrices before and after.

    Raises:
        ValueError: an unknown ``weights``, or ``"float"`` (nothing to compress to).
        CompressError: the model has no MatMul/Gemm weight to compress, or the installed
            onnxruntime cannot write or run the format.
        PrepareError: ``dst`` or its weights file is (or aliases) a source file, or is not a
            regular file: refused before any work.
        ModelError, PrepareError: from :func:`sharedml.prepare`.

    Thread safety: safe to call concurrently (each call has its own temporary folder).
    """
    fmt = WeightsFormat.parse(weights)
    if fmt is WeightsFormat.FLOAT:
        raise ValueError("compress() needs weights='int8' or 'int4'; for float use prepare().")
    src_path = Path(src)
    dst_path, weights_path = output_paths(src_path, dst)
    # Before any work: the last step prepares the quantized scratch copy at dst, and would
    # replace the source there (compress(m, m)) without this.
    check_outputs(
        (dst_path, weights_path),
        source_files(src_path, load_graph(src_path).graph),
        writer="compress",
        fix="write the compressed model to another path",
    )
    dst_path.parent.mkdir(parents=True, exist_ok=True)
    with scratch_folder(dst_path.parent, "compress") as scratch:
        float_path = prepare(src, scratch / "float.onnx").model_path
        _refuse_if_nothing(float_path, src)
        return _write(float_path, dst_path, fmt, scratch)


def _entry_key(float_path: Path, fmt: WeightsFormat) -> str:
    """The ``models`` entry key of ``float_path`` compressed to ``fmt``.

    The prepared graph records its weights file's SHA-256 and size, so a hash of the graph
    covers every byte of the model; the prefix keeps these keys apart from prepare's own.
    """
    digest = _host.sha256_file(float_path)
    settings = f"{fmt.value}:{fmt.block_size}:{fmt.accuracy_level}"
    text = f"sharedml-compressed:{_KEY_VERSION}:{settings}:{digest}"
    return hashlib.sha256(text.encode()).hexdigest()


def compressed_model_for(
    model_path: str | os.PathLike[str],
    *,
    weights: WeightsFormat | str,
    cache_dir: CacheDir = None,
    size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    verify: bool = True,
    source: str | os.PathLike[str] | None = None,
) -> Path:
    """A prepared, compressed copy of ``model_path`` in the cache, built once per model and format.

    The float model is prepared first (:func:`~sharedml.prepared._prepare.prepared_model_for`;
    a prepared model is used as it is), then compressed into a ``models`` entry keyed by that
    prepared graph and the format, which every later pool and process reuses and maps.

    Args:
        model_path: Any ONNX model.
        weights: ``"int8"`` or ``"int4"`` (``"float"`` returns the prepared float model).
        cache_dir: The cache: a path, a :class:`sharedml.cache.Cache`, or None for
            :func:`sharedml.cache_dir`.
        size_threshold_bytes: Passed to prepare for the float model.
        verify: Check the entry's files against their recorded SHA-256 (as prepare's entries).
        source: What messages and the entry's record call the model (default: ``model_path``;
            the route planner passes the caller's model when ``model_path`` is its prepared
            copy).

    Returns:
        ``<cache>/models/<key>/model.onnx``.

    Raises:
        ValueError: an unknown ``weights``.
        CompressError: nothing to compress, or the installed onnxruntime cannot make the format.
        ModelError, CacheError: as :func:`~sharedml.prepared._prepare.prepared_model_for`.

    Thread and process safety: as ``prepared_model_for``: every caller gets a complete entry;
    two processes building at once both quantize, and the first to publish wins.
    """
    fmt = WeightsFormat.parse(weights)
    named = source if source is not None else model_path
    cache = Cache.at(cache_dir)  # resolved once, for every step below
    float_path = prepared_model_for(
        model_path,
        cache_dir=cache,
        size_threshold_bytes=check_threshold(size_threshold_bytes),
        verify=verify,
    )
    if fmt is WeightsFormat.FLOAT:
        return float_path
    _refuse_if_nothing(float_path, named)
    key = _entry_key(float_path, fmt)
    checked: bool | tuple[str, ...] = True if verify else (_PREPARED_NAME,)
    with contextlib.suppress(CacheError):  # a damaged entry: ensure_entry below rebuilds it
        entry = open_entry("models", key, cache=cache, verify=checked)
        if entry is not None:
            # Built before: no quantizer import and no probe here. Both cost a process about
            # 50 MiB (onnx-ir, sympy), more than a compressed model saves on small weights.
            lend_hold(entry)
            return entry.file(_PREPARED_NAME)
    why = compression_unavailable(fmt)
    if why is not None:
        raise CompressError(f"Cannot compress '{named}' to {fmt.value}: {why.rstrip('.')}.")

    def build(folder: Path) -> Built:
        result = _write(float_path, folder / _PREPARED_NAME, fmt, folder)
        _log.info(
            "sharedml: compressed %d matrices of '%s' to %s: %d -> %d bytes",
            result.matrices,
            named,
            fmt.value,
            result.float_bytes,
            result.compressed_bytes,
        )
        return Built(
            meta={
                # "<model bytes>" stays as it is: a model given as bytes has no path
                "source": str(named) if str(named).startswith("<") else str(Path(named).absolute()),
                "weights": fmt.value,
                "float_model": str(float_path),
                "matrices": result.matrices,
                "float_bytes": result.float_bytes,
                "compressed_bytes": result.compressed_bytes,
                "tensors_moved": result.prepared.tensors_moved,
                "bytes": result.prepared.bytes_moved,
            },
            sha256={result.weights_path.name: result.prepared.manifest.sha256},
        )

    entry = ensure_entry("models", key, build, cache=cache, verify=checked)
    lend_hold(entry)  # as prepared_model_for: held until the caller maps it
    return entry.file(_PREPARED_NAME)
