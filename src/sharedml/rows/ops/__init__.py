"""The rules, one per operator: what its outputs are given its inputs' facts."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from sharedml.model._proto import GraphProto, TensorProto
from sharedml.rows._dims import BATCH, ONE, ZERO, Dim, opaque, product
from sharedml.rows._facts import (
    MAX_VALUES,
    TO_THE_END,
    Fact,
    Kind,
    Value,
    rows_among,
    tensor_values,
)
from sharedml.rows._registry import Node, Refused, rule

_LOOP_ROUNDS = 4  # rounds of a loop's carried values before they must be stable


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    """``axis`` (negative: from the end) as an index into ``rank`` axes; refused if out of range."""
    if not -rank <= axis < rank:
        raise Refused(f"has {what} {axis} out of range for rank {rank}")
    return axis % rank


def _dims_value(n: Node, i: int, what: str) -> list[Dim] | None:
    """Input ``i``'s values as dims (a shape, sizes, repeats); None where absent."""
    values = n.static_values(i, what)
    if values is None:
        return None
    if not all(isinstance(v, Dim) for v in values):
        raise Refused(f"takes its {what} from values that are not integers")
    return list(values)


def join_dim(dims: Sequence[Dim]) -> Dim:
    """The broadcast of ``dims`` (one axis, aligned): the one that is not 1, where known."""
    distinct = [d for d in dict.fromkeys(dims)]
    if len(distinct) == 1:
        return distinct[0]
    rest = [d for d in distinct if d != ONE]
    if len(rest) == 1:
        return rest[0]
    return opaque(rest)


def broadcast_shape(shapes: Sequence[tuple[Dim, ...]]) -> tuple[Dim, ...]:
    """The numpy broadcast of ``shapes`` (aligned at their last axes)."""
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        column = [s[k - (rank - len(s))] for s in shapes if k - (rank - len(s)) >= 0]
        out.append(join_dim(column))
    return tuple(out)


def no_count_in_values(n: Node, facts: Iterable[Fact | None]) -> None:
    """Refuse where a value computed from the row count would meet the rows."""
    for f in facts:
        if f is not None and f.kind is Kind.SIZED:
            raise Refused("puts the row count into values that reach the rows")


def broadcast(
    n: Node,
    indices: Sequence[int] | None = None,
    values: Callable[[list[tuple[Value, ...]]], list[Value] | None] | None = None,
) -> Fact:
    """Numpy-style broadcasting of the inputs at ``indices`` (default: all present).

    Rows may meet rows only on the same axis (one output row from one row of each); a static
    tensor may meet them only with size 1 on the rows' axis (a size there would pair each row
    with an entry by its position in the batch).
    """
    idx = range(len(n.ins)) if indices is None else indices
    facts = [f for i in idx if i < len(n.ins) and (f := n.ins[i]) is not None]
    if not facts:
        raise Refused("has no inputs")
    rows = rows_among(facts)
    if not rows:
        known = [f.shape for f in facts if f.shape is not None]
        shape = broadcast_shape(known) if len(known) == len(facts) else None
        value = None
        if values is not None and shape is not None and len(shape) <= 1:
            vals = [f.value for f in facts]
            if all(v is not None for v in vals):
                value = _elementwise_values(vals, values)  # type: ignore[arg-type]
        return n.plain(shape, value)
    no_count_in_values(n, facts)
    shapes = []
    for f in facts:
        if f.shape is None:
            raise Refused("meets the rows with a tensor of unknown rank")
        shapes.append(f.shape)
    rank = max(len(s) for s in shapes)
    positions = {f.axis + rank - len(f.shape) for f in rows}  # type: ignore[arg-type]
    if len(positions) > 1:
        raise Refused("pairs rows held on different axes: each result row meets every row")
    pos = positions.pop()
    if len({f.fold for f in rows}) > 1:
        raise Refused("pairs rows folded in different ways")
    for f, s in zip(facts, shapes, strict=True):
        if f.rows:
            continue
        k = pos - (rank - len(s))
        if k >= 0 and s[k] != ONE:
            raise Refused(
                f"pairs each row with an entry of a {_kind_text(f)} tensor by the row's position "
                f"in the batch (size {s[k]} on the rows' axis)"
            )
    return n.rows(broadcast_shape(shapes), pos, rows[0].fold)


def _kind_text(f: Fact) -> str:
    return "static" if f.kind is Kind.STATIC else "row-count-sized"


def _elementwise_values(
    vals: list[tuple[Value, ...]], op: Callable[[list[tuple[Value, ...]]], list[Value] | None]
) -> list[Value] | None:
    length = max(len(v) for v in vals)
    if any(len(v) not in (1, length) for v in vals):
        return None
    columns = [tuple(v[i] if len(v) > 1 else v[0] for v in vals) for i in range(length)]
    out = op(columns)
    if out is None or any(x is None for x in out):
        return None
    return out


def _arith(
    fn: Callable[[Value, Value], Value | None],
) -> Callable[[list[tuple[Value, ...]]], list[Value] | None]:
    def apply(columns: list[tuple[Value, ...]]) -> list[Value] | None:
        out = []
        for col in columns:
            if len(col) != 2:
                return None
            try:
                out.append(fn(col[0], col[1]))
            except (TypeError, ZeroDivisionError, OverflowError):
                return None
        return out

    return apply


def _add(a: Value, b: Value) -> Value:
    return a + b


def _sub(a: Value, b: Value) -> Value:
    return a - b


def _mul(a: Value, b: Value) -> Value:
    return a * b


def _div(a: Value, b: Value) -> Value | None:
    if isinstance(a, Dim) and isinstance(b, Dim):
        ca, cb = a.const, b.const
        if ca is not None and cb is not None:
            q = abs(ca) // abs(cb)
            return Dim.of(q if (ca >= 0) == (cb >= 0) else -q)  # ONNX integer Div truncates
        exact = a.divide(b)
        return exact if exact is not None else opaque([a, b])
    return float(number(a)) / float(number(b))


def _mod(fmod: bool) -> Callable[[Value, Value], Value | None]:
    """Integer ``Mod`` (``fmod=0``: the sign of the divisor; 1: of the dividend, as C's)."""

    def apply(a: Value, b: Value) -> Value | None:
        if not (isinstance(a, Dim) and isinstance(b, Dim)):
            return None
        ca, cb = a.const, b.const
        if ca is None or cb is None:
            # A size computed modulo another (pad to a multiple): not a polynomial, but a
            # value of its own that depends on the row count only where its operands do.
            return opaque([a, b])
        if cb == 0:
            return None
        return Dim.of(int(math.fmod(ca, cb)) if fmod else ca % cb)

    return apply


def number(v: Value) -> float:
    """A known number as a float (TypeError for a symbolic dim)."""
    if isinstance(v, Dim):
        c = v.const
        if c is None:
            raise TypeError
        return c
    return float(v)


def _equal(a: Value, b: Value) -> Value | None:
    if isinstance(a, Dim) and isinstance(b, Dim):
        if a == b:
            return True
        ca, cb = a.const, b.const
        if ca is not None and cb is not None:
            return False
        # A size is at least 1: a symbolic size never equals 0 or a negative number.
        for x, y in ((a, b), (b, a)):
            if x.const is None and x.positive and y.const is not None and y.const <= 0:
                return False
        return None
    try:
        return number(a) == number(b)
    except TypeError:
        return None


