"""A batching pool runs a graph that declares only what the row analysis proved.

ONNX Runtime takes declared shapes as facts: a ``value_info`` (a graph output, a subgraph's
input or output) declared ``[1, 4]`` lets it fold ``Shape(t)`` into a constant while it loads the
graph, and ``Reshape(x, [Shape(t)[0], -1])`` then joins every caller's rows. Each lying model
here is accepted by the analysis (it trusts no declaration) and is shown to really join callers'
rows when ORT runs it as declared, so the corpus cannot pass by refusing; a pool over it still
gives every caller its own rows, after a first batch of harmless rows that passes any check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import ModelProto, TensorProto, helper, numpy_helper

import sharedml
from sharedml.pool._batching import signature_of
from sharedml.pool._relax import ROWS_DIM, relax
from sharedml.rows import Dim, RowAnalysis

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
        [c("one", 1), c("eight", 8), c("ax0", [0]), c("ax1", [1]), c("zeros4", [0] * 4),
         c("zero1", [0])],
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
        [c("two", [2]), c("lr", [1, 2]), c("pairs", [-1, 2]), c("m1", [-1]),
         c("big", [-(2**63) + 1]), c("ax0", [0])],
    )


def row_feeds(shape: Sequence[int], *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"x": (rng.standard_normal((1, *shape)) + 4 * k).astype(np.float32)}
        for k in range(CALLERS)
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


def plain(m: ModelProto, **options: Any) -> ort.InferenceSession:
    so = ort.SessionOptions()
    for key, value in options.items():
        setattr(so, key, value)
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def merged(feeds: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]}


def proof(m: ModelProto) -> RowAnalysis:
    sig = signature_of(m, name="m", relax=True)
    assert sig.proof is not None
    return sig.proof


@pytest.mark.parametrize("case", sorted(LYING))
def test_plain_ort_joins_callers_rows_of_a_lying_model_the_analysis_accepts(case: str) -> None:
    build, feeds = LYING[case]
    m = build()
    proof(m)  # accepted: the analysis derives every shape and trusts no declaration
    fixed = m.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1
    if fixed:  # ORT refuses two rows of a model fixed at 1: the lie is in the relaxer's copy
        old = relax(m, proof(m)).graph
        then = next(a.g for a in old.graph.node[0].attribute if a.name == "then_branch")
        then.value_info.extend([vi("t", F, [1, 4])])
        m = old
    solo = [plain(m).run(None, f)[0] for f in feeds[:4]]
    together = plain(m).run(None, merged(feeds[:4]))[0]
    assert not np.allclose(np.concatenate(solo), together, rtol=1e-4, atol=1e-4)


@pytest.fixture
def model_path(tmp_path: Path) -> Callable[[ModelProto], Path]:
    def save(m: ModelProto) -> Path:
        path = tmp_path / "model.onnx"
        onnx.save(m, path)
        return path

    return save


def serve_together(pool: sharedml.SessionPool, feeds: Sequence[dict[str, np.ndarray]]) -> list[Any]:
    """Every feed's first output, each from a thread of its own, started together."""
    results: list[Any] = [None] * len(feeds)
    barrier = threading.Barrier(len(feeds))

    def call(k: int) -> None:
        barrier.wait()
        results[k] = pool.run(None, feeds[k])[0]

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("case", sorted(LYING) + sorted(HONEST))
def test_a_pool_gives_each_caller_its_own_rows_after_a_primed_first_batch(
    case: str, model_path: Callable[[ModelProto], Path]
) -> None:
    build, feeds = {**LYING, **HONEST}[case]
    m = build()
    reference = [plain(m).run(None, f)[0] for f in feeds]  # one row each: the lies hold
    batching = sharedml.Batching(max_batch_size=CALLERS, max_delay_ms=100)
    with sharedml.SessionPool(model_path(m), sessions=1, batching=batching) as pool:
        harmless = [{k: np.zeros_like(v) for k, v in f.items()} for f in feeds]
        serve_together(pool, harmless)  # a first batch no check can tell from a right one
        primed = pool.stats()
        got = serve_together(pool, feeds)
        stats = pool.stats()
    assert stats.max_batch_rows > 1 and stats.batches - primed.batches < CALLERS  # merged
    for k, (want, have) in enumerate(zip(reference, got, strict=True)):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-4, err_msg=f"caller {k}")
    assert stats.batch_mismatches == 0  # no check had to step in: the proof held


