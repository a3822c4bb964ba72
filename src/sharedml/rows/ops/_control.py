"""Control flow (If, Loop, Scan): the bodies are followed like the graph itself."""

from __future__ import annotations

import dataclasses
from typing import Any

from sharedml.model._proto import GraphProto
from sharedml.rows._dims import Dim, opaque
from sharedml.rows._facts import Fact, Kind
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import norm_axis

_LOOP_ROUNDS = 4  # rounds of a loop's carried values before they must be stable


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


@rule("", "If", since=1)
@summary("a static condition; both branches give the same layouts")
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


@rule("", "Loop", since=1)
@summary("a static trip count and condition; carried values keep their layout")
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


@rule("", "Scan", since=9)  # Scan-8 has a batch axis and sequence lengths of its own
@summary("scans axes other than the rows'; carried values keep their layout")
def _scan(n: Node) -> list[Fact]:
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
