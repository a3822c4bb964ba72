"""CUDA graphs in the pool: one thread per session, slots per shape, captures alone.

The machinery runs on ORT's CPU device here (the CPU provider accepts and ignores
``enable_cuda_graph``; the tests route it through the graph sessions): what a pool does around
a capture is checked on every machine. The capture itself needs CUDA:
``tests/weights/test_device.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from _models import batchable_model, conv_model
from _waiting import DEADLINE_S

import sharedml
from sharedml.pool import _graphs

CPU_GRAPHS = [("CPUExecutionProvider", {"enable_cuda_graph": "1"})]


@pytest.fixture(autouse=True)
def graphs_on_the_cpu_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_graphs.GRAPH_DEVICES, "CPUExecutionProvider", "cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return batchable_model(tmp_path_factory.mktemp("g") / "b.onnx", dim=16)


def solo(model: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16)).astype(np.float32)


@pytest.fixture
def pool(model: Path) -> Iterator[sharedml.SessionPool]:
    with sharedml.SessionPool(model, sessions=2, providers=CPU_GRAPHS) as p:
        p.wait_ready()
        yield p


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("onnxruntime_extensions")
    from _overlap import probe_model

    return probe_model(tmp_path_factory.mktemp("probe") / "probe.onnx")


def probe_pool(probe: Path, sessions: int) -> sharedml.SessionPool:
    from _overlap import register

    pool = sharedml.SessionPool(
        probe, sessions=sessions, providers=CPU_GRAPHS, prepacking="off", configure=register
    )
    pool.wait_ready()
    return pool


def test_a_graph_pool_runs_every_session_on_a_thread_of_its_own(probe: Path) -> None:
    from _overlap import DETECTOR

    with probe_pool(probe, 2) as pool:
        DETECTOR.reset()
        barrier = threading.Barrier(8, timeout=DEADLINE_S)

        def caller(i: int) -> None:
            barrier.wait()
            for _ in range(5):
                pool.run(None, {"x": np.full((1, 4), i, np.float32)})

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
        for c in callers:
            c.start()
        for c in callers:
            c.join(DEADLINE_S)
    threads = {name for name, _, _, _ in DETECTOR.runs}
    # 8 caller threads, but ORT ran every Run on one of the two sessions' own threads.
    assert len(DETECTOR.runs) >= 40
    assert len(threads) == 2 and all(name.startswith("sharedml-graph-") for name in threads)


def test_outputs_equal_a_plain_session_and_each_shape_gets_its_own_slot(
    pool: sharedml.SessionPool, model: Path
) -> None:
    for n in (1, 3, 1, 3, 5):
        out = pool.run(None, {"x": rows(n, n)})[0]
        np.testing.assert_allclose(out, solo(model, rows(n, n)), rtol=1e-5, atol=1e-6)
    with pool.session() as sess:
        slots = sorted(s.rows for s in sess._slots.values())
    assert set(slots) <= {1, 3, 5}


def test_a_slot_neither_writes_into_a_callers_feed_nor_hands_out_its_own_buffer(
    model: Path,
) -> None:
    # On ORT's CPU device a slot once wrapped the first caller's array as its input buffer (the
    # next feed of that shape was written into it) and returned views of its output buffer
    # (the next run overwrote a result already handed out).
    with (
        sharedml.SessionPool(model, sessions=1, providers=CPU_GRAPHS) as pool,
        pool.session() as sess,
    ):
        assert isinstance(sess, _graphs.GraphSession)  # the iobinding probe passed
        first, second = rows(2, 1), rows(2, 2)
        kept = first.copy()
        out = sess.run(None, {"x": first})[0]
        out_then = out.copy()
        sess.run(None, {"x": second})
        np.testing.assert_array_equal(first, kept)
        np.testing.assert_array_equal(out, out_then)
        np.testing.assert_allclose(out, solo(model, kept), rtol=1e-5, atol=1e-6)


class _RecordingBinding:
    """An IOBinding that remembers which output buffers are bound (ORT's own or ours)."""

    def __init__(self, real: ort.IOBinding) -> None:
        self.real = real
        self.outputs: dict[str, object] = {}

    def bind_output(self, name: str, *args: object) -> None:
        self.outputs[name] = "allocated by ORT"
        self.real.bind_output(name, *args)

    def bind_ortvalue_output(self, name: str, value: ort.OrtValue) -> None:
        self.outputs[name] = value
        self.real.bind_ortvalue_output(name, value)

    def clear_binding_outputs(self) -> None:
        self.outputs.clear()
        self.real.clear_binding_outputs()

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


class _RecordingSession:
    """A session that records, for every bound run, its graph id and the outputs bound."""

    def __init__(self, real: ort.InferenceSession) -> None:
        self.real = real
        self.runs: list[tuple[str, dict[str, object]]] = []

    def io_binding(self) -> _RecordingBinding:
        return _RecordingBinding(self.real.io_binding())

    def run_with_iobinding(self, binding: _RecordingBinding, options: ort.RunOptions) -> None:
        graph_id = options.get_run_config_entry(_graphs.GRAPH_ID_KEY)
        self.runs.append((graph_id, dict(binding.outputs)))
        self.real.run_with_iobinding(binding.real, options)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def test_every_run_of_a_graph_id_writes_into_the_slots_own_output_buffers(model: Path) -> None:
    # A captured graph keeps writing where the outputs were when its graph id first ran: with
    # ORT's own buffers bound then and the slot's bound later, every replay left the slot's
    # buffers stale (onnxruntime-gpu 1.31 on an H100). Only a run outside any graph may let
    # ORT allocate the outputs.
    sessions: list[_RecordingSession] = []

    def factory(dims: dict[str, int]) -> _RecordingSession:
        so = ort.SessionOptions()
        for name, value in dims.items():
            so.add_free_dimension_override_by_name(name, value)
        sessions.append(_RecordingSession(ort.InferenceSession(str(model), so)))
        return sessions[-1]

    template = ort.InferenceSession(str(model))
    graph = _graphs.GraphSession(template, factory, device="cpu", device_id=0)
    try:
        for n in (1, 2, 1):
            np.testing.assert_allclose(
                graph.run(None, {"x": rows(n, n)})[0], solo(model, rows(n, n))
            )
        slots = [graph.slot({"x": rows(n)}) for n in (1, 2)]
    finally:
        graph.close()
    assert [slot.session for slot in slots] == sessions  # a session per batch size here
    for slot in slots:
        graph_runs = [bound for g, bound in slot.session.runs if g == str(slot.graph_id)]
        assert len(graph_runs) == len(slot.session.runs) - 1 >= _graphs.CAPTURE_RUNS
        for bound in graph_runs:
            assert bound.keys() == slot.outputs.keys()
            assert all(bound[name] is value for name, value in slot.outputs.items()), bound


def test_more_shapes_than_graphs_is_a_clear_error(model: Path) -> None:
    with (
        sharedml.SessionPool(model, sessions=1, providers=CPU_GRAPHS) as pool,
        pool.session() as sess,
    ):
        sess.max_graphs = 2
        sess.run(None, {"x": rows(1)})
        sess.run(None, {"x": rows(2)})
        with pytest.raises(_graphs.GraphLimitError, match=r"at most 2 graphs.*x\[3, 16\]"):
            sess.run(None, {"x": rows(3)})


def test_batching_pads_to_power_of_two_buckets_and_trims_the_rows(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1, providers=CPU_GRAPHS, batching=True) as pool:
        for n in (1, 3, 5, 6, 7):
            out = pool.run(None, {"x": rows(n, n)})[0]
            assert out.shape == (n, 16)
            np.testing.assert_allclose(out, solo(model, rows(n, n)), rtol=1e-5, atol=1e-6)
        with pool.session() as sess:
            assert sorted(s.rows for s in sess._slots.values()) == [1, 4, 8]


def test_warm_up_captures_every_bucket_on_every_session(model: Path) -> None:
    batching = sharedml.Batching(max_batch_size=8)
    with sharedml.SessionPool(model, sessions=2, providers=CPU_GRAPHS, batching=batching) as pool:
        pool.warm_up({"x": rows(1)})
        with pool.session() as a, pool.session() as b:
            for sess in (a, b):
                assert sorted(s.rows for s in sess._slots.values()) == [1, 2, 4, 8]


def test_callers_that_keep_data_on_the_device_use_the_slots_buffers(
    pool: sharedml.SessionPool, model: Path
) -> None:
    x = rows(2, 7)
    with pool.session() as sess:
        slot = sess.slot({"x": x})
        slot.inputs["x"].update_inplace(x)  # a device caller writes through DLPack instead
        sess.replay(slot)
        np.testing.assert_allclose(slot.outputs["y"].numpy(), solo(model, x), rtol=1e-5, atol=1e-6)


def test_run_options_are_refused_with_graphs(pool: sharedml.SessionPool) -> None:
    with pytest.raises(sharedml.InvalidInputError, match="run_options"):
        pool.run(None, {"x": rows(1)}, ort.RunOptions())


def test_a_capture_never_overlaps_another_sessions_replay(probe: Path) -> None:
    """While one session runs the runs that may capture a new shape, no other session replays.

    ORT captures within a slot's first CAPTURE_RUNS runs; the probe op records every Run's
    thread, rows and interval from inside ORT.
    """
    from _overlap import DETECTOR

    with probe_pool(probe, 2) as pool:
        pool.warm_up({"x": np.ones((1, 4), np.float32)})
        DETECTOR.reset()
        stop = threading.Event()

        def replaying() -> None:
            while not stop.is_set():
                pool.run(None, {"x": np.ones((1, 4), np.float32)})

        busy = [threading.Thread(target=replaying) for _ in range(3)]
        for t in busy:
            t.start()
        for n in range(2, 6):  # new shapes while the others replay: captures
            pool.run(None, {"x": np.ones((n, 4), np.float32)})
        stop.set()
        for t in busy:
            t.join(DEADLINE_S)
    seen: dict[tuple[str, int], int] = {}
    captures, replays = [], []
    for name, n, start, end in sorted(DETECTOR.runs, key=lambda run: run[2]):
        k = seen[(name, n)] = seen.get((name, n), 0) + 1
        (captures if n > 1 and k <= _graphs.CAPTURE_RUNS else replays).append((name, start, end))
    assert len(captures) == 4 * _graphs.CAPTURE_RUNS and replays
    for name, c_start, c_end in captures:
        for other, r_start, r_end in replays:
            if other != name:
                assert r_end <= c_start or r_start >= c_end  # disjoint in time


def test_each_set_of_dim_values_gets_a_session_with_those_dims_fixed(
    pool: sharedml.SessionPool,
) -> None:
    # Fixed dims let ORT fold shape arithmetic away, which it would otherwise put on the CPU,
    # where CUDA graphs refuse it. The pool itself reports the model as declared.
    assert pool.get_inputs()[0].shape == ["batch", 16]
    with pool.session() as sess:
        three, again, five = (sess.slot({"x": rows(n)}) for n in (3, 3, 5))
    assert three.dims == {"batch": 3} and five.dims == {"batch": 5}
    assert three.session is again.session and three.session is not five.session
    assert three.session.get_inputs()[0].shape == [3, 16]
    assert five.session.get_outputs()[0].shape == [5, 16]


def test_inputs_that_disagree_on_a_shared_dim_are_refused(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    a, b, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in "aby")
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "add", [a, b], [y])
    path = tmp_path / "add.onnx"
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnx's default can be newer than the oldest onnxruntime accepted
    onnx.save(model, path)
    with sharedml.SessionPool(path, sessions=1, providers=CPU_GRAPHS) as pool:
        ones = np.ones((2, 4), np.float32)
        np.testing.assert_array_equal(pool.run(None, {"a": ones, "b": ones})[0], 2 * ones)
        with pytest.raises(sharedml.InvalidInputError, match=r"'batch'.*must agree"):
            pool.run(None, {"a": ones, "b": np.ones((3, 4), np.float32)})


