"""The graph rewrites of weight compression, as passes applied in order by one driver.

Each pass does one thing to a model, for one format (:class:`~sharedml.runtime._quantization.
BlockFormat`), and hands the model on: :class:`GemmsToMatMuls` rewrites ``Gemm`` as the
``MatMul`` the quantizer reads, :class:`MatMulsToNBits` has ORT's own quantizer turn those into
``com.microsoft.MatMulNBits``, :class:`TablesToBlockQuantized` stores embedding tables in
blocks read by ``com.microsoft.GatherBlockQuantized``. :func:`run_passes` applies a list of
them; :mod:`sharedml.prepared._compress` decides which (formats, what ORT runs here) and writes
the result. :func:`compressible` tells from the graph alone what the first two would take.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from sharedml.model._graph import iter_graphs
from sharedml.runtime import _quantization
from sharedml.runtime._quantization import BlockFormat

__all__ = [
    "MS_DOMAIN",
    "GemmsToMatMuls",
    "MatMulsToNBits",
    "Pass",
    "TablesToBlockQuantized",
    "compressible",
    "dequantized",
    "quantize_tables",
    "run_passes",
]

_FLOAT_TYPES = (1, 10)  # TensorProto.FLOAT, FLOAT16: what ORT's quantizer reads
_INDEX_TYPES = (6, 7)  # TensorProto.INT32, INT64: a Gather's indices
MS_DOMAIN = "com.microsoft"

# A pass rewrites a model (in place where it can) and returns the model it made.
Pass = Callable[[Any], Any]


def run_passes(model: Any, passes: Iterable[Pass]) -> Any:
    """Apply ``passes`` to ``model`` in order; return the model the last one made."""
    for rewrite in passes:
        model = rewrite(model)
    return model


@dataclasses.dataclass(frozen=True)
class GemmsToMatMuls:
    """``Gemm`` with a constant weight -> ``MatMul`` (+ ``Add``), in every graph."""

    def __call__(self, model: Any) -> Any:
        for graph in _graphs(model.graph):
            _gemms_to_matmuls(graph)
        return model


@dataclasses.dataclass(frozen=True)
class MatMulsToNBits:
    """``MatMul`` with a constant float weight -> ``MatMulNBits``, by ORT's own quantizer."""

    fmt: BlockFormat

    def __call__(self, model: Any) -> Any:
        quantizer = _quantization.matmul_nbits_quantizer(self.fmt)
        return _quantization.quantize_matmuls(model, self.fmt, quantizer)


@dataclasses.dataclass(frozen=True)
class TablesToBlockQuantized:
    """Embedding tables -> ``GatherBlockQuantized`` lookups (:func:`quantize_tables`)."""

    fmt: BlockFormat

    def __call__(self, model: Any) -> Any:
        quantize_tables(model, self.fmt)
        return model


# --------------------------------------------------------------------------------------------
# The graph


def _graphs(graph: Any) -> Iterator[Any]:
    """``graph`` and every subgraph (``If``/``Loop``/``Scan`` bodies) at any depth."""
    return (g for g, _ in iter_graphs(graph))


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def compressible(model: Any) -> list[str]:
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


# --------------------------------------------------------------------------------------------
# Gemm -> MatMul (+ Add)


def _gemms_to_matmuls(graph: Any) -> int:
    """Rewrite each ``Gemm`` with a constant weight as ``MatMul`` (+ ``Add``); returns how many.

    ``alpha`` and ``transB`` are folded into a new weight, ``beta`` into a constant bias; a
    non-constant bias with ``beta`` other than 1 keeps its Gemm (float, uncompressed).
    """
    inits = {t.name: t for t in graph.initializer}
    fresh = _fresh_names(graph)
    nodes = []
    rewritten = 0
    for node in graph.node:
        replacement = _gemm_as_matmul(node, graph, inits, fresh) if node.op_type == "Gemm" else None
        if replacement is None:
            nodes.append(node)
            continue
        nodes.extend(replacement)
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


def _fresh_names(graph: Any) -> Callable[[str], str]:
    """A maker of names no tensor of ``graph`` has yet: ``base``, else ``base_1``, ``base_2``..."""
    taken = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    taken |= {i.name for i in graph.input}

    def fresh(base: str) -> str:
        name, i = base, 0
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        taken.add(name)
        return name

    return fresh


def _gemm_as_matmul(
    node: Any, graph: Any, inits: dict[str, Any], fresh: Callable[[str], str]
) -> list[Any] | None:
    """The ``MatMul`` (+ ``Add``) that compute the Gemm ``node``; None where it stays a Gemm.

    The folded weight (and a bias scaled by ``beta``) are added to ``graph``'s initializers.
    """
    from onnx import helper, numpy_helper

    attrs = _attrs(node)
    b = inits.get(node.input[1])
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
        return None
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
    nodes = [helper.make_node("MatMul", [node.input[0], w_name], [product], name=prefix)]
    if bias is not None:
        if beta != 1.0:
            c = numpy_helper.to_array(inits[bias])
            scaled = fresh(f"{bias}_beta")
            graph.initializer.append(numpy_helper.from_array((c * beta).astype(c.dtype), scaled))
            bias = scaled
        nodes.append(
            helper.make_node("Add", [product, bias], [node.output[0]], name=f"{prefix}_bias")
        )
    return nodes


# --------------------------------------------------------------------------------------------
# Embedding tables -> GatherBlockQuantized


