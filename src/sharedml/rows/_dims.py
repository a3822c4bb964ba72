"""Symbolic tensor dimensions: integers as polynomials over named sizes.

The row-independence analysis (:mod:`sharedml.rows`) follows shapes through a graph without
knowing its sizes: ``N``, the rows of a (merged) request, and the model's other symbolic dims
(a sequence length, an image's height) stay symbols, so that ``N * seq`` reshaped to
``[N, seq]`` can be proven to keep every row whole. A :class:`Dim` is a polynomial with integer
coefficients over such symbols; it adds, subtracts, multiplies, and divides exactly where the
divisor is one term. Anything else (a floor division that is not exact, a maximum of two
unknowns) becomes a fresh opaque symbol, marked as depending on ``N`` where its operands did.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Union

__all__ = ["BATCH", "ONE", "ZERO", "Dim", "DimLike", "opaque", "product"]

BATCH = "N"
"""The symbol of the rows axis: how many rows the (merged) request has."""

_N_DEPENDENT = "?N"  # prefix of opaque symbols derived from the rows' count
_N_FREE = "?"  # prefix of opaque symbols that are not
_counter = itertools.count()

Monomial = tuple[str, ...]  # sorted symbol names, repeated for powers; () is the constant term


class Dim:
    """An integer-valued polynomial over symbols (immutable, hashable, compared exactly)."""

    __slots__ = ("_hash", "_terms")

    _terms: dict[Monomial, int]
    _hash: int

    def __init__(self, terms: Mapping[Monomial, int]) -> None:
        self._terms = {m: c for m, c in terms.items() if c}
        self._hash = hash(frozenset(self._terms.items()))

    @classmethod
    def of(cls, value: DimLike) -> Dim:
        """A Dim from an int, a symbol name, or a Dim."""
        if isinstance(value, Dim):
            return value
        if isinstance(value, bool):
            return cls({(): int(value)})
        if isinstance(value, int):
            return cls({(): value})
        if isinstance(value, str):
            return cls({(value,): 1})
        raise TypeError(f"not a dimension: {value!r}")

    @property
    def const(self) -> int | None:
        """The value where the polynomial has no symbol, else None."""
        if not self._terms:
            return 0
        if len(self._terms) == 1 and () in self._terms:
            return self._terms[()]
        return None

    def symbols(self) -> set[str]:
        """Every symbol that occurs."""
        return {s for m in self._terms for s in m}

    @property
    def has_batch(self) -> bool:
        """Whether the value depends on the rows' count ``N``."""
        return any(s == BATCH or s.startswith(_N_DEPENDENT) for s in self.symbols())

    @property
    def positive(self) -> bool:
        """Whether every coefficient is positive (so the value is >= 1 where symbols are)."""
        return bool(self._terms) and all(c > 0 for c in self._terms.values())

    def batch_factor(self) -> Dim | None:
        """``self / N`` where ``self`` is ``N`` times an ``N``-free polynomial, else None."""
        out: dict[Monomial, int] = {}
        for m, c in self._terms.items():
            if m.count(BATCH) != 1:
                return None
            rest = list(m)
            rest.remove(BATCH)
            out[tuple(rest)] = c
        result = Dim(out)
        return None if not out or result.has_batch else result

    def __add__(self, other: DimLike) -> Dim:
        o = Dim.of(other)
        terms = dict(self._terms)
        for m, c in o._terms.items():
            terms[m] = terms.get(m, 0) + c
        return Dim(terms)

    __radd__ = __add__

    def __neg__(self) -> Dim:
        return Dim({m: -c for m, c in self._terms.items()})

    def __sub__(self, other: DimLike) -> Dim:
        return self + (-Dim.of(other))

    def __rsub__(self, other: DimLike) -> Dim:
        return Dim.of(other) - self

    def __mul__(self, other: DimLike) -> Dim:
        o = Dim.of(other)
        terms: dict[Monomial, int] = {}
        for (m1, c1), (m2, c2) in itertools.product(self._terms.items(), o._terms.items()):
            m = tuple(sorted(m1 + m2))
            terms[m] = terms.get(m, 0) + c1 * c2
        return Dim(terms)

    __rmul__ = __mul__

    def divide(self, other: DimLike) -> Dim | None:
        """``self / other`` where it is exact and ``other`` has one term, else None."""
        o = Dim.of(other)
        if len(o._terms) != 1:
            return Dim({}) if not self._terms and o._terms else None
        ((dm, dc),) = o._terms.items()
        if dc == 0:
            return None
        out: dict[Monomial, int] = {}
        for m, c in self._terms.items():
            rest = list(m)
            for s in dm:
                if s not in rest:
                    return None
                rest.remove(s)
            if c % dc:
                return None
            out[tuple(rest)] = c // dc
        return Dim(out)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (int, str)) and not isinstance(other, bool):
            other = Dim.of(other)
        return isinstance(other, Dim) and self._terms == other._terms

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if not self._terms:
            return "0"
        parts = []
        for m, c in sorted(self._terms.items(), key=lambda t: (-len(t[0]), t[0])):
            name = "*".join(m)
            if not name:
                parts.append(str(c))
            elif c == 1:
                parts.append(name)
            else:
                parts.append(f"{c}*{name}")
        return " + ".join(parts).replace("+ -", "- ")


DimLike = Union[int, str, Dim]  # noqa: UP007 (a runtime alias: 3.10 has no str | type)

ONE = Dim.of(1)
ZERO = Dim.of(0)


def opaque(operands: Iterable[Dim] = ()) -> Dim:
    """A fresh symbol for a value not tracked exactly, ``N``-dependent where an operand is."""
    batch = any(d.has_batch for d in operands)
    return Dim.of(f"{_N_DEPENDENT if batch else _N_FREE}{next(_counter)}")


def product(dims: Iterable[Dim]) -> Dim:
    """The product of ``dims`` (1 for none)."""
    out = ONE
    for d in dims:
        out = out * d
    return out