def _extreme(pick: Callable[[float, float], float]) -> Callable[[Value, Value], Value | None]:
    def apply(a: Value, b: Value) -> Value | None:
        if isinstance(a, Dim) and isinstance(b, Dim) and a == b:
            return a
        try:
            result = pick(number(a), number(b))
        except TypeError:
            return opaque([x for x in (a, b) if isinstance(x, Dim)])
        return Dim.of(int(result)) if isinstance(a, Dim) and isinstance(b, Dim) else result

    return apply


def _compare(pred: Callable[[float, float], bool]) -> Callable[[Value, Value], Value | None]:
    def apply(a: Value, b: Value) -> Value | None:
        try:
            return pred(number(a), number(b))
        except TypeError:
            return None

    return apply


def _where(columns: list[tuple[Value, ...]]) -> list[Value] | None:
    out = []
    for cond, a, b in columns:
        if not isinstance(cond, bool):
            return None
        out.append(a if cond else b)
    return out


_UNARY = (  # noqa: SIM905 (a table: one name each, compact)
    "Abs Acos Acosh Asin Asinh Atan Atanh BitwiseNot Ceil Celu Cos Cosh Elu Erf Exp Floor "
    "Gelu HardSigmoid HardSwish IsInf IsNaN LeakyRelu Log Mish Reciprocal Relu Round Selu "
    "Shrink Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Swish Tan Tanh ThresholdedRelu"
).split()


@rule(*_UNARY, summary="elementwise: the rows stay where they are")
def _unary(n: Node) -> Fact:
    return n.like(n.need(0))


@rule("Identity", summary="passes its input through")
def _identity(n: Node) -> Fact:
    return n.need(0)


@rule("Neg", summary="elementwise")
def _neg(n: Node) -> Fact:
    f = n.need(0)
    if f.plain and f.value is not None and all(isinstance(v, (Dim, float)) for v in f.value):
        return n.plain(f.shape, [-v for v in f.value])
    return n.like(f)


@rule("Not", summary="elementwise")
def _not(n: Node) -> Fact:
    f = n.need(0)
    if f.plain and f.value is not None and all(isinstance(v, bool) for v in f.value):
        return n.plain(f.shape, [not v for v in f.value])
    return n.like(f)


_INT_TYPES = {
    TensorProto.INT8,
    TensorProto.INT16,
    TensorProto.INT32,
    TensorProto.INT64,
    TensorProto.UINT8,
    TensorProto.UINT16,
    TensorProto.UINT32,
    TensorProto.UINT64,
}


@rule("Cast", "CastLike", summary="elementwise (values followed for shape arithmetic)")
def _cast(n: Node) -> Fact:
    f = n.need(0)
    if n.op == "CastLike":
        n.require_static([1], "target type")
    to = n.attr("to")
    if not (f.plain and f.value is not None):
        return n.like(f)
    out: list[Value] = []
    for v in f.value:
        if to in _INT_TYPES:
            if isinstance(v, float):
                if not math.isfinite(v):
                    return n.plain(f.shape, sized=f.kind is Kind.SIZED)
                v = Dim.of(int(v))
            elif isinstance(v, bool):
                v = Dim.of(int(v))
        elif to == TensorProto.BOOL:
            if isinstance(v, Dim):
                if v.const is None:
                    return n.plain(f.shape, sized=f.kind is Kind.SIZED)
                v = bool(v.const)
            else:
                v = bool(v)
        elif isinstance(v, bool):
            v = float(v)
        out.append(v)
    return n.plain(f.shape, out)


_ARITH = {"Add": _add, "Sub": _sub, "Mul": _mul, "Div": _div}


_COMPARE = {
    "Greater": lambda a, b: a > b,
    "Less": lambda a, b: a < b,
    "GreaterOrEqual": lambda a, b: a >= b,
    "LessOrEqual": lambda a, b: a <= b,
}


_BINARY = (  # noqa: SIM905 (a table: one name each, compact)
    "Add Sub Mul Div Pow Mod And Or Xor Equal Greater Less GreaterOrEqual LessOrEqual "
    "BitShift BitwiseAnd BitwiseOr BitwiseXor PRelu Max Min Sum Mean Where Clip"
).split()


@rule(
    *_BINARY,
    summary="elementwise with numpy broadcasting: rows meet rows on the same axis only, and a "
    "static tensor must have size 1 on the rows' axis",
)
def _elementwise(n: Node) -> Fact:
    op = n.op
    values: Callable[[list[tuple[Value, ...]]], list[Value] | None] | None = None
    if op in _ARITH:
        values = _arith(_ARITH[op])
    elif op == "Equal":
        values = _arith(_equal)
    elif op in _COMPARE:
        values = _arith(_compare(_COMPARE[op]))
    elif op == "Mod":
        values = _arith(_mod(bool(n.attr("fmod", 0))))
    elif op in ("Max", "Min") and len(n.ins) == 2:
        values = _arith(_extreme(max if op == "Max" else min))
    elif op == "Where":
        values = _where
    if op == "Clip" and n.opset < 11:
        return n.like(n.need(0))
    return broadcast(n, values=values)


@rule("Dropout", summary="identity where it is not training (a training Dropout is random)")
def _dropout(n: Node) -> list[Fact]:
    if n.opset >= 12 and n.input(2) is not None:
        training = n.static_values(2, "training mode")
        if training is None or any(bool(v) if isinstance(v, bool) else v != ZERO for v in training):
            raise Refused("may run in training mode, which draws random numbers per row")
    elif n.attr("is_test", 1) == 0 and n.opset < 7:
        raise Refused("runs in training mode, which draws random numbers per row")
    f = n.need(0)
    out = [n.like(f)]
    if n.outputs > 1:
        out.append(n.like(f))
    return out


@rule("Shape", summary="a shape: sized by N where the input holds rows")
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


@rule("Size", summary="an element count: sized by N where the input holds rows")
def _size(n: Node) -> Fact:
    f = n.need(0)
    if f.shape is None:
        return n.plain((), sized=f.kind is not Kind.STATIC)
    return n.plain((), [product(f.shape)])


@rule(
    "ConstantOfShape",
    summary="a filled tensor: holds rows (all alike) where its shape has N on exactly one axis",
)
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


@rule("Reshape", summary="rows stay whole where the new shape keeps them, row-major, on one axis")
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


@rule("Flatten", summary="as Reshape to [prod(dims before axis), prod(dims from axis)]")
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


@rule("Transpose", summary="the rows move with their axis")
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


def listed_axes(n: Node, index: int, attr: str = "axes") -> list[int] | None:
    """Axes from an attribute (older opsets) or an input; None where not given."""
    listed = n.attr(attr)
    if listed is not None:
        return list(listed)
    if index < len(n.ins) and n.input(index) is not None:
        return n.ints(index, attr)
    return None


@rule("Squeeze", summary="drops size-1 axes; never the rows' axis")
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


@rule("Unsqueeze", summary="inserts size-1 axes; the rows move with theirs")
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


