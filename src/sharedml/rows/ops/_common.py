"""Helpers the op families share: axes, numpy broadcasting, values free of the row count."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from sharedml.rows._dims import ONE, Dim, opaque
from sharedml.rows._facts import Fact, Kind, Value, rows_among
from sharedml.rows._registry import Node, Refused


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    """``axis`` (negative: from the end) as an index into ``rank`` axes; refused if out of range."""
    if not -rank <= axis < rank:
        raise Refused(f"has {what} {axis} out of range for rank {rank}")
    return axis % rank


def listed_axes(n: Node, index: int, attr: str = "axes") -> list[int] | None:
    """Axes from an attribute (older opsets) or an input; None where not given."""
    listed = n.attr(attr)
    if listed is not None:
        return list(listed)
    if index < len(n.ins) and n.input(index) is not None:
        return n.ints(index, attr)
    return None


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


def number(v: Value) -> float:
    """A known number as a float (TypeError for a symbolic dim)."""
    if isinstance(v, Dim):
        c = v.const
        if c is None:
            raise TypeError
        return c
    return float(v)


def along(n: Node, axis: int, why: str) -> Fact:
    """An operator along one ``axis`` of input 0, which must not be the rows'; same layout out."""
    f = n.need(0)
    if f.rows and norm_axis(axis, len(n.shape(0))) == f.axis:
        raise Refused(why)
    return n.like(f)


def normalized_from(n: Node, f: Fact, first: int) -> None:
    """Refuse where ``f``'s rows lie on an axis from ``first`` on (normalized together)."""
    if f.rows and f.axis >= first:
        raise Refused("normalizes over the rows' axis")
