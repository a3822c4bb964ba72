"""Dynamic batching: requests that queue merge into one Run, and every caller gets its own rows.

The batches formed here are deterministic: the tests hold the pool's only session with a
checkout, let callers queue (polling the pool's ``waiting`` count), and then release it, so
what merges is decided by the queue, never by how fast this machine happens to be.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import pickle
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from _models import OPSET, batchable_model, fixed_at_one, save_model
from _waiting import DEADLINE_S, wait_until
from hypothesis import example, given, settings, target
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml.pool import _batching
from sharedml.pool._batching import UNTOLD_GAP

DIM = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return batchable_model(tmp_path_factory.mktemp("b") / "b.onnx", dim=DIM, extra_input=True)


@pytest.fixture(scope="module")
def solo(model: Path) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return lambda feed: sess.run(None, feed)[0]


def feed(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, DIM)).astype(np.float32),
        "scale": rng.uniform(0.5, 2, (rows, 1)).astype(np.float32),
    }


def queue_behind_a_checkout(
    pool: sharedml.SessionPool, calls: Sequence[Callable[[], Any]]
) -> list[Any]:
    """Hold the pool's one session, let ``calls`` queue in order, release; their results.

    A call refused before it queues (a feed that fails validation) finishes at once instead.
    """
    results: list[Any] = [None] * len(calls)
    finished: list[int] = []

    def call(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            results[i] = exc
        finished.append(i)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    with pool.session():
        for i, t in enumerate(threads):
            t.start()
            wait_until(
                lambda i=i: pool.stats().waiting + len(finished) == i + 1,
                what=f"request {i} to queue",
            )
    for t in threads:
        t.join(DEADLINE_S)
        assert not t.is_alive()
    return results


def test_requests_that_queue_merge_into_one_run_and_get_their_own_rows(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        feeds = [feed(rows, seed) for seed, rows in enumerate([1, 3, 2, 1])]
        outs = queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, f) for f in feeds])
        stats = pool.stats()
    assert stats.batches == 1 and stats.batched_rows == 7 and stats.max_batch_rows == 7
    for f, out in zip(feeds, outs, strict=True):
        (y,) = out
        assert y.shape == (f["x"].shape[0], DIM)
        assert y.flags.owndata or y.base is None or y.base.shape == y.shape  # the caller's own
        np.testing.assert_allclose(y, solo(f), rtol=1e-5, atol=1e-6)


def _reachable(root: Any) -> list[Any]:
    """Everything reachable from ``root`` through ``.base`` and Python references (not types).

    numpy arrays do not report their ``.base`` to ``gc``: it is followed by hand.
    """
    seen: dict[int, Any] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen[id(obj)] = obj
        if isinstance(obj, np.ndarray) and obj.base is not None:
            todo.append(obj.base)
        todo.extend(gc.get_referents(obj))
    return list(seen.values())


def test_copy_outputs_false_hands_each_caller_a_view_that_reaches_only_its_rows(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    batching = sharedml.Batching(copy_outputs=False)
    with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
        feeds = [feed(rows, seed) for seed, rows in enumerate([2, 1, 3])]
        outs = queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, f) for f in feeds])
        assert pool.stats().batches == 1
    ys = [out[0] for out in outs]
    # No copy: the three callers' rows lie one after the other in the batch's output.
    assert all(not y.flags.owndata for y in ys)
    for a, b in itertools.pairwise(ys):
        assert b.ctypes.data == a.ctypes.data + a.nbytes
    # Nothing a caller's view leads to (its .base chain, what those reference, the buffers
    # numpy exports) spans more than the caller's own rows.
    for y in ys:
        for obj in _reachable(y):
            if isinstance(obj, np.ndarray):
                assert obj.nbytes <= y.nbytes, (obj.shape, y.shape)
            if hasattr(obj, "__array_interface__"):
                assert np.asarray(obj).nbytes <= y.nbytes
        assert np.asarray(y.base).ctypes.data == y.ctypes.data
        assert not np.shares_memory(y, np.concatenate([z for z in ys if z is not y]))
        assert len(pickle.loads(pickle.dumps(y))) == len(y)
    expected = [solo(f) for f in feeds]
    ys[1][:] = np.nan  # a caller's writes stay in its own rows
    for y, want in zip([ys[0], ys[2]], [expected[0], expected[2]], strict=True):
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    # The batch's output lives as long as any caller's view, and no longer.
    last = ys.pop()
    del outs, ys, y, a, b  # every reference to the other views
    gc.collect()
    np.testing.assert_allclose(last, expected[2], rtol=1e-5, atol=1e-6)
    held = _batching._HELD
    assert held  # the one view left holds the output
    del last
    gc.collect()
    assert not held
    with pytest.raises(ValueError, match="copy_outputs must be True or False"):
        sharedml.Batching(copy_outputs=None)  # type: ignore[arg-type]


def test_dims_exported_as_minus_one_are_dynamic_as_ort_treats_them(tmp_path: Path) -> None:
    """Paddle's exporter writes dim_value -1 for dynamic dims (PP-OCR's classifier, PicoDet)."""
    import onnx

    path = batchable_model(tmp_path / "paddle.onnx", dim=DIM, extra_input=True)
    model = onnx.load(path)
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_value = -1
    onnx.save(model, path)
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with sharedml.SessionPool(path, sessions=1, batching=True) as pool:
        feeds = [feed(rows, seed) for seed, rows in enumerate([1, 2, 1])]
        outs = queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, f) for f in feeds])
        assert pool.stats().max_batch_rows == 4
    for f, (y,) in zip(feeds, outs, strict=True):
        np.testing.assert_allclose(y, plain.run(None, f)[0], rtol=1e-5, atol=1e-6)


def test_a_batch_holds_at_most_max_batch_size_rows_oldest_first(model: Path) -> None:
    with sharedml.SessionPool(
        model, sessions=1, batching=sharedml.Batching(max_batch_size=4)
    ) as pool:
        feeds = [feed(2, seed) for seed in range(5)]  # 10 rows: batches of 4, 4 and 2
        queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, f) for f in feeds])
        stats = pool.stats()
    assert (stats.batches, stats.batched_rows, stats.max_batch_rows) == (3, 10, 4)


def test_an_idle_pool_runs_a_request_at_once_alone(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        pool.run(None, feed(2, 0))
        stats = pool.stats()
    assert (stats.batches, stats.waits, stats.max_batch_rows) == (1, 0, 2)


def test_incompatible_requests_run_alone_in_their_turn(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    options = ort.RunOptions()
    broadcast = feed(1, 5) | {"scale": np.full((2, 1), 2.0, np.float32)}  # ORT broadcasts it
    as_lists = {k: v.tolist() for k, v in feed(1, 6).items()}  # ORT converts lists itself
    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        calls: list[Callable[[], Any]] = [
            lambda: pool.run(None, feed(1, 0)),
            lambda: pool.run(["y"], feed(1, 1)),  # other output_names
            lambda: pool.run(None, feed(1, 2), options),  # run_options
            lambda: pool.run(None, broadcast),  # inputs of different batch sizes
            lambda: pool.run(None, as_lists),
            lambda: pool.run(None, feed(1, 3)),  # merges with the first
        ]
        outs = queue_behind_a_checkout(pool, calls)
        stats = pool.stats()
    assert stats.batches == 5
    for seed, out in zip((0, 1, 2, 3), (outs[0], outs[1], outs[2], outs[5]), strict=True):
        np.testing.assert_allclose(out[0], solo(feed(1, seed)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[3][0], solo(broadcast), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[4][0], solo(feed(1, 6)), rtol=1e-5, atol=1e-6)


def test_a_bad_request_fails_alone_with_the_error_an_unbatched_run_gives(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    bad = [
        {"x": np.zeros((1, DIM + 1), np.float32), "scale": np.ones((1, 1), np.float32)},
        {"x": np.zeros((1, DIM), np.float64), "scale": np.ones((1, 1), np.float32)},
        {"x": np.zeros((1, DIM), np.float32)},
        {"x": np.zeros((1, DIM), np.float32), "nope": np.ones((1, 1), np.float32)},
    ]
    for batching in (False, True):
        with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
            calls = [lambda b=b: pool.run(None, b) for b in bad]
            calls += [lambda s=s: pool.run(None, feed(1, s)) for s in range(3)]
            outs = queue_behind_a_checkout(pool, calls)
        for out in outs[: len(bad)]:
            assert isinstance(out, sharedml.InvalidInputError), (batching, out)
            assert isinstance(out, ValueError)
        for seed, out in enumerate(outs[len(bad) :]):
            np.testing.assert_allclose(out[0], solo(feed(1, seed)), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def lookup(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ids: int64[batch, 4]`` -> rows of a 10-row table: an id out of range fails the Run."""
    table = numpy_helper.from_array(np.arange(80, dtype=np.float32).reshape(10, 8), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        "lookup",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8])],
        initializer=[table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return save_model(model, tmp_path_factory.mktemp("lookup") / "lookup.onnx")


def test_a_merged_run_that_fails_is_rerun_one_by_one_so_only_the_culprit_fails(
    lookup: Path,
) -> None:
    good = [np.full((1, 4), i, np.int64) for i in range(3)]
    culprit = np.array([[1, 2, 99, 3]], np.int64)  # valid shape and dtype, bad value
    with sharedml.SessionPool(lookup, sessions=1, batching=True) as pool:
        calls = [lambda g=g: pool.run(None, {"ids": g}) for g in good[:2]]
        calls += [
            lambda: pool.run(None, {"ids": culprit}),
            lambda: pool.run(None, {"ids": good[2]}),
        ]
        outs = queue_behind_a_checkout(pool, calls)
        stats = pool.stats()
    assert isinstance(outs[2], sharedml.RunError) and "99" in str(outs[2])
    assert outs[2].ort_type  # ORT's own exception type name is kept
    for i, out in zip((0, 1, 3), (outs[0], outs[1], outs[3]), strict=True):
        expected = np.arange(80, dtype=np.float32).reshape(10, 8)[good[min(i, 2)]]
        np.testing.assert_array_equal(out[0], expected)
    assert stats.failed_runs == 1 and stats.runs == 5  # 4 requests and the checkout


@pytest.mark.parametrize(
    ("inputs", "outputs", "nodes", "match"),
    [
        ([("x", [2, 4])], [("y", ["n", 4])], [("Relu", ["x"], ["y"])], "Input 'x'.*fixed at 2"),
        (
            [("x", [1, 4])],
            [("y", [4])],
            [("Squeeze", ["x"], ["y"])],  # every size-1 axis: the rows' too, at one row
            r"Input 'x'.*fixed at 1 on axis 0.*\(Squeeze\).*squeezes every size-1 axis",
        ),
        (
            [("x", ["n", 4])],
            [("y", ["n", 4])],
            [("ReduceSum", ["x"], ["y"])],
            r"\(ReduceSum\) \(on the rows of input 'x'\) reduces over the rows' axis",
        ),
        (
            [("x", ["n", 4]), ("sr", [])],
            [("y", ["n", 4])],
            [("Relu", ["x"], ["y"])],
            "Input 'sr'.*a scalar",
        ),
        (
            [("x", ["n", 4]), ("state", [2, "n", 8])],
            [("y", ["n", 4])],
            [("Relu", ["x"], ["y"])],
            "Input 'state'.*fixed at 2",
        ),
    ],
)
def test_a_model_that_cannot_batch_is_refused_naming_why(
    tmp_path: Path,
    inputs: list[tuple[str, list[Any]]],
    outputs: list[tuple[str, list[Any]]],
    nodes: list[tuple[str, list[str], list[str]]],
    match: str,
) -> None:
    graph = helper.make_graph(
        [helper.make_node(op, i, o) for op, i, o in nodes],
        "unbatchable",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    path = save_model(model, tmp_path / "m.onnx")
    with pytest.raises(sharedml.NotBatchableError, match=match):
        sharedml.SessionPool(path, sessions=1, batching=True)
    with sharedml.SessionPool(path, sessions=1) as pool:  # unbatched, it runs
        assert pool.batching is None


def test_a_declared_output_shape_is_not_trusted_over_the_graph(tmp_path: Path) -> None:
    # Declared [2, 4] (or [] by Paddle's exporter): the graph says Relu keeps x's rows.
    for declared in ([2, 4], []):
        graph = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"])],
            "relu",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, declared)],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        path = save_model(model, tmp_path / f"relu{len(declared)}.onnx")
        feeds = [np.full((2, 4), i - 1, np.float32) for i in range(3)]
        with sharedml.SessionPool(path, sessions=1, batching=True) as pool:
            outs = queue_behind_a_checkout(
                pool, [lambda f=f: pool.run(None, {"x": f}) for f in feeds]
            )
            assert pool.stats().batched_rows == 6 and pool.stats().batches == 1
        for f, out in zip(feeds, outs, strict=True):
            np.testing.assert_array_equal(out[0], np.maximum(f, 0))


