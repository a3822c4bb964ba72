"""The rules' registry: which rule answers for an operator, and the view of a node a rule gets.

A rule is a function of a :class:`Node` (its inputs' facts and its attributes) that returns its
outputs' facts, or raises :class:`Refused` where they mix rows or cannot be proven not to. The
op families in :mod:`sharedml.rows.ops` register theirs here when they are imported; the engine
(:mod:`sharedml.rows._engine`) imports them all and looks rules up by domain and operator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from typing import Any, Protocol, TypeVar

from sharedml.model._proto import AttributeProto, GraphProto, NodeProto
from sharedml.rows._dims import BATCH, ONE, Dim
from sharedml.rows._facts import Fact, Kind, Pin, Value

__all__ = [
    "RULES",
    "SUMMARIES",
    "Analysis",
    "Node",
    "Refused",
    "Registration",
    "Rule",
    "RuleEntry",
    "domain_key",
    "rule",
    "summary",
]


class Refused(Exception):
    """A rule's way to say that a node's outputs combine rows (or cannot be proven not to)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Analysis(Protocol):
    """What a rule may ask of the analysis that runs it (:class:`~sharedml.rows.RowAnalysis`)."""

    @property
    def max_rows(self) -> int:
        """The most rows a merged run holds."""

    @property
    def fixed_rows(self) -> bool:
        """Whether the model was exported with axis 0 fixed at 1 (and is served relaxed)."""

    def opset(self, domain: str) -> int:
        """The opset version the model imports for ``domain``."""

    def node_name(self, node: NodeProto, where: str = "") -> str:
        """A node's name for a refusal."""

    def run_graph(
        self,
        graph: GraphProto,
        outer: MutableMapping[str, Fact],
        where: str,
        inputs: Sequence[Fact],
    ) -> list[Fact]:
        """Facts of a subgraph's outputs, its inputs given."""


class Node:
    """One node, its inputs' facts and its attributes, as a rule sees them."""

    def __init__(
        self,
        analysis: Analysis,
        node: NodeProto,
        ins: list[Fact | None],
        where: str,
        scope: MutableMapping[str, Fact],
    ) -> None:
        self.analysis = analysis
        self.proto = node
        self.op = node.op_type
        self.ins = ins
        self.where = where
        self.scope = scope
        self.opset = analysis.opset(node.domain)
        self.attrs = {a.name: a for a in node.attribute}
        self.outputs = len(node.output)
        self.sources = frozenset().union(*(f.sources for f in ins if f is not None))

    # Inputs ------------------------------------------------------------------------------------

    def input(self, i: int) -> Fact | None:
        """Input ``i``'s fact; None where it is absent (optional, or given as '')."""
        return self.ins[i] if i < len(self.ins) else None

    def need(self, i: int) -> Fact:
        """Input ``i``'s fact; refused where it is absent."""
        fact = self.input(i)
        if fact is None:
            raise Refused(f"has no input {i}")
        return fact

    def shape(self, i: int) -> tuple[Dim, ...]:
        """Input ``i``'s dims; refused where its rank is unknown."""
        shape = self.need(i).shape
        if shape is None:
            raise Refused(f"gets input {i} of unknown rank, so its axes cannot be followed")
        return shape

    def static_values(self, i: int, what: str) -> tuple[Value, ...] | None:
        """Input ``i``'s values, which must not depend on the rows (None: absent)."""
        fact = self.input(i)
        if fact is None:
            return None
        if fact.rows:
            raise Refused(f"takes its {what} from the rows' values")
        if fact.value is None:
            raise Refused(f"takes its {what} from a tensor whose values could not be followed")
        return fact.value

    def ints(self, i: int, what: str) -> list[int] | None:
        """Input ``i``'s values as known integers (None: absent)."""
        values = self.static_values(i, what)
        if values is None:
            return None
        out = []
        for v in values:
            c = v.const if isinstance(v, Dim) else None
            if c is None:
                raise Refused(f"takes its {what} from values that are not known integers")
            out.append(c)
        return out

    def require_static(self, indices: Iterable[int], what: str = "parameters") -> None:
        """The inputs at ``indices`` (where present) must not depend on the rows or their count."""
        for i in indices:
            fact = self.input(i)
            if fact is not None and fact.kind is not Kind.STATIC:
                raise Refused(
                    f"takes its {what} (input {i}) from "
                    + ("the rows' values" if fact.rows else "the row count")
                )

    # Attributes --------------------------------------------------------------------------------

    def attr(self, name: str, default: Any = None) -> Any:
        """Attribute ``name``'s value (numbers, strings, lists of them, a tensor, a graph)."""
        a = self.attrs.get(name)
        if a is None:
            return default
        if a.type == AttributeProto.INT:
            return a.i
        if a.type == AttributeProto.FLOAT:
            return a.f
        if a.type == AttributeProto.STRING:
            return a.s.decode("utf-8", "replace")
        if a.type == AttributeProto.INTS:
            return list(a.ints)
        if a.type == AttributeProto.FLOATS:
            return list(a.floats)
        if a.type == AttributeProto.STRINGS:
            return [s.decode("utf-8", "replace") for s in a.strings]
        if a.type == AttributeProto.TENSOR:
            return a.t
        if a.type == AttributeProto.GRAPH:
            return a.g
        return default

    # Results -----------------------------------------------------------------------------------

    def plain(
        self,
        shape: Sequence[Dim] | None,
        value: Sequence[Value] | None = None,
        *,
        sized: bool | None = None,
    ) -> Fact:
        """A result no row's values reach: SIZED where it depends on N, else STATIC."""
        val = tuple(value) if value is not None else None
        if sized is None:
            if val is not None:
                sized = any(isinstance(v, Dim) and v.has_batch for v in val)
            else:
                sized = any(f is not None and f.kind is not Kind.STATIC for f in self.ins)
        if shape is not None and any(d.has_batch for d in shape):
            # A tensor whose size depends on N but whose values do not come from rows: which
            # entry belongs to which row is a matter of position.
            raise Refused("makes a tensor whose size depends on the row count")
        return Fact(
            Kind.SIZED if sized else Kind.STATIC,
            tuple(shape) if shape is not None else None,
            value=val,
            sources=self.sources if sized else frozenset(),
            pin=next((f.pin for f in self.ins if f is not None and f.pin is not None), None),
        )

    def pinned(self, fact: Fact, shape_input: int) -> Fact:
        """``fact``, marked as pinned by this node where ``fixed_rows`` finds it so.

        Pinned: a static result of rank >= 1 with a literal 1 on axis 0 whose shape came from
        the static values of input ``shape_input`` (a constant shape, as an export traced at
        batch 1 writes it).
        """
        given = self.input(shape_input)
        if (
            not self.analysis.fixed_rows
            or fact.kind is not Kind.STATIC
            or not fact.shape
            or fact.shape[0] != ONE
            or given is None
            or given.kind is not Kind.STATIC
        ):
            return fact
        return dataclasses.replace(fact, pin=Pin(self.name(), self.op, fact.shape))

    def rows(self, shape: Sequence[Dim] | None, axis: int, fold: Dim = ONE) -> Fact:
        """A result holding the rows on ``axis``."""
        if shape is None:
            raise Refused("makes a result of unknown rank from the rows")
        dims = list(shape)
        if not 0 <= axis < len(dims):
            raise Refused("moves the rows out of its result's axes")
        dims[axis] = Dim.of(BATCH) * fold
        for k, d in enumerate(dims):
            if k != axis and d.has_batch:
                raise Refused(
                    f"makes a result whose axis {k} depends on the row count as well as axis {axis}"
                )
        if fold.has_batch:
            raise Refused("folds the rows into themselves")
        return Fact(Kind.ROWS, tuple(dims), axis, fold, sources=self.sources)

    def like(self, fact: Fact, shape: Sequence[Dim] | None = None) -> Fact:
        """A result laid out as ``fact`` (same axis and fold; another shape if given)."""
        shape = fact.shape if shape is None else shape
        if fact.rows:
            return self.rows(shape, fact.axis, fact.fold)
        return self.plain(shape, sized=fact.kind is Kind.SIZED)

    def name(self) -> str:
        """The node's name for a refusal, with the subgraph it sits in."""
        return self.analysis.node_name(self.proto, self.where)


