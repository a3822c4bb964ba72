"""Tables that inputs index: weights read only at the rows the inputs touch.

An embedding table read by ``Gather(table, ids)`` is read only where ``ids`` point: a weights
file mapped once (the pool's, or ORT's own mapping of external data) holds only those pages in
memory, and a measurement on generated inputs (every id 1) sees one row of a 30,000-row table.
Traffic reads every row over time. This module finds such tables in a model, and the input
whose values index each one where it reaches the table through ops that keep values as they
are (``Cast``, ``Reshape``, ``Unsqueeze``...), so that the measuring child can run inputs that
cover every row (:func:`covering_feeds`) and measure what the sessions then hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["IndexedTable", "covering_feeds", "indexed_tables", "runs_to_cover"]

# Ops that index their first input (the table) by their second (the indices); the
# com.microsoft embedding ops index several tables, listed by position.
_INDEXING = {
    ("", "Gather"): ((0, 1),),
    ("", "GatherElements"): ((0, 1),),
    ("", "GatherND"): ((0, 1),),
    ("com.microsoft", "GatherBlockQuantized"): ((0, 1),),
    # input_ids -> word_embedding, segment_ids -> segment_embedding
    ("com.microsoft", "EmbedLayerNormalization"): ((2, 0), (4, 1)),
    ("com.microsoft", "QEmbedLayerNormalization"): ((2, 0), (4, 1)),
}
# Ops whose output holds their first input's values unchanged (moved, cast, reshaped).
_KEEPS_VALUES = frozenset(
    ("Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Transpose", "Expand")
)


@dataclasses.dataclass(frozen=True)
class IndexedTable:
    """A weight that an op indexes by values computed from the inputs.

    Attributes:
        name: The weight's name.
        dtype: Its element type, lower case.
        shape: Its dimensions.
        nbytes: Its size in bytes.
        rows: How many entries the indices choose from (the indexed axis).
        op: The op that indexes it (``Gather``...).
        input: The graph input whose values are the indices, where they reach the op
            unchanged; None where the graph computes them (positions from a shape, ids plus
            an offset): then no input is known to cover the rows.
        block: Where only part of ``input`` indexes this table, ``(axis, index)`` of that
            part (``Gather(input, index, axis)`` selects it); else None.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    rows: int
    op: str
    input: str | None
    block: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


def _weights(graph: Any) -> dict[str, Any]:
    """The graph's tensors with values: initializers and Constant nodes' values, by name."""
    out = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attr in node.attribute:
                if attr.name == "value" and attr.type == attr.TENSOR:
                    out[node.output[0]] = attr.t
    return out


def _int_scalar(tensor: Any) -> int | None:
    """The value of a one-element integer tensor, else None."""
    from onnx import numpy_helper

    count = 1
    for d in tensor.dims:
        count *= int(d)
    if count != 1 or tensor.data_type not in (6, 7):  # INT32, INT64
        return None
    try:
        return int(numpy_helper.to_array(tensor).reshape(-1)[0])
    except Exception:  # external data not loaded: not a selector we can read
        return None


def _attr_int(node: Any, name: str, default: int) -> int:
    for attr in node.attribute:
        if attr.name == name:
            return int(attr.i)
    return default


def _trace(
    start: str,
    producers: Mapping[str, Any],
    inputs: set[str],
    weights: Mapping[str, Any],
) -> tuple[str | None, tuple[int, int] | None]:
    """The graph input whose values reach ``start`` unchanged, and the block selected of it."""
    name, block = start, None
    for _ in range(64):  # chains are short; a cycle is malformed
        if name in inputs:
            return name, block
        node = producers.get(name)
        if node is None:
            return None, None
        if node.op_type in _KEEPS_VALUES:
            name = node.input[0]
            continue
        if node.op_type == "Gather" and block is None and node.input[1] in weights:
            index = _int_scalar(weights[node.input[1]])
            if index is None:
                return None, None
            block = (_attr_int(node, "axis", 0), index)
            name = node.input[0]
            continue
        return None, None
    return None, None