def test_dynamic_quantization_is_refused_because_it_mixes_rows(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])],
        "dq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("q", TensorProto.UINT8, ["n", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    path = save_model(model, tmp_path / "dq.onnx")
    with pytest.raises(sharedml.NotBatchableError, match=r"DynamicQuantizeLinear.*one scale"):
        sharedml.SessionPool(path, sessions=1, batching=True)


def _sum_over_rows(tmp_path: Path) -> Path:
    # Declared [n, 4], but ReduceSum over axis 0 gives one row whatever the batch.
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)],
        "sum",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", 4])],
        initializer=[numpy_helper.from_array(np.array([0], np.int64), "axes")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return save_model(model, tmp_path / "sum.onnx")


def test_outputs_whose_rows_never_add_up_stop_merging_after_repeated_evidence(
    tmp_path: Path,
) -> None:
    # The analysis refuses this model; a caller who insists (rows_independent=True) gets the
    # runtime fallback: each merged run that does not split is rerun one by one, and after
    # a few such runs the pool stops merging.
    path = _sum_over_rows(tmp_path)
    with pytest.raises(sharedml.NotBatchableError, match="ReduceSum"):
        sharedml.SessionPool(path, sessions=1, batching=True)
    batching = sharedml.Batching(rows_independent=True)
    with sharedml.SessionPool(path, sessions=1, batching=batching) as pool:
        for round_ in range(3):
            feeds = [np.full((2, 4), 3 * round_ + i, np.float32) for i in range(3)]
            calls = [lambda f=f: pool.run(None, {"x": f}) for f in feeds]
            if round_ < 2:
                outs = queue_behind_a_checkout(pool, calls)
                assert pool.batching is not None, "one odd batch must not stop merging"
            else:
                with pytest.warns(RuntimeWarning, match="stops merging"):
                    outs = queue_behind_a_checkout(pool, calls)
                assert pool.batching is None and not pool.stats().batching
                assert "stopped merging" in pool.batching_reason
            for f, out in zip(feeds, outs, strict=True):
                np.testing.assert_array_equal(out[0], f.sum(axis=0, keepdims=True))


def test_a_model_that_mixes_rows_despite_the_callers_word_is_caught_by_the_first_merge(
    tmp_path: Path,
) -> None:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=0)],
        "softmax0",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    path = save_model(model, tmp_path / "softmax0.onnx")
    batching = sharedml.Batching(rows_independent=True)
    same = [np.ones((1, 4), np.float32)] * 2
    distinct = [np.zeros((1, 4), np.float32), np.full((1, 4), 3, np.float32)]
    with sharedml.SessionPool(path, sessions=1, batching=batching) as pool:
        # Equal rows prove nothing (softmax over two equal rows is 0.5 both ways): not checked.
        queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, {"x": f}) for f in same])
        assert pool.stats().batch_checks == 0 and pool.batching is not None
        with pytest.warns(RuntimeWarning, match="other values than running its request alone"):
            outs = queue_behind_a_checkout(
                pool, [lambda f=f: pool.run(None, {"x": f}) for f in distinct]
            )
        stats = pool.stats()
        assert pool.batching is None and "stopped merging" in pool.batching_reason
        assert stats.batch_checks == 1 and stats.batch_mismatches == 1
        # Every caller got its own solo result: softmax over its one row.
        for out in outs:
            np.testing.assert_array_equal(out[0], np.ones((1, 4), np.float32))
        # From then on requests run alone.
        outs = queue_behind_a_checkout(
            pool, [lambda f=f: pool.run(None, {"x": f}) for f in distinct]
        )
        for out in outs:
            np.testing.assert_array_equal(out[0], np.ones((1, 4), np.float32))
        assert pool.stats().batches == stats.batches


