"""Models whose declared shapes lie, and that the row analysis accepts (it trusts none).

ONNX Runtime takes declared shapes as facts: each model here declares a tensor of N rows as
``[1, 4]`` somewhere (a ``value_info``, a second output, an If branch's output, a Loop body's
carried value), and ``Reshape(x, [Shape(t)[0], -1])`` then joins every caller's rows when ORT
runs the model as declared. One row at a time the lies hold, so a plain session's one-row runs
are each caller's reference. Used by ``tests/pool/test_relax.py`` (the pool) and
``tests/serve/test_lying_models.py`` (the same over HTTP).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from onnx import ModelProto, TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
I32 = TensorProto.INT32
I64 = TensorProto.INT64
B = TensorProto.BOOL
MS = "com.microsoft"
CALLERS = 16


def c(name: str, value: Any, dtype: Any = np.int64) -> TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=dtype), name)


def vi(name: str, elem: int, shape: Sequence[Any] | None) -> Any:
    return helper.make_tensor_value_info(name, elem, shape)


def mk(
    nodes: Sequence[Any],
    inputs: Sequence[Any],
    outputs: Sequence[Any],
    inits: Sequence[TensorProto] = (),
    value_info: Sequence[Any] = (),
    *,
    ms: bool = False,
) -> ModelProto:
    graph = helper.make_graph(
        list(nodes), "g", list(inputs), list(outputs), list(inits), value_info=list(value_info)
    )
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    m = helper.make_model(graph, opset_imports=opsets)
    m.ir_version = 8
    return m


def joined_by_shape_of(t: str, out: str = "y") -> list[Any]:
    """``out = x + rowsum(Reshape(x, [Shape(t)[0], -1]))``: per row where ``t`` has N rows."""
    return [
        helper.make_node("Shape", [t], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["s0"], axis=0),
        helper.make_node("Unsqueeze", ["s0", "ax0"], ["s0u"]),
        helper.make_node("Concat", ["s0u", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("ReduceSum", ["r", "ax1"], ["rs"], keepdims=1),
        helper.make_node("Add", ["x", "rs"], [out]),
    ]


SHAPE_INITS = [c("zero", 0), c("ax0", [0]), c("minus1", [-1]), c("ax1", [1])]


def _value_info_lie() -> ModelProto:
    """A rows tensor declared [1, 4] in value_info."""
    return mk(
        [helper.make_node("Add", ["x", "one"], ["t"]), *joined_by_shape_of("t")],
        [vi("x", F, ["N", 4])],
        [vi("y", F, ["N", 4])],
        [c("one", 1.0, np.float32), *SHAPE_INITS],
        [vi("t", F, [1, 4])],
    )


def _output_lie() -> ModelProto:
    """A second output left out of dynamic_axes by a batch-1 export: declared [1, 4]."""
    return mk(
        [helper.make_node("Add", ["x", "one"], ["t"]), *joined_by_shape_of("t")],
        [vi("x", F, ["N", 4])],
        [vi("y", F, ["N", 4]), vi("t", F, [1, 4])],
        [c("one", 1.0, np.float32), *SHAPE_INITS],
    )


def _if_output_lie() -> ModelProto:
    """An If branch whose output is declared [1, 4]."""
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["a"])], "then", [], [vi("a", F, [1, 4])]
    )
    other = helper.make_graph(
        [helper.make_node("Sub", ["x", "one"], ["b"])], "else", [], [vi("b", F, [1, 4])]
    )
    return mk(
        [
            helper.make_node("If", ["cond"], ["t"], then_branch=then, else_branch=other),
            *joined_by_shape_of("t"),
        ],
        [vi("x", F, ["N", 4])],
        [vi("y", F, ["N", 4])],
        [c("one", 1.0, np.float32), c("cond", True, np.bool_), *SHAPE_INITS],
    )


def _loop_carried_lie() -> ModelProto:
    """A Loop body whose carried value is declared [1, 4]; the body reshapes by its Shape."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c_in"], ["c_out"]), *joined_by_shape_of("v", "v_out")],
        "body",
        [vi("i", I64, []), vi("c_in", B, []), vi("v", F, [1, 4])],
        [vi("c_out", B, []), vi("v_out", F, [1, 4])],
        [*SHAPE_INITS],
    )
    # The body's Reshape is of x (the outer value), so each round adds x's row sums again.
    return mk(
        [helper.make_node("Loop", ["trip", "cond", "x"], ["y"], body=body)],
        [vi("x", F, ["N", 4])],
        [vi("y", F, ["N", 4])],
        [c("trip", 2), c("cond", True, np.bool_)],
    )


