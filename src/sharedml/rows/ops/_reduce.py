"""Reductions and operators along one axis (softmax, arg max, top-k, cumulative sums)."""

from __future__ import annotations

from sharedml.rows._dims import ONE, ZERO, Dim, opaque, product
from sharedml.rows._facts import Fact
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import along, listed_axes, norm_axis, normalized_from


@rule("", "Softmax", since=1)
@rule("", "LogSoftmax", since=1)
@rule("", "Hardmax", since=1)
@summary("over one axis (opset 13+) or the axes from it: not the rows'")
def _softmax(n: Node) -> Fact:
    if n.opset >= 13:
        return along(n, n.attr("axis", -1), "normalizes along the rows' axis")
    f = n.need(0)
    normalized_from(n, f, norm_axis(n.attr("axis", 1), len(n.shape(0))))
    return n.like(f)


@rule("com.microsoft", "QLinearSoftmax", since=1)
@summary("as Softmax")
def _qlinear_softmax(n: Node) -> Fact:
    n.require_static(range(1, len(n.ins)), "quantization parameters")
    return _softmax(n)


@rule("", "ReduceSum", since=1)
@rule("", "ReduceMean", since=1)
@rule("", "ReduceMax", since=1)
@rule("", "ReduceMin", since=1)
@rule("", "ReduceProd", since=1)
@rule("", "ReduceL1", since=1)
@rule("", "ReduceL2", since=1)
@rule("", "ReduceLogSum", since=1)
@rule("", "ReduceLogSumExp", since=1)
@rule("", "ReduceSumSquare", since=1)
@summary("reduces axes other than the rows' (no axes: all of them)")
def _reduce(n: Node) -> Fact:
    f = n.need(0)
    shape = f.shape
    keep = bool(n.attr("keepdims", 1))
    axes_from_input = n.opset >= 18 or (n.op == "ReduceSum" and n.opset >= 13)
    axes = listed_axes(n, 1) if axes_from_input else n.attr("axes")
    if shape is None:
        if f.rows:
            raise Refused("reduces a tensor of unknown rank")
        return n.plain(None)
    rank = len(shape)
    if not axes:
        if n.attr("noop_with_empty_axes", 0) and axes_from_input:
            return n.like(f)
        axes = list(range(rank))
    axes = sorted({norm_axis(a, rank) for a in axes})
    if f.rows and f.axis in axes:
        raise Refused("reduces over the rows' axis: every row's result depends on all rows")
    out = (
        [ONE if k in axes else d for k, d in enumerate(shape)]
        if keep
        else [d for k, d in enumerate(shape) if k not in axes]
    )
    if f.rows:
        return n.rows(out, f.axis if keep else f.axis - sum(a < f.axis for a in axes), f.fold)
    value = None
    if (
        f.value is not None
        and rank <= 1
        and n.op in ("ReduceProd", "ReduceSum")
        and all(isinstance(v, Dim) for v in f.value)
    ):
        total = product(f.value) if n.op == "ReduceProd" else sum(f.value, ZERO)
        value = [total]
    return n.plain(out, value)


@rule("", "ArgMax", since=1)
@rule("", "ArgMin", since=1)
@summary("along an axis other than the rows'")
def _argmax(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    axis = norm_axis(n.attr("axis", 0), len(shape))
    if f.rows and axis == f.axis:
        raise Refused("compares entries along the rows' axis")
    keep = bool(n.attr("keepdims", 1))
    out = (
        [ONE if k == axis else d for k, d in enumerate(shape)]
        if keep
        else [d for k, d in enumerate(shape) if k != axis]
    )
    if f.rows:
        return n.rows(out, f.axis if keep or f.axis < axis else f.axis - 1, f.fold)
    return n.plain(out)


@rule("", "TopK", since=1)
@summary("along an axis other than the rows'; a static K")
def _topk(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    axis = norm_axis(n.attr("axis", -1), len(shape))
    if f.rows and axis == f.axis:
        raise Refused("ranks entries along the rows' axis")
    if n.opset >= 10:
        n.require_static([1], "K")
        k = n.need(1).value
        kdim = k[0] if k and isinstance(k[0], Dim) else opaque()
    else:
        kdim = Dim.of(n.attr("k", 1))
    out = list(shape)
    out[axis] = kdim
    return [n.like(f, out), n.like(f, out)]


@rule("", "CumSum", since=11)
@summary("along an axis other than the rows'")
def _cumsum(n: Node) -> Fact:
    axis = n.ints(1, "axis")
    if not axis:
        raise Refused("has no axis")
    return along(n, axis[0], "accumulates along the rows' axis")