# ShapeSessions: a session per batch bucket, graphs off (Batching.session_per_bucket)

PER_BUCKET = sharedml.Batching(max_batch_size=8, pad_to_buckets=True, session_per_bucket=True)


def test_session_per_bucket_defaults_to_cuda_batches_that_are_padded_without_graphs() -> None:
    default = sharedml.Batching()
    assert default.sessions_per_bucket("CUDAExecutionProvider")
    assert not default.sessions_per_bucket("CUDAExecutionProvider", convolutions=False)
    assert PER_BUCKET.sessions_per_bucket("CUDAExecutionProvider", convolutions=False)  # asked
    assert not default.sessions_per_bucket("CUDAExecutionProvider", cuda_graphs=True)
    assert not default.sessions_per_bucket("CPUExecutionProvider")  # not padded there
    assert not default.sessions_per_bucket("DmlExecutionProvider")
    unpadded = sharedml.Batching(pad_to_buckets=False, session_per_bucket=True)
    assert not unpadded.sessions_per_bucket("CUDAExecutionProvider")  # a session per size
    assert PER_BUCKET.sessions_per_bucket("CPUExecutionProvider")
    with pytest.raises(ValueError, match="session_per_bucket must be True, False or None"):
        sharedml.Batching(session_per_bucket="yes")  # type: ignore[arg-type]


