"""Gathers, scatters and selections: none may pick entries of the rows' axis by position."""

from __future__ import annotations

from sharedml.rows._dims import Dim, opaque
from sharedml.rows._facts import Fact, Kind, Value, rows_among
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import norm_axis


@rule("", "Gather", since=1)
@summary(
    "indexes an axis other than the rows' with static indices, or a static table by "
    "indices that hold rows (an embedding lookup)"
)
def _gather(n: Node) -> Fact:
    data, idx = n.need(0), n.need(1)
    dshape = n.shape(0)
    ishape = n.shape(1)
    axis = norm_axis(n.attr("axis", 0), len(dshape))
    out = list(dshape[:axis]) + list(ishape) + list(dshape[axis + 1 :])
    if data.rows and idx.rows:
        raise Refused("looks rows up by indices that hold rows: each result row meets every row")
    if data.rows:
        if axis == data.axis:
            raise Refused("picks entries of the rows' axis by position")
        if idx.kind is Kind.SIZED:
            raise Refused("picks entries by indices that depend on the row count")
        a = data.axis if data.axis < axis else data.axis + len(ishape) - 1
        return n.rows(out, a, data.fold)
    if idx.rows:
        if data.kind is Kind.SIZED:
            raise Refused("looks rows up in a table that depends on the row count")
        return n.rows(out, axis + idx.axis, idx.fold)
    value = None
    if data.value is not None and idx.value is not None and len(dshape) == 1 and len(ishape) <= 1:
        length = len(data.value)
        picked: list[Value] | None = []
        for v in idx.value:
            c = v.const if isinstance(v, Dim) else None
            if c is None or not -length <= c < length:
                picked = None
                break
            picked.append(data.value[c])  # type: ignore[union-attr]
        value = picked
    return n.plain(out, value)


@rule("", "GatherElements", since=11)
@summary("rows index their own rows on another axis")
def _gather_elements(n: Node) -> Fact:
    data, idx = n.need(0), n.need(1)
    shape = n.shape(1)
    axis = norm_axis(n.attr("axis", 0), len(shape))
    if not data.rows and not idx.rows:
        return n.plain(shape)
    if data.rows and idx.rows and data.same_layout(idx) and axis != data.axis:
        return n.rows(shape, idx.axis, idx.fold)
    if idx.rows and not data.rows and data.kind is Kind.STATIC and axis == idx.axis:
        return n.rows(shape, idx.axis, idx.fold)
    raise Refused("pairs indices and data by position across the rows")


@rule("", "GatherND", since=11)
@summary("batch_dims over the rows, or static data indexed by rows")
def _gather_nd(n: Node) -> Fact:
    data, idx = n.need(0), n.need(1)
    dshape, ishape = n.shape(0), n.shape(1)
    b = n.attr("batch_dims", 0)
    depth = ishape[-1].const
    if depth is None:
        raise Refused("has an index depth that could not be followed")
    out = list(ishape[:-1]) + list(dshape[b + depth :])
    if not data.rows and not idx.rows:
        return n.plain(out)
    if data.rows and idx.rows:
        if data.same_layout(idx) and data.axis == idx.axis < b:
            return n.rows(out, idx.axis, idx.fold)
        raise Refused("looks rows up by indices that hold other rows")
    if idx.rows:
        if data.kind is not Kind.STATIC or b != 0 or idx.axis == len(ishape) - 1:
            raise Refused("indexes by rows in a way that pairs them by position")
        return n.rows(out, idx.axis, idx.fold)
    if data.axis < b + depth:
        raise Refused("picks entries of the rows' axis by position")
    return n.rows(out, len(ishape) - 1 + data.axis - b - depth, data.fold)


@rule("", "ScatterElements", since=11)
@rule("", "Scatter", since=9)
@summary("rows update their own rows on another axis")
def _scatter_elements(n: Node) -> Fact:
    data, idx, upd = n.need(0), n.need(1), n.need(2)
    shape = n.shape(0)
    axis = norm_axis(n.attr("axis", 0), len(shape))
    facts = [data, idx, upd]
    if not rows_among(facts):
        return n.plain(shape)
    if all(f.rows and f.same_layout(data) for f in facts) and axis != data.axis:
        return n.rows(shape, data.axis, data.fold)
    raise Refused("scatters entries across the rows")


@rule("", "ScatterND", since=11)
@summary("rows update their own rows below the indexed axes")
def _scatter_nd(n: Node) -> Fact:
    data, idx, upd = n.need(0), n.need(1), n.need(2)
    shape, ishape = n.shape(0), n.shape(1)
    if not rows_among([data, idx, upd]):
        return n.plain(shape)
    depth = ishape[-1].const
    if not data.rows or idx.rows or depth is None or data.axis < depth:
        raise Refused("scatters entries into the rows' axis by position")
    want = len(ishape) - 1 + data.axis - depth
    if not (upd.rows and upd.axis == want and upd.fold == data.fold):
        raise Refused("scatters updates that do not hold the same rows")
    return n.rows(shape, data.axis, data.fold)


@rule("", "OneHot", since=9)
@summary("indices that hold rows give rows")
def _one_hot(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    n.require_static([1, 2], "depth and values")
    rank = len(shape) + 1
    axis = norm_axis(n.attr("axis", -1), rank)
    depth = n.need(1).value
    d = depth[0] if depth and isinstance(depth[0], Dim) else opaque()
    out = [*shape[:axis], d, *shape[axis:]]
    if not f.rows:
        return n.plain(out)
    return n.rows(out, f.axis + (1 if axis <= f.axis else 0), f.fold)


@rule("", "Compress", since=9)
@summary("selects by a static condition on an axis other than the rows'")
def _compress(n: Node) -> Fact:
    f = n.need(0)
    n.require_static([1], "condition")
    axis = n.attr("axis")
    if not f.rows:
        return n.plain(None)
    shape = n.shape(0)
    if axis is None:
        raise Refused("flattens the rows before selecting")
    axis = norm_axis(axis, len(shape))
    if axis == f.axis:
        raise Refused("selects entries of the rows' axis")
    out = list(shape)
    out[axis] = opaque([shape[axis]])
    return n.rows(out, f.axis, f.fold)


@rule("", "NonZero", since=9)
@rule("", "Unique", since=11)
@summary("data-dependent sizes: refused where rows reach it")
def _data_sized(n: Node) -> list[Fact]:
    if rows_among(n.ins):
        raise Refused("counts entries across all rows (its size depends on every row)")
    return [n.plain(None) for _ in range(n.outputs)]


@rule("com.microsoft", "GatherBlockQuantized", since=1)
@summary("a static block-quantized table looked up by indices that hold rows (an embedding)")
def _gather_block_quantized(n: Node) -> Fact:
    idx = n.need(1)
    n.require_static([0, 2, 3], "quantized table")
    dshape, ishape = n.shape(0), n.shape(1)
    axis = norm_axis(n.attr("gather_axis", 0), len(dshape))
    quantized = norm_axis(n.attr("quantize_axis", len(dshape) - 1), len(dshape))
    table = list(dshape)
    if n.attr("bits", 4) != 8:  # two 4-bit values per byte where the table is stored as uint8
        table[quantized] = opaque()
    out = table[:axis] + list(ishape) + table[axis + 1 :]
    if not idx.rows:
        return n.plain(out)
    return n.rows(out, axis + idx.axis, idx.fold)
