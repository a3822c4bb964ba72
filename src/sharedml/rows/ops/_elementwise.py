"""Elementwise operators: the rows stay where they are and meet others by broadcasting."""

from __future__ import annotations

import math
from collections.abc import Callable

from sharedml.model._proto import TensorProto
from sharedml.rows._dims import ZERO, Dim, opaque
from sharedml.rows._facts import Fact, Kind, Value
from sharedml.rows._registry import Node, Refused, rule
from sharedml.rows.ops._common import broadcast, number

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
