"""Static int8 (compress_static): int8 weights and activations at calibrated, constant scales."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _waiting import wait_until
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml._errors import CompressError
from sharedml.cache._files import temp_owner
from sharedml.prepared import compress_static

CHANNELS, SIZE, CLASSES = 16, 12, 10


def small_cnn(
    path: Path, *, seed: int = 0, width: int = CHANNELS, depth: int = 1, opset: int = 17
) -> Path:
    """x[N, 3, 12, 12] -> Conv -> Relu -> (Conv -> Relu) x depth -> GlobalAveragePool -> Flatten
    -> Gemm: ``width`` channels."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        fan_in = int(np.prod(shape[1:]))
        return (rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)).astype(np.float32)

    conv = {"kernel_shape": [3, 3], "pads": [1] * 4}
    inits, nodes, previous = [], [], "x"
    for i in range(depth + 1):
        inits += [
            numpy_helper.from_array(w(width, width if i else 3, 3, 3), f"c{i}"),
            numpy_helper.from_array(w(width) * 0.1, f"b{i}"),
        ]
        nodes += [
            helper.make_node("Conv", [previous, f"c{i}", f"b{i}"], [f"h{i}"], **conv),
            helper.make_node("Relu", [f"h{i}"], [f"r{i}"]),
        ]
        previous = f"r{i}"
    inits += [
        numpy_helper.from_array(w(CLASSES, width), "fc"),
        numpy_helper.from_array(w(CLASSES) * 0.1, "fcb"),
    ]
    nodes += [
        helper.make_node("GlobalAveragePool", [f"r{depth}"], ["g"]),
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
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)
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


def test_a_model_of_an_old_opset_still_gets_a_weight_scale_per_channel(tmp_path: Path) -> None:
    """Per-channel DequantizeLinear needs opset 13; many exported CNNs are opset 11."""
    src = small_cnn(tmp_path / "cnn11.onnx", opset=11)
    check = feeds(2, seed=500, rows=4)
    result = compress_static(src, tmp_path / "q" / "cnn.onnx", calibration=feeds(8, 0), check=check)
    assert result.per_channel
    scales = [
        t for t in onnx.load(str(result.model_path)).graph.initializer if t.name == "c1_scale"
    ]
    assert [list(t.dims) for t in scales] == [[CHANNELS]]  # one scale per output channel
    want = plain(src, check[0]["x"])
    got = plain(result.model_path, check[0]["x"])
    np.testing.assert_allclose(got, want, rtol=0, atol=0.1 * np.abs(want).max())


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
    onnx.save(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), src
    )
    calibration = [{"x": np.random.default_rng(0).standard_normal((1, 4)).astype(np.float32)}]
    with pytest.raises(CompressError, match="no weight"):
        compress_static(src, tmp_path / "q" / "relu.onnx", calibration=calibration)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps")