Rule = Callable[[Node], "Fact | list[Fact]"]


@dataclasses.dataclass(frozen=True)
class Registration:
    """One operator's rule, and the first opset of the operator's domain that it covers."""

    rule: Rule
    since: int


@dataclasses.dataclass(frozen=True)
class RuleEntry:
    """One row of the rule table: an operator, the opsets its rule covers, and what it does.

    Attributes:
        domain: The operator's domain ("ai.onnx" for the default one).
        op_type: The operator.
        since: The first opset of ``domain`` the rule covers: a node of an older opset is
            refused, whatever its inputs.
        summary: What the rule does with the rows (the docs' rule table).
    """

    domain: str
    op_type: str
    since: int
    summary: str


RULES: dict[tuple[str, str], Registration] = {}
SUMMARIES: dict[Rule, str] = {}

_R = TypeVar("_R", bound=Rule)


def rule(domain: str, op_type: str, *, since: int) -> Callable[[_R], _R]:
    """Register the decorated function as ``op_type``'s rule from opset ``since`` of ``domain`` on.

    One line per operator, stacked on the function that implements it (as onnx-ir's shape
    inference registers its functions), so that grepping an operator's quoted name finds its
    rule. ``since`` is the first version the rule was written for: the operator's first version
    where the rule reads every version right, a later one where an older version meant
    something else. A node of an older opset is refused, whatever its inputs (it might have
    subgraphs or attributes the rule does not read).

    Args:
        domain: The operator's domain ("" for the default one).
        op_type: The operator.
        since: The first opset of ``domain`` the rule covers.

    Returns:
        A decorator that registers its function and returns it unchanged.

    Raises:
        ValueError: ``op_type`` of ``domain`` has a rule already (two would silently shadow).
    """
    key = (domain_key(domain), op_type)

    def register(fn: _R) -> _R:
        if key in RULES:
            raise ValueError(f"{op_type} ({domain or 'ai.onnx'}) is registered twice")
        RULES[key] = Registration(fn, since)
        return fn

    return register


def summary(text: str) -> Callable[[_R], _R]:
    """Give the decorated rule its line in the docs' rule table, one for all its operators.

    Args:
        text: What the rule does with the rows, in a few words.

    Returns:
        A decorator that records ``text`` for its function and returns it unchanged.
    """

    def register(fn: _R) -> _R:
        SUMMARIES[fn] = text
        return fn

    return register


def domain_key(domain: str) -> str:
    """The registry's key for an operator domain: '' for the default one however it is spelled."""
    return "" if domain in ("", "ai.onnx") else domain
