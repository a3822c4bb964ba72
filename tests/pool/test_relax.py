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
from _lying import CALLERS, HONEST, LYING, SHAPE_INITS, F, c, mk, vi
from onnx import ModelProto, helper, numpy_helper

import sharedml
from sharedml.pool._batching import signature_of
from sharedml.pool._relax import ROWS_DIM, relax
from sharedml.rows import Dim, RowAnalysis


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
                for sub in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                    walk(sub, depth + 1)

    walk(m.graph, 0)
    return found


@pytest.mark.parametrize("case", sorted(LYING) + sorted(HONEST))
def test_the_graph_ort_runs_declares_no_shape_the_analysis_did_not_prove(case: str) -> None:
    m = LYING.get(case, HONEST.get(case))[0]()  # type: ignore[index]
    analysis = proof(m)
    served = relax(m, analysis).graph
    top = analysis.top_facts
    names: dict[str, int] = {}  # how often the main graph's declarations use each dim name
    for value in (*served.graph.input, *served.graph.output, *served.graph.value_info):
        for d in value.type.tensor_type.shape.dim:
            names[d.dim_param] = names.get(d.dim_param, 0) + bool(d.dim_param)
    batch = {v.type.tensor_type.shape.dim[0].dim_param for v in served.graph.input}
    for name, depth, type_proto in declarations(served):
        if depth:  # a Loop body's iteration number and condition only: scalars, by the op
            tensor = type_proto.tensor_type
            assert not tensor.HasField("shape") or len(tensor.shape.dim) == 0, name
    for value in (*served.graph.value_info, *served.graph.output):
        name, tensor = value.name, value.type.tensor_type
        if not tensor.HasField("shape"):
            continue
        fact = top[name]  # the main graph's own value of that name
        dims = tensor.shape.dim
        assert fact.shape is not None and len(dims) == len(fact.shape), name
        for axis, (dim, proven) in enumerate(zip(dims, fact.shape, strict=True)):
            if dim.HasField("dim_value"):
                assert not (fact.rows and axis == fact.axis), f"{name}: a size for the rows"
                assert proven == Dim.of(dim.dim_value), name
            elif names.get(dim.dim_param, 0) > 1:  # a name ORT may equate with another dim
                if fact.rows and axis == fact.axis:
                    assert dim.dim_param in (*batch, ROWS_DIM) and fact.fold == 1, name
                else:
                    assert proven == Dim.of(f"dim:{dim.dim_param}"), name


def test_a_model_whose_declarations_hold_is_loaded_as_it_is() -> None:
    """No copy where nothing needs dropping: value_info and outputs the analysis proves."""
    m = mk(
        [helper.make_node("Add", ["x", "one"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        [vi("x", F, ["N", 4])],
        [vi("y", F, ["N", 4])],
        [c("one", 1.0, np.float32)],
        [vi("h", F, ["N", 4]), vi("unnamed", F, ["dim_used_once"])],
    )
    relaxed = relax(m, proof(m))
    assert relaxed.graph is m and relaxed.changed == () and relaxed.reason == ""


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


def _weights_of(model_path: Path) -> list[Path]:
    graph = onnx.load(model_path, load_external_data=False).graph
    found = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
    return [model_path.parent / name for name in sorted(found)]


def test_a_prepared_model_of_the_callers_is_copied_into_the_cache_never_linked(
    tmp_path: Path,
) -> None:
    """A second link would change the caller's file: onnx.load refuses such external data."""
    m = LYING["value_info declares a rows tensor [1, 4]"][0]()
    big = numpy_helper.from_array(np.ones((64, 4), np.float32), "w")  # a tensor prepare moves
    m.graph.initializer.append(big)
    m.graph.node.append(helper.make_node("MatMul", ["y", "w_t"], ["unused"]))
    m.graph.initializer.append(numpy_helper.from_array(np.ones((4, 64), np.float32), "w_t"))
    onnx.save(m, tmp_path / "source.onnx")
    mine = tmp_path / "mine" / "model.onnx"
    sharedml.prepare(tmp_path / "source.onnx", mine)
    (weights,) = _weights_of(mine)
    with sharedml.SessionPool(
        mine, sessions=1, batching=True, cache_dir=tmp_path / "cache"
    ) as pool:
        served = pool.recipe.model_path
        assert served != mine  # the relaxed graph, an entry of the cache
        (copy,) = _weights_of(served)
        assert copy.stat().st_ino != weights.stat().st_ino
    assert weights.stat().st_nlink == 1
    onnx.load(mine)  # the caller's model loads with its weights, as before

    with sharedml.SessionPool(
        tmp_path / "source.onnx", sessions=1, batching=True, cache_dir=tmp_path / "cache2"
    ) as pool:  # prepared by the pool: the cache's own files are linked, the same inode
        (linked,) = _weights_of(pool.recipe.model_path)
        assert linked.stat().st_nlink == 2