def test_merged_batches_are_checked_first_and_then_within_check_within(model: Path) -> None:
    def three_batches(pool: sharedml.SessionPool) -> sharedml.PoolStats:
        for seed in range(3):
            outs = queue_behind_a_checkout(
                pool,
                [lambda s=s: pool.run(None, feed(2, s)) for s in range(10 * seed, 10 * seed + 3)],
            )
            assert all(not isinstance(o, BaseException) for o in outs)
        return pool.stats()

    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        assert "analysis proved" in pool.batching_reason
        stats = three_batches(pool)
        assert 1 <= stats.batch_checks <= 3 and stats.batch_mismatches == 0
        assert stats.batches == 3 and pool.batching is not None
    # check_within=1: every merged batch (a spot check after the first, full one); None: the
    # first only, once it could have shown a leak.
    with sharedml.SessionPool(
        model, sessions=1, batching=sharedml.Batching(check_within=1)
    ) as pool:
        stats = three_batches(pool)
        assert (stats.batch_checks, stats.check_runs) == (3, 3 + 1 + 1)
    with sharedml.SessionPool(
        model, sessions=1, batching=sharedml.Batching(check_within=None)
    ) as pool:
        stats = three_batches(pool)
        assert (stats.batch_checks, stats.check_runs) == (1, 3)
        assert 0 < stats.check_seconds < stats.run_seconds