def test_the_signature_says_whether_a_model_has_convolutions(model: Path, tmp_path: Path) -> None:
    from sharedml.model._graph import load_graph
    from sharedml.pool._batching import signature_of

    conv = conv_model(tmp_path / "conv.onnx")
    assert signature_of(load_graph(conv), name="conv").convolutions
    assert not signature_of(load_graph(model), name="mlp").convolutions


def test_every_bucket_gets_a_session_with_its_batch_dim_fixed(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=2, batching=PER_BUCKET) as pool:
        pool.warm_up({"x": rows(1)})
        with pool.session() as a, pool.session() as b:
            for sess in (a, b):
                assert isinstance(sess, _graphs.ShapeSessions)
                assert sess.shapes == [{"batch": n} for n in (1, 2, 4, 8)]
                fixed = sess.session_for({"x": rows(4)})
                assert fixed.get_inputs()[0].shape == [4, 16]
            assert a.get_inputs()[0].shape == ["batch", 16]  # the pool reports the model


def test_batched_callers_on_bucket_sessions_get_their_solo_results(model: Path) -> None:
    callers = 12

    def size(i: int) -> int:
        # 3 or 6 rows: a batch of them (at most 8 rows) is never a power of two, so every batch
        # is padded however the callers meet (with 1-3 rows, batches of 8 could need none).
        return 3 + 3 * (i % 2)

    barrier = threading.Barrier(callers, timeout=DEADLINE_S)
    results: dict[int, np.ndarray] = {}

    with sharedml.SessionPool(model, sessions=1, batching=PER_BUCKET) as pool:
        pool.warm_up({"x": rows(1)})

        def caller(i: int) -> None:
            barrier.wait()
            results[i] = pool.run(None, {"x": rows(size(i), i)})[0]

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        stats = pool.stats()
    assert sorted(results) == list(range(callers))
    for i, out in results.items():
        np.testing.assert_allclose(out, solo(model, rows(size(i), i)), rtol=1e-5, atol=1e-6)
    assert stats.padded_rows > 0  # the padded batches ran on the bucket sessions