def indexed_tables(model: Any) -> tuple[IndexedTable, ...]:
    """The weights of ``model``'s main graph that an op indexes by values from the inputs.

    Each table once, in graph order (a tied embedding indexed by the encoder and the decoder
    is one table). Indices that are weights themselves (folded at load) do not count.
    """
    from onnx import TensorProto

    from sharedml.model._graph import tensor_nbytes

    graph = model.graph
    weights = _weights(graph)
    inputs = {v.name for v in graph.input} - set(weights)
    producers = {out: node for node in graph.node for out in node.output}
    found: dict[str, IndexedTable] = {}
    for node in graph.node:
        pairs = _INDEXING.get((node.domain if node.domain != "ai.onnx" else "", node.op_type))
        for table_at, index_at in pairs or ():
            if len(node.input) <= max(table_at, index_at):
                continue
            table, indices = node.input[table_at], node.input[index_at]
            if not table or table not in weights or not indices or indices in weights:
                continue
            if table in found:
                continue
            tensor = weights[table]
            dims = tuple(int(d) for d in tensor.dims)
            axis = _attr_int(node, "batch_dims" if node.op_type == "GatherND" else "axis", 0)
            if not dims:
                continue
            rows = dims[axis % len(dims)]
            source, block = _trace(indices, producers, inputs, weights)
            found[table] = IndexedTable(
                name=table,
                dtype=TensorProto.DataType.Name(tensor.data_type).lower(),
                shape=dims,
                nbytes=tensor_nbytes(tensor) or 0,
                rows=rows,
                op=node.op_type,
                input=source,
                block=block,
            )
    return tuple(found.values())


def _fed(tables: Sequence[Mapping[str, Any]]) -> dict[tuple[str, Any], int]:
    """Rows to cover per (input, block): the smallest table fed by it bounds the ids."""
    out: dict[tuple[str, Any], int] = {}
    for t in tables:
        if t.get("input") is None:
            continue
        block = tuple(t["block"]) if t.get("block") is not None else None
        key = (str(t["input"]), block)
        out[key] = min(out.get(key, int(t["rows"])), int(t["rows"]))
    return out


def _block_size(shape: Sequence[int], block: tuple[int, int] | None) -> int:
    count = 1
    for axis, d in enumerate(shape):
        if block is None or axis != block[0] % len(shape):
            count *= int(d)
    return count


def runs_to_cover(tables: Sequence[Mapping[str, Any]], inputs: Sequence[Mapping[str, Any]]) -> int:
    """How many runs of the inputs' shapes it takes to index every row of every fed table."""
    shapes = {str(i["name"]): tuple(i["shape"]) for i in inputs}
    runs = 0
    for (name, block), rows in _fed(tables).items():
        shape = shapes.get(name)
        if shape is None:
            continue
        per_run = max(1, _block_size(shape, block))
        runs = max(runs, -(-rows // per_run))
    return runs


def covering_feeds(
    tables: Sequence[Mapping[str, Any]],
    inputs: Sequence[Mapping[str, Any]],
    base: Mapping[str, Any],
) -> Iterator[dict[str, Any]]:
    """Feeds that together index every row of the tables (:func:`runs_to_cover` of them).

    Each is ``base`` with the indexing inputs (or their blocks) holding consecutive ids:
    run ``r`` holds ids ``r*n .. r*n+n-1`` modulo the rows, ``n`` the values per run.
    """
    import numpy as np

    shapes = {str(i["name"]): tuple(i["shape"]) for i in inputs}
    fed = {k: v for k, v in _fed(tables).items() if k[0] in shapes}
    for run in range(runs_to_cover(tables, inputs)):
        feeds = dict(base)
        for (name, block), rows in fed.items():
            shape = shapes[name]
            array = np.array(feeds[name], copy=True)
            if block is None:
                n = array.size
                ids = (run * n + np.arange(n)) % rows
                array = ids.reshape(shape).astype(array.dtype)
            else:
                axis = block[0] % len(shape)
                part = np.take(array, block[1], axis=axis)
                n = part.size
                ids = ((run * n + np.arange(n)) % rows).reshape(part.shape).astype(array.dtype)
                index: list[Any] = [slice(None)] * len(shape)
                index[axis] = block[1]
                array[tuple(index)] = ids
            feeds[name] = array
        yield feeds