def _leaks_above(path: Path, threshold: float) -> Path:
    """y = x + the batch's column sums of relu(x - threshold): rows mix only above it."""
    graph = helper.make_graph(
        [
            helper.make_node("Sub", ["x", "t"], ["shifted"]),
            helper.make_node("Relu", ["shifted"], ["over"]),
            helper.make_node("ReduceSum", ["over", "axes"], ["total"], keepdims=1),
            helper.make_node("Add", ["x", "total"], ["y"]),
        ],
        "leaks_above",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        initializer=[
            numpy_helper.from_array(np.array(threshold, np.float32), "t"),
            numpy_helper.from_array(np.array([0], np.int64), "axes"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return save_model(model, path)


@pytest.mark.parametrize("priming", ["settled", "zeros", "zero-sum"])
def test_a_leak_is_caught_within_check_within_batches_whatever_came_first(
    tmp_path: Path, priming: str
) -> None:
    # A model that mixes rows only for values above 10 (taken on the caller's word): batches
    # below it settle the class (or, zeros and zero-sum rows, prove nothing), then every batch
    # leaks. A check must come within check_within of them (UNTOLD_GAP after harmless rows),
    # give that batch's callers their solo results, and stop merging.
    path = _leaks_above(tmp_path / "leaks.onnx", 10.0)
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    batching = sharedml.Batching(max_delay_ms=0, rows_independent=True, check_within=16)
    within = 16 if priming == "settled" else UNTOLD_GAP

    def prime(b: int) -> list[np.ndarray]:
        if priming == "zeros":
            return [np.zeros((1, 4), np.float32), np.full((1, 4), 1e-7 * (b + 1), np.float32)]
        if priming == "zero-sum":
            row = rng.uniform(1, 5, (1, 4)).astype(np.float32)
            return [np.concatenate([row, -row]), np.array([[1, -1, 2, -2]] * 2, np.float32)]
        return [rng.uniform(0, 5, (1, 4)).astype(np.float32) for _ in range(2)]

    with sharedml.SessionPool(path, sessions=1, batching=batching) as pool:
        for b in range(24):
            queue_behind_a_checkout(pool, [lambda x=x: pool.run(None, {"x": x}) for x in prime(b)])
        assert pool.stats().batch_mismatches == 0 and pool.batching is not None
        shapes = [x.shape for x in prime(0)]
        for _ in range(within):
            inputs = [rng.uniform(20, 30, shape).astype(np.float32) for shape in shapes]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs = queue_behind_a_checkout(
                    pool, [lambda x=x: pool.run(None, {"x": x}) for x in inputs]
                )
            if pool.stats().batch_mismatches:
                break
        else:
            pytest.fail(f"{within} leaking batches in a row went unchecked")
        assert any("other values than running its request alone" in str(w.message) for w in caught)
        assert pool.batching is None and not pool.stats().batching
    for x, out in zip(inputs, outs, strict=True):
        np.testing.assert_array_equal(out[0], plain.run(None, {"x": x})[0])


def test_a_request_of_zero_rows_runs_alone_and_never_stops_merging(model: Path) -> None:
    # Padding on (the GPU default): a zero-row request once made the pool pad an empty batch,
    # see outputs that did not split, and stop merging for good.
    batching = sharedml.Batching(pad_to_buckets=True, max_batch_size=8)
    empty = {k: v[:0] for k, v in feed(1, 0).items()}
    with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
        for round_ in range(4):
            assert pool.run(None, empty)[0].shape == (0, DIM)  # alone, on an idle pool
            calls = [
                lambda: pool.run(None, empty),
                *(lambda s=s: pool.run(None, feed(1, s)) for s in range(3)),
            ]
            outs = queue_behind_a_checkout(pool, calls)
            assert outs[0][0].shape == (0, DIM), round_
            assert all(out[0].shape == (1, DIM) for out in outs[1:]), round_
        stats = pool.stats()
        assert pool.batching is not None and stats.batching
        assert stats.padded_rows == 4  # the 3 real rows of each batch padded to 4, nothing else


def test_max_delay_waits_for_a_second_request_to_fill_the_batch(model: Path) -> None:
    batching = sharedml.Batching(max_batch_size=2, max_delay_ms=DEADLINE_S * 1000)
    with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
        results: list[Any] = []
        first = threading.Thread(target=lambda: results.append(pool.run(None, feed(1, 0))))
        first.start()
        wait_until(lambda: pool.stats().busy == 1, what="the first request to hold the session")
        assert pool.stats().batches == 0  # waiting to fill, not run
        second = pool.run(None, feed(1, 1))  # fills the batch: both run now, not after the delay
        first.join(DEADLINE_S)
        stats = pool.stats()
    assert len(results) == 1 and second[0].shape == (1, DIM)
    assert (stats.batches, stats.max_batch_rows) == (1, 2)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
def test_ctrl_c_in_a_leader_filling_its_batch_fails_only_its_own_request(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray], sigint_raises: None
) -> None:
    # The main thread leads a batch that is still filling (1 row of 3, a long delay) and has
    # taken a second caller's row when Ctrl-C arrives. The KeyboardInterrupt is the main
    # thread's alone: the row it took goes back to the queue, the session comes back, and the
    # next request fills a batch with that row.
    batching = sharedml.Batching(max_batch_size=3, max_delay_ms=DEADLINE_S * 1000)
    pool = sharedml.SessionPool(model, sessions=1, batching=batching)
    feeds = [feed(1, 0), feed(1, 1), feed(2, 2)]
    results: dict[int, Any] = {}

    def run(i: int) -> threading.Thread:
        def call() -> None:
            results[i] = pool.run(None, feeds[i])

        thread = threading.Thread(target=call, daemon=True)  # broken code leaves it hanging
        thread.start()
        return thread

    def interrupt_the_leader() -> None:
        wait_until(lambda: pool.stats().busy == 1, what="the main thread to lead")
        run(1)
        wait_until(
            lambda: (pool.stats().waits, pool.stats().waiting) == (1, 0),
            what="the leader to take the second request",
        )
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    interrupter = threading.Thread(target=interrupt_the_leader)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            pool.run(None, feeds[0])
        interrupter.join(DEADLINE_S)
        run(2)
        wait_until(lambda: len(results) == 2, what="both other requests to finish")
        stats = pool.stats()
    finally:
        pool.close(timeout_s=1)
    for i in (1, 2):
        np.testing.assert_array_equal(results[i][0], solo(feeds[i]))
    assert (stats.busy, stats.waiting, stats.runs, stats.failed_runs) == (0, 0, 3, 1)
    assert (stats.batches, stats.max_batch_rows) == (1, 3)


def test_a_leader_stops_waiting_when_the_next_request_cannot_fit(model: Path) -> None:
    # First come, first served: the 4-row request cannot join a batch of 1 + 4 > 4 rows, and
    # nothing behind it may pass it, so waiting for more rows could only add latency.
    batching = sharedml.Batching(max_batch_size=4, max_delay_ms=2000)
    with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
        results = queue_behind_a_checkout(
            pool, [lambda: pool.run(None, feed(1, 0)), lambda: pool.run(None, feed(4, 1))]
        )
        stats = pool.stats()
    assert [r[0].shape for r in results] == [(1, DIM), (4, DIM)]
    assert stats.batches == 2
    assert stats.fill_wait_seconds < 1.0  # the first leader did not wait the 2 s out


def test_adaptive_delay_waits_after_a_batch_and_never_after_a_lone_request(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        pool.run(None, feed(1, 0))
        pool.run(None, feed(1, 1))  # the latest batch had one row: nothing more is expected
        assert pool.stats().fill_wait_seconds == 0.0
        queue_behind_a_checkout(pool, [lambda s=s: pool.run(None, feed(1, s)) for s in range(4)])
        assert pool.stats().fill_wait_seconds == 0.0  # four were queued: no need to wait
        pool.run(None, feed(1, 5))  # expects four rows: waits (half a run at most), runs alone
        waited = pool.stats()
        pool.run(None, feed(1, 6))  # after a lone request: runs at once
        stats = pool.stats()
    assert waited.fill_wait_seconds > 0.0
    assert stats.fill_wait_seconds == waited.fill_wait_seconds
    assert (stats.batches, stats.batched_rows) == (5, 8)


def test_max_delay_zero_never_waits(model: Path) -> None:
    batching = sharedml.Batching(max_delay_ms=0)
    with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
        queue_behind_a_checkout(pool, [lambda s=s: pool.run(None, feed(1, s)) for s in range(4)])
        pool.run(None, feed(1, 5))
        stats = pool.stats()
    assert (stats.batches, stats.max_batch_rows, stats.fill_wait_seconds) == (2, 4, 0.0)


ONE_ROW = {"x": np.ones((1, 4), np.float32)}


@contextlib.contextmanager
def probe_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **options: Any
) -> Iterator[tuple[sharedml.SessionPool, ModuleType]]:
    """A pool over ``_overlap``'s probe model (each run takes a second; a SLOW row: SLOW_S),
    and the ``_overlap`` module, whose ``DETECTOR`` records the rows of every run.

    Every session exists before the pool is handed over, and the record is empty.
    """
    pytest.importorskip("onnxruntime_extensions")
    import _overlap

    monkeypatch.setattr(_overlap, "SLEEP_S", 1.0)
    probe = _overlap.probe_model(tmp_path / "probe.onnx")
    batching = options.pop("batching", None)
    if batching is True:
        batching = _overlap.BATCHING
    elif isinstance(batching, sharedml.Batching):
        batching = dataclasses.replace(batching, rows_independent=True)
    options["batching"] = batching
    with sharedml.SessionPool(
        probe, prepacking="off", configure=_overlap.register, **options
    ) as pool:
        pool.wait_ready()
        _overlap.DETECTOR.reset()
        yield pool, _overlap


def test_looping_callers_meet_in_one_batch_instead_of_a_lone_run_and_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pattern the adaptive delay is for: four callers got their rows back from one batch and
    # come back one by one. The first finds the session free; it waits for the other three
    # (for at most half a run: 0.5 s here) instead of running alone while they queue.
    with probe_pool(tmp_path, monkeypatch, sessions=1, batching=True) as (pool, overlap):
        queue_behind_a_checkout(pool, [lambda: pool.run(None, ONE_ROW)] * 4)
        first = threading.Thread(target=pool.run, args=(None, ONE_ROW))
        first.start()
        wait_until(lambda: pool.stats().busy == 1, what="the first caller to take the session")
        rest = [threading.Thread(target=pool.run, args=(None, ONE_ROW)) for _ in range(3)]
        for t in rest:
            t.start()
        for t in [first, *rest]:
            t.join(DEADLINE_S)
    assert overlap.DETECTOR.rows == [4, 4]


@pytest.mark.parametrize(("batching", "rows"), [(False, [1, 1, 1, 1]), (True, [1, 3])])
def test_run_seconds_are_the_pools_runs_and_not_a_checkouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batching: bool, rows: list[int]
) -> None:
    # Every Run here spends a second in the probe op. A checkout's Run is the caller's own
    # work; the three requests after it are the pool's (merged, or one after another).
    with probe_pool(tmp_path, monkeypatch, sessions=1, batching=batching) as (pool, overlap):
        with pool.session() as sess:
            sess.run(None, ONE_ROW)
        queue_behind_a_checkout(pool, [lambda: pool.run(None, ONE_ROW)] * 3)
        stats = pool.stats()
    runs = overlap.DETECTOR.runs
    assert [r[1] for r in runs] == rows
    in_op = sum(end - start for _, _, start, end in runs[1:])
    assert in_op <= stats.run_seconds < in_op + 0.5


def test_sessions_that_share_rows_split_the_queue_instead_of_one_taking_it_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Session A runs a lone request for a second, session B a slow one for three, while four
    # more queue. When A is back, the rows in play are its leader's, three queued and B's one:
    # A takes its share, three (not all four), and the fourth is left for the next session
    # free (A again, as B is still busy), which runs it alone. Both sessions exist before the
    # first request (probe_pool): B's run of the slow row starts at once.
    batching = sharedml.Batching(share_rows=True)
    with probe_pool(tmp_path, monkeypatch, sessions=2, batching=batching) as (pool, overlap):
        slow_row = {"x": np.full((1, 4), overlap.SLOW, np.float32)}
        threads = []
        for i, f in enumerate([ONE_ROW, slow_row, ONE_ROW, ONE_ROW, ONE_ROW, ONE_ROW]):
            threads.append(threading.Thread(target=pool.run, args=(None, f)))
            threads[-1].start()
            if i < 2:
                wait_until(lambda i=i: pool.stats().busy == i + 1, what=f"lone run {i}")
            else:
                wait_until(lambda i=i: pool.stats().waiting == i - 1, what=f"request {i}")
        for t in threads:
            t.join(DEADLINE_S)
    assert overlap.DETECTOR.rows == [1, 1, 3, 1]


def test_rows_are_shared_on_gpus_and_never_on_the_cpu_or_when_runs_are_serialized() -> None:
    default = sharedml.Batching()
    assert default.shares_rows("CUDAExecutionProvider")
    assert default.shares_rows("DmlExecutionProvider") is True
    assert not default.shares_rows("DmlExecutionProvider", serialized=True)
    assert not default.shares_rows("CPUExecutionProvider")
    assert sharedml.Batching(share_rows=True).shares_rows("CPUExecutionProvider")
    assert not sharedml.Batching(share_rows=False).shares_rows("CUDAExecutionProvider")
    assert not sharedml.Batching(max_delay_ms=1).shares_rows("CUDAExecutionProvider")


def test_run_async_requests_queue_without_threads_and_merge(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    async def main(pool: sharedml.SessionPool) -> list[Any]:
        pending = [asyncio.ensure_future(pool.run_async(None, feed(1, s))) for s in range(12)]
        return await asyncio.wait_for(asyncio.gather(*pending), DEADLINE_S)

    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        held, release = threading.Event(), threading.Event()

        def holder() -> None:
            with pool.session():
                held.set()
                wait_until(lambda: pool.stats().waiting == 12, what="12 async requests to queue")
                release.set()

        thread = threading.Thread(target=holder)
        thread.start()
        assert held.wait(DEADLINE_S)
        threads_before = threading.active_count()
        outs = asyncio.run(main(pool))
        thread.join(DEADLINE_S)
        stats = pool.stats()
    assert threading.active_count() <= threads_before + 1  # queued as futures, not threads
    assert stats.batches == 1 and stats.batched_rows == 12
    for seed, out in enumerate(outs):
        np.testing.assert_allclose(out[0], solo(feed(1, seed)), rtol=1e-5, atol=1e-6)


def test_cancelled_run_async_callers_leave_their_batch_and_never_run(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    feeds = [feed(1, s) for s in range(6)]
    gone = {0, 3}

    async def poll(predicate: Callable[[], bool], what: str) -> None:
        deadline = asyncio.get_running_loop().time() + DEADLINE_S
        while not predicate():
            assert asyncio.get_running_loop().time() < deadline, f"timed out: {what}"
            await asyncio.sleep(0.001)

    async def main(pool: sharedml.SessionPool) -> list[Any]:
        barrier = asyncio.Barrier(len(feeds))

        async def call(f: dict[str, np.ndarray]) -> Any:
            await barrier.wait()
            return await pool.run_async(None, f)

        with pool.session():
            tasks = [asyncio.ensure_future(call(f)) for f in feeds]
            await poll(lambda: pool.stats().waiting == 6, "every caller to queue")
            for i in gone:
                tasks[i].cancel()
            await poll(lambda: pool.stats().waiting == 4, "the cancelled to leave the queue")
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), DEADLINE_S)

    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        outs = asyncio.run(main(pool))
        wait_until(lambda: pool.stats().busy == 0, what="the session to come back")
        stats = pool.stats()
        assert (stats.batches, stats.batched_rows, stats.cancelled) == (1, 4, 2)  # 4 rows ran
        assert (stats.waiting, stats.busy, stats.failed_runs) == (0, 0, 0)
        later = queue_behind_a_checkout(
            pool, [lambda s=s: pool.run(None, feed(1, s)) for s in (7, 8)]
        )
        assert pool.stats().batches == 2  # a later batch still forms
    for i, (f, out) in enumerate(zip(feeds, outs, strict=True)):
        if i in gone:
            assert isinstance(out, asyncio.CancelledError)
        else:
            np.testing.assert_allclose(out[0], solo(f), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(later[1][0], solo(feed(1, 8)), rtol=1e-5, atol=1e-6)


def test_close_fails_queued_requests_and_finishes_the_batch_in_flight(model: Path) -> None:
    with (
        sharedml.SessionPool(model, sessions=1, batching=True) as pool,
        contextlib.ExitStack() as stack,
    ):
        held = pool.session()
        held.__enter__()
        stack.callback(lambda: pool.stats().busy and held.__exit__(None, None, None))
        outcomes: list[Any] = []
        threads = [
            threading.Thread(target=lambda s=s: outcomes.append(_call(pool, feed(1, s))))
            for s in range(3)
        ]
        for t in threads:
            t.start()
        wait_until(lambda: pool.stats().waiting == 3, what="three requests to queue")
        closer = threading.Thread(target=pool.close)
        closer.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert all(isinstance(o, sharedml.PoolClosedError) for o in outcomes), outcomes
        assert closer.is_alive()  # the checkout is still held
        held.__exit__(None, None, None)
        closer.join(DEADLINE_S)
        assert not closer.is_alive() and pool.closed


def _call(pool: sharedml.SessionPool, f: dict[str, np.ndarray]) -> Any:
    try:
        return pool.run(None, f)
    except BaseException as exc:
        return exc


# --------------------------------------------------------------------------------------------
# Any arrival pattern: every good request gets exactly a solo run's rows, every bad one fails


@st.composite
def arrivals(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """(kind, rows, seed) per caller, in arrival order; kind is good, bad-shape or bad-dtype."""
    n = draw(st.integers(2, 10))
    return [
        (
            draw(st.sampled_from(["good", "good", "good", "bad-shape", "bad-dtype"])),
            draw(st.integers(1, 5)),
            seed,
        )
        for seed in range(n)
    ]


def _request(kind: str, rows: int, seed: int) -> dict[str, np.ndarray]:
    f = feed(rows, seed)
    if kind == "bad-shape":
        f["x"] = np.ones((rows, DIM + 1), np.float32)
    elif kind == "bad-dtype":
        f["x"] = f["x"].astype(np.float64)
    return f


# Patterns that merge whatever the timing: every caller queued behind the held sessions, and
# their rows fit one batch. Whether a drawn pattern merges depends on the draw (rows that do not
# fit together, callers that never queue), which left as few as 6 of 50 merging in a CI run.
MERGING = [
    [("good", 1, 0), ("good", 1, 1), ("good", 1, 2), ("good", 1, 3)],
    [("good", 2, 0), ("bad-shape", 1, 1), ("good", 3, 2), ("good", 1, 3)],
    [("good", 1, 0), ("good", 1, 1), ("bad-dtype", 2, 2), ("good", 1, 3), ("good", 2, 4)],
]


@settings(max_examples=50, deadline=None)
@example(pattern=MERGING[0], max_rows=8, queued=4)
@example(pattern=MERGING[1], max_rows=8, queued=4)
@example(pattern=MERGING[2], max_rows=8, queued=5)
@given(pattern=arrivals(), max_rows=st.integers(1, 8), queued=st.integers(0, 10))
def _every_caller_gets_its_own_rows(
    merged: list[bool],
    model: Path,
    solo: Callable[[dict[str, np.ndarray]], np.ndarray],
    pattern: list[tuple[str, int, int]],
    max_rows: int,
    queued: int,
) -> None:
    """The first ``queued`` callers queue behind a checkout; the rest arrive as they come."""
    batching = sharedml.Batching(max_batch_size=max_rows)
    with sharedml.SessionPool(model, sessions=2, batching=batching) as pool:
        results: list[Any] = [None] * len(pattern)
        finished: list[int] = []

        def call(i: int) -> None:
            results[i] = _call(pool, _request(*pattern[i]))
            finished.append(i)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(pattern))]
        with contextlib.ExitStack() as held:  # released even if a wait below fails
            held.enter_context(pool.session())
            held.enter_context(pool.session())
            for i, t in enumerate(threads[:queued]):
                t.start()
                wait_until(lambda i=i: pool.stats().waiting + len(finished) == i + 1)
        for t in threads[queued:]:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
            assert not t.is_alive()
        stats = pool.stats()
    assert stats.busy == 0 and stats.waiting == 0
    # A mismatch would have been hidden: the pool hands out solo results once it sees one.
    assert stats.batch_mismatches == 0
    for (kind, rows, seed), out in zip(pattern, results, strict=True):
        if kind == "good":
            assert isinstance(out, list), out
            np.testing.assert_allclose(out[0], solo(feed(rows, seed)), rtol=1e-5, atol=1e-6)
        else:
            assert isinstance(out, sharedml.InvalidInputError), (kind, out)
    good = sum(kind == "good" for kind, _, _ in pattern)
    # Fewer runs than good requests: some run held several. Most patterns never merge (rows
    # that do not fit together, callers that never queue): steer the search towards those that do.
    merged.append(stats.batches < good)
    target(float(good - stats.batches), label="requests that shared a run")


def test_any_arrival_pattern_gives_every_caller_its_own_rows(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    merged: list[bool] = []
    _every_caller_gets_its_own_rows(merged, model, solo)
    # Patterns that never merged would pass with batching broken or off: the explicit ones
    # (MERGING) merge whatever the timing, and drawn ones add to them.
    assert sum(merged) >= len(MERGING), f"{sum(merged)} of {len(merged)} patterns merged requests"


def test_padded_batches_run_at_a_bucket_and_give_each_caller_its_rows(
    model: Path, solo: Callable[[dict[str, np.ndarray]], np.ndarray]
) -> None:
    batching = sharedml.Batching(max_batch_size=8, pad_to_buckets=True)
    with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
        feeds = [feed(rows, seed) for seed, rows in enumerate([1, 3, 1])]  # 5 rows: run as 8
        outs = queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, f) for f in feeds])
        alone = feed(3, 9)
        (lone,) = pool.run(None, alone)  # 3 rows: run as 4
        (full,) = pool.run(None, feed(8, 10))  # a bucket already: as it is
        stats = pool.stats()
    assert (stats.batches, stats.batched_rows, stats.padded_rows) == (3, 16, 4)
    for f, (y,) in [*zip(feeds, outs, strict=True), (alone, (lone,))]:
        assert y.shape == (f["x"].shape[0], DIM)
        np.testing.assert_allclose(y, solo(f), rtol=1e-5, atol=1e-6)
    assert full.shape == (8, DIM)