def _block_quantized(table: np.ndarray, fmt: BlockFormat) -> tuple[np.ndarray, ...]:
    """``table`` [rows, width] as unsigned ``bits``-bit blocks along its width, asymmetric.

    Returns the values ``q`` [rows, width], the float32 ``scales`` and the ``zero_points``
    [rows, blocks], unpacked: ``table ~= (q - zero_point) * scale`` block by block. Each
    block's range includes 0, so a zero stays exactly zero.
    """
    bits, block = fmt.bits, fmt.block_size
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


def dequantized(table: np.ndarray, fmt: BlockFormat) -> np.ndarray:
    """What :func:`_block_quantized`'s blocks stand for, as float32 (the probe's expectation)."""
    q, scales, zero_points = _block_quantized(table, fmt)
    rows, width = table.shape
    blocks = q.reshape(rows, -1, fmt.block_size).astype(np.float32) - zero_points[..., None]
    return np.asarray(blocks * scales[..., None], np.float32).reshape(rows, width)


def _nibbles(values: np.ndarray) -> np.ndarray:
    """Two 4-bit values per byte along the last axis, the first in the low half (ORT's order).

    An odd count gets a zero high half.
    """
    if values.shape[-1] % 2:
        pad = np.zeros((*values.shape[:-1], 1), np.uint8)
        values = np.concatenate([values, pad], axis=-1)
    return np.asarray(values[..., 0::2] | (values[..., 1::2] << 4), np.uint8)


def quantize_tables(model: Any, fmt: BlockFormat) -> int:
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
    from onnx import helper

    types = _index_types(model)
    if types is None:  # a graph shape inference cannot read: no table is touched
        return 0
    readers = _readers(model)
    done = 0
    for graph in _graphs(model.graph):
        constant = {t.name for t in graph.initializer}
        for table in list(graph.initializer):
            users = readers.get(table.name, [])
            if _is_embedding_table(table, users, graph, constant, types, fmt.block_size):
                _replace_table(graph, table, users, types, fmt)
                done += 1
    if done and not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return done


def _index_types(model: Any) -> dict[str, int] | None:
    """The element type of every value shape inference knows (None where it fails)."""
    from onnx import shape_inference

    try:  # the indices' element types, for the bounds check's Cast
        inferred = shape_inference.infer_shapes(model).graph
        return {
            v.name: v.type.tensor_type.elem_type
            for v in (*inferred.input, *inferred.value_info, *inferred.output)
        }
    except Exception:
        return None


def _readers(model: Any) -> dict[str, list[Any]]:
    """The nodes that read each value, in any graph; a graph output counts as a None reader."""
    readers: dict[str, list[Any]] = {}
    for graph in _graphs(model.graph):
        for node in graph.node:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        for output in graph.output:  # a table that is also an output stays as it is
            readers.setdefault(output.name, []).append(None)
    return readers


def _is_embedding_table(
    table: Any,
    users: list[Any],
    graph: Any,
    constant: set[str],
    types: dict[str, int],
    block: int,
) -> bool:
    """Whether ``table`` is a lookup table that only axis-0 ``Gather`` nodes of ``graph`` read."""
    if table.data_type != 1 or len(table.dims) != 2 or table.dims[1] % block or not users:
        return False  # not float32, not a whole number of blocks wide, or read by nothing
    return all(
        u is not None
        and u.op_type == "Gather"
        and u.domain in ("", "ai.onnx")
        and u in graph.node
        and u.input[0] == table.name
        and u.input[1] not in constant
        and types.get(u.input[1]) in _INDEX_TYPES
        and _attrs(u).get("axis", 0) == 0
        for u in users
    )


def _replace_table(
    graph: Any, table: Any, users: list[Any], types: dict[str, int], fmt: BlockFormat
) -> None:
    """Store ``table`` in blocks and have each of its ``users`` look it up, bounds-checked."""
    from onnx import numpy_helper

    q, scales, zero_points = _block_quantized(numpy_helper.to_array(table), fmt)
    if fmt.bits == 4:
        q, zero_points = _nibbles(q), _nibbles(zero_points)
    names = [f"{table.name}_q{fmt.bits}", f"{table.name}_scales"]
    names.append(f"{table.name}_zero_points")
    names.append(f"{table.name}_rows")
    graph.initializer.remove(table)
    rows = np.zeros(table.dims[0], np.uint8)
    for array, name in zip((q, scales, zero_points, rows), names, strict=True):
        graph.initializer.append(numpy_helper.from_array(array, name))
    for k, user in enumerate(users):
        _look_up_checked(graph, user, k, names, types[user.input[1]], fmt)


def _look_up_checked(
    graph: Any, user: Any, k: int, names: list[str], index_type: int, fmt: BlockFormat
) -> None:
    """Replace the ``Gather`` ``user`` with a bounds check and a ``GatherBlockQuantized``.

    ``names``: the quantized values, scales, zero points and the one-byte-per-row table.
    """
    from onnx import helper

    at = list(graph.node).index(user)
    checked = f"{names[3]}_checked_{k}"
    zeros = [f"{names[3]}_zeros_{k}", f"{names[3]}_zeros_cast_{k}"]
    guard = [
        helper.make_node("Gather", [names[3], user.input[1]], [zeros[0]], axis=0),
        helper.make_node("Cast", [zeros[0]], [zeros[1]], to=index_type),
        helper.make_node("Add", [user.input[1], zeros[1]], [checked]),
    ]
    for offset, node in enumerate(guard):
        graph.node.insert(at + offset, node)
    lookup = helper.make_node(
        "GatherBlockQuantized",
        [names[0], checked, names[1], names[2]],
        list(user.output),
        name=user.name,
        domain=MS_DOMAIN,
        gather_axis=0,
        quantize_axis=1,
        block_size=fmt.block_size,
        bits=fmt.bits,
    )
    graph.node.insert(list(graph.node).index(user), lookup)
    graph.node.remove(user)