def declarations(m: ModelProto) -> list[tuple[str, int, Any]]:
    """(name, depth, type) of every declared value: value_info and subgraph inputs/outputs."""
    found: list[tuple[str, int, Any]] = []

    def walk(g: Any, depth: int) -> None:
        found.extend((v.name, depth, v.type) for v in g.value_info)
        if depth:
            found.extend((v.name, depth, v.type) for v in (*g.input, *g.output))
        for node in g.node:
            for a in node.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                    walk(sub, depth + 1)

    walk(m.graph, 0)
    return found


@pytest.mark.parametrize("case", sorted(LYING) + sorted(HONEST))
def test_the_graph_ort_runs_declares_no_shape_the_analysis_did_not_prove(case: str) -> None:
    m = LYING.get(case, HONEST.get(case))[0]()  # type: ignore[index]
    analysis = proof(m)
    served = relax(m, analysis).graph
    for name, depth, type_proto in declarations(served):
        assert depth > 0, f"value_info '{name}' is still declared"
        tensor = type_proto.tensor_type
        # a Loop body's iteration number and condition only: scalars by the operator
        assert not tensor.HasField("shape") or len(tensor.shape.dim) == 0, name
    facts = dict(analysis.outputs())
    batch = analysis.batch_params
    for value in served.graph.output:
        fact = facts[value.name]
        dims = value.type.tensor_type.shape.dim
        assert fact.shape is not None and len(dims) in (0, len(fact.shape))
        for axis, (dim, proven) in enumerate(zip(dims, fact.shape, strict=False)):
            if axis == fact.axis:
                assert not dim.HasField("dim_value"), value.name
                assert dim.dim_param in (*batch, ROWS_DIM, ""), value.name
            elif dim.HasField("dim_value"):
                assert proven == Dim.of(dim.dim_value), value.name
            elif dim.dim_param:
                assert proven == Dim.of(f"dim:{dim.dim_param}"), value.name


def ort_optimized(m: ModelProto, tmp: Path) -> ModelProto:
    """The graph ORT makes of ``m`` at load: constants folded, with what it took as facts."""
    path = tmp / "optimized.onnx"
    plain(
        m,
        optimized_model_filepath=str(path),
        graph_optimization_level=ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    )
    return onnx.load(path)


@pytest.mark.parametrize("case", sorted(LYING))
def test_ort_folds_nothing_that_joins_rows_in_the_graph_a_pool_runs(
    case: str, tmp_path: Path
) -> None:
    m = LYING[case][0]()
    served = relax(m, proof(m)).graph
    optimized = ort_optimized(served, tmp_path)
    assert RowAnalysis(optimized).refusal() is None  # what ORT made of it still keeps rows apart
    if served.graph.input[0].type.tensor_type.shape.dim[0].dim_param != ROWS_DIM:
        # and the check can fail: ORT's fold of the model as declared is refused
        assert RowAnalysis(ort_optimized(m, tmp_path)).refusal() is not None


def test_a_static_value_declared_smaller_than_it_is_is_refused() -> None:
    """No rule computes CenterCropPad's shape: a declared [1, 1] once stood in for its [2, 1]."""
    m = mk(
        [
            helper.make_node("CenterCropPad", ["table", "size"], ["w"]),
            helper.make_node("Mul", ["x", "w"], ["y"]),
        ],
        [vi("x", F, ["N", 1])],
        [vi("y", F, ["N", 1])],
        [c("table", [[2.0], [3.0]], np.float32), c("size", [2, 1])],
        [vi("w", F, [1, 1])],
    )
    m.opset_import[0].version = 18
    x = np.array([[1.0], [10.0]], np.float32)
    together = plain(m).run(None, {"x": x})[0]
    alone = plain(m).run(None, {"x": x[1:]})[0]
    assert together[1, 0] == 30.0 and alone[0, 0] == 20.0  # row k meets entry k, by position
    refusal = RowAnalysis(m).refusal()
    assert refusal is not None and "unknown rank" in refusal.reason, refusal


def test_an_unused_mixing_node_is_found_though_another_branch_reuses_its_name() -> None:
    """ORT runs every node of a model fixed at 1: one that mixes rows fails merged runs."""
    then = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["x", "ax0"], ["t"], keepdims=1),  # unused, mixing
            helper.make_node("Add", ["x", "one"], ["o1"]),
        ],
        "then",
        [],
        [vi("o1", F, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["t"]), helper.make_node("Neg", ["t"], ["o2"])],
        "else",
        [],
        [vi("o2", F, None)],
    )
    m = mk(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        [vi("x", F, [1, 4])],
        [vi("y", F, [1, 4])],
        [c("one", 1.0, np.float32), c("cond", True, np.bool_), *SHAPE_INITS],
    )
    with pytest.raises(sharedml.NotBatchableError, match="ReduceSum"):
        signature_of(m, name="m", relax=True)