def test_padding_repeats_the_last_real_row() -> None:
    from sharedml.pool._batching import Request, merge, split

    ids = [np.array([[5, 6]]), np.array([[7, 8], [9, 10]])]
    requests = [Request(None, {"ids": x}, None, len(x), "k") for x in ids]
    merged = merge(requests, rows=4)["ids"]
    np.testing.assert_array_equal(merged, [[5, 6], [7, 8], [9, 10], [9, 10]])  # no zero ids
    parts = split([merged * 2], requests, rows=4)
    assert parts is not None
    np.testing.assert_array_equal(parts[1][0], [[14, 16], [18, 20]])
    assert split([merged], requests) is None  # unpadded rows expected: 3, not 4


def test_padding_is_on_where_kernels_are_chosen_per_shape() -> None:
    default = sharedml.Batching()
    assert not default.pads("CPUExecutionProvider")
    assert default.pads("CUDAExecutionProvider") and default.pads("DmlExecutionProvider")
    assert not sharedml.Batching(pad_to_buckets=False).pads("CUDAExecutionProvider")
    assert sharedml.Batching(pad_to_buckets=False).pads("CUDAExecutionProvider", cuda_graphs=True)
    assert sharedml.Batching(max_batch_size=12).buckets() == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="pad_to_buckets"):
        sharedml.Batching(pad_to_buckets="yes")  # type: ignore[arg-type]


