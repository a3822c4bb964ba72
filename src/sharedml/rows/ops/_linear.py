"""Linear algebra: matrix products (plain, quantized, fused) and the last two axes' operators."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sharedml.rows._dims import ONE, Dim, opaque
from sharedml.rows._facts import Fact, rows_among
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import broadcast_shape, no_count_in_values


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


@rule("", "MatMul", since=1)
@summary("rows on a batch axis of both operands or on A's row / B's column axis")
def _matmul(n: Node) -> Fact:
    return _matmul_like(n, 0, 1, ())


@rule("", "MatMulInteger", since=10)
@summary("as MatMul")
def _matmul_integer(n: Node) -> Fact:
    return _matmul_like(n, 0, 1, (2, 3))


@rule("", "QLinearMatMul", since=10)
@summary("as MatMul, static quantization parameters")
def _qlinear_matmul(n: Node) -> Fact:
    return _matmul_like(n, 0, 3, (1, 2, 4, 5, 6, 7))


@rule("", "Gemm", since=1)
@summary("rows on A's row axis (or B's column axis); C static or holding the same rows")
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


@rule("", "Einsum", since=12)
@summary("the rows' letter is kept in the output and held by row operands only")
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


@rule("com.microsoft", "FusedMatMul", since=1)
@summary("as MatMul (batch transposes refused)")
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


@rule("com.microsoft", "FusedGemm", since=1)
@summary("as Gemm")
def _fused_gemm(n: Node) -> Fact:
    return _gemm_like(n, (0, 1, 2), ())


@rule("com.microsoft", "QGemm", since=1)
@summary("as Gemm, static quantization parameters")
def _qgemm(n: Node) -> Fact:
    return _gemm_like(n, (0, 3, 6), (1, 2, 4, 5, 7, 8))


@rule("com.microsoft", "MatMulNBits", since=1)
@rule("com.microsoft", "MatMulBnb4", since=1)
@summary("A @ a static packed weight: rows of A")
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


@rule("com.microsoft", "MatMulIntegerToFloat", since=1)
@summary("as MatMul, static scales and zero points")
def _matmul_int_float(n: Node) -> Fact:
    return _matmul_like(n, 0, 1, range(2, len(n.ins)))


@rule("", "Trilu", since=14)
@summary("on the last two axes: not the rows'")
def _trilu(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    n.require_static([1], "k")
    if f.rows and f.axis >= len(shape) - 2:
        raise Refused("masks by position along the rows' axis")
    return n.like(f)


@rule("", "Det", since=11)
@summary("over the last two axes: rows before them")
def _det(n: Node) -> Fact:
    f = n.need(0)
    shape = n.shape(0)
    if f.rows and f.axis >= len(shape) - 2:
        raise Refused("combines entries along the rows' axis")
    return n.like(f, shape[:-2])


@rule("", "EyeLike", since=9)
@summary("a static identity: refused where its input holds rows")
def _eye_like(n: Node) -> Fact:
    f = n.need(0)
    if not f.plain:
        raise Refused("puts ones on a diagonal that runs across the rows")
    return n.plain(f.shape, sized=False)