def _branch_name_lie_fixed_at_one() -> ModelProto:
    """Fixed at 1; two branches define 't', rows in one and static in the other; one declares it."""
    then = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["t"]), *joined_by_shape_of("t", "o1")],
        "then",
        [],
        [vi("o1", F, [1, 4])],
        value_info=[vi("t", F, [1, 4])],
    )
    other = helper.make_graph(
        [
            helper.make_node("Constant", [], ["t"], value=c("k", np.ones((1, 4)), np.float32)),
            helper.make_node("Add", ["x", "t"], ["o2"]),
        ],
        "else",
        [],
        [vi("o2", F, [1, 4])],
    )
    return mk(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        [vi("x", F, [1, 4])],
        [vi("y", F, [1, 4])],
        [c("one", 1.0, np.float32), c("cond", True, np.bool_), *SHAPE_INITS],
    )


def _pad_to_a_multiple() -> ModelProto:
    """Pads the sequence axis to a multiple of 8, by pads computed from its length (Mod)."""
    return mk(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Gather", ["s", "one"], ["S"], axis=0),
            helper.make_node("Mod", ["S", "eight"], ["r"]),
            helper.make_node("Sub", ["eight", "r"], ["p0"]),
            helper.make_node("Mod", ["p0", "eight"], ["p"]),
            helper.make_node("Unsqueeze", ["p", "ax0"], ["pu"]),
            helper.make_node("Concat", ["zeros4", "pu", "zero1"], ["pads"], axis=0),
            helper.make_node("Pad", ["x", "pads"], ["padded"], mode="reflect"),
            helper.make_node("ReduceSum", ["padded", "ax1"], ["y"], keepdims=0),
        ],
        [vi("x", F, ["N", "S", 4])],
        [vi("y", F, ["N", 4])],
        [
            c("one", 1),
            c("eight", 8),
            c("ax0", [0]),
            c("ax1", [1]),
            c("zeros4", [0] * 4),
            c("zero1", [0]),
        ],
    )


def _torch_f_pad() -> ModelProto:
    """PyTorch's export of ``F.pad(x, (1, 2))``: the pads table reshaped, reversed, transposed."""
    return mk(
        [
            helper.make_node("ConstantOfShape", ["two"], ["zeros"], value=c("v", [0])),
            helper.make_node("Concat", ["lr", "zeros"], ["flat"], axis=0),
            helper.make_node("Reshape", ["flat", "pairs"], ["table"]),
            helper.make_node("Slice", ["table", "m1", "big", "ax0", "m1"], ["rev"]),
            helper.make_node("Transpose", ["rev"], ["tr"], perm=[1, 0]),
            helper.make_node("Reshape", ["tr", "m1"], ["pads"]),
            helper.make_node("Pad", ["x", "pads"], ["y"]),
        ],
        [vi("x", F, ["N", 5])],
        [vi("y", F, ["N", 8])],
        [
            c("two", [2]),
            c("lr", [1, 2]),
            c("pairs", [-1, 2]),
            c("m1", [-1]),
            c("big", [-(2**63) + 1]),
            c("ax0", [0]),
        ],
    )


def row_feeds(shape: Sequence[int], *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"x": (rng.standard_normal((1, *shape)) + 4 * k).astype(np.float32)} for k in range(CALLERS)
    ]


# name -> (model, one-row feeds of distinct callers)
LYING: dict[str, tuple[Callable[[], ModelProto], list[dict[str, np.ndarray]]]] = {
    "value_info declares a rows tensor [1, 4]": (_value_info_lie, row_feeds([4])),
    "a second output declared [1, 4]": (_output_lie, row_feeds([4])),
    "an If branch's output declared [1, 4]": (_if_output_lie, row_feeds([4])),
    "a Loop body's carried value declared [1, 4]": (_loop_carried_lie, row_feeds([4])),
    "fixed at 1: branches share a name, one declares it": (
        _branch_name_lie_fixed_at_one,
        row_feeds([4]),
    ),
}
# Accepted models whose declarations are true, for the invariant.
HONEST = {
    "pads computed to a multiple of 8": (_pad_to_a_multiple, row_feeds([5, 4])),
    "PyTorch's F.pad export": (_torch_f_pad, row_feeds([5])),
}
