"""CPU: sharing ORT's prepacked weights too (issue 6): route choice, outputs, cache, memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from _models import PLACEMENTS, build_model, feeds, save_model

import sharedml
from sharedml import _host, _prepack


@pytest.fixture(scope="module")
def mlp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("mlp")
    return Path(mlp(folder / "mlp.onnx", target_bytes=24 * 2**20, width=1024).path)


def plain(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feed)[0]


def test_auto_shares_prepacked_weights_where_ort_packs_them(mlp_model: Path) -> None:
    feed = {"input": np.random.default_rng(0).standard_normal((8, 1024)).astype(np.float32)}
    with sharedml.SessionPool(mlp_model, sessions=3) as pool:
        assert pool.mechanism == "prepacked-file"
        assert "prepacked blobs" in pool.mechanism_reason
        # Same packed kernels as a plain session: equal up to float reassociation.
        np.testing.assert_allclose(pool.run(None, feed)[0], plain(mlp_model, feed), rtol=1e-5)
        with pool.session() as a, pool.session() as b:
            np.testing.assert_array_equal(a.run(None, feed)[0], b.run(None, feed)[0])


def test_auto_keeps_raw_sharing_where_nothing_is_packed(tmp_path: Path) -> None:
    # 32x32 weights stay under ORT's packing sizes: nothing to gain from a saved copy.
    src = save_model(build_model(list(PLACEMENTS), dim=32), tmp_path / "m.onnx")
    with sharedml.SessionPool(src, sessions=2) as pool:
        assert pool.mechanism in sharedml.zero_copy_mechanisms()
        assert "neither prepacks nor derives" in pool.mechanism_reason


def test_forced_shared_prepacking_works_on_subgraph_models(tmp_path: Path) -> None:
    src = save_model(build_model(list(PLACEMENTS), dim=32), tmp_path / "m.onnx")
    with sharedml.SessionPool(src, sessions=2, prepacking="shared") as pool:
        assert pool.mechanism == "prepacked-file"
        for flag in (True, False):
            np.testing.assert_allclose(
                pool.run(None, feeds(32, flag=flag))[0],
                plain(src, feeds(32, flag=flag)),
                rtol=1e-5,
                atol=1e-6,
            )


@pytest.mark.parametrize(
    ("prepacking", "config"),
    [("off", "1"), (False, "1"), ("per-session", "0"), (True, "0")],
)
def test_explicit_prepacking_modes(mlp_model: Path, prepacking: object, config: str) -> None:
    seen: list[str] = []
    with sharedml.SessionPool(
        mlp_model,
        sessions=1,
        prepacking=prepacking,  # type: ignore[arg-type]
        configure=lambda so: seen.append(so.get_session_config_entry("session.disable_prepacking")),
    ) as pool:
        assert pool.mechanism in sharedml.zero_copy_mechanisms()
    assert seen == [config]


def test_bad_prepacking_values(mlp_model: Path) -> None:
    with pytest.raises(ValueError, match="prepacking must be"):
        sharedml.SessionPool(mlp_model, prepacking="sometimes")
    with pytest.raises(ValueError, match="mechanism='auto'"):
        sharedml.SessionPool(mlp_model, prepacking="shared", mechanism="ort-mmap")


def test_a_failed_build_falls_back_to_raw_sharing_with_a_warning(
    mlp_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise sharedml.SessionCreationError("simulated: ORT refused the optimized model")

    monkeypatch.setattr(_prepack, "build_prepacked_model", broken)
    with pytest.warns(RuntimeWarning, match="simulated"):
        pool = sharedml.SessionPool(mlp_model, sessions=1)
    with pool:
        assert pool.mechanism in sharedml.zero_copy_mechanisms()
        assert pool.run(None, {"input": np.ones((1, 1024), np.float32)})[0].shape == (1, 1024)
    with pytest.raises(sharedml.SessionCreationError, match="simulated"):
        sharedml.SessionPool(mlp_model, sessions=1, prepacking="shared")


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
from sharedml import _host
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
released = _host.release_freed_heap()
after = proc.memory_info().rss - before
print(json.dumps({"kept": kept, "released": released, "after": after}))
"""


@pytest.mark.skipif(not _host.heap_trim_available(), reason="malloc_trim is glibc's")
def test_release_freed_heap_gives_freed_heap_back_to_the_os() -> None:
    out = subprocess.run(
        [sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kept"] > 120 * 2**20, result  # glibc kept the freed heap...
    assert result["released"] is True
    assert result["after"] < 40 * 2**20, result  # ...until it was trimmed


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps")
def test_four_sessions_with_shared_prepacked_weights_cost_a_third_of_plain(
    mlp_model: Path,
) -> None:
    naive, shared = (
        sharedml.measure(mlp_model, s, sessions=4, dims={"batch": 8}) for s in ("naive", "shared")
    )
    assert shared.details["mechanism"] == "prepacked-file"
    assert naive.outputs_agree and shared.outputs_agree
    assert naive.total_bytes and shared.total_bytes is not None
    print(
        f"4 sessions, PSS growth: plain {naive.total_bytes / 2**20:.0f} MiB, shared prepacked "
        f"{shared.total_bytes / 2**20:.0f} MiB ({shared.total_bytes / naive.total_bytes:.2f}x)"
    )
    assert shared.total_bytes <= 0.35 * naive.total_bytes
