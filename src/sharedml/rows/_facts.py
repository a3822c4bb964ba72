"""What the row analysis knows of one tensor (a :class:`Fact`), and why rows mix."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable
from typing import Any

from sharedml.model._proto import TensorProto
from sharedml.rows._dims import ONE, Dim

__all__ = [
    "MAX_VALUES",
    "TO_THE_END",
    "Fact",
    "Kind",
    "Pin",
    "Refusal",
    "Value",
    "rows_among",
    "tensor_values",
]

MAX_VALUES = 64  # elements of a small tensor whose values are followed (shapes, axes, sizes)
TO_THE_END = 2**31 - 1  # a Slice end at least this large means "to the end of the axis"


class Kind(enum.Enum):
    """What a tensor's values depend on (see :mod:`sharedml.rows`)."""

    STATIC = "static"
    SIZED = "sized"
    ROWS = "rows"
    MIXED = "mixed"


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a model cannot be batched: the first node that combines rows or cannot be proven.

    Attributes:
        node: The node's name (its op type and position where it has none), with the
            subgraph it sits in.
        op_type: Its operator.
        reason: What it does with the rows.
        inputs: The model inputs whose rows reach it.
    """

    node: str
    op_type: str
    reason: str
    inputs: tuple[str, ...] = ()

    def describe(self) -> str:
        """One sentence: the node, its op type, the inputs it came from, and why."""
        came = ""
        if self.inputs:
            names = ", ".join(f"'{name}'" for name in self.inputs)
            came = f" (on the rows of input{'s' if len(self.inputs) > 1 else ''} {names})"
        return f"node {self.node} ({self.op_type}){came} {self.reason}"


Value = Any  # an element of a followed small tensor: Dim (integers), float or bool


@dataclasses.dataclass(frozen=True)
class Pin:
    """A node that made a tensor of a constant shape with 1 on axis 0 (see ``fixed_rows``)."""

    node: str
    op_type: str
    shape: tuple[Dim, ...]


@dataclasses.dataclass(frozen=True)
class Fact:
    """What one tensor's values depend on, and its shape where it is known.

    Attributes:
        kind: See :class:`Kind`.
        shape: Dims (``None``: rank unknown). For ``ROWS``, ``shape[axis]`` is ``N * fold``.
        axis: ``ROWS``: the axis that holds the rows.
        fold: ``ROWS``: entries per row along ``axis`` (1 unless a Reshape folded the rows
            with another axis, ``[N, seq, h] -> [N * seq, h]``).
        value: A small tensor's elements, flattened (rank 0 or 1 only), where known.
        sources: The model inputs whose rows (or row count) it depends on.
        refusal: ``MIXED``: why.
        pin: With ``fixed_rows``: the node that gave a tensor without rows a literal 1 on
            axis 0 from a constant shape (an export's batch of one), which a refusal names
            where that tensor meets the rows.
    """

    kind: Kind
    shape: tuple[Dim, ...] | None = None
    axis: int = 0
    fold: Dim = ONE
    value: tuple[Value, ...] | None = None
    sources: frozenset[str] = frozenset()
    refusal: Refusal | None = None
    pin: Pin | None = None

    @property
    def rank(self) -> int | None:
        """The number of axes, where known."""
        return None if self.shape is None else len(self.shape)

    @property
    def rows(self) -> bool:
        """Whether one axis holds the rows."""
        return self.kind is Kind.ROWS

    @property
    def plain(self) -> bool:
        """Whether no row's values reach it (``STATIC`` or ``SIZED``)."""
        return self.kind in (Kind.STATIC, Kind.SIZED)

    def same_layout(self, other: Fact) -> bool:
        """Whether both hold their rows on the same axis with the same fold."""
        return self.axis == other.axis and self.fold == other.fold


def rows_among(facts: Iterable[Fact | None]) -> list[Fact]:
    """The facts that hold rows."""
    return [f for f in facts if f is not None and f.rows]


def tensor_values(t: TensorProto) -> list[Value] | None:
    """The elements of a small inline tensor, or None (too large, external, or another type)."""
    dims = list(t.dims)
    count = math.prod(dims) if dims else 1
    if len(dims) > 1 or count > MAX_VALUES or t.data_location == TensorProto.EXTERNAL:
        return None
    import numpy as np

    from sharedml.model._dtypes import np_dtype

    try:
        dtype = np_dtype(t.data_type)
    except Exception:
        return None
    if dtype.kind not in "biuf":
        return None
    if t.HasField("raw_data"):
        arr = np.frombuffer(t.raw_data, dtype=dtype.newbyteorder("<"))
    elif dtype.kind == "f" and dtype.itemsize == 8:
        arr = np.array(t.double_data, dtype=dtype)
    elif dtype.kind == "f" and dtype.itemsize == 4:
        arr = np.array(t.float_data, dtype=dtype)
    elif dtype.kind == "f":
        arr = np.array(t.int32_data, dtype=np.uint16).view(dtype)
    elif dtype.kind in "iu" and dtype.itemsize == 8:
        arr = np.array(t.uint64_data if dtype.kind == "u" else t.int64_data, dtype=dtype)
    else:
        arr = np.array(t.int32_data, dtype=dtype)
    if arr.size != count:
        return None
    if dtype.kind == "b":
        return [bool(x) for x in arr.tolist()]
    if dtype.kind == "f":
        return [float(x) for x in arr.tolist()]
    return [Dim.of(int(x)) for x in arr.tolist()]
