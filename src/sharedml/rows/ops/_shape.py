"""Shapes as values, and the operators that reshape, join, slice or size axes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from sharedml.rows._dims import ONE, ZERO, Dim, opaque, product
from sharedml.rows._facts import (
    MAX_VALUES,
    TO_THE_END,
    Fact,
    Kind,
    Value,
    rows_among,
    tensor_values,
)
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import join_dim, listed_axes, norm_axis, number


def _dims_value(n: Node, i: int, what: str) -> list[Dim] | None:
    """Input ``i``'s values as dims (a shape, sizes, repeats); None where absent."""
    values = n.static_values(i, what)
    if values is None:
        return None
    if not all(isinstance(v, Dim) for v in values):
        raise Refused(f"takes its {what} from values that are not integers")
    return list(values)


@rule("", "Shape", since=1)
@summary("a shape: sized by N where the input holds rows")
def _shape_op(n: Node) -> Fact:
    f = n.need(0)
    if f.shape is None:
        return n.plain([opaque()], sized=f.kind is not Kind.STATIC)
    dims = list(f.shape)
    start, end = n.attr("start", 0), n.attr("end", None)
    rank = len(dims)
    lo = max(0, min(rank, start + rank if start < 0 else start))
    hi = rank if end is None else max(0, min(rank, end + rank if end < 0 else end))
    picked = dims[lo:hi]
    return n.plain([Dim.of(len(picked))], picked)


@rule("", "Size", since=1)
@summary("an element count: sized by N where the input holds rows")
def _size(n: Node) -> Fact:
    f = n.need(0)
    if f.shape is None:
        return n.plain((), sized=f.kind is not Kind.STATIC)
    return n.plain((), [product(f.shape)])


@rule("", "ConstantOfShape", since=9)
@summary("a filled tensor: holds rows (all alike) where its shape has N on exactly one axis")
def _constant_of_shape(n: Node) -> Fact:
    dims = _dims_value(n, 0, "shape")
    if dims is None:
        raise Refused("has no shape")
    fill: Value = 0.0
    t = n.attr("value")
    if t is not None:
        vals = tensor_values(t)
        if vals:
            fill = vals[0]
    if not any(d.has_batch for d in dims):
        value = None
        if len(dims) <= 1:
            count = product(dims).const
            if count is not None and count <= MAX_VALUES:
                value = [fill] * count
        return n.pinned(n.plain(dims, value, sized=False), 0)
    return _spread(n, Fact(Kind.STATIC, ()), dims, [ONE] * len(dims), dims)


def _static_array(f: Fact) -> Any:
    """A static or sized value of constant shape as a numpy array of its elements, or None.

    Small tensors of any rank (a ``[2, 2]`` pads table that PyTorch's ``F.pad`` export reshapes,
    reverses and transposes into ONNX's pads order) are followed through Reshape, Transpose and
    Slice this way; every other rule reads values of rank 0 or 1 only.
    """
    if f.rows or f.value is None or f.shape is None:
        return None
    dims = [d.const for d in f.shape]
    if any(d is None or d < 0 for d in dims) or math.prod(dims) != len(f.value):  # type: ignore[arg-type]
        return None
    array = np.empty(len(f.value), dtype=object)
    array[:] = list(f.value)
    return array.reshape(dims)


def _constant(shape: Sequence[Dim]) -> bool:
    """Whether every dim is a known integer (a shape a value's elements can be laid out in)."""
    return all(d.const is not None for d in shape)