def test_warm_up_runs_every_bucket_when_batches_are_padded(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime_extensions")
    from _overlap import DETECTOR, probe_model, register

    probe = probe_model(tmp_path / "probe.onnx")
    batching = sharedml.Batching(max_batch_size=8, pad_to_buckets=True, rows_independent=True)
    with sharedml.SessionPool(
        probe, sessions=2, batching=batching, prepacking="off", configure=register
    ) as pool:
        DETECTOR.reset()
        pool.warm_up({"x": np.ones((1, 4), np.float32)})
        assert sorted(DETECTOR.rows) == [1, 1, 2, 2, 4, 4, 8, 8]  # every bucket, each session
        DETECTOR.reset()
        pool.run(None, {"x": np.ones((3, 4), np.float32)})
        assert DETECTOR.rows == [4]  # what ORT ran: the bucket


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_delay_ms", 1e300),  # accepted once, then every run raised OverflowError
        ("max_delay_ms", 60_001),
        ("max_delay_ms", float("inf")),
        ("max_delay_ms", float("nan")),
        ("max_delay_ms", -1),
        ("max_delay_ms", "5"),
        ("max_delay_ms", True),
        ("max_batch_size", 0),
        ("max_batch_size", 2.0),
        ("max_batch_size", (1 << 20) + 1),
        ("max_batch_size", True),
        ("max_batch_size", "8"),
        ("pad_to_buckets", 1),
        ("session_per_bucket", "yes"),
        ("share_rows", 0),
        ("copy_outputs", None),
        ("rows_independent", 1),
        ("required", "auto"),
        ("check_within", 0),
        ("check_within", 1.5),
        ("check_within", False),
    ],
)
def test_every_batching_field_is_checked_when_written(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^Batching\({field}=.*\): {field} must be"):
        sharedml.Batching(**{field: value})


def test_batching_takes_numpy_numbers_and_the_largest_values_it_allows(model: Path) -> None:
    batching = sharedml.Batching(
        max_batch_size=np.int64(4),
        max_delay_ms=np.float32(60_000),
        share_rows=np.bool_(False),
        check_within=np.int32(1 << 20),
    )
    assert batching == sharedml.Batching(
        max_batch_size=4, max_delay_ms=60_000.0, share_rows=False, check_within=1 << 20
    )
    assert type(batching.max_batch_size) is int and type(batching.share_rows) is bool
    with sharedml.SessionPool(model, sessions=1, batching=batching) as pool:
        # A full batch runs at once, however long the delay.
        queue_behind_a_checkout(pool, [lambda s=s: pool.run(None, feed(1, s)) for s in range(4)])
        assert pool.stats().batches == 1


def test_each_batching_spelling_has_one_meaning() -> None:
    assert sharedml.Batching.parse(True) == sharedml.Batching()
    assert sharedml.Batching.parse(False) is None
    assert sharedml.Batching.parse("auto") == "auto"
    custom = sharedml.Batching(max_batch_size=4)
    assert sharedml.Batching.parse(custom) is custom
    for other in ("on", "AUTO", 1, 0):
        with pytest.raises(ValueError, match=r"'auto', True, False or a sharedml\.Batching"):
            sharedml.Batching.parse(other)


def test_batching_none_is_refused_naming_false_and_the_default(model: Path) -> None:
    said = r"not None \(False: no batching; leave the argument out for the pool's default\)"
    with pytest.raises(ValueError, match=said):
        sharedml.Batching.parse(None)
    with pytest.raises(ValueError, match=said):
        sharedml.SessionPool(model, sessions=1, batching=None)  # type: ignore[arg-type]


def test_auto_merges_wherever_the_model_is_proven_batchable(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1, batching="auto") as pool:
        assert pool.batching == sharedml.Batching()
        assert "row-independence analysis proved" in pool.batching_reason


_DTYPES = [np.float32, np.float64, np.int64, np.int32, np.uint8, np.bool_, np.object_]


@settings(max_examples=300, deadline=None)
@given(
    want_dtype=st.sampled_from([*_DTYPES, None]),
    want_shape=st.none() | st.lists(st.none() | st.integers(0, 3), max_size=3).map(tuple),
    got_dtype=st.sampled_from([*_DTYPES, np.dtype(">f4"), np.dtype("<U3")]),
    got_shape=st.lists(st.integers(0, 3), max_size=3).map(tuple),
)
def test_a_request_is_refused_exactly_where_the_full_check_refuses_it(
    want_dtype: Any, want_shape: Any, got_dtype: Any, got_shape: tuple[int, ...]
) -> None:
    # Requests pass a quick test first and go through the full check only where it fails:
    # the two must never disagree, in what they let through or in what they say.
    spec = _batching._Input("x", "tensor", want_dtype, want_shape)
    signature = _batching.Signature({"x": spec}, ("y",))
    value = np.zeros(got_shape, got_dtype)
    said: list[str | None] = []
    for check in (
        lambda: _batching.Signature._check(spec, value),
        lambda: signature.request(None, {"x": value}, None),
    ):
        try:
            check()
            said.append(None)
        except sharedml.InvalidInputError as exc:
            said.append(str(exc))
    assert said[0] == said[1]


def test_batching_not_required_is_auto_with_its_own_settings(model: Path, tmp_path: Path) -> None:
    settings = sharedml.Batching(max_batch_size=4, copy_outputs=False, required=False)
    with sharedml.SessionPool(model, sessions=1, batching=settings) as pool:
        assert pool.batching == settings
        outs = queue_behind_a_checkout(
            pool, [lambda s=s: pool.run(None, feed(1, s)) for s in range(6)]
        )
        assert pool.stats().max_batch_rows == 4
        assert all(not out[0].flags.owndata for out in outs)  # views: copy_outputs=False
    mixing = _sum_over_rows(tmp_path)
    with sharedml.SessionPool(mixing, sessions=1, batching=settings) as pool:
        assert pool.batching is None and not pool.stats().batching
        assert "ReduceSum" in pool.batching_reason
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(pool.run(None, {"x": x})[0], x.sum(axis=0, keepdims=True))
    with pytest.raises(sharedml.NotBatchableError, match="ReduceSum"):
        sharedml.SessionPool(
            mixing, sessions=1, batching=dataclasses.replace(settings, required=True)
        )


# ----------------------------------------------------------------------------------------------
# Models exported with axis 0 fixed at 1


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("kind", ["mlp", "conv"])
@pytest.mark.parametrize("batching", [True, "auto"])
def test_a_model_fixed_at_one_row_is_served_batched_and_merged_rows_equal_solo_runs(
    tmp_path: Path, kind: str, batching: Any
) -> None:
    from _models import conv_model

    if kind == "mlp":
        dynamic = batchable_model(tmp_path / "d.onnx", dim=DIM, extra_input=True)
        feeds = [{k: v[:1] for k, v in feed(1, seed).items()} for seed in range(4)]
    else:
        dynamic = conv_model(tmp_path / "d.onnx")
        rng = np.random.default_rng(0)
        feeds = [{"x": rng.standard_normal((1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    path = fixed_at_one(dynamic, tmp_path / "fixed.onnx")
    before = _sha256(path)
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with sharedml.SessionPool(path, sessions=1, batching=batching) as pool:
        assert pool.batching is not None
        assert "relaxed" in pool.batching_reason and "fixes axis 0 at 1" in pool.batching_reason
        assert pool.source_path == path and pool.model_path.parent != path.parent
        outs = queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, f) for f in feeds])
        stats = pool.stats()
        with pytest.raises(sharedml.InvalidInputError, match="must have 1 on axis 0"):
            pool.run(None, {k: np.concatenate([v, v]) for k, v in feeds[0].items()})
    assert stats.batches == 1 and stats.max_batch_rows == 4
    assert stats.batch_checks == 1 and stats.batch_mismatches == 0  # the pool's own check
    for f, out in zip(feeds, outs, strict=True):
        np.testing.assert_allclose(out[0], plain.run(None, f)[0], rtol=1e-5, atol=1e-6)
    assert _sha256(path) == before  # the model as given is never written


def _zipmap_classifier(path: Path, features: int = 16, classes: int = 3) -> Path:
    """A scikit-learn-style classifier: LinearClassifier (softmax) + ZipMap, as skl2onnx writes.

    Outputs: ``label`` [N] and ``probabilities``, a sequence of one {class: probability} map
    per row (ONNX-ML ``seq(map(int64, float))``).
    """
    coefficients = np.random.default_rng(0).standard_normal((classes, features))
    labels = list(range(classes))
    graph = helper.make_graph(
        [
            helper.make_node(
                "LinearClassifier",
                ["x"],
                ["label", "scores"],
                domain="ai.onnx.ml",
                classlabels_ints=labels,
                coefficients=coefficients.astype(np.float32).ravel().tolist(),
                intercepts=[0.1 * c for c in labels],
                post_transform="SOFTMAX",
                multi_class=1,
            ),
            helper.make_node(
                "ZipMap",
                ["scores"],
                ["probabilities"],
                domain="ai.onnx.ml",
                classlabels_int64s=labels,
            ),
        ],
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", features])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, ["n"]),
            helper.make_value_info(
                "probabilities",
                helper.make_sequence_type_proto(
                    helper.make_map_type_proto(
                        TensorProto.INT64, helper.make_tensor_type_proto(TensorProto.FLOAT, [])
                    )
                ),
            ),
        ],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("ai.onnx.ml", 3)],
    )
    model.ir_version = 8
    return save_model(model, path)


