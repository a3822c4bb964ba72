"""CPU: sharing ORT's prepacked weights too: route choice, outputs, cache, memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from _models import PLACEMENTS, build_model, feeds, save_model

import sharedml
from sharedml._host import _platform
from sharedml.route import _cpu
from sharedml.runtime._options import config_entry
from sharedml.weights import _prepacked as _prepack


@pytest.fixture(scope="module")
def mlp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("mlp")
    return Path(mlp(folder / "mlp.onnx", target_bytes=24 * 2**20, width=1024).path)


def plain(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]


@pytest.mark.capability("prepacked-save")
def test_auto_shares_prepacked_weights_where_ort_packs_them(mlp_model: Path) -> None:
    feed = {"input": np.random.default_rng(0).standard_normal((8, 1024)).astype(np.float32)}
    with sharedml.SessionPool(mlp_model, sessions=3) as pool:
        assert pool.mechanism == "prepacked-file"
        assert "prepacked blobs" in pool.mechanism_reason
        # Same packed kernels as a plain session: equal up to float reassociation.
        np.testing.assert_allclose(pool.run(None, feed)[0], plain(mlp_model, feed), rtol=1e-5)
        with pool.session() as a, pool.session() as b:
            np.testing.assert_array_equal(a.run(None, feed)[0], b.run(None, feed)[0])


@pytest.mark.capability("prepacked-save")
def test_sessions_of_the_saved_model_leave_parallel_packing_to_the_caller(
    mlp_model: Path,
) -> None:
    # Parallel validation packs kept 14-16 MiB more per process (weights/_prepacked.py): a
    # pool does not set the key; a caller's template still may.
    key = "session.prepack.enable_parallel"
    with sharedml.SessionPool(mlp_model, sessions=1) as pool, pool.session() as sess:
        assert pool.mechanism == "prepacked-file"
        assert config_entry(sess.get_session_options(), key) is None
    template = ort.SessionOptions()
    template.add_session_config_entry(key, "1")
    with (
        sharedml.SessionPool(mlp_model, sessions=1, sess_options=template) as pool,
        pool.session() as sess,
    ):
        assert sess.get_session_options().get_session_config_entry(key) == "1"


@pytest.mark.capability("prepacked-save")
def test_auto_keeps_raw_sharing_where_nothing_is_packed(tmp_path: Path) -> None:
    # 32x32 weights: ORT packs each, but all stay inline in the saved model (under 64 KiB):
    # nothing to gain from a saved copy; each session packs them, as plain ORT does.
    src = save_model(build_model(list(PLACEMENTS), dim=32), tmp_path / "m.onnx")
    with sharedml.SessionPool(src, sessions=2) as pool:
        assert pool.mechanism in sharedml.weights.zero_copy_mechanisms()
        assert "each too small for the saved model's data file" in pool.mechanism_reason
        assert _prepacking_setting(pool) == "0"
        for flag in (True, False):
            feed = feeds(32, flag=flag)
            np.testing.assert_array_equal(pool.run(None, feed)[0], plain(src, feed))


@pytest.mark.capability("prepacked-save")
def test_forced_shared_prepacking_works_on_subgraph_models(tmp_path: Path) -> None:
    src = save_model(build_model(list(PLACEMENTS), dim=32), tmp_path / "m.onnx")
    with sharedml.SessionPool(src, sessions=2, prepacking="shared") as pool:
        # 32x32: ORT packs nothing, so the saved model is named for what it is, not "prepacked".
        assert pool.mechanism == "optimized-file"
        for flag in (True, False):
            np.testing.assert_allclose(
                pool.run(None, feeds(32, flag=flag))[0],
                plain(src, feeds(32, flag=flag)),
                rtol=1e-5,
                atol=1e-6,
            )


@pytest.mark.parametrize(
    ("prepacking", "config"),
    [("off", "1"), ("per-session", "0")],
)
def test_explicit_prepacking_modes(mlp_model: Path, prepacking: object, config: str) -> None:
    seen: list[str] = []
    with sharedml.SessionPool(
        mlp_model,
        sessions=1,
        prepacking=prepacking,  # type: ignore[arg-type]
        configure=lambda so: seen.append(so.get_session_config_entry("session.disable_prepacking")),
    ) as pool:
        assert pool.mechanism in sharedml.weights.zero_copy_mechanisms()
    assert seen == [config]


def test_bad_prepacking_values(mlp_model: Path) -> None:
    with pytest.raises(ValueError, match="prepacking must be"):
        sharedml.SessionPool(mlp_model, prepacking="sometimes")
    with pytest.raises(ValueError, match="mechanism='auto'"):
        sharedml.SessionPool(mlp_model, prepacking="shared", mechanism="ort-mmap")


@pytest.mark.capability("prepacked-save")
def test_a_failed_build_falls_back_to_raw_sharing_with_a_warning(
    mlp_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise sharedml.SessionCreationError("simulated: ORT refused the optimized model")

    monkeypatch.setattr(_prepack, "build_prepacked_model", broken)
    with pytest.warns(RuntimeWarning, match="simulated"):
        pool = sharedml.SessionPool(mlp_model, sessions=1)
    with pool:
        assert pool.mechanism in sharedml.weights.zero_copy_mechanisms()
        assert pool.run(None, {"input": np.ones((1, 1024), np.float32)})[0].shape == (1, 1024)
    with pytest.raises(sharedml.SessionCreationError, match="simulated"):
        sharedml.SessionPool(mlp_model, sessions=1, prepacking="shared")


class _SavedFormComputes(ort.InferenceSession):
    """ORT, except that a session over a saved prepacked model changes its first output with
    ``change`` (onnxruntime 1.30 returned NaN there for a transformer's 8-bit MatMulNBits
    weights, where plain sessions computed numbers)."""

    change: Any = None

    def __init__(self, path_or_bytes: object, *args: object, **kwargs: object) -> None:
        self.wrong = isinstance(path_or_bytes, str) and "prepacked" in Path(path_or_bytes).parts
        super().__init__(path_or_bytes, *args, **kwargs)  # type: ignore[arg-type]

    def run(self, *args: object, **kwargs: object) -> list[object]:
        outputs = super().run(*args, **kwargs)  # type: ignore[arg-type]
        if self.wrong:
            outputs[0] = type(self).change(outputs[0])
        return outputs


@pytest.mark.capability("prepacked-save")
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda out: np.full_like(out, np.nan), "NaN or infinity where plain ORT"),
        (lambda out: np.where(out > 0, out * 1.01, out), "differs from"),
    ],
    ids=["nan", "one-percent-off"],
)
def test_a_saved_form_that_computes_other_values_is_never_used(
    mlp_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[np.ndarray], np.ndarray],
    message: str,
) -> None:
    monkeypatch.setattr(_SavedFormComputes, "change", staticmethod(change))
    monkeypatch.setattr(ort, "InferenceSession", _SavedFormComputes)
    feed = {"input": np.random.default_rng(0).standard_normal((2, 1024)).astype(np.float32)}
    with pytest.warns(RuntimeWarning, match=message):
        pool = sharedml.SessionPool(mlp_model, sessions=1, cache_dir=tmp_path)
    with pool:
        assert pool.mechanism in sharedml.weights.zero_copy_mechanisms()
        # Unpacked kernels: equal to plain ORT's packed ones up to float reassociation.
        got = pool.run(None, feed)[0]
        np.testing.assert_allclose(got, plain(mlp_model, feed), rtol=1e-4, atol=1e-5)
    assert not list((tmp_path / "prepacked").glob("*/model.onnx"))  # nothing was published
    with pytest.raises(sharedml.SessionCreationError, match=message):
        sharedml.SessionPool(mlp_model, sessions=1, prepacking="shared", cache_dir=tmp_path)


@pytest.mark.capability("prepacked-save")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_compressed_weights_whose_saved_form_is_wrong_are_packed_by_each_session(
    mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: str
) -> None:
    """Unpacked MatMulNBits kernels run at a fraction of their packed speed, so compressed
    weights fall back to each session's own packs, not to prepacking off."""
    monkeypatch.setattr(_SavedFormComputes, "change", staticmethod(lambda o: o * np.nan))
    monkeypatch.setattr(ort, "InferenceSession", _SavedFormComputes)
    feed = {"input": np.random.default_rng(0).standard_normal((2, 1024)).astype(np.float32)}
    with pytest.warns(RuntimeWarning, match="each session packs its own copy of the compressed"):
        pool = sharedml.SessionPool(mlp_model, sessions=2, weights=weights, cache_dir=tmp_path)
    with pool:
        assert pool.recipe.prepacking is sharedml.route.Prepacking.PER_SESSION
        assert "each session packs a private copy" in pool.recipe.reason
        with pool.session() as sess:
            assert (
                sess.get_session_options().get_session_config_entry("session.disable_prepacking")
                == "0"
            )
        got = pool.run(None, feed)[0]
        np.testing.assert_allclose(got, plain(pool.recipe.model_path, feed), rtol=1e-4, atol=1e-5)
    # A float model keeps the memory-first fallback: raw weights, prepacking off.
    with pytest.warns(RuntimeWarning, match="prepacking off instead"):
        pool = sharedml.SessionPool(mlp_model, sessions=2, cache_dir=tmp_path)
    with pool:
        assert pool.recipe.prepacking is sharedml.route.Prepacking.AUTO