def _reshape_rows(n: Node, f: Fact, out: list[Dim]) -> Fact:
    """Rows of ``f`` reinterpreted in ``out``'s shape (row-major, as Reshape does).

    Row-major, the input is ``[P, N, R]`` (``P``: the entries before the rows' axis, ``R``:
    those of a row after it); the rows stay whole where an output axis ``b`` has ``N * F``
    entries (``F`` free of ``N``) and the axes before it hold ``P`` entries. The entries after
    it then hold ``R / F`` each: a Reshape keeps the element count, or fails the run.
    """
    assert f.shape is not None
    prefix = product(f.shape[: f.axis])
    for b in range(len(out)):
        fold = out[b].batch_factor()
        if fold is None:
            if out[b].has_batch:
                break
            continue
        if product(out[:b]) == prefix:
            if n.analysis.fixed_rows and f.axis == 0 and b > 0:
                # [1, -1] of an export traced at batch 1: its 1 stood for the rows, and the
                # -1 would take them all. (A shape written for any batch has 0 or -1 there.)
                raise Refused(
                    f"reshapes {list(f.shape)} to {out}: its shape puts a literal 1 where the "
                    "rows were, fixed for one row when the model was exported"
                )
            return n.rows(out, b, fold)
        break
    raise Refused(
        f"reshapes {list(f.shape)} (rows on axis {f.axis}) to {out}: the rows would not stay whole "
        "on one axis"
    )


def _reshape_target(n: Node, f: Fact, target: list[Dim], allowzero: bool) -> list[Dim]:
    if f.shape is None:
        raise Refused("reshapes a tensor of unknown rank")
    out: list[Dim | None] = []
    for k, t in enumerate(target):
        c = t.const
        if c == 0 and not allowzero:
            if k >= len(f.shape):
                raise Refused("copies a dim its input does not have")
            out.append(f.shape[k])
        elif c == -1:
            out.append(None)
        else:
            out.append(t)
    if out.count(None) > 1:
        raise Refused("has more than one -1 in its shape")
    if None in out:
        known = product(d for d in out if d is not None)
        inferred = product(f.shape).divide(known)
        out[out.index(None)] = inferred if inferred is not None else opaque(f.shape)
    return [d for d in out if d is not None]


@rule("", "Reshape", since=1)
@summary("rows stay whole where the new shape keeps them, row-major, on one axis")
def _reshape(n: Node) -> Fact:
    f = n.need(0)
    target = (
        _dims_value(n, 1, "shape") if n.opset >= 5 else [Dim.of(d) for d in n.attr("shape", [])]
    )
    allowzero = bool(n.attr("allowzero", 0))
    if target is None:
        raise Refused("has no shape")
    if not f.rows:
        if f.shape is None and any(t.const in (0, -1) for t in target):
            return n.plain(None, sized=f.kind is Kind.SIZED)
        out = _reshape_target(n, f, target, allowzero) if f.shape is not None else target
        # Row-major order is what Reshape keeps: the flattened elements stay as they are.
        kept = len(out) <= 1 or (_static_array(f) is not None and _constant(out))
        value = f.value if f.value is not None and kept else None
        return n.pinned(
            n.plain(out, value, sized=None if value is not None else f.kind is Kind.SIZED), 1
        )
    return _reshape_rows(n, f, _reshape_target(n, f, target, allowzero))