def test_a_zipmap_classifier_stays_batched_and_its_maps_match_solo_runs(tmp_path: Path) -> None:
    # Merged runs compute the probabilities with other kernel blockings (they differ from solo
    # runs by ~1e-7): the check compares maps' values as floats, their keys exactly.
    path = _zipmap_classifier(tmp_path / "classifier.onnx")
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    batching = sharedml.Batching(check_within=1)  # every merged batch checked
    with sharedml.SessionPool(path, sessions=1, batching=batching) as pool:
        assert pool.batching is not None, pool.batching_reason
        for _ in range(3):
            feeds = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(16)]
            outs = queue_behind_a_checkout(pool, [lambda f=f: pool.run(None, f) for f in feeds])
            for f, out in zip(feeds, outs, strict=True):
                label, maps = plain.run(None, f)
                np.testing.assert_array_equal(out[0], label)
                assert [sorted(m) for m in out[1]] == [sorted(m) for m in maps]
                for got, want in zip(out[1], maps, strict=True):
                    np.testing.assert_allclose(
                        [got[k] for k in want], list(want.values()), rtol=0, atol=1e-6
                    )
        stats = pool.stats()
    assert pool.batching is not None and stats.batching
    assert (stats.batches, stats.batch_checks, stats.batch_mismatches) == (3, 3, 0)