def _skip_unless_compressible(weights: str) -> None:
    from sharedml.prepared import WeightsFormat
    from sharedml.prepared._compress import compression_unavailable

    why = compression_unavailable(WeightsFormat.parse(weights))
    if why is not None:
        pytest.skip(why)


def _quantized_elsewhere(mlp_model: Path, folder: Path, weights: str) -> Path:
    """``mlp_model`` with its MatMuls already in ORT's blocks, as a user might bring it."""
    from sharedml.prepared import compress

    _skip_unless_compressible(weights)
    return Path(compress(mlp_model, folder / "quantized" / "mlp.onnx", weights=weights).model_path)


def _prepacking_setting(pool: sharedml.SessionPool) -> str | None:
    with pool.session() as sess:
        try:
            return str(sess.get_session_options().get_session_config_entry(_DISABLE_PREPACKING))
        except RuntimeError:  # never set: ORT's default, packing on
            return None


_DISABLE_PREPACKING = "session.disable_prepacking"


@pytest.mark.capability("prepacked-save")
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_model_quantized_elsewhere_whose_saved_form_is_wrong_is_packed_by_each_session(
    mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: str
) -> None:
    quantized = _quantized_elsewhere(mlp_model, tmp_path, weights)
    monkeypatch.setattr(_SavedFormComputes, "change", staticmethod(lambda o: o * np.nan))
    monkeypatch.setattr(ort, "InferenceSession", _SavedFormComputes)
    feed = {"input": np.random.default_rng(0).standard_normal((2, 1024)).astype(np.float32)}
    with pytest.warns(RuntimeWarning, match="each session packs its own copy"):
        pool = sharedml.SessionPool(quantized, sessions=2, cache_dir=tmp_path / "cache")
    with pool:
        assert pool.recipe.prepacking is sharedml.route.Prepacking.PER_SESSION
        assert _prepacking_setting(pool) == "0"
        got = pool.run(None, feed)[0]
        np.testing.assert_allclose(got, plain(quantized, feed), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("origin", ["compressed-by-the-pool", "quantized-elsewhere"])
def test_block_quantized_weights_never_run_unpacked(
    mlp_model: Path, tmp_path: Path, weights: str, origin: str
) -> None:
    """Unpacked MatMulNBits kernels run at a fraction of their packed speed, and before
    onnxruntime 1.28 ORT saves no packed form of them: the pool then packs in each session."""
    _skip_unless_compressible(weights)
    if origin == "compressed-by-the-pool":
        pool = sharedml.SessionPool(
            mlp_model, sessions=2, weights=weights, cache_dir=tmp_path / "cache"
        )
    else:
        quantized = _quantized_elsewhere(mlp_model, tmp_path, weights)
        pool = sharedml.SessionPool(quantized, sessions=2, cache_dir=tmp_path / "cache")
    with pool:
        assert _prepacking_setting(pool) != "1", pool.mechanism_reason
        if pool.mechanism != "prepacked-file":
            assert pool.recipe.prepacking is sharedml.route.Prepacking.PER_SESSION
            assert "neither prepacks" not in pool.mechanism_reason  # ORT does pack these


def test_no_saved_pack_of_block_quantized_weights_is_not_taken_for_no_packing() -> None:
    nothing_saved = _prepack.PrepackStats(4, 2**20, 0, 0, 0, 0, 4, inline_packed_blobs=0)
    plain_decision = _cpu.choose_cpu_route(nothing_saved, sessions=2)
    assert "saves no packed form of any weight" in plain_decision.reason
    assert not plain_decision.packs_per_session
    decision = _cpu.choose_cpu_route(nothing_saved, sessions=2, block_quantized=True)
    assert decision.route is _cpu.CpuRoute.SHARED_RAW
    assert "MatMulNBits" in decision.reason and "saves no packed form" not in decision.reason


@pytest.mark.parametrize(
    ("inline", "cost", "packs", "says"),
    [
        (3, 2**19, True, "ORT packs 3 weight(s) of this model (2.0 KiB packed), each too small"),
        (None, 2**19, True, "could not be told"),
        (3, 2**23, False, "cost each session 8.0 MiB"),
        (3, None, False, "could not be measured"),
    ],
)
def test_sessions_pack_what_no_saved_model_shares_where_that_costs_them_little(
    inline: int | None, cost: int | None, packs: bool, says: str
) -> None:
    stats = _prepack.PrepackStats(
        4,
        2**20,
        0,
        0,
        0,
        0,
        4,
        inline_packed_blobs=inline,
        inline_packed_bytes=2048,
        session_pack_bytes=cost,
    )
    decision = _cpu.choose_cpu_route(stats, sessions=2)
    assert decision.route is _cpu.CpuRoute.SHARED_RAW
    assert decision.packs_per_session is packs
    assert says in decision.reason and "neither prepacks" not in decision.reason
    if not packs:  # prepacking off: the reason says what that means for the outputs
        assert "outputs may differ from plain ORT's" in decision.reason


def picky_model(path: Path, width: int = 512) -> Path:
    """y = MatMul(Flatten(x), W): x is float[batch, 1, "h", width], so only h = 1 runs (a text
    recognizer refuses an image height that is not its own in the same way)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", ["x"], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "w"], ["y"]),
        ],
        "picky",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, "h", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        [numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return save_model(model, path)


@pytest.mark.capability("prepacked-save")
def test_a_model_that_refuses_plausible_sizes_is_still_checked_and_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The check's inputs are guessed as inspect guesses them, down to sizes of 1; the guesses
    the model refuses are not printed as ORT errors."""
    model = picky_model(tmp_path / "picky.onnx")
    monkeypatch.setattr(_SavedFormComputes, "change", staticmethod(np.zeros_like))
    monkeypatch.setattr(ort, "InferenceSession", _SavedFormComputes)
    capfd.readouterr()
    with pytest.raises(sharedml.SessionCreationError, match="differs from"):
        sharedml.SessionPool(model, sessions=1, prepacking="shared", cache_dir=tmp_path / "c")
    assert "ExecuteKernel" not in capfd.readouterr().err


@pytest.mark.capability("prepacked-save")
def test_a_saved_form_within_float_reassociation_of_plain_ort_is_used(
    mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another kernel's summation order moves the last bits, not the result.
    monkeypatch.setattr(_SavedFormComputes, "change", staticmethod(lambda out: out * (1 + 1e-6)))
    monkeypatch.setattr(ort, "InferenceSession", _SavedFormComputes)
    with sharedml.SessionPool(mlp_model, sessions=1, cache_dir=tmp_path) as pool:
        assert pool.mechanism == "prepacked-file"


@pytest.mark.capability("prepacked-save")
def test_the_prepacked_model_is_built_once_and_reused(mlp_model: Path, tmp_path: Path) -> None:
    with sharedml.SessionPool(mlp_model, sessions=1) as first:
        assert first.recipe.prepacked is not None
        entry = first.recipe.prepacked.model_path
    mtime = entry.stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sharedml.SessionPool(mlp_model, sessions=1) as second:
            assert second.recipe.prepacked.model_path == entry
    assert entry.stat().st_mtime_ns == mtime
    assert not os.access(entry, os.W_OK) or os.geteuid() == 0  # published read-only


def test_cache_key_follows_ort_version_and_options(mlp_model: Path, tmp_path: Path) -> None:
    with sharedml.SessionPool(mlp_model, sessions=1) as pool:
        model, weights = pool.model_path, pool.weights.path
    base = _prepack.build_prepacked_model(model, weights, tmp_path / "pp")
    same = _prepack.build_prepacked_model(model, weights, tmp_path / "pp")
    assert same.key == base.key
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    other_level = _prepack.build_prepacked_model(model, weights, tmp_path / "pp", sess_options=so)
    assert other_level.key != base.key


def test_cache_key_changes_with_the_ort_version(
    mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with sharedml.SessionPool(mlp_model, sessions=1) as pool:
        model, weights = pool.model_path, pool.weights.path
    base = _prepack.build_prepacked_model(model, weights, tmp_path / "pp")
    monkeypatch.setattr(ort, "__version__", "0.0.1-test")
    assert _prepack.build_prepacked_model(model, weights, tmp_path / "pp").key != base.key


HEAP_SCRIPT = r"""
import ctypes, json, psutil
from sharedml._host import _platform
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
proc = psutil.Process()
before = proc.memory_info().rss
# 160 MiB in 64 KiB blocks (below glibc's mmap threshold: they come from the heap), touched,
# then a small block on top so that freeing the rest leaves a hole glibc keeps.
blocks = [libc.malloc(64 * 1024) for _ in range(2560)]
for b in blocks:
    ctypes.memset(b, 1, 64 * 1024)
pin = libc.malloc(64 * 1024)  # from the top of the heap: nothing freed yet fits
for b in blocks:
    libc.free(b)
kept = proc.memory_info().rss - before
released = _platform.release_freed_heap()
after = proc.memory_info().rss - before
print(json.dumps({"kept": kept, "released": released, "after": after}))
"""


@pytest.mark.skipif(not _platform.heap_trim_available(), reason="malloc_trim is glibc's")
def test_release_freed_heap_gives_freed_heap_back_to_the_os() -> None:
    out = subprocess.run(
        [sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kept"] > 120 * 2**20, result  # glibc kept the freed heap...
    assert result["released"] is True
    assert result["after"] < 40 * 2**20, result  # ...until it was trimmed


@pytest.mark.capability("prepacked-save")
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps")
def test_four_sessions_with_shared_prepacked_weights_cost_a_third_of_plain(
    mlp_model: Path,
) -> None:
    naive, shared = (
        sharedml.measure.measure(mlp_model, s, sessions=4, dims={"batch": 8})
        for s in ("naive", "shared")
    )
    assert shared.details["mechanism"] == "prepacked-file"
    assert naive.outputs_agree and shared.outputs_agree
    assert naive.total_bytes and shared.total_bytes is not None
    print(
        f"4 sessions, PSS growth: plain {naive.total_bytes / 2**20:.0f} MiB, shared prepacked "
        f"{shared.total_bytes / 2**20:.0f} MiB ({shared.total_bytes / naive.total_bytes:.2f}x)"
    )
    assert shared.total_bytes <= 0.35 * naive.total_bytes


# --------------------------------------------------------------------------------------------
# Models ORT derives weights of but packs nothing of


def conv_bn(path: Path, *, layers: int = 1, channels: int = 64) -> Path:
    """Conv + BatchNormalization blocks: ORT fuses each pair (a derived weight), packs nothing."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((channels, channels, 3, 3)) / (3 * channels**0.5)).astype(
            np.float32
        )
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        names = [f"{n}{i}" for n in ("scale", "bias", "mean", "var")]
        for name, v in zip(
            names,
            (
                1 + rng.random(channels),
                rng.random(channels),
                rng.random(channels),
                1 + rng.random(channels),
            ),
            strict=True,
        ):
            inits.append(numpy_helper.from_array(v.astype(np.float32), name))
        nodes += [
            helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}", *names], [f"y{i}"]),
        ]
        x = f"y{i}"
    graph = helper.make_graph(
        nodes,
        "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, channels, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return save_model(model, path)


def conv_feed(channels: int = 64) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).random((1, channels, 8, 8), dtype=np.float32)}


@pytest.mark.capability("prepacked-save")
def test_a_model_ort_packs_nothing_of_is_named_for_what_it_shares(tmp_path: Path) -> None:
    src = conv_bn(tmp_path / "cb.onnx")
    with sharedml.SessionPool(src, sessions=2) as pool:
        assert pool.mechanism == "optimized-file"
        assert "ORT packs no weight" in pool.mechanism_reason
        assert "prepacked blobs" not in pool.mechanism_reason
        stats = pool.recipe.runtime_stats
        assert stats.prepacked_blobs == 0 and stats.derived_bytes == 64 * 64 * 9 * 4
        np.testing.assert_allclose(
            pool.run(None, conv_feed())[0], plain(src, conv_feed()), rtol=1e-4, atol=1e-5
        )


def test_prepacking_off_warns_where_ort_derives_weights_and_says_so(tmp_path: Path) -> None:
    src = conv_bn(tmp_path / "cb.onnx")
    with pytest.warns(RuntimeWarning, match="prepacking='off' shares only the raw weights"):
        pool = sharedml.SessionPool(src, sessions=2, prepacking="off")
    with pool:
        assert pool.mechanism in sharedml.weights.zero_copy_mechanisms()
        assert "derive 0.1 MiB of weights" in pool.mechanism_reason
        assert "every session derives and keeps for itself" in pool.mechanism_reason


def test_prepacking_off_says_nothing_where_ort_derives_nothing(mlp_model: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sharedml.SessionPool(mlp_model, sessions=1, prepacking="off") as pool:
            assert "derive" not in pool.mechanism_reason
            assert pool.recipe.runtime_stats.derived_bytes == 0


@pytest.mark.capability("prepacked-save")
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is a Linux figure")
def test_with_prepacking_off_each_session_keeps_its_own_derived_weights(tmp_path: Path) -> None:
    """The warning's claim, measured: 'off' grows per session like plain sessions, 'auto' not."""
    src = conv_bn(tmp_path / "cb.onnx", layers=4, channels=256)  # 9 MiB of fused Conv weights
    derived = 4 * 256 * 256 * 9 * 4
    got = {
        name: sharedml.measure.measure(src, name, sessions=3).per_session_bytes or 0
        for name in ("naive", "shared", "shared-raw")
    }
    assert got["shared-raw"] > 0.7 * derived  # each 'off' session: its own fused weights
    assert got["shared-raw"] > 0.6 * got["naive"]  # about what a plain session holds
    assert got["shared"] < 0.2 * got["naive"]  # the default maps them once


def unet_1d(path: Path, channels: int) -> Path:
    """A 1-D U-Net: two inputs [N, 1, T] concatenated, Conv1d down twice (stride 2),
    ConvTranspose1d up twice, each joined to its skip connection by Concat, then a 1x1 Conv."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits: list[Any] = []
    nodes: list[Any] = []

    def weight(name: str, *shape: int) -> str:
        fan_in = int(np.prod(shape[1:]))
        array = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        inits.append(numpy_helper.from_array(array, name))
        return name

    def conv(x: str, cin: int, cout: int, name: str, *, k: int = 3, stride: int = 1) -> str:
        w, b = weight(f"{name}_w", cout, cin, k), weight(f"{name}_b", cout)
        nodes.append(
            helper.make_node("Conv", [x, w, b], [name], pads=[k // 2] * 2, strides=[stride])
        )
        nodes.append(helper.make_node("Relu", [name], [f"{name}_r"]))
        return f"{name}_r"

    def up(x: str, cin: int, cout: int, name: str) -> str:
        w, b = weight(f"{name}_w", cin, cout, 2), weight(f"{name}_b", cout)
        nodes.append(helper.make_node("ConvTranspose", [x, w, b], [name], strides=[2]))
        return name

    c = channels
    nodes.append(helper.make_node("Concat", ["audio", "cond"], ["x0"], axis=1))
    e1 = conv("x0", 2, c, "e1", k=5)
    e2 = conv(e1, c, 2 * c, "e2", k=5, stride=2)
    e3 = conv(e2, 2 * c, 4 * c, "e3", k=5, stride=2)
    nodes.append(helper.make_node("Concat", [up(e3, 4 * c, 2 * c, "u2"), e2], ["s2"], axis=1))
    d2 = conv("s2", 4 * c, 2 * c, "d2")
    nodes.append(helper.make_node("Concat", [up(d2, 2 * c, c, "u1"), e1], ["s1"], axis=1))
    d1 = conv("s1", 2 * c, c, "d1")
    nodes.append(
        helper.make_node("Conv", [d1, weight("out_w", 1, c, 1), weight("out_b", 1)], ["y"])
    )
    signal = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n", 1, "t"])
        for n in ("audio", "cond")
    ]
    graph = helper.make_graph(
        nodes,
        "unet1d",
        signal,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 1, "t"])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return save_model(model, path)


@pytest.mark.capability("prepacked-save")
@pytest.mark.parametrize("channels", [8, 64])  # every ConvTranspose filter inline / one saved
def test_a_1d_unet_pools_with_plain_orts_numerics_and_a_true_reason(
    tmp_path: Path, channels: int
) -> None:
    # A real 1-D U-Net got prepacking off because its saved model held no blob, while plain ORT
    # packs its ConvTranspose filters: 5.7e-6 away from plain ORT, and the reason said ORT
    # "neither prepacks nor derives any weight".
    src = unet_1d(tmp_path / "unet.onnx", channels)
    rng = np.random.default_rng(0)
    with sharedml.SessionPool(src, sessions=2) as pool:
        reason = pool.mechanism_reason
        assert "neither prepacks" not in reason
        if pool.mechanism in sharedml.weights.zero_copy_mechanisms():
            assert re.match(r"ORT packs 2 weight\(s\) of this model", reason), reason
            assert _prepacking_setting(pool) == "0"  # each session packs, as plain ORT
        else:  # the larger filter's blob is mapped; the smaller is packed per session
            assert pool.mechanism == "prepacked-file" and "prepacked blobs" in reason
        # Length 4 leaves 1 step at the bottleneck, where packed and unpacked ConvTranspose
        # kernels round differently; the same kernels run here as in plain ORT: bitwise.
        for t in (4, 8, 64):
            feed = {
                name: rng.standard_normal((2, 1, t)).astype(np.float32)
                for name in ("audio", "cond")
            }
            np.testing.assert_array_equal(pool.run(None, feed)[0], plain(src, feed))