@rule("", "Flatten", since=1)
@summary("as Reshape to [prod(dims before axis), prod(dims from axis)]")
def _flatten(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    axis = n.attr("axis", 1)
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis <= len(shape):
        raise Refused(f"has axis {axis} out of range")
    out = [product(shape[:axis]), product(shape[axis:])]
    if not f.rows:
        return n.plain(out, sized=f.kind is Kind.SIZED)
    return _reshape_rows(n, f, out)


@rule("", "Transpose", since=1)
@summary("the rows move with their axis")
def _transpose(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    perm = n.attr("perm") or list(range(len(shape)))[::-1]
    if sorted(perm) != list(range(len(shape))):
        raise Refused(f"has perm {perm} for rank {len(shape)}")
    out = [shape[p] for p in perm]
    if f.rows:
        return n.rows(out, perm.index(f.axis), f.fold)
    array = _static_array(f)
    if array is not None:
        return n.plain(out, list(array.transpose(perm).ravel()))
    return n.plain(out, sized=f.kind is Kind.SIZED)


@rule("", "Squeeze", since=1)
@summary("drops size-1 axes; never the rows' axis")
def _squeeze(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    axes = listed_axes(n, 1)
    if axes is None:
        if f.rows:
            raise Refused(
                "squeezes every size-1 axis, which drops the rows' axis of a one-row request"
            )
        if any(d.const is None for d in shape):
            return n.plain(None, sized=f.kind is Kind.SIZED)
        axes = [k for k, d in enumerate(shape) if d == ONE]
    axes = sorted({norm_axis(a, len(shape)) for a in axes})
    if f.rows and f.axis in axes:
        raise Refused("squeezes the rows' axis")
    out = [d for k, d in enumerate(shape) if k not in axes]
    if f.rows:
        return n.rows(out, f.axis - sum(a < f.axis for a in axes), f.fold)
    return n.plain(out, f.value, sized=None if f.value is not None else f.kind is Kind.SIZED)


@rule("", "Unsqueeze", since=1)
@summary("inserts size-1 axes; the rows move with theirs")
def _unsqueeze(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    axes = listed_axes(n, 1)
    if axes is None:
        raise Refused("has no axes")
    rank = len(shape) + len(axes)
    axes = sorted({norm_axis(a, rank) for a in axes})
    out: list[Dim] = []
    it = iter(shape)
    for k in range(rank):
        out.append(ONE if k in axes else next(it))
    if f.rows:
        axis = f.axis
        for a in axes:
            if a <= axis:
                axis += 1
        return n.rows(out, axis, f.fold)
    return n.plain(out, f.value, sized=None if f.value is not None else f.kind is Kind.SIZED)


@rule("", "Concat", since=4)  # Concat-1 joined on axis 1 where no axis attribute was given
@summary("joins tensors on an axis other than the rows' (rows with rows only)")
def _concat(n: Node) -> Fact:
    return _concat_facts(n, [f for f in n.ins if f is not None])


def _concat_facts(n: Node, facts: list[Fact]) -> Fact:
    if not facts:
        raise Refused("has no inputs")
    shapes = [f.shape for f in facts]
    rows = rows_among(facts)
    if any(s is None for s in shapes):
        if rows:
            raise Refused("joins rows with a tensor of unknown rank")
        return n.plain(None, sized=any(f.kind is Kind.SIZED for f in facts))
    rank = len(shapes[0])  # type: ignore[arg-type]
    axis = norm_axis(n.attr("axis", 0), rank)
    out = list(shapes[0])  # type: ignore[arg-type]
    out[axis] = sum((s[axis] for s in shapes), ZERO)  # type: ignore[index]
    if not rows:
        value = None
        if rank == 1 and all(f.value is not None for f in facts):
            value = [v for f in facts for v in f.value]  # type: ignore[union-attr]
        return n.plain(out, value)
    if len(rows) != len(facts):
        raise Refused("joins rows with a tensor that has none: the sizes match only by position")
    first = rows[0]
    if any(not f.same_layout(first) for f in rows):
        raise Refused("joins tensors whose rows lie on different axes")
    if first.axis == axis:
        raise Refused(
            "joins tensors along the rows' axis: the result's rows are no longer the callers'"
        )
    return n.rows(out, first.axis, first.fold)


@rule("com.microsoft", "QLinearConcat", since=1)
@summary("as Concat")
def _qlinear_concat(n: Node) -> Fact:
    # Inputs: y_scale, y_zero_point, then (tensor, scale, zero_point) triples.
    n.require_static([0, 1], "quantization parameters")
    tensors = list(range(2, len(n.ins), 3))
    n.require_static([i + k for i in tensors for k in (1, 2)], "quantization parameters")
    return _concat_facts(n, [f for i in tensors if (f := n.ins[i]) is not None])


@rule("", "Split", since=2)  # Split-1 could take its sizes from an input, which this rule ignores
@summary("splits an axis other than the rows'")
def _split(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    axis = norm_axis(n.attr("axis", 0), len(shape))
    if f.rows and f.axis == axis:
        raise Refused("splits the rows' axis")
    sizes = (
        n.attr("split")
        if n.opset < 13
        else (n.ints(1, "split sizes") if n.input(1) is not None else None)
    )
    outs = []
    for k in range(n.outputs):
        dims = list(shape)
        dims[axis] = (
            Dim.of(sizes[k]) if sizes is not None and k < len(sizes) else opaque([shape[axis]])
        )
        if f.rows:
            outs.append(n.rows(dims, f.axis, f.fold))
        else:
            value = None
            if f.value is not None and len(shape) == 1 and sizes is not None:
                start = sum(sizes[:k])
                value = list(f.value[start : start + sizes[k]])
            outs.append(
                n.plain(dims, value, sized=None if value is not None else f.kind is Kind.SIZED)
            )
    return outs


@rule("", "Slice", since=1)
@summary("slices other axes; the rows' axis only whole (start 0, step 1, to the end)")
def _slice(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    rank = len(shape)
    starts_v: list[Value | None]
    ends_v: list[Value | None]
    counted = False  # starts or ends depend on N in a way that could not be followed
    if n.opset < 10:
        starts_v = [Dim.of(v) for v in n.attr("starts", [])]
        ends_v = [Dim.of(v) for v in n.attr("ends", [])]
        axes = n.attr("axes") or list(range(len(starts_v)))
        steps = [1] * len(starts_v)
    else:
        bounds = []
        for i, what in ((1, "starts"), (2, "ends")):
            g = n.need(i)
            if g.rows:
                raise Refused(f"takes its {what} from the rows' values")
            counted = counted or (g.value is None and g.kind is Kind.SIZED)
            bounds.append(g)
        axes = listed_axes(n, 3) if n.input(3) is not None else None
        count = len(bounds[0].value) if bounds[0].value is not None else None
        if axes is None:
            if count is None:
                raise Refused("slices axes that could not be followed")
            axes = list(range(count))
        steps = n.ints(4, "steps") or [1] * len(axes)
        starts_v = list(bounds[0].value) if bounds[0].value is not None else [None] * len(axes)
        ends_v = list(bounds[1].value) if bounds[1].value is not None else [None] * len(axes)
    axes = [norm_axis(a, rank) for a in axes]
    if not (len(starts_v) == len(ends_v) == len(steps) == len(axes)):
        raise Refused("has starts, ends, axes and steps of different lengths")
    out = list(shape)
    for a, start, end, step in zip(axes, starts_v, ends_v, steps, strict=True):
        if f.rows and a == f.axis:
            # A merged run holds at most max_rows rows: an end beyond them keeps them all.
            whole = isinstance(end, Dim) and (
                (end.const is not None and end.const >= n.analysis.max_rows) or end == shape[a]
            )
            if not (start == ZERO and step == 1 and whole):
                raise Refused("takes part of the rows' axis, or reorders it")
            continue
        if f.rows and (counted or any(isinstance(v, Dim) and v.has_batch for v in (start, end))):
            raise Refused("slices another axis by amounts that depend on the row count")
        out[a] = _slice_len(shape[a], start, end, step)
    if f.rows:
        return n.rows(out, f.axis, f.fold)
    value = None
    array = _static_array(f)
    bounds_known = all(isinstance(v, Dim) and v.const is not None for v in (*starts_v, *ends_v))
    if array is not None and bounds_known:
        picks: list[slice] = [slice(None)] * rank
        for a, start, end, step in zip(axes, starts_v, ends_v, steps, strict=True):
            picks[a] = slice(start.const, end.const, step)  # type: ignore[union-attr]
        array = array[tuple(picks)]
        value = list(array.ravel())
        out = [Dim.of(d) for d in array.shape]
    return n.plain(out, value, sized=None if value is not None else f.kind is Kind.SIZED)


def _slice_len(dim: Dim, start: Value, end: Value, step: int) -> Dim:
    size = dim.const
    s0 = start.const if isinstance(start, Dim) else None
    e0 = end.const if isinstance(end, Dim) else None
    if size is not None and s0 is not None and e0 is not None:
        return Dim.of(len(range(size)[slice(s0, e0, step)]))
    if step == 1 and s0 is not None and s0 >= 0 and e0 is not None and e0 >= TO_THE_END:
        return dim - s0
    if step == 1 and s0 == 0 and isinstance(end, Dim) and end == dim:
        return dim
    return opaque([dim])


@rule("", "Expand", since=8)
@summary("broadcasts to a shape; N may appear only on the rows' axis")
def _expand(n: Node) -> Fact:
    f = n.need(0)
    target = _dims_value(n, 1, "shape")
    if target is None:
        raise Refused("has no shape")
    shape = n.shape(0)
    rank = max(len(shape), len(target))
    padded_in = [ONE] * (rank - len(shape)) + list(shape)
    padded_t = [ONE] * (rank - len(target)) + list(target)
    out = [
        t if d == ONE else d if t == ONE else join_dim([d, t])
        for d, t in zip(padded_in, padded_t, strict=True)
    ]
    if f.rows:
        pos = f.axis + rank - len(shape)
        for k, t in enumerate(padded_t):
            if k == pos:
                if t != ONE and t != shape[f.axis]:
                    raise Refused("expands the rows' axis to another size")
            elif t.has_batch:
                raise Refused("expands another axis to a size that depends on the row count")
        out[pos] = shape[f.axis]
        return n.rows(out, pos, f.fold)
    return n.pinned(_spread(n, f, padded_t, padded_in, out), 1)


def _spread(n: Node, f: Fact, sizes: Sequence[Dim], base: Sequence[Dim], out: list[Dim]) -> Fact:
    """A tensor without rows (dims ``base``) repeated to ``sizes``, which may hold the row count.

    Repeated along one axis of size 1 to ``N`` (times an ``N``-free fold), a static tensor holds
    rows, all alike (an initial state of zeros sized by the batch); anything else sized by the
    row count pairs entries with rows by position.
    """
    batched = [k for k, d in enumerate(sizes) if d.has_batch]
    if not batched:
        return n.plain(out, sized=False if f.kind is Kind.STATIC else None)
    if f.kind is not Kind.STATIC:
        raise Refused("spreads values that depend on the row count over the rows")
    if len(batched) > 1 or base[batched[0]] != ONE:
        raise Refused("spreads a static tensor to a size that depends on the row count")
    k = batched[0]
    fold = sizes[k].batch_factor()
    if fold is None:
        raise Refused("spreads a tensor to a size that is not a whole number of rows")
    return n.rows(out, k, fold)


@rule("", "Tile", since=6)  # Tile-1 took a scalar count and an axis
@summary("repeats other axes; the rows' axis only once")
def _tile(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    reps = _dims_value(n, 1, "repeats")
    if reps is None or len(reps) != len(shape):
        raise Refused("has repeats that could not be followed")
    out = [d * r for d, r in zip(shape, reps, strict=True)]
    if f.rows:
        for k, r in enumerate(reps):
            if k == f.axis and r != ONE:
                raise Refused("repeats the rows' axis: the copies interleave callers' rows")
            if k != f.axis and r.has_batch:
                raise Refused("repeats another axis by the row count")
        return n.rows(out, f.axis, f.fold)
    return n.pinned(_spread(n, f, reps, shape, out), 1)


@rule("", "Pad", since=2)  # Pad-1 named its pads "paddings"
@summary("pads other axes; never the rows'")
def _pad(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    rank = len(shape)
    if n.opset < 11:
        pads: list[Dim] | None = [Dim.of(p) for p in n.attr("pads", [])]
    else:
        n.require_static([2], "padding value")
        pads = _dims_value(n, 1, "pads")
    axes = (listed_axes(n, 3) if n.opset >= 18 else None) or list(range(rank))
    if pads is None or len(pads) != 2 * len(axes):
        raise Refused("has pads that could not be followed")
    out = list(shape)
    for k, a in enumerate(axes):
        a = norm_axis(a, rank)
        before, after = pads[k], pads[k + len(axes)]
        if f.rows and a == f.axis and (before != ZERO or after != ZERO):
            raise Refused("pads the rows' axis")
        if before.has_batch or after.has_batch:
            raise Refused("pads by amounts that depend on the row count")
        out[a] = out[a] + before + after
    return n.like(f, out)


@rule("", "Resize", since=10)
@rule("", "Upsample", since=7)  # Upsample-1 had height_scale and width_scale attributes
@summary("resizes other axes; the rows' axis keeps scale 1 (or size N)")
def _resize(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    rank = len(shape)
    if n.op == "Upsample":
        scale_in, size_in = (None if n.opset < 9 else 1), None
    elif n.opset < 11:
        scale_in, size_in = 1, None
    else:
        scale_in, size_in = 2, 3
        n.require_static([1], "region of interest")
    axes = [norm_axis(a, rank) for a in (n.attr("axes") or range(rank))]
    out = list(shape)
    sizes = (
        _dims_value(n, size_in, "sizes")
        if size_in is not None and n.input(size_in) is not None
        else None
    )
    policy = n.attr("keep_aspect_ratio_policy", "stretch")
    if sizes is not None and policy != "stretch":
        # One scale for every axis in `axes` (the smallest or largest of their ratios): the
        # rows' axis among them is scaled as the others are.
        if f.rows and f.axis in axes:
            raise Refused(f"resizes with keep_aspect_ratio_policy '{policy}' over the rows' axis")
        for a in axes:
            out[a] = opaque([shape[a], *sizes])
        return n.like(f, out)
    if sizes is not None and len(sizes) == len(axes):
        for a, s in zip(axes, sizes, strict=True):
            if f.rows and a == f.axis:
                if s != shape[a]:
                    raise Refused("resizes the rows' axis")
                continue
            if s.has_batch:
                raise Refused("resizes another axis by the row count")
            out[a] = s
        return n.like(f, out)
    if scale_in is None:
        scales = n.attr("scales")
    else:
        if n.input(scale_in) is None:
            raise Refused("has neither scales nor sizes that could be followed")
        raw = n.static_values(scale_in, "scales")
        scales = [number(v) if not isinstance(v, bool) else float(v) for v in raw or []]
    if scales is None or len(scales) != len(axes):
        raise Refused("has scales that could not be followed")
    for a, s in zip(axes, scales, strict=True):
        if f.rows and a == f.axis:
            if s != 1.0:
                raise Refused("scales the rows' axis")
            continue
        c = shape[a].const
        out[a] = Dim.of(math.floor(c * s)) if c is not None else opaque([shape[a]])
    return n.like(f, out)


@rule("", "Range", since=11)
@summary("a static sequence; one that counts rows is refused where it meets them")
def _range(n: Node) -> Fact:
    facts = [n.need(i) for i in range(3)]
    if rows_among(facts):
        raise Refused("counts by the rows' values")
    vals = [f.value[0] if f.value else None for f in facts]
    if any(isinstance(v, Dim) and v.has_batch for v in vals) or (
        any(v is None for v in vals) and any(f.kind is Kind.SIZED for f in facts)
    ):
        raise Refused("counts up to the row count: entries stand for rows by position")
    consts = [v.const if isinstance(v, Dim) else None for v in vals]
    if all(c is not None for c in consts):
        start, limit, delta = (int(c or 0) for c in consts)
        if delta:
            count = max(0, math.ceil((limit - start) / delta))
            value = [Dim.of(start + k * delta) for k in range(count)]
            return n.plain([Dim.of(count)], value if count <= MAX_VALUES else None)
    start_v, limit_v, delta_v = vals
    if delta_v == ONE and isinstance(start_v, Dim) and isinstance(limit_v, Dim):
        length = limit_v - start_v  # a count up to a symbolic size: the positions of a sequence
        return n.plain([length])
    return n.plain([opaque()])
