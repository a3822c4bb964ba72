"""Elementwise operators: the rows stay where they are and meet others by broadcasting."""

from __future__ import annotations

import math
from collections.abc import Callable

from sharedml.model._proto import TensorProto
from sharedml.rows._dims import ZERO, Dim, opaque
from sharedml.rows._facts import Fact, Kind, Value
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import broadcast, number


@rule("", "Abs", since=1)
@rule("", "Acos", since=7)
@rule("", "Acosh", since=9)
@rule("", "Asin", since=7)
@rule("", "Asinh", since=9)
@rule("", "Atan", since=7)
@rule("", "Atanh", since=9)
@rule("", "BitwiseNot", since=18)
@rule("", "Ceil", since=1)
@rule("", "Celu", since=12)
@rule("", "Cos", since=7)
@rule("", "Cosh", since=9)
@rule("", "Elu", since=1)
@rule("", "Erf", since=9)
@rule("", "Exp", since=1)
@rule("", "Floor", since=1)
@rule("", "Gelu", since=20)
@rule("", "HardSigmoid", since=1)
@rule("", "HardSwish", since=14)
@rule("", "IsInf", since=10)
@rule("", "IsNaN", since=9)
@rule("", "LeakyRelu", since=1)
@rule("", "Log", since=1)
@rule("", "Mish", since=18)
@rule("", "Reciprocal", since=1)
@rule("", "Relu", since=1)
@rule("", "Round", since=11)
@rule("", "Selu", since=1)
@rule("", "Shrink", since=9)
@rule("", "Sigmoid", since=1)
@rule("", "Sign", since=9)
@rule("", "Sin", since=7)
@rule("", "Sinh", since=9)
@rule("", "Softplus", since=1)
@rule("", "Softsign", since=1)
@rule("", "Sqrt", since=1)
@rule("", "Swish", since=24)
@rule("", "Tan", since=7)
@rule("", "Tanh", since=1)
@rule("", "ThresholdedRelu", since=10)
@summary("elementwise: the rows stay where they are")
def _unary(n: Node) -> Fact:
    return n.like(n.need(0))


@rule("", "Identity", since=1)
@summary("passes its input through")
def _identity(n: Node) -> Fact:
    return n.need(0)


@rule("", "Neg", since=1)
@summary("elementwise")
def _neg(n: Node) -> Fact:
    f = n.need(0)
    if f.plain and f.value is not None and all(isinstance(v, (Dim, float)) for v in f.value):
        return n.plain(f.shape, [-v for v in f.value])
    return n.like(f)


@rule("", "Not", since=1)
@summary("elementwise")
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


@rule("", "Cast", since=6)  # Cast-1 names its target type as a string ("FLOAT")
@rule("", "CastLike", since=15)
@summary("elementwise (values followed for shape arithmetic)")
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


# Add, Sub, Mul, Div, Pow, And, Or, Xor, Equal, Greater, Less from opset 7 (PRelu too): their
# older versions broadcast B by a `broadcast` attribute, from the axis an `axis` attribute names,
# which numpy's rule would misread.
@rule("", "Add", since=7)
@rule("", "Sub", since=7)
@rule("", "Mul", since=7)
@rule("", "Div", since=7)
@rule("", "Pow", since=7)
@rule("", "Mod", since=10)
@rule("", "And", since=7)
@rule("", "Or", since=7)
@rule("", "Xor", since=7)
@rule("", "Equal", since=7)
@rule("", "Greater", since=7)
@rule("", "Less", since=7)
@rule("", "GreaterOrEqual", since=12)
@rule("", "LessOrEqual", since=12)
@rule("", "BitShift", since=11)
@rule("", "BitwiseAnd", since=18)
@rule("", "BitwiseOr", since=18)
@rule("", "BitwiseXor", since=18)
@rule("", "PRelu", since=7)
@rule("", "Max", since=1)
@rule("", "Min", since=1)
@rule("", "Sum", since=1)
@rule("", "Mean", since=1)
@rule("", "Where", since=9)
@rule("", "Clip", since=1)
@summary(
    "elementwise with numpy broadcasting: rows meet rows on the same axis only, and a "
    "static tensor must have size 1 on the rows' axis"
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


@rule("", "Dropout", since=7)  # Dropout-1/6 train unless an is_test attribute says otherwise
@summary("identity where it is not training (a training Dropout is random)")
def _dropout(n: Node) -> list[Fact]:
    if n.opset >= 12 and n.input(2) is not None:
        training = n.static_values(2, "training mode")
        if training is None or any(bool(v) if isinstance(v, bool) else v != ZERO for v in training):
            raise Refused("may run in training mode, which draws random numbers per row")
    f = n.need(0)
    out = [n.like(f)]
    if n.outputs > 1:
        out.append(n.like(f))
    return out


@rule("com.microsoft", "Gelu", since=1)
@rule("com.microsoft", "FastGelu", since=1)
@rule("com.microsoft", "BiasGelu", since=1)
@rule("com.microsoft", "QuickGelu", since=1)
@rule("com.microsoft", "BiasAdd", since=1)
@rule("com.microsoft", "BiasDropout", since=1)
@summary("elementwise with broadcasting")
def _ms_elementwise(n: Node) -> list[Fact]:
    y = broadcast(n, [0, 1, 2] if n.op == "BiasAdd" else None)
    return [y] * max(1, n.outputs)


@rule("com.microsoft", "QLinearAdd", since=1)
@rule("com.microsoft", "QLinearMul", since=1)
@summary("elementwise, static quantization parameters")
def _qlinear_binary(n: Node) -> Fact:
    n.require_static([1, 2, 4, 5, 6, 7], "quantization parameters")
    return broadcast(n, [0, 3])


@rule("com.microsoft", "QLinearSigmoid", since=1)
@rule("com.microsoft", "QLinearLeakyRelu", since=1)
@summary("elementwise")
def _qlinear_unary(n: Node) -> Fact:
    n.require_static(range(1, len(n.ins)), "quantization parameters")
    return n.like(n.need(0))