def test_maps_and_sequences_compare_within_tolerance_and_keys_exactly() -> None:
    from sharedml.pool._batching import same_results

    solo = [np.array([1, 0]), [{0: 0.25, 1: 0.75}, {0: 0.5, 1: 0.5}]]
    close = [np.array([1, 0]), [{0: 0.25 + 2e-8, 1: 0.75 - 2e-8}, {0: 0.5, 1: 0.5}]]
    assert same_results(close, solo, rtol=1e-3)
    for other in (
        [{0: 0.3, 1: 0.75}, {0: 0.5, 1: 0.5}],  # another caller's value
        [{0: 0.25, 2: 0.75}, {0: 0.5, 1: 0.5}],  # another key
        [{0: 0.25, 1: 0.75}],  # a row missing
        [{"0": 0.25, "1": 0.75}, {0: 0.5, 1: 0.5}],  # keys of another type
    ):
        assert not same_results([solo[0], other], solo, rtol=1e-3), other
    # The tolerance is relative to the output's largest magnitude, as for tensors.
    assert same_results([[{"a": 1000.0}, {"a": 0.5}]], [[{"a": 1000.0}, {"a": 0.9}]], rtol=1e-3)
    assert not same_results([[{"a": 1.0}, {"a": 0.5}]], [[{"a": 1.0}, {"a": 0.9}]], rtol=1e-3)
    seq = [[np.array([1.0, 2.0]), np.array([3.0])]]  # a sequence of tensors
    assert same_results([[np.array([1.0, 2.0 + 1e-7]), np.array([3.0])]], seq, rtol=1e-3)
    assert not same_results([[np.array([1.0, 2.0]), np.array([3.5])]], seq, rtol=1e-3)
    assert not same_results([[np.array([1.0, 2.0])]], seq, rtol=1e-3)
    assert same_results([["a", "b"]], [["a", "b"]], rtol=1e-3)
    assert not same_results([["a", "c"]], [["a", "b"]], rtol=1e-3)


def _pinned_model(path: Path) -> Path:
    """x: [1, 4] -> Reshape to [1, -1] (named 'to_one_row') -> y: [1, 4]."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "s"], ["y"], name="to_one_row")],
        "pinned",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.array([1, -1], np.int64), "s")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return save_model(model, path)


def test_a_fixed_model_whose_reshape_ties_axis_0_to_one_runs_unbatched_saying_which_node(
    tmp_path: Path,
) -> None:
    path = _pinned_model(tmp_path / "pinned.onnx")
    with sharedml.SessionPool(path, sessions=1, batching="auto") as pool:
        assert pool.batching is None
        assert "'to_one_row' (Reshape)" in pool.batching_reason
        assert "fixed at 1 on axis 0" in pool.batching_reason
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        np.testing.assert_array_equal(pool.run(None, {"x": x})[0], x)
    with pytest.raises(sharedml.NotBatchableError, match=r"'to_one_row' \(Reshape\)"):
        sharedml.SessionPool(path, sessions=1, batching=True)


def test_a_fixed_model_whose_weights_cannot_be_linked_into_the_cache_runs_unbatched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    path = fixed_at_one(batchable_model(tmp_path / "d.onnx", dim=DIM), tmp_path / "f.onnx")

    def no_links(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)  # the cache on another file system
    with sharedml.SessionPool(path, sessions=1, batching="auto") as pool:
        assert pool.batching is None
        assert "cannot be hard-linked into the cache" in pool.batching_reason
        x = np.ones((1, DIM), np.float32)
        np.testing.assert_allclose(
            pool.run(None, {"x": x})[0], run_plain(path, {"x": x}), rtol=1e-5, atol=1e-6
        )


def run_plain(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]