def test_shapes_beyond_the_limit_and_non_numpy_feeds_run_on_the_template(model: Path) -> None:
    created: list[dict[str, int]] = []
    template = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])

    def factory(dims: dict[str, int]) -> object:
        created.append(dict(dims))
        so = ort.SessionOptions()
        for name, value in dims.items():
            so.add_free_dimension_override_by_name(name, value)
        return ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])

    sess = _graphs.ShapeSessions(template, factory, max_shapes=2)
    for n in (1, 2, 1, 3):
        out = sess.run(None, {"x": rows(n, n)})[0]
        np.testing.assert_allclose(out, solo(model, rows(n, n)), rtol=1e-5, atol=1e-6)
    assert created == [{"batch": 1}, {"batch": 2}]  # 3 rows: over the limit, on the template
    assert sess.session_for({"x": rows(3)}) is template
    assert sess.session_for({"x": ort.OrtValue.ortvalue_from_numpy(rows(1))}) is template
    sess.close()
    assert sess.shapes == []


def test_paddles_question_mark_dims_are_not_one_shared_name() -> None:
    shapes = {"x": (2, 3, 48, 192)}
    assert _graphs.symbolic_dims({"x": [None, 3, "?", "?"]}, shapes) == {}
    assert _graphs.symbolic_dims({"x": ["batch", 3, "?", "?"]}, shapes) == {"batch": 2}
