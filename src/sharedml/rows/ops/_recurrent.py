"""Recurrences (RNN, GRU, LSTM) and sequence reversal: the rows on the batch axis."""

from __future__ import annotations

from sharedml.rows._dims import ONE, Dim, opaque
from sharedml.rows._facts import Fact, rows_among
from sharedml.rows._registry import Node, Refused, rule, summary
from sharedml.rows.ops._common import norm_axis


@rule("", "RNN", since=1)
@rule("", "GRU", since=1)
@rule("", "LSTM", since=1)
@summary("rows on the batch axis of its layout (1 time-major, 0 batch-major)")
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


@rule("", "ReverseSequence", since=10)
@summary("rows on batch_axis, their own lengths")
def _reverse_sequence(n: Node) -> Fact:
    f, lens = n.need(0), n.need(1)
    shape = n.shape(0)
    batch_axis = norm_axis(n.attr("batch_axis", 1), len(shape))
    if f.rows and (f.axis != batch_axis or f.fold != ONE):
        raise Refused("reverses along the rows' axis, or takes its batch elsewhere")
    if f.rows and not (lens.rows and lens.axis == 0 and lens.fold == ONE):
        raise Refused("pairs each row with a static sequence length by position")
    return n.like(f)
