"""The row analysis: facts for a model's inputs, then every node of every graph, rule by rule."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import MutableMapping, Sequence
from typing import Any

from sharedml.model._proto import AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto
from sharedml.rows import ops  # noqa: F401 (importing the op families registers every rule)
from sharedml.rows._dims import BATCH, ONE, Dim, opaque
from sharedml.rows._facts import TO_THE_END, Fact, Kind, Refusal, rows_among, tensor_values
from sharedml.rows._registry import RULES, SUMMARIES, Node, Refused, RuleEntry, domain_key

__all__ = ["RowAnalysis", "rule_entries", "rules_table"]


def _tensor_fact(t: TensorProto) -> Fact:
    return Fact(Kind.STATIC, tuple(Dim.of(int(d)) for d in t.dims), value=tensor_values(t))  # type: ignore[arg-type]


def _constant_fact(node: NodeProto) -> Fact:
    for a in node.attribute:
        if a.name == "value" and a.type == AttributeProto.TENSOR:
            return _tensor_fact(a.t)
        if a.name == "value_int":
            return Fact(Kind.STATIC, (), value=(Dim.of(a.i),))
        if a.name == "value_ints":
            return Fact(Kind.STATIC, (Dim.of(len(a.ints)),), value=tuple(Dim.of(v) for v in a.ints))
        if a.name == "value_float":
            return Fact(Kind.STATIC, (), value=(float(a.f),))
        if a.name == "value_floats":
            return Fact(
                Kind.STATIC, (Dim.of(len(a.floats)),), value=tuple(float(v) for v in a.floats)
            )
    return Fact(Kind.STATIC)


class RowAnalysis:
    """Facts for every tensor of a model whose inputs all hold the rows on axis 0.

    Args:
        model: The model (external data need not be loaded: only small inline tensors are read).
        max_rows: The most rows a merged run holds (``Batching.max_batch_size``): a Slice of
            the rows' axis up to at least that many keeps them all (exporters write "to the
            end" as 2**31 - 1, 10**9, ...). Default: no bound below 2**31 - 1.
        fixed_rows: The model was exported with axis 0 fixed at 1, and is to be served with
            that axis relaxed (:mod:`sharedml.pool._relax`). Its constants were traced at one
            row, so a literal 1 may stand where the rows go: a Reshape of the rows whose shape
            has a 1 before the rows' new axis (``[1, -1]``) is refused, and a refusal where a
            tensor with a constant shape of 1 on axis 0 (``Expand``, ``ConstantOfShape``,
            ``Tile``, ``Reshape``) meets the rows names the node that made it.

    Attributes:
        facts: After :meth:`outputs`, the fact of every value it reached, subgraphs included
            (by name: where two subgraphs define one name, the one analyzed last).
        refused: After :meth:`outputs`, why each node whose outputs mix rows does, in graph
            order, whether or not an output needs it (ORT runs every node).
    """

    def __init__(
        self, model: ModelProto, *, max_rows: int = TO_THE_END, fixed_rows: bool = False
    ) -> None:
        self.model = model
        self.max_rows = max_rows
        self.fixed_rows = fixed_rows
        self.facts: dict[str, Fact] = {}
        self._opsets: dict[str, int] = {o.domain or "": int(o.version) for o in model.opset_import}
        self.refused: list[Refusal] = []
        self._batch_params: set[str] = set()
        self._outputs: list[tuple[str, Fact]] | None = None
        self._top: dict[str, Fact] = {}

    def opset(self, domain: str) -> int:
        """The opset version the model imports for ``domain`` (the default domain for '')."""
        key = domain_key(domain)
        return self._opsets.get(key, self._opsets.get("ai.onnx", 0) if key == "" else 1)

    @staticmethod
    def node_name(node: NodeProto, where: str = "") -> str:
        """A node's name for a refusal: quoted, or its op type where it has none."""
        return f"'{where}{node.name}'" if node.name else f"{where}<unnamed {node.op_type}>"

    # Inputs -------------------------------------------------------------------------------

    def _input_fact(self, value: Any) -> Fact:
        tensor = value.type.tensor_type if value.type.HasField("tensor_type") else None
        if tensor is None or not tensor.HasField("shape"):
            return Fact(Kind.ROWS, None, 0, sources=frozenset([value.name]))
        dims: list[Dim] = []
        for k, d in enumerate(tensor.shape.dim):
            if k == 0:
                dims.append(Dim.of(BATCH))
            elif d.HasField("dim_value") and d.dim_value >= 0:
                dims.append(Dim.of(d.dim_value))
            elif d.HasField("dim_param") and d.dim_param:
                if d.dim_param in self._batch_params:
                    refusal = Refusal(
                        f"input '{value.name}'",
                        "graph input",
                        f"has the rows' dim '{d.dim_param}' on axis {k} as well as on axis 0",
                        (value.name,),
                    )
                    return Fact(Kind.MIXED, refusal=refusal, sources=frozenset([value.name]))
                dims.append(Dim.of(f"dim:{d.dim_param}"))
            else:
                dims.append(opaque())
        if not dims:
            refusal = Refusal(f"input '{value.name}'", "graph input", "is a scalar: it has no rows")
            return Fact(Kind.MIXED, refusal=refusal)
        return Fact(Kind.ROWS, tuple(dims), 0, sources=frozenset([value.name]))

    def input_facts(self) -> dict[str, Fact]:
        """The facts of the model's inputs (rows on axis 0) and initializers (static)."""
        graph = self.model.graph
        initializers = {t.name for t in graph.initializer}
        for value in graph.input:
            if value.name in initializers:
                continue
            tensor = value.type.tensor_type if value.type.HasField("tensor_type") else None
            if tensor is not None and tensor.HasField("shape") and tensor.shape.dim:
                d0 = tensor.shape.dim[0]
                if d0.HasField("dim_param") and d0.dim_param:
                    self._batch_params.add(d0.dim_param)
        facts: dict[str, Fact] = {}
        for t in graph.initializer:
            facts[t.name] = _tensor_fact(t)
        for value in graph.input:
            if value.name not in initializers:
                facts[value.name] = self._input_fact(value)
        self.facts.update(facts)
        return facts

    # Graphs -------------------------------------------------------------------------------

    def run_graph(
        self,
        graph: GraphProto,
        outer: MutableMapping[str, Fact],
        where: str,
        inputs: Sequence[Fact],
    ) -> list[Fact]:
        """Facts of ``graph``'s outputs, its inputs given (a subgraph sees ``outer`` too)."""
        scope: MutableMapping[str, Fact] = ChainMap({}, outer)
        for t in graph.initializer:
            scope[t.name] = _tensor_fact(t)
        for value, fact in zip(graph.input, inputs, strict=False):
            scope[value.name] = fact
            self.facts[value.name] = fact
        self._run_nodes(graph, scope, where)
        return [scope.get(o.name, self._unknown(o.name, where)) for o in graph.output]

    def _unknown(self, name: str, where: str) -> Fact:
        return Fact(Kind.MIXED, refusal=Refusal(f"'{where}{name}'", "value", "is never computed"))

    def _run_nodes(self, graph: GraphProto, scope: MutableMapping[str, Fact], where: str) -> None:
        for node in graph.node:
            ins: list[Fact | None] = []
            for name in node.input:
                if not name:
                    ins.append(None)
                else:
                    ins.append(scope.get(name) or self._unknown(name, where))
            for name, fact in zip(node.output, self._node(node, ins, where, scope), strict=False):
                if name:
                    scope[name] = fact
                    self.facts[name] = fact
                    refusal = fact.refusal
                    if fact.kind is Kind.MIXED and refusal and refusal not in self.refused:
                        self.refused.append(refusal)

    def _node(
        self, node: NodeProto, ins: list[Fact | None], where: str, scope: MutableMapping[str, Fact]
    ) -> list[Fact]:
        count = len(node.output)
        for f in ins:
            if f is not None and f.kind is Kind.MIXED:
                return [f] * count
        domain = domain_key(node.domain)
        if domain == "" and node.op_type == "Constant":
            return [_constant_fact(node)]
        n = Node(self, node, ins, where, scope)
        registered = RULES.get((domain, node.op_type))
        try:
            if registered is None:
                return self._unruled(n, count)
            if n.opset < registered.since:
                # An older version of the operator may mean something else (Add-6 broadcasts
                # by an axis attribute; Scan-8 has a batch axis of its own) or carry subgraphs
                # the rule does not follow: refused whatever its inputs, like Scan-8 always was.
                reason = (
                    f"is {node.op_type} of {domain or 'ai.onnx'} opset {n.opset}, older than the "
                    f"analysis knows it: its rule covers opset {registered.since} and later"
                )
                return [self._mixed(n, reason)] * count
            result = registered.rule(n)
        except Refused as refused:
            return [self._mixed(n, refused.reason)] * count
        except Exception as exc:
            # A node the rule did not expect (an attribute out of range, a malformed graph):
            # nothing is proven about it, and refusing is the safe answer.
            return [self._mixed(n, f"could not be analyzed ({type(exc).__name__}: {exc})")] * count
        outs = result if isinstance(result, list) else [result]
        if len(outs) < count:
            outs = outs + [self._mixed(n, "has outputs the analysis does not model")] * (
                count - len(outs)
            )
        return outs

    def _unruled(self, n: Node, count: int) -> list[Fact]:
        """An operator without a rule: static stays static; rows are refused."""
        facts = [f for f in n.ins if f is not None]
        domain = n.proto.domain or "ai.onnx"
        if rows_among(facts):
            return [self._mixed(n, f"is an operator ({domain}) the analysis does not know")] * count
        outer = [n.scope.get(name) for name in sorted(_outer_names(n.proto))]
        if any(f is None or f.kind is not Kind.STATIC for f in outer):
            # Its subgraph reads values of the enclosing graphs that its inputs do not show.
            return [
                self._mixed(
                    n,
                    f"is an operator ({domain}) the analysis does not know, whose subgraph "
                    "reads the rows (or their count) from the enclosing graph",
                )
            ] * count
        sized = any(f.kind is Kind.SIZED for f in facts)
        return [
            Fact(Kind.SIZED if sized else Kind.STATIC, sources=n.sources if sized else frozenset())
        ] * count

    def _mixed(self, n: Node, reason: str) -> Fact:
        refusal = Refusal(n.name(), n.op, reason, tuple(sorted(n.sources)))
        pin = next((f.pin for f in n.ins if f is not None and f.pin is not None), None)
        if self.fixed_rows and pin is not None:
            # The node that fixed the shape for one row is the one to change (or to blame).
            refusal = Refusal(
                pin.node,
                pin.op_type,
                f"makes a tensor of the constant shape {list(pin.shape)}, its axis 0 fixed at "
                f"1 when the model was exported; where it meets the rows, node {n.name()} "
                f"({n.op}) {reason}",
            )
        return Fact(Kind.MIXED, sources=n.sources, refusal=refusal)

    @property
    def batch_params(self) -> frozenset[str]:
        """The symbolic dims the graph's inputs name their axis 0 with (after :meth:`outputs`)."""
        return frozenset(self._batch_params)

    @property
    def top_facts(self) -> dict[str, Fact]:
        """The facts of the main graph's own values, by name (after :meth:`outputs`).

        Unlike :attr:`facts`, no subgraph's value of the same name stands in for one of them.
        """
        self.outputs()
        return self._top

    def outputs(self) -> list[tuple[str, Fact]]:
        """Each graph output's name and fact (the analysis runs once; later calls reuse it)."""
        if self._outputs is None:
            graph = self.model.graph
            facts = self.input_facts()
            scope: MutableMapping[str, Fact] = ChainMap(facts)
            self._run_nodes(graph, scope, "")
            self._top = dict(scope)
            self._outputs = [
                (o.name, scope.get(o.name) or self._unknown(o.name, "")) for o in graph.output
            ]
        return self._outputs

    def refusal(self) -> Refusal | None:
        """Why merging requests could change a caller's outputs, or None where it cannot."""
        for name, fact in self.outputs():
            if fact.kind is Kind.MIXED:
                assert fact.refusal is not None
                return fact.refusal
            if fact.kind is not Kind.ROWS:
                return Refusal(
                    f"output '{name}'",
                    "graph output",
                    "does not depend on the rows: its axis 0 is not one entry per row",
                )
            if fact.axis != 0:
                return Refusal(
                    f"output '{name}'",
                    "graph output",
                    f"holds the rows on axis {fact.axis}, not axis 0",
                    tuple(sorted(fact.sources)),
                )
            if fact.fold != ONE:
                return Refusal(
                    f"output '{name}'",
                    "graph output",
                    f"holds {fact.fold} entries per row on axis 0, not one",
                    tuple(sorted(fact.sources)),
                )
        return None


def rule_entries() -> list[RuleEntry]:
    """Every operator the analysis has a rule for, with the opsets it covers, sorted.

    Returns:
        One entry per operator: the default domain first, then by domain and operator.
    """
    entries = [
        RuleEntry(domain or "ai.onnx", op, registered.since, SUMMARIES.get(registered.rule, ""))
        for (domain, op), registered in RULES.items()
    ]
    return sorted(entries, key=lambda e: (e.domain != "ai.onnx", e.domain, e.op_type))


def rules_table() -> list[tuple[str, str, str]]:
    """``(domain, op_type, rule)`` of every operator the analysis knows, sorted.

    :func:`rule_entries` gives each operator's first opset as well.
    """
    return [(e.domain, e.op_type, e.summary) for e in rule_entries()]


def _outer_names(node: NodeProto) -> set[str]:
    """The names a node's subgraphs read from the graphs that enclose the node."""
    found: set[str] = set()
    for a in node.attribute:
        subs = [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)
        for g in subs:
            defined = {v.name for v in g.input} | {t.name for t in g.initializer}
            for inner in g.node:
                found.update(n for n in inner.input if n and n not in defined)
                found.update(_outer_names(inner) - defined)
                defined.update(inner.output)
    return found