@rule("Concat", summary="joins tensors on an axis other than the rows' (rows with rows only)")
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


@rule("Split", summary="splits an axis other than the rows'")
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


@rule("Slice", summary="slices other axes; the rows' axis only whole (start 0, step 1, to the end)")
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


@rule(
    "Gather",
    summary="indexes an axis other than the rows' with static indices, or a static table by "
    "indices that hold rows (an embedding lookup)",
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


@rule("GatherElements", summary="rows index their own rows on another axis")
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


@rule("GatherND", summary="batch_dims over the rows, or static data indexed by rows")
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


@rule("ScatterElements", "Scatter", summary="rows update their own rows on another axis")
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


@rule("ScatterND", summary="rows update their own rows below the indexed axes")
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


@rule("OneHot", summary="indices that hold rows give rows")
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


@rule("Compress", summary="selects by a static condition on an axis other than the rows'")
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


@rule("NonZero", "Unique", summary="data-dependent sizes: refused where rows reach it")
def _data_sized(n: Node) -> list[Fact]:
    if rows_among(n.ins):
        raise Refused("counts entries across all rows (its size depends on every row)")
    return [n.plain(None) for _ in range(n.outputs)]


@rule("Expand", summary="broadcasts to a shape; N may appear only on the rows' axis")
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


@rule("Tile", summary="repeats other axes; the rows' axis only once")
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


@rule("Pad", summary="pads other axes; never the rows'")
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


@rule("Resize", "Upsample", summary="resizes other axes; the rows' axis keeps scale 1 (or size N)")
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


@rule("Range", summary="a static sequence; one that counts rows is refused where it meets them")
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


def _matmul_rows(n: Node, a: Fact, b: Fact, ashape: Sequence[Dim], bshape: Sequence[Dim]) -> Fact:
    """A @ B with numpy's matmul broadcasting (1-D operands promoted and dropped again)."""
    a_vec, b_vec = len(ashape) == 1, len(bshape) == 1
    A = [ONE, *ashape] if a_vec else list(ashape)  # a row vector: [1, K]
    B = [*bshape, ONE] if b_vec else list(bshape)  # a column vector: [K, 1]
    operands = ((a, A, a.axis + (1 if a_vec else 0), True), (b, B, b.axis, False))
    stacks = [tuple(A[:-2]), tuple(B[:-2])]
    batch = broadcast_shape(stacks) if any(stacks) else ()
    out = [*batch, A[-2], B[-1]]
    r = len(out)
    pos: int | None = None
    fold = ONE
    for f, shape, axis, left in operands:
        if not f.rows:
            continue
        k = len(shape)
        if axis == (k - 1 if left else k - 2):
            raise Refused("sums over the rows' axis (it is the contracted one)")
        if left and axis == k - 2:
            p = r - 2
        elif not left and axis == k - 1:
            p = r - 1
        else:
            p = axis + r - k
        if pos is not None and (p != pos or f.fold != fold):
            raise Refused("pairs every row of one operand with every row of the other")
        pos, fold = p, f.fold
    assert pos is not None
    for f, shape, _, _ in operands:
        if f.rows:
            continue
        q = pos - (r - len(shape))
        if pos < r - 2 and q >= 0 and shape[q] != ONE:
            raise Refused("pairs each row with a matrix of a static stack by position")
    dropped = ([r - 1] if b_vec else []) + ([r - 2] if a_vec else [])
    out = [d for k, d in enumerate(out) if k not in dropped]
    pos -= sum(k < pos for k in dropped)
    return n.rows(out, pos, fold)


def _matmul_like(n: Node, ai: int, bi: int, static: Sequence[int]) -> Fact:
    a, b = n.need(ai), n.need(bi)
    n.require_static(static, "quantization parameters")
    ashape, bshape = n.shape(ai), n.shape(bi)
    if not a.rows and not b.rows:
        return n.plain(None)
    no_count_in_values(n, [a, b])
    return _matmul_rows(n, a, b, ashape, bshape)


@rule("MatMul", summary="rows on a batch axis of both operands or on A's row / B's column axis")
def _matmul(n: Node) -> Fact:
    return _matmul_like(n, 0, 1, ())


@rule("MatMulInteger", summary="as MatMul")
def _matmul_integer(n: Node) -> Fact:
    return _matmul_like(n, 0, 1, (2, 3))


@rule("QLinearMatMul", summary="as MatMul, static quantization parameters")
def _qlinear_matmul(n: Node) -> Fact:
    return _matmul_like(n, 0, 3, (1, 2, 4, 5, 6, 7))


@rule(
    "Gemm", summary="rows on A's row axis (or B's column axis); C static or holding the same rows"
)
def _gemm(n: Node) -> Fact:
    return _gemm_like(n, (0, 1, 2), ())


def _gemm_like(n: Node, abc: tuple[int, int, int], static: Sequence[int]) -> Fact:
    ai, bi, ci = abc
    a, b = n.need(ai), n.need(bi)
    n.require_static(static, "quantization parameters")
    ashape, bshape = n.shape(ai), n.shape(bi)
    if len(ashape) != 2 or len(bshape) != 2:
        raise Refused("is a Gemm of operands that are not matrices")
    ta, tb = bool(n.attr("transA", 0)), bool(n.attr("transB", 0))
    m = ashape[1] if ta else ashape[0]
    cols = bshape[0] if tb else bshape[1]
    out = [m, cols]
    if not a.rows and not b.rows:
        c = n.input(ci)
        if c is not None and c.rows:
            raise Refused("adds rows to a product that has none")
        return n.plain(out)
    no_count_in_values(n, [a, b, n.input(ci)])
    if a.rows and b.rows:
        raise Refused("pairs every row of A with every row of B")
    if a.rows:
        if a.axis != (1 if ta else 0):
            raise Refused("sums over the rows' axis (it is the contracted one)")
        pos, fold = 0, a.fold
    else:
        if b.axis != (0 if tb else 1):
            raise Refused("sums over the rows' axis (it is the contracted one)")
        pos, fold = 1, b.fold
    c = n.input(ci)
    if c is not None:
        if c.shape is None:
            raise Refused("adds a C of unknown rank")
        if c.rows:
            if c.axis + 2 - len(c.shape) != pos or c.fold != fold:
                raise Refused("adds a C whose rows lie on another axis")
        else:
            k = pos - (2 - len(c.shape))
            if k >= 0 and c.shape[k] != ONE:
                raise Refused("adds a static C entry to each row by position")
    return n.rows(out, pos, fold)


@rule("Einsum", summary="the rows' letter is kept in the output and held by row operands only")
def _einsum(n: Node) -> Fact:
    eq = str(n.attr("equation", "")).replace(" ", "")
    facts = [n.need(i) for i in range(len(n.ins))]
    shapes = [n.shape(i) for i in range(len(n.ins))]
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(facts):
        raise Refused("has an equation that does not match its inputs")
    letters: list[str] = []
    for term, shape in zip(terms, shapes, strict=True):
        if "..." in term:
            extra = len(shape) - (len(term) - 3)
            term = term.replace("...", "".join(chr(0x3B1 + k) for k in range(max(0, extra))))
        if len(term) != len(shape):
            raise Refused("has an equation that does not match its inputs' ranks")
        letters.append(term)
    if not rows_among(facts):
        return n.plain(None)
    no_count_in_values(n, facts)
    if "->" not in eq:
        counts: dict[str, int] = {}
        for term in letters:
            for ch in term:
                counts[ch] = counts.get(ch, 0) + 1
        ell = "".join(ch for ch in sorted(counts) if ord(ch) >= 0x3B1)
        rhs = ell + "".join(ch for ch in sorted(counts) if counts[ch] == 1 and ord(ch) < 0x3B1)
    elif "..." in rhs:
        extra = max(len(s) - (len(t) - 3) for t, s in zip(terms, shapes, strict=True) if "..." in t)
        rhs = rhs.replace("...", "".join(chr(0x3B1 + k) for k in range(max(0, extra))))
    row_letters = {letters[i][f.axis] for i, f in enumerate(facts) if f.rows}
    folds = {f.fold for f in facts if f.rows}
    if len(row_letters) > 1 or len(folds) > 1:
        raise Refused("pairs rows held on different axes")
    letter = row_letters.pop()
    for i, f in enumerate(facts):
        if not f.rows and letter in letters[i]:
            raise Refused("pairs each row with a static entry by position")
        if f.rows and letters[i].count(letter) > 1:
            # "ii->i": the rows' letter names another axis as well, so row k meets entry k of
            # that axis: a diagonal across the rows, by position
            raise Refused("names the rows' axis and another axis with one letter")
    if letter not in rhs:
        raise Refused("sums over the rows' axis")
    dims: dict[str, Dim] = {}
    for term, shape in zip(letters, shapes, strict=True):
        for ch, d in zip(term, shape, strict=True):
            if d != ONE or ch not in dims:
                dims[ch] = d
    return n.rows([dims.get(ch, opaque()) for ch in rhs], rhs.index(letter), folds.pop())


def _window_dims(
    n: Node, spatial: Sequence[Dim], kernel: Sequence[int], transpose: bool = False
) -> list[Dim]:
    k = len(spatial)
    strides = n.attr("strides") or [1] * k
    dil = n.attr("dilations") or [1] * k
    pads = n.attr("pads") or [0] * (2 * k)
    auto = n.attr("auto_pad", "NOTSET")
    ceil = n.attr("ceil_mode", 0)
    out: list[Dim] = []
    for i, d in enumerate(spatial):
        c = d.const
        if c is None or i >= len(kernel) or kernel[i] is None:
            out.append(opaque([d]))
            continue
        kk, s, dl = kernel[i], strides[i], dil[i]
        if transpose:
            op = (n.attr("output_padding") or [0] * k)[i]
            shape = n.attr("output_shape")
            if shape:
                out.append(Dim.of(shape[i]))
            else:
                out.append(Dim.of(s * (c - 1) + op + ((kk - 1) * dl + 1) - pads[i] - pads[i + k]))
            continue
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(Dim.of(-(-c // s)))
        elif auto == "VALID":
            out.append(Dim.of((c - ((kk - 1) * dl + 1)) // s + 1))
        else:
            span = c + pads[i] + pads[i + k] - ((kk - 1) * dl + 1)
            out.append(Dim.of((-(-span // s) if ceil else span // s) + 1))
    return out


def _conv_like(
    n: Node,
    x: int,
    w: int,
    static: Sequence[int],
    transpose: bool = False,
    channels_last: bool = False,
) -> Fact:
    f = n.need(x)
    shape = n.shape(x)
    n.require_static(static, "weights")
    wshape = n.need(w).shape
    if not f.rows:
        return n.plain(None)
    if f.axis != 0 or f.fold != ONE:
        raise Refused("convolves across the rows (they are not on axis 0)")
    kernel = n.attr("kernel_shape") or ([d.const for d in wshape[2:]] if wshape else [])
    spatial = shape[1:-1] if channels_last else shape[2:]
    group = n.attr("group", 1)
    if wshape is None:
        m = opaque()
    elif transpose:
        m = wshape[1] * group
    else:
        m = wshape[0]
    dims = _window_dims(n, spatial, kernel, transpose)
    out = [shape[0], *dims, m] if channels_last else [shape[0], m, *dims]
    return n.rows(out, 0)


@rule("Conv", summary="rows on axis 0; static weights")
def _conv(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2))


@rule("ConvTranspose", summary="rows on axis 0; static weights")
def _conv_transpose(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2), transpose=True)


@rule("ConvInteger", summary="rows on axis 0; static weights")
def _conv_integer(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2, 3))


@rule("QLinearConv", summary="rows on axis 0; static weights and quantization parameters")
def _qlinear_conv(n: Node) -> Fact:
    return _conv_like(n, 0, 3, (1, 2, 3, 4, 5, 6, 7, 8))


@rule("FusedConv", domain="com.microsoft", summary="as Conv; the added Z holds the same rows")
def _fused_conv(n: Node) -> Fact:
    z = n.input(3)
    out = _conv_like(n, 0, 1, (1, 2))
    if z is not None and not (z.rows and z.axis == 0 and z.fold == ONE):
        raise Refused("adds a Z that does not hold the rows on axis 0")
    return out


@rule("NhwcConv", domain="com.microsoft", summary="as Conv, channels last")
def _nhwc_conv(n: Node) -> Fact:
    return _conv_like(n, 0, 1, (1, 2), channels_last=True)


_POOLS = ["AveragePool", "MaxPool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"]


@rule(*_POOLS, summary="pools spatial axes (2 and later): rows on axis 0 or 1")
def _pool(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    if f.rows and (f.axis > 1 or f.fold != ONE):
        raise Refused("pools over the rows' axis")
    if n.op.startswith("Global"):
        dims = [ONE] * (len(shape) - 2)
    else:
        dims = _window_dims(n, shape[2:], n.attr("kernel_shape") or [])
    out = n.like(f, [shape[0], shape[1], *dims])
    if n.op == "MaxPool" and n.outputs > 1 and n.proto.output[1] and f.rows:
        raise Refused(
            "returns indices counted over the whole batch (each row's depend on its position)"
        )
    return [out] + [out] * (n.outputs - 1)


@rule(
    "QLinearAveragePool", "QLinearGlobalAveragePool", domain="com.microsoft", summary="as the pools"
)
def _qlinear_pool(n: Node) -> Fact:
    n.require_static(range(1, len(n.ins)), "quantization parameters")
    f = n.need(0)
    shape = n.shape(0)
    last = bool(n.attr("channels_last", 0))
    if f.rows and (f.axis != 0 or f.fold != ONE):
        raise Refused("pools over the rows' axis")
    if n.op == "QLinearGlobalAveragePool":
        dims = [ONE] * (len(shape) - 2)
    else:
        dims = _window_dims(n, shape[1:-1] if last else shape[2:], n.attr("kernel_shape") or [])
    out = [shape[0], *dims, shape[-1]] if last else [shape[0], shape[1], *dims]
    return n.like(f, out)


@rule("DepthToSpace", "SpaceToDepth", summary="rows on axis 0")
def _depth_space(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    if f.rows and (f.axis != 0 or f.fold != ONE):
        raise Refused("moves entries across the rows' axis")
    b = n.attr("blocksize", 1)
    if n.op == "DepthToSpace":
        out = [shape[0], _cdiv(shape[1], b * b), shape[2] * b, shape[3] * b]
    else:
        out = [shape[0], shape[1] * (b * b), _cdiv(shape[2], b), _cdiv(shape[3], b)]
    return n.like(f, out)


def _cdiv(d: Dim, k: int) -> Dim:
    exact = d.divide(k)
    return exact if exact is not None else opaque([d])


@rule(
    "BatchNormalization",
    summary="inference only (training computes batch statistics); rows not on the channel axis",
)
def _batch_norm(n: Node) -> Fact:
    f = n.need(0)
    training = (
        n.attr("training_mode", 0)
        if n.opset >= 14
        else (0 if n.attr("is_test", 1) or n.opset >= 7 else 1)
    )
    if training or (n.outputs > 1 and any(n.proto.output[1:])):
        raise Refused("runs in training mode: it normalizes with statistics of the whole batch")
    n.require_static(range(1, 5), "scale, bias, mean and variance")
    if f.rows and f.axis == 1:
        raise Refused("pairs each row with a channel's statistics by position")
    return n.like(f)


@rule("InstanceNormalization", "GroupNormalization", summary="statistics per row: rows on axis 0")
def _instance_norm(n: Node) -> Fact:
    f = n.need(0)
    n.require_static(range(1, len(n.ins)), "scale and bias")
    if f.rows and (f.axis != 0 or f.fold != ONE):
        raise Refused("normalizes with statistics that span the rows' axis")
    return n.like(f)


def normalized_from(n: Node, f: Fact, first: int) -> None:
    """Refuse where ``f``'s rows lie on an axis from ``first`` on (normalized together)."""
    if f.rows and f.axis >= first:
        raise Refused("normalizes over the rows' axis")


@rule("LayerNormalization", "RMSNormalization", summary="normalizes axes after the rows'")
def _layer_norm(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    axis = norm_axis(n.attr("axis", -1), len(shape))
    normalized_from(n, f, axis)
    broadcast(n, [0, 1, 2])  # scale and bias meet the rows as in broadcasting
    y = n.like(f)
    stats = n.like(f, [*shape[:axis], *([ONE] * (len(shape) - axis))])
    return [y] + [stats] * (n.outputs - 1)


@rule(
    "LayerNormalization",
    "SimplifiedLayerNormalization",
    domain="com.microsoft",
    summary="normalizes axes after the rows'",
)
def _ms_layer_norm(n: Node) -> list[Fact]:
    return _layer_norm(n)


@rule(
    "SkipLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    domain="com.microsoft",
    summary="adds a skip and normalizes the last axis: rows elsewhere",
)
def _skip_layer_norm(n: Node) -> list[Fact]:
    f = n.need(0)
    shape = n.shape(0)
    normalized_from(n, f, len(shape) - 1)
    y = broadcast(n)
    outs = [y]
    for k in range(1, n.outputs):
        outs.append(y if k == 3 else n.like(y, [*shape[:-1], ONE]))
    return outs


def along(n: Node, axis: int, why: str) -> Fact:
    """An operator along one ``axis`` of input 0, which must not be the rows'; same layout out."""
    f = n.need(0)
    if f.rows and norm_axis(axis, len(n.shape(0))) == f.axis:
        raise Refused(why)
    return n.like(f)


@rule("LpNormalization", summary="normalizes one axis: not the rows'")
def _lp_norm(n: Node) -> Fact:
    return along(n, n.attr("axis", -1), "normalizes along the rows' axis")


@rule("MeanVarianceNormalization", summary="normalizes its axes (default 0, 2, 3): not the rows'")
def _mvn(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    axes = [norm_axis(a, len(shape)) for a in n.attr("axes", [0, 2, 3])]
    if f.rows and f.axis in axes:
        raise Refused("normalizes with statistics over the rows' axis")
    return n.like(f)


@rule(
    "Softmax",
    "LogSoftmax",
    "Hardmax",
    summary="over one axis (opset 13+) or the axes from it: not the rows'",
)
def _softmax(n: Node) -> Fact:
    if n.opset >= 13:
        return along(n, n.attr("axis", -1), "normalizes along the rows' axis")
    f = n.need(0)
    normalized_from(n, f, norm_axis(n.attr("axis", 1), len(n.shape(0))))
    return n.like(f)


@rule("QLinearSoftmax", domain="com.microsoft", summary="as Softmax")
def _qlinear_softmax(n: Node) -> Fact:
    n.require_static(range(1, len(n.ins)), "quantization parameters")
    return _softmax(n)


_REDUCE = (  # noqa: SIM905 (a table: one name each, compact)
    "ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 ReduceLogSum "
    "ReduceLogSumExp ReduceSumSquare"
).split()


@rule(*_REDUCE, summary="reduces axes other than the rows' (no axes: all of them)")
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


@rule("ArgMax", "ArgMin", summary="along an axis other than the rows'")
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


@rule("TopK", summary="along an axis other than the rows'; a static K")
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


@rule("CumSum", summary="along an axis other than the rows'")
def _cumsum(n: Node) -> Fact:
    axis = n.ints(1, "axis")
    if not axis:
        raise Refused("has no axis")
    return along(n, axis[0], "accumulates along the rows' axis")


@rule("Trilu", summary="on the last two axes: not the rows'")
def _trilu(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    n.require_static([1], "k")
    if f.rows and f.axis >= len(shape) - 2:
        raise Refused("masks by position along the rows' axis")
    return n.like(f)


@rule("Det", summary="over the last two axes: rows before them")
def _det(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    if f.rows and f.axis >= len(shape) - 2:
        raise Refused("combines entries along the rows' axis")
    return n.like(f, shape[:-2])


@rule("EyeLike", summary="a static identity: refused where its input holds rows")
def _eye_like(n: Node) -> Fact:
    f = n.need(0)
    if not f.plain:
        raise Refused("puts ones on a diagonal that runs across the rows")
    return n.plain(f.shape, sized=False)


@rule("ReverseSequence", summary="rows on batch_axis, their own lengths")
def _reverse_sequence(n: Node) -> Fact:
    f, lens = n.need(0), n.need(1)
    shape = n.shape(0)
    batch_axis = norm_axis(n.attr("batch_axis", 1), len(shape))
    if f.rows and (f.axis != batch_axis or f.fold != ONE):
        raise Refused("reverses along the rows' axis, or takes its batch elsewhere")
    if f.rows and not (lens.rows and lens.axis == 0 and lens.fold == ONE):
        raise Refused("pairs each row with a static sequence length by position")
    return n.like(f)


@rule("GridSample", summary="both inputs hold the rows on axis 0")
def _grid_sample(n: Node) -> Fact:
    x, grid = n.need(0), n.need(1)
    xs, gs = n.shape(0), n.shape(1)
    out = [xs[0], xs[1], *gs[1:-1]]
    if not x.rows and not grid.rows:
        return n.plain(out)
    for f in (x, grid):
        if not (f.rows and f.axis == 0 and f.fold == ONE):
            raise Refused("samples a batch by another batch's position")
    return n.rows(out, 0)


@rule(
    "QuantizeLinear", "DequantizeLinear", summary="per-tensor or per-axis parameters, not per row"
)
def _quantize(n: Node) -> Fact:
    f = n.need(0)
    n.require_static([1, 2], "scale and zero point")
    if not f.rows:
        return n.like(f)
    shape = n.shape(0)
    scale = n.need(1).shape
    if scale is None:
        raise Refused("has a scale of unknown rank")
    if len(scale) >= 1 and product(scale) != ONE:
        if len(scale) > 1 or n.attr("block_size", 0):
            raise Refused("quantizes in blocks that may span the rows' axis")
        if norm_axis(n.attr("axis", 1), len(shape)) == f.axis:
            raise Refused("pairs each row with a scale by position")
    return n.like(f)


_RANDOM = (  # noqa: SIM905 (a table: one name each, compact)
    "RandomNormal RandomNormalLike RandomUniform RandomUniformLike Bernoulli Multinomial"
).split()


@rule(*_RANDOM, summary="random: refused (a merged run draws other numbers for every row)")
def _random(n: Node) -> Fact:
    raise Refused("draws random numbers: a merged run would give each row other draws")


@rule(
    "DynamicQuantizeLinear",
    "DynamicQuantizeMatMul",
    "DynamicQuantizeLSTM",
    domain="",
    summary="refused: one quantization scale for the whole tensor, all rows together",
)
def _dynamic_quantize(n: Node) -> Fact:
    raise Refused("quantizes with one scale computed from the whole tensor, all rows together")


@rule(
    "RNN",
    "GRU",
    "LSTM",
    summary="rows on the batch axis of its layout (1 time-major, 0 batch-major)",
)
def _recurrent(n: Node) -> list[Fact]:
    layout = n.attr("layout", 0)
    batch_axis = 0 if layout else 1
    x = n.need(0)
    shape = n.shape(0)
    n.require_static([1, 2, 3, 7], "weights")
    hidden = Dim.of(n.attr("hidden_size")) if n.attr("hidden_size") else opaque()
    dirs = Dim.of(2 if n.attr("direction", "forward") == "bidirectional" else 1)
    seq, batch = (shape[1], shape[0]) if layout else (shape[0], shape[1])
    y = [batch, seq, dirs, hidden] if layout else [seq, dirs, batch, hidden]
    h = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    facts = [n.input(i) for i in (0, 4, 5, 6)]
    if not rows_among(facts):
        return [n.plain(y)] + [n.plain(h)] * (n.outputs - 1)
    if not (x.rows and x.axis == batch_axis and x.fold == ONE):
        raise Refused(
            f"runs its recurrence along axis {1 - batch_axis} of X, where the rows are: the state "
            "carries from one row to the next"
        )
    lens = n.input(4)
    if lens is not None and not (lens.rows and lens.axis == 0 and lens.fold == ONE):
        raise Refused("pairs each row with a sequence length by position")
    for i in (5, 6):
        init = n.input(i)
        if init is not None and not (
            init.rows and init.axis == (0 if layout else 1) and init.fold == ONE
        ):
            raise Refused("starts each row from an initial state picked by position")
    outs = [n.rows(y, 0 if layout else 2)]
    outs += [n.rows(h, 0 if layout else 1)] * (n.outputs - 1)
    return outs


def _join(a: Fact, b: Fact) -> Fact | None:
    """One fact for a value that is either ``a`` or ``b``; None where they cannot agree."""
    if a.kind is Kind.MIXED:
        return a
    if b.kind is Kind.MIXED:
        return b
    if a.rows != b.rows:
        return None
    if a.rows and not a.same_layout(b):
        return None
    shape: tuple[Dim, ...] | None = None
    if a.shape is not None and b.shape is not None and len(a.shape) == len(b.shape):
        shape = tuple(
            x if x == y else opaque([x, y]) for x, y in zip(a.shape, b.shape, strict=True)
        )
        if a.rows:
            shape = (*shape[: a.axis], a.shape[a.axis], *shape[a.axis + 1 :])
    elif a.rows:
        return None
    kind = a.kind if a.kind is b.kind else Kind.SIZED
    value = a.value if a.value == b.value else None
    return Fact(kind, shape, a.axis, a.fold, value, a.sources | b.sources)


def _structure(f: Fact) -> tuple[Any, ...]:
    return (f.kind, f.axis, f.fold, f.rank)


@rule("If", summary="a static condition; both branches give the same layouts")
def _if(n: Node) -> list[Fact]:
    cond = n.need(0)
    if cond.rows:
        raise Refused("branches on the rows' values: one row's value decides for all")
    if cond.kind is Kind.SIZED:
        raise Refused("branches on the row count")
    branches = [n.attr("then_branch"), n.attr("else_branch")]
    results = [
        n.analysis.run_graph(g, n.scope, f"{n.where}{n.name()}/{name}/", [])
        for g, name in zip(branches, ("then", "else"), strict=True)
    ]
    outs = []
    for k, (a, b) in enumerate(zip(*results, strict=True)):
        joined = _join(a, b)
        if joined is None:
            raise Refused(f"gives output {k} different layouts in its two branches")
        outs.append(joined)
    return outs


@rule("Loop", summary="a static trip count and condition; carried values keep their layout")
def _loop(n: Node) -> list[Fact]:
    trip, cond = n.input(0), n.input(1)
    for f, what in ((trip, "trip count"), (cond, "condition")):
        if f is not None and f.rows:
            raise Refused(f"takes its {what} from the rows' values: one row decides for all")
        if f is not None and f.kind is Kind.SIZED:
            raise Refused(f"takes its {what} from the row count: it iterates over the rows")
    body: GraphProto = n.attr("body")
    carried = [n.need(i) for i in range(2, len(n.ins))]
    scalar = Fact(Kind.STATIC, ())
    for _round in range(_LOOP_ROUNDS):
        outs = n.analysis.run_graph(
            body, n.scope, f"{n.where}{n.name()}/body/", [scalar, scalar, *carried]
        )
        mixed = [f for f in outs if f.kind is Kind.MIXED]
        if mixed:
            return [mixed[0]] * n.outputs
        if outs[0].kind is not Kind.STATIC:
            raise Refused("stops on a condition computed from the rows (or their count)")
        new = []
        for k, (old, got) in enumerate(zip(carried, outs[1 : 1 + len(carried)], strict=True)):
            joined = _join(old, got)
            if joined is None:
                raise Refused(
                    f"changes the layout of carried value {k} from one iteration to the next"
                )
            new.append(joined)
        if [_structure(f) for f in new] == [_structure(f) for f in carried]:
            scans = outs[1 + len(carried) :]
            return new + [_stack(n, f, 0) for f in scans]
        carried = new
    raise Refused("has carried values whose layout does not settle")


def _stack(n: Node, f: Fact, axis: int) -> Fact:
    """Per-iteration values stacked on a new ``axis`` (a loop's scan outputs)."""
    if f.kind is Kind.MIXED:
        return f
    if f.shape is None:
        if f.rows:
            raise Refused("stacks rows of unknown rank")
        return dataclasses.replace(f, shape=None, value=None)
    shape = [*f.shape[:axis], opaque(), *f.shape[axis:]]
    if f.rows:
        return Fact(
            Kind.ROWS,
            tuple(shape),
            f.axis + (1 if axis <= f.axis else 0),
            f.fold,
            sources=f.sources,
        )
    return Fact(f.kind, tuple(shape), sources=f.sources)


@rule("Scan", summary="scans axes other than the rows'; carried values keep their layout")
def _scan(n: Node) -> list[Fact]:
    if n.opset < 9:
        raise Refused("is an opset-8 Scan, which is not analyzed")
    body: GraphProto = n.attr("body")
    k = n.attr("num_scan_inputs")
    states = [n.need(i) for i in range(len(n.ins) - k)]
    scans = [n.need(i) for i in range(len(n.ins) - k, len(n.ins))]
    in_axes = n.attr("scan_input_axes") or [0] * k
    out_axes = n.attr("scan_output_axes")
    slices = []
    for f, axis in zip(scans, in_axes, strict=True):
        if f.shape is None:
            raise Refused("scans a tensor of unknown rank")
        axis = norm_axis(axis, len(f.shape))
        shape = f.shape[:axis] + f.shape[axis + 1 :]
        if f.rows:
            if f.axis == axis:
                raise Refused("iterates over the rows' axis: its state carries from row to row")
            slices.append(
                Fact(
                    Kind.ROWS,
                    shape,
                    f.axis - (1 if axis < f.axis else 0),
                    f.fold,
                    sources=f.sources,
                )
            )
        else:
            slices.append(Fact(f.kind, shape, sources=f.sources))
    for _round in range(_LOOP_ROUNDS):
        outs = n.analysis.run_graph(body, n.scope, f"{n.where}{n.name()}/body/", [*states, *slices])
        mixed = [f for f in outs if f.kind is Kind.MIXED]
        if mixed:
            return [mixed[0]] * n.outputs
        new = []
        for i, (old, got) in enumerate(zip(states, outs[: len(states)], strict=True)):
            joined = _join(old, got)
            if joined is None:
                raise Refused(f"changes the layout of state {i} from one iteration to the next")
            new.append(joined)
        if [_structure(f) for f in new] == [_structure(f) for f in states]:
            per = outs[len(states) :]
            axes = out_axes or [0] * len(per)
            stacked = []
            for f, axis in zip(per, axes, strict=True):
                rank = (f.rank or 0) + 1
                stacked.append(_stack(n, f, norm_axis(axis, rank)))
            return new + stacked
        states = new
    raise Refused("has states whose layout does not settle")


_ML_ROWWISE = (  # noqa: SIM905 (a table: one name each, compact)
    "LinearClassifier LinearRegressor SVMClassifier SVMRegressor TreeEnsembleClassifier "
    "TreeEnsembleRegressor TreeEnsemble Normalizer Scaler Binarizer Imputer LabelEncoder "
    "OneHotEncoder ZipMap ArrayFeatureExtractor FeatureVectorizer CategoryMapper"
).split()


@rule(
    *_ML_ROWWISE,
    domain="ai.onnx.ml",
    summary="one result row per input row: rows on axis 0 of a matrix",
)
def _ml_rowwise(n: Node) -> list[Fact]:
    facts = [f for f in n.ins if f is not None]
    rows = rows_among(facts)
    if not rows:
        return [n.plain(None) for _ in range(n.outputs)]
    if n.op == "ArrayFeatureExtractor":
        n.require_static([1], "indices")
        facts = facts[:1]
    for f in rows:
        if f.axis != 0 or f.fold != ONE:
            raise Refused("takes its samples from axis 0, where the rows are not")
        if (
            f.rank is not None
            and f.rank < 2
            and n.op
            not in ("LabelEncoder", "CategoryMapper", "Binarizer", "Imputer", "Scaler", "ZipMap")
        ):
            raise Refused("reads a one-dimensional input as a single sample")
    if len(rows) != len(facts):
        raise Refused("combines rows with a tensor that has none")
    first = rows[0]
    outs = []
    for k in range(n.outputs):
        if n.op in (
            "LabelEncoder",
            "CategoryMapper",
            "Binarizer",
            "Imputer",
            "Scaler",
            "Normalizer",
        ):
            outs.append(n.like(first))
        elif n.op in ("ZipMap",):
            outs.append(n.rows([first.shape[0] if first.shape else Dim.of(BATCH)], 0))
        elif k == 0 and n.op.endswith("Classifier"):
            outs.append(n.rows([Dim.of(BATCH)], 0))
        else:
            outs.append(n.rows([Dim.of(BATCH), opaque()], 0))
    return outs


@rule(
    "Gelu",
    "FastGelu",
    "BiasGelu",
    "QuickGelu",
    "BiasAdd",
    "BiasDropout",
    domain="com.microsoft",
    summary="elementwise with broadcasting",
)
def _ms_elementwise(n: Node) -> list[Fact]:
    y = broadcast(n, [0, 1, 2] if n.op == "BiasAdd" else None)
    return [y] * max(1, n.outputs)


@rule("FusedMatMul", domain="com.microsoft", summary="as MatMul (batch transposes refused)")
def _fused_matmul(n: Node) -> Fact:
    if n.attr("transBatchA", 0) or n.attr("transBatchB", 0):
        raise Refused("transposes batch axes, which is not analyzed")
    a, b = n.need(0), n.need(1)
    ashape, bshape = list(n.shape(0)), list(n.shape(1))
    if not a.rows and not b.rows:
        return n.plain(None)
    no_count_in_values(n, [a, b])
    a2, b2 = a, b
    if n.attr("transA", 0):
        ashape[-1], ashape[-2] = ashape[-2], ashape[-1]
        if a.rows and a.axis >= len(ashape) - 2:
            a2 = dataclasses.replace(
                a, axis=len(ashape) - 1 if a.axis == len(ashape) - 2 else len(ashape) - 2
            )
    if n.attr("transB", 0):
        bshape[-1], bshape[-2] = bshape[-2], bshape[-1]
        if b.rows and b.axis >= len(bshape) - 2:
            b2 = dataclasses.replace(
                b, axis=len(bshape) - 1 if b.axis == len(bshape) - 2 else len(bshape) - 2
            )
    return _matmul_rows(n, a2, b2, ashape, bshape)


@rule("FusedGemm", domain="com.microsoft", summary="as Gemm")
def _fused_gemm(n: Node) -> Fact:
    return _gemm_like(n, (0, 1, 2), ())


@rule("QGemm", domain="com.microsoft", summary="as Gemm, static quantization parameters")
def _qgemm(n: Node) -> Fact:
    return _gemm_like(n, (0, 3, 6), (1, 2, 4, 5, 7, 8))


@rule(
    "MatMulNBits",
    "MatMulBnb4",
    domain="com.microsoft",
    summary="A @ a static packed weight: rows of A",
)
def _matmul_nbits(n: Node) -> Fact:
    a = n.need(0)
    n.require_static(range(1, len(n.ins)), "packed weights")
    shape = n.shape(0)
    cols = Dim.of(n.attr("N")) if n.attr("N") else opaque()
    if not a.rows:
        return n.plain([*shape[:-1], cols])
    if a.axis == len(shape) - 1:
        raise Refused("sums over the rows' axis (it is the contracted one)")
    return n.rows([*shape[:-1], cols], a.axis, a.fold)


@rule(
    "GatherBlockQuantized",
    domain="com.microsoft",
    summary="a static block-quantized table looked up by indices that hold rows (an embedding)",
)
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


@rule(
    "MatMulIntegerToFloat",
    domain="com.microsoft",
    summary="as MatMul, static scales and zero points",
)
def _matmul_int_float(n: Node) -> Fact:
    return _matmul_like(n, 0, 1, range(2, len(n.ins)))


@rule(
    "QLinearAdd",
    "QLinearMul",
    domain="com.microsoft",
    summary="elementwise, static quantization parameters",
)
def _qlinear_binary(n: Node) -> Fact:
    n.require_static([1, 2, 4, 5, 6, 7], "quantization parameters")
    return broadcast(n, [0, 3])


@rule("QLinearSigmoid", "QLinearLeakyRelu", domain="com.microsoft", summary="elementwise")
def _qlinear_unary(n: Node) -> Fact:
    n.require_static(range(1, len(n.ins)), "quantization parameters")
    return n.like(n.need(0))


@rule("QLinearConcat", domain="com.microsoft", summary="as Concat")
def _qlinear_concat(n: Node) -> Fact:
    # Inputs: y_scale, y_zero_point, then (tensor, scale, zero_point) triples.
    n.require_static([0, 1], "quantization parameters")
    tensors = list(range(2, len(n.ins), 3))
    n.require_static([i + k for i in tensors for k in (1, 2)], "quantization parameters")
    return _concat_facts(n, [f for i in tensors if (f := n.ins[i]) is not None])


def _batch_first(
    n: Node,
    names: Sequence[str],
    required: Sequence[int],
    optional: Sequence[int] = (),
    *,
    past: Sequence[int] = (),
    broadcast: Sequence[int] = (),
) -> None:
    """Check that the batch inputs at ``required``/``optional``/``past`` hold the rows apart.

    These operators read such an input per batch entry (a mask of key lengths per entry, a
    cache per entry, ids per entry), and several of them tell an input's form by its length
    (``mask_index`` of ``B``, ``2B`` or ``3B + 2`` entries): the input must hold the rows one
    entry each on the batch axis (axis 0; axis 1 of the ``[2, batch, ...]`` caches at
    ``past``). A static tensor there is refused: made for some batch, it would be read entry by
    entry against merged requests' rows. Only inputs at ``broadcast``, which the operator
    broadcasts over the batch where their batch axis is 1, may be static, and only where that 1
    is proven (a shape the analysis computed).

    Args:
        n: The node.
        names: The operator's input names, by index (for the messages).
        required: Inputs that must be there.
        optional: Inputs that may be absent.
        past: Inputs with the batch on axis 1.
        broadcast: Inputs that may also be static with 1 on the batch axis.
    """
    for i in [*required, *optional, *past]:
        f = n.input(i)
        what = f"input {i} ({names[i]})" if i < len(names) else f"input {i}"
        if f is None:
            if i in required:
                raise Refused(f"has no {what}")
            continue
        axis = 1 if i in past else 0
        if f.rows:
            if f.axis != axis or f.fold != ONE:
                raise Refused(
                    f"expects the batch on axis {axis} of {what}, one entry per row, where the "
                    "rows are not"
                )
        elif f.kind is Kind.SIZED:
            raise Refused(f"takes {what} from the row count")
        elif not (
            i in broadcast and f.shape is not None and len(f.shape) > axis and f.shape[axis] == ONE
        ):
            raise Refused(
                f"reads {what} per batch entry, and it is a static tensor: one request's "
                "entries would be read against another request's rows"
            )


_ATTENTION_INPUTS = (  # noqa: SIM905 (a table: one name each, compact)
    "input weights bias mask_index past attention_bias past_sequence_length"
).split()


_MHA_INPUTS = (  # noqa: SIM905 (a table: one name each, compact)
    "query key value bias key_padding_mask attention_bias past_key past_value "
    "past_sequence_length cache_indirection"
).split()


_EMBED_INPUTS = (  # noqa: SIM905 (a table: one name each, compact)
    "input_ids segment_ids word_embedding position_embedding segment_embedding gamma beta "
    "mask position_ids"
).split()


@rule(
    "Attention",
    domain="com.microsoft",
    summary="batch on axis 0 of the input and mask (past on axis 1); static weights; a static "
    "mask or past refused",
)
def _attention(n: Node) -> list[Fact]:
    n.require_static([1, 2], "weights")
    n.require_static([6], "past sequence length")
    _batch_first(n, _ATTENTION_INPUTS, [0], [3, 5], past=[4], broadcast=[5])
    shape = n.shape(0)
    sizes = n.attr("qkv_hidden_sizes")
    hidden = Dim.of(sizes[2]) if sizes else shape[2]
    out = [n.rows([shape[0], shape[1], hidden], 0)]
    if n.outputs > 1:
        out.append(n.rows([Dim.of(2), shape[0], opaque(), opaque(), opaque()], 1))
    return out


@rule(
    "MultiHeadAttention",
    "RotaryEmbedding",
    "GroupQueryAttention",
    domain="com.microsoft",
    summary="batch on axis 0 of every tensor input; static masks, keys and caches refused",
)
def _mha(n: Node) -> list[Fact]:
    if n.op == "GroupQueryAttention":
        raise Refused("is GroupQueryAttention, whose cache lengths are not analyzed")
    if n.op == "RotaryEmbedding":
        n.require_static([2, 3], "cos/sin caches")
        ids = n.input(1)
        if ids is not None and ids.kind is Kind.STATIC and ids.rank == 1:
            # one position offset for every batch entry (shape [1]): the same for any rows
            if ids.shape is None or ids.shape[0] != ONE:
                raise Refused("takes position ids of a static 1-D shape other than [1]")
        else:
            _batch_first(n, ("input", "position_ids"), [0, 1])
        return [n.like(n.need(0))]
    n.require_static([3], "bias")
    n.require_static([8], "past sequence length")
    _batch_first(n, _MHA_INPUTS, [0], [1, 2, 4, 5, 6, 7, 9], broadcast=[5])
    shape = n.shape(0)
    out = [n.rows(shape if len(shape) == 3 else [shape[0], shape[1], opaque()], 0)]
    for _ in range(1, n.outputs):
        out.append(n.rows([shape[0], opaque(), opaque(), opaque()], 0))
    return out


@rule(
    "EmbedLayerNormalization",
    domain="com.microsoft",
    summary="ids, segment ids and mask on axis 0; static embeddings; static position ids [1, S]",
)
def _embed_layer_norm(n: Node) -> list[Fact]:
    n.require_static([2, 3, 4, 5, 6], "embeddings and norm parameters")
    _batch_first(n, _EMBED_INPUTS, [0], [1, 7, 8], broadcast=[8])
    shape = n.shape(0)
    out = [n.rows([shape[0], shape[1], opaque()], 0), n.rows([shape[0]], 0)]
    if n.outputs > 2:
        out.append(out[0])
    return out[: n.outputs]