def test_a_static_int8_pool_maps_its_int8_weights_once_for_every_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four sessions of a static int8 pool against four plain float sessions and one: the int8
    weights are a quarter of the float ones, and the pool holds them once."""
    src = small_cnn(tmp_path / "cnn.onnx", width=256, depth=8)  # 18 MiB of float weights
    static = compress_static(src, tmp_path / "q" / "cnn.onnx", calibration=feeds(4, 0))
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(tmp_path / "cache"))
    measure = sharedml.measure.measure
    plain_float = measure(src, "naive", sessions=4)  # each a fresh subprocess
    plain_int8 = measure(static.model_path, "naive", sessions=4)
    pool_int8 = measure(static.model_path, "shared", sessions=4)
    costs = {
        name: m.total_bytes
        for name, m in (("float", plain_float), ("int8", plain_int8), ("pool", pool_int8))
    }
    print({k: f"{v / 2**20:.1f} MiB" for k, v in costs.items() if v is not None})
    assert None not in costs.values()
    # 4 float copies -> 1 int8 copy is 1/16 of the weights; each session keeps about 2 MiB of
    # its own (kernel state, activations: 12.8 MiB in all, measured on onnxruntime 1.32).
    assert costs["pool"] <= 0.25 * costs["float"]
    assert costs["pool"] <= 0.7 * costs["int8"]  # 4 plain int8 sessions: 22.4 MiB


def plain(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------
# Calibration data is validated; the accuracy is checked on inputs the scales were not fit to


def _nothing_left(folder: Path) -> None:
    """No output and no scratch folder in ``folder`` (or it does not exist)."""
    assert not folder.exists() or list(folder.iterdir()) == []


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("inf", r"calibration\[2\]\['x'\] holds 1 NaN or infinite value"),
        ("nan", r"calibration\[2\]\['x'\] holds 1 NaN or infinite value"),
        ("no rows", r"calibration\[2\]\['x'\] holds no values \(shape \(0, 3, 12, 12\)\)"),
        ("float64", r"calibration\[2\]\['x'\] is float64, but the model's input 'x' is float32"),
        ("rank", r"calibration\[2\]\['x'\] has shape \(3, 12, 12\).*rank 4"),
        ("size", r"calibration\[2\]\['x'\] has shape \(1, 3, 12, 11\).*axis 3 must be 12"),
    ],
)
def test_calibration_that_would_write_a_broken_model_is_refused_before_any_work(
    cnn: Path, tmp_path: Path, bad: str, match: str
) -> None:
    # +inf once gave an activation an infinite range: the written model output NaN for every
    # input, silently; zero rows wrote garbage with an empty accuracy report.
    calibration = feeds(4, 0)
    x = calibration[2]["x"]
    calibration[2]["x"] = {
        "inf": np.where(np.arange(x.size).reshape(x.shape) == 5, np.inf, x).astype(np.float32),
        "nan": np.where(np.arange(x.size).reshape(x.shape) == 5, np.nan, x).astype(np.float32),
        "no rows": x[:0],
        "float64": x.astype(np.float64),
        "rank": x[0],
        "size": x[..., :11],
    }[bad]
    with pytest.raises(ValueError, match=match):
        compress_static(cnn, tmp_path / "q" / "cnn.onnx", calibration=calibration)
    _nothing_left(tmp_path / "q")
    with pytest.raises(ValueError, match=match.replace("calibration", "check")):
        compress_static(
            cnn, tmp_path / "q" / "cnn.onnx", calibration=feeds(4, 0), check=calibration
        )
    _nothing_left(tmp_path / "q")


def test_a_calibration_of_one_value_is_refused(cnn: Path, tmp_path: Path) -> None:
    # All zeros once reported perfect accuracy: the check defaulted to the same zeros.
    zeros = [{"x": np.zeros((2, 3, SIZE, SIZE), np.float32)} for _ in range(4)]
    with pytest.raises(ValueError, match=r"one value in every feed \(\{'x': 0.0\}\)"):
        compress_static(cnn, tmp_path / "q" / "cnn.onnx", calibration=zeros)
    _nothing_left(tmp_path / "q")


def test_without_check_feeds_the_accuracy_is_measured_on_held_back_calibration_feeds(
    cnn: Path, tmp_path: Path
) -> None:
    calibration = feeds(8, 0, rows=2)
    result = compress_static(cnn, tmp_path / "q" / "cnn.onnx", calibration=calibration)
    assert result.checked_on == "held back" and result.caveats == ()
    assert (result.calibration_feeds, result.checked_feeds) == (6, 2)
    # One feed in four, spread over the list: the 4th and the 8th were held back, and the
    # reported accuracy is what the written model computes on exactly those.
    held = [calibration[3], calibration[7]]
    diff = max(
        float(np.abs(plain(result.model_path, f["x"]) - plain(cnn, f["x"])).max()) for f in held
    )
    assert result.accuracy[0].max_abs_diff == pytest.approx(diff, rel=1e-6)


def test_one_calibration_feed_of_many_rows_holds_back_its_last_rows(
    cnn: Path, tmp_path: Path
) -> None:
    (feed,) = feeds(1, 0, rows=8)
    result = compress_static(cnn, tmp_path / "q" / "cnn.onnx", calibration=[feed])
    assert result.checked_on == "held back" and result.caveats == ()
    (logits,) = result.accuracy
    assert logits.top1_rows == 2  # a quarter of the 8 rows, checked apart from the other 6
    want, got = plain(cnn, feed["x"][6:]), plain(result.model_path, feed["x"][6:])
    assert logits.max_abs_diff == pytest.approx(float(np.abs(got - want).max()), rel=1e-6)


def test_where_nothing_can_be_held_back_the_report_and_a_warning_say_so(
    cnn: Path, tmp_path: Path
) -> None:
    with pytest.warns(RuntimeWarning, match="measured on the calibration inputs themselves"):
        result = compress_static(cnn, tmp_path / "q" / "cnn.onnx", calibration=feeds(1, 0))
    assert result.checked_on == "calibration"
    assert len(result.caveats) == 1 and "nothing could be held back" in result.caveats[0]


def test_a_check_of_constant_inputs_is_reported_as_saying_nothing(
    cnn: Path, tmp_path: Path
) -> None:
    constant = [{"x": np.full((2, 3, SIZE, SIZE), 0.5, np.float32)}]
    with pytest.warns(
        RuntimeWarning, match=r"Every checked input holds one value \(\{'x': 0.5\}\)"
    ):
        result = compress_static(
            cnn, tmp_path / "q" / "cnn.onnx", calibration=feeds(4, 0), check=constant
        )
    assert result.checked_on == "check" and "says nothing" in result.caveats[0]


def test_an_int8_model_that_computes_nan_where_float_does_not_is_refused() -> None:
    from sharedml.prepared import _static

    good = [{"y": np.array([1.0, 2.0], np.float32)}]
    with pytest.raises(CompressError, match=r"NaN or infinity in 1 value\(s\) of output 'y'"):
        _static._refuse_non_finite("m.onnx", good, [{"y": np.array([1.0, np.nan], np.float32)}])
    # Where the float model itself is not finite there, the int8 model is not blamed.
    odd = [{"y": np.array([1.0, np.inf], np.float32)}]
    _static._refuse_non_finite("m.onnx", odd, [{"y": np.array([1.0, np.nan], np.float32)}])


# --------------------------------------------------------------------------------------------
# A killed build's scratch folder is removed by the next writer into the folder

_CHILD = """
import sys
from pathlib import Path

