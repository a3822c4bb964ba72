"""A CPU session's arena gives a peak's memory back once the peak has passed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from _models import conv_model

import sharedml
from sharedml.pool import _arena

CHANNELS, SIZE = 32, 128  # 2 MiB a row for each activation


def test_a_session_shrinks_once_its_runs_stay_well_below_their_peak() -> None:
    peaks = _arena.ArenaPeaks()
    sess = type("Session", (), {})()  # any object a weak reference can hold
    quiet = _arena.QUIET_RUNS
    assert not peaks.shrink_due(sess, 16)
    assert [peaks.shrink_due(sess, 1) for _ in range(quiet)] == [False] * (quiet - 1) + [True]
    assert peaks.shrinks == 1
    # The run that shrank is the new peak: single rows from here on never shrink again.
    assert not any(peaks.shrink_due(sess, 1) for _ in range(3 * quiet))
    # A run near the peak interrupts the quiet runs; steady batches never shrink.
    assert not peaks.shrink_due(sess, 16)
    steady = [14, 16, 15, 16, 9, 16, 12, 8] * 3  # never at most 16 // FALL for QUIET_RUNS runs
    assert not any(peaks.shrink_due(sess, rows) for rows in steady)
    assert [peaks.shrink_due(sess, 2) for _ in range(quiet)].count(True) == 1
    assert peaks.shrinks == 2


def test_a_callers_own_run_options_are_never_replaced() -> None:
    peaks = _arena.ArenaPeaks()
    sess = type("Session", (), {})()
    mine = ort.RunOptions()
    big, small = {"x": np.zeros((16, 2))}, {"x": np.zeros((1, 2))}
    assert peaks.run_options(sess, big, None) is None
    for _ in range(_arena.QUIET_RUNS + 2):
        assert peaks.run_options(sess, small, mine) is mine
    for _ in range(_arena.QUIET_RUNS - 1):
        assert peaks.run_options(sess, small, None) is None
    shrinking = peaks.run_options(sess, small, None)
    assert shrinking is not None
    assert shrinking.get_run_config_entry("memory.enable_memory_arena_shrinkage") == "cpu:0"


_AFTER_A_PEAK = r"""
import ctypes, json, sys
import numpy as np, onnxruntime as ort, psutil
import sharedml
model, kind = sys.argv[1], sys.argv[2]
libc = ctypes.CDLL("libc.so.6")
def rss():
    libc.malloc_trim(0); return psutil.Process().memory_info().rss
one = np.random.default_rng(0).standard_normal((1, %(c)d, %(s)d, %(s)d)).astype(np.float32)
peak = np.repeat(one, 16, axis=0)
if kind == "pool":
    pool = sharedml.SessionPool(model, sessions=1, batching=False, create_in_background=False)
    run = lambda x: pool.run(None, {"x": x})
else:
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    run = lambda x: sess.run(None, {"x": x})
for _ in range(3):
    run(one)
before = rss()
for _ in range(2):
    run(peak)
at_peak = rss()
for _ in range(%(quiet)d + 2):
    out = run(one)
after = rss()
shrinks = pool.stats().arena_shrinks if kind == "pool" else 0
print(json.dumps({"peak": at_peak - before, "kept": after - before, "shrinks": shrinks}))
"""


def _after_a_peak(model: Path, kind: str) -> dict[str, Any]:
    code = _AFTER_A_PEAK % {"c": CHANNELS, "s": SIZE, "quiet": _arena.QUIET_RUNS}
    out = subprocess.run(
        [sys.executable, "-c", code, str(model), kind], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="trims the heap with glibc")
def test_a_pool_gives_a_peaks_memory_back_where_a_plain_session_keeps_it(
    tmp_path: Path,
) -> None:
    model = conv_model(tmp_path / "conv.onnx", channels=CHANNELS, size=SIZE)
    plain = _after_a_peak(model, "plain")
    pooled = _after_a_peak(model, "pool")
    mib = {
        k: {n: round(v / 2**20, 1) for n, v in d.items()}
        for k, d in (("plain", plain), ("pool", pooled))
    }
    print(mib)
    # 16 rows of two 2 MiB activations: the plain session's arena grew by tens of MiB, and
    # kept them while it ran single rows again.
    assert plain["peak"] > 24 * 2**20 and plain["kept"] > 0.8 * plain["peak"]
    assert pooled["peak"] > 24 * 2**20
    assert pooled["shrinks"] == 1
    assert pooled["kept"] < 0.25 * plain["kept"]


def test_a_cpu_pool_counts_its_shrinks_in_its_stats(tmp_path: Path) -> None:
    model = conv_model(tmp_path / "conv.onnx", channels=4, size=8)
    with sharedml.SessionPool(model, sessions=1, create_in_background=False) as pool:
        assert pool.stats().arena_shrinks == 0
        x = np.zeros((16, 4, 8, 8), np.float32)
        pool.run(None, {"x": x})
        for _ in range(_arena.QUIET_RUNS + 1):
            pool.run(None, {"x": x[:1]})
        assert pool.stats().arena_shrinks == 1


def test_a_cpu_pools_sessions_run_without_memory_patterns_unless_configure_says(
    tmp_path: Path,
) -> None:
    model = conv_model(tmp_path / "conv.onnx", channels=4, size=8)
    with sharedml.SessionPool(model, sessions=1, create_in_background=False) as pool:
        with pool.session() as sess:
            assert sess.get_session_options().enable_mem_pattern is False
        assert "Memory patterns are off" in pool.mechanism_reason
    seen: list[bool] = []

    def configure(so: Any) -> None:
        seen.append(so.enable_mem_pattern)  # the pool's setting arrives first
        so.enable_mem_pattern = True

    with (
        sharedml.SessionPool(
            model, sessions=1, create_in_background=False, configure=configure
        ) as pool,
        pool.session() as sess,
    ):
        assert sess.get_session_options().enable_mem_pattern is True
    assert seen and not any(seen)
