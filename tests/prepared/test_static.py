"""Static int8 (compress_static): int8 weights and activations at calibrated, constant scales."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml._errors import CompressError
from sharedml.prepared import compress_static

CHANNELS, SIZE, CLASSES = 16, 12, 10


def small_cnn(path: Path, *, seed: int = 0) -> Path:
    """x[N, 3, 12, 12] -> Conv -> Relu -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        fan_in = int(np.prod(shape[1:]))
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    inits = [
        numpy_helper.from_array(w(CHANNELS, 3, 3, 3), "c1"),
        numpy_helper.from_array(w(CHANNELS) * 0.1, "b1"),
        numpy_helper.from_array(w(CHANNELS, CHANNELS, 3, 3), "c2"),
        numpy_helper.from_array(w(CHANNELS) * 0.1, "b2"),
        numpy_helper.from_array(w(CLASSES, CHANNELS), "fc"),
        numpy_helper.from_array(w(CLASSES) * 0.1, "fcb"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "c1", "b1"], ["h1"], kernel_shape=[3, 3], pads=[1] * 4),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Conv", ["r1", "c2", "b2"], ["h2"], kernel_shape=[3, 3], pads=[1] * 4),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def images(n: int, seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)) * scale).astype(
        np.float32
    )


def feeds(count: int, seed: int, rows: int = 1, scale: float = 1.0) -> list[dict[str, np.ndarray]]:
    return [{"x": images(rows, seed + i, scale)} for i in range(count)]


@pytest.fixture
def cnn(tmp_path: Path) -> Path:
    return small_cnn(tmp_path / "cnn.onnx")


def test_static_int8_stores_int8_weights_and_says_what_accuracy_it_cost(
    cnn: Path, tmp_path: Path
) -> None:
    check = feeds(4, seed=500, rows=8)
    dst = tmp_path / "q" / "cnn.onnx"
    result = compress_static(cnn, dst, calibration=feeds(16, 0), check=check)
    assert result.model_path.exists() and result.weights_path.exists()
    assert result.quantized_weights == 3  # both convolutions and the classifier
    assert result.compressed_bytes < 0.4 * result.float_bytes
    assert (result.calibration_feeds, result.checked_feeds) == (16, 4)
    graph = onnx.load(str(result.model_path), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and "DynamicQuantizeLinear" not in ops
    # The reported accuracy is what the written model computes on the checked inputs.
    (logits,) = result.accuracy
    want = [plain(cnn, f["x"]) for f in check]
    got = [plain(result.model_path, f["x"]) for f in check]
    diff = max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    assert logits.max_abs_diff == pytest.approx(diff, rel=1e-6)
    agree = np.mean([np.argmax(g, 1) == np.argmax(w, 1) for g, w in zip(got, want, strict=True)])
    assert logits.top1_agreement == pytest.approx(agree) and logits.top1_rows == 32
    assert 0 < logits.max_rel_diff < 0.1


def test_the_calibration_inputs_decide_the_accuracy(cnn: Path, tmp_path: Path) -> None:
    """Scales come from the caller's inputs: calibrating on inputs 100x larger than the ones
    checked wastes most of the int8 range on values that never come."""
    check = feeds(4, seed=500, rows=8)
    like = compress_static(cnn, tmp_path / "a" / "m.onnx", calibration=feeds(8, 0), check=check)
    unlike = compress_static(
        cnn, tmp_path / "b" / "m.onnx", calibration=feeds(8, 0, scale=100.0), check=check
    )
    assert unlike.accuracy[0].max_rel_diff > 3 * like.accuracy[0].max_rel_diff


def test_a_static_int8_pool_never_lets_one_callers_rows_change_anothers(
    cnn: Path, tmp_path: Path
) -> None:
    """Callers whose inputs differ 100x in scale share batches: with scales taken from the
    batch (dynamic quantization) the loud caller would coarsen the quiet one's values."""
    result = compress_static(cnn, tmp_path / "q" / "cnn.onnx", calibration=feeds(8, 0))
    callers = 6
    xs = [images(1, seed=i, scale=100.0 if i % 2 else 1.0) for i in range(callers)]
    results: list[list[np.ndarray]] = [[] for _ in range(callers)]
    barrier = threading.Barrier(callers)
    with sharedml.SessionPool(
        result.model_path,
        sessions=1,
        cache_dir=tmp_path / "cache",
        batching=sharedml.Batching(max_delay_ms=50),
    ) as pool:
        assert pool.batching is not None  # the analysis proves constant-scale QDQ row-wise

        def call(i: int) -> None:
            barrier.wait()
            for _ in range(5):
                results[i].append(pool.run(None, {"x": xs[i]})[0])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = pool.stats()
    assert stats.max_batch_rows > 1  # rows of several callers did run together
    solo = ort.InferenceSession(str(result.model_path), providers=["CPUExecutionProvider"])
    for i in range(callers):
        alone = solo.run(None, {"x": xs[i]})[0]
        for got in results[i]:
            np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_calibration_must_be_feeds_of_the_models_inputs(cnn: Path, tmp_path: Path) -> None:
    dst = tmp_path / "q" / "cnn.onnx"
    with pytest.raises(ValueError, match="empty"):
        compress_static(cnn, dst, calibration=[])
    with pytest.raises(TypeError, match="list of feeds"):
        compress_static(cnn, dst, calibration={"x": images(1, 0)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"calibration\[1\].*missing \['x'\].*unknown \['y'\]"):
        compress_static(cnn, dst, calibration=[{"x": images(1, 0)}, {"y": images(1, 1)}])
    with pytest.raises(ValueError, match=r"check\[0\]"):
        compress_static(cnn, dst, calibration=feeds(2, 0), check=[{"image": images(1, 0)}])
    assert not dst.exists()


def test_a_model_with_nothing_to_quantize_is_refused(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
    )
    src = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), src)
    calibration = [{"x": np.ones((1, 4), np.float32)}]
    with pytest.raises(CompressError, match="no weight"):
        compress_static(src, tmp_path / "q" / "relu.onnx", calibration=calibration)


def plain(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]  # type: ignore[no-any-return]