import numpy as np

from sharedml.prepared import compress_static

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
rng = np.random.default_rng(0)
# Many feeds: the quantizer's calibration runs long enough to be killed in the middle.
calibration = [{"x": rng.standard_normal((8, 3, 12, 12)).astype(np.float32)} for _ in range(400)]
compress_static(src, dst, calibration=calibration)
"""


def _scratch(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.startswith(".sharedml-static-"))


@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_the_scratch_folder_of_a_killed_build_is_removed_by_the_next_one(tmp_path: Path) -> None:
    src = small_cnn(tmp_path / "cnn.onnx", width=32, depth=2)
    out = tmp_path / "q"
    out.mkdir()
    # onnxruntime's quantizer keeps its own temporary folder (ort.quant.*) in TMPDIR, which the
    # kill leaves when it comes late enough: the child's TMPDIR is this test's, not the run's.
    scratch_tmp = tmp_path / "tmp"
    scratch_tmp.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(src), str(out / "cnn.onnx")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(scratch_tmp)},
    )
    try:
        # Killed once the quantizer has begun: the prepared float model is in its scratch.
        wait_until(
            lambda: (
                any((s / "float.onnx").exists() for s in _scratch(out)) or child.poll() is not None
            ),
            timeout_s=120,
            what="the child's scratch folder",
        )
        child.kill()
    finally:
        _, err = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL, err.decode(errors="replace")
    (left,) = _scratch(out)  # what nothing used to remove, tens of MB for a real model
    # A live build's folder, named as this process's, and a folder of the same name pattern
    # that is not a folder: both are left alone.
    live = out / f".sharedml-static-{temp_owner()}-abcd1234"
    live.mkdir()
    decoy = out / f".sharedml-static-{temp_owner().split('.')[0]}.{child.pid}-abcd1234"
    decoy.write_bytes(b"a user's file, not a folder sharedml made")
    result = compress_static(src, out / "cnn.onnx", calibration=feeds(8, 0))
    assert not left.exists()
    assert live.is_dir() and decoy.is_file()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [live.name, decoy.name, result.model_path.name, result.weights_path.name]
    )


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_another_users_scratch_folder_is_left_alone(
    cnn: Path, tmp_path: Path, other_user: Callable[[Callable[[], None]], None]
) -> None:
    out = tmp_path / "q"
    out.mkdir()
    os.chmod(out, 0o1777)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    host = temp_owner().split(".")[0]
    # Named as a process of this host that is gone: stale, if it were this user's.
    theirs = out / f".sharedml-static-{host}.{int(dead.stdout)}-abcd1234"
    theirs.mkdir()
    os.chown(theirs, other_user.uid, other_user.gid)  # type: ignore[attr-defined]
    compress_static(cnn, out / "cnn.onnx", calibration=feeds(8, 0))
    assert theirs.is_dir()
