"""benchmarks/: run.py end to end on tiny models, and the pieces the figures rest on."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _harness  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import serving  # noqa: E402

REQUIRED_STRATEGIES = ("naive", "single", "shared", "shared-private-packs", "shared-raw")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "results" / "tiny.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "run.py"),
            "--size", "tiny",
            "--models", "mlp",
            "--sessions", "1", "2",
            "--repeats", "1",
            "--warmup-s", "0.05",
            "--duration-s", "0.1",
            "--out-dir", str(tmp / "out"),
            "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads(out.read_text())


@pytest.mark.slow
def test_run_writes_results_with_machine_info(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, doc = tiny_run
    assert doc["schema"] == "sharedml-benchmarks/1"
    machine = doc["machine"]
    assert machine["onnxruntime"] == ort.__version__
    assert machine["logical_cores"] >= 1
    assert machine["memory_total_gib"] > 0
    assert doc["settings"]["sessions"] == [1, 2]
    assert doc["failures"] == []

    results = doc["results"]
    assert isinstance(results, list)
    combos = {(r["model"], r["strategy"], r["sessions"]) for r in results}
    assert combos == {("mlp", s, n) for s in _harness.DEFAULT_STRATEGIES for n in (1, 2)}
    for row in results:
        assert row["repeats"] == 1
        assert row["threads"] == row["sessions"]
        for metric in ("pss_mib", "create_s", "first_run_ms", "throughput_b1", "throughput_b8"):
            summary = row[metric]
            assert set(summary) >= {"median", "min", "max", "values"}, metric
            assert summary["min"] <= summary["median"] <= summary["max"]
        assert row["throughput_b1"]["median"] > 0
        assert row["throughput_b8"]["median"] > 0
        assert row["create_s"]["median"] > 0
        assert row["vs_naive"]["pss_mib"] is not None
    pools = [r for r in results if r["strategy"].startswith("shared")]
    assert all(r["mechanism"] for r in pools)
    assert {t["strategy"] for t in doc["targets"]} == set(_harness.DEFAULT_STRATEGIES) - {"naive"}


@pytest.mark.slow
def test_every_strategy_matches_plain_outputs(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    _, doc = tiny_run
    for row in doc["results"]:
        assert row["outputs_equal"] is True, row["strategy"]
        # each session at batch 1 and 8, plus the first run
        assert row["outputs_checked"] == 2 * row["sessions"] + 1
        assert row["max_abs_diff"]["max"] < 1e-3


@pytest.mark.slow
def test_markdown_and_chart_are_written(tiny_run: tuple[Path, dict[str, Any]]) -> None:
    out, doc = tiny_run
    md = out.with_suffix(".md").read_text()
    assert "## Issue 6 figures" in md
    assert "| strategy | N | PSS MiB |" in md
    for name in REQUIRED_STRATEGIES:
        assert f"| {name} | 2 |" in md
    assert doc["command"] in md
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_render_rebuilds_the_report_from_the_json(
    tiny_run: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out, _ = tiny_run
    copy = tmp_path / "again.json"
    copy.write_text(out.read_text())
    subprocess.run(
        [sys.executable, str(BENCHMARKS / "run.py"), "--render", str(copy), "--no-png"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert copy.with_suffix(".md").read_text() == out.with_suffix(".md").read_text()


def test_required_strategies_run_by_default() -> None:
    assert set(REQUIRED_STRATEGIES) <= set(_harness.DEFAULT_STRATEGIES)
    for name in REQUIRED_STRATEGIES:
        assert _harness.STRATEGIES[name].description


def test_a_strategy_is_added_with_a_decorator() -> None:
    @_harness.strategy("test-extra", "for this test", copies_fixed=1, copies_per_session=1)
    def _extra(req: _harness.OpenRequest) -> _harness.Opened:
        raise NotImplementedError

    try:
        assert _harness.STRATEGIES["test-extra"].opener is _extra
        with pytest.raises(ValueError, match="registered twice"):
            _harness.strategy("test-extra", "again", copies_fixed=1, copies_per_session=1)(_extra)
    finally:
        del _harness.STRATEGIES["test-extra"]


def test_throughput_window_counts_straddling_runs_by_fraction() -> None:
    spans = [(0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 5.0)]
    # window [1.5, 3.0]: half of the 2nd run, half of the 3rd
    assert _harness._window_runs(spans, 1.5, 3.0) == pytest.approx(1.0)
    assert _harness._window_runs(spans, 0.0, 5.0) == pytest.approx(4.0)
    assert _harness._window_runs(spans, 5.0, 6.0) == 0.0


def test_compare_flags_differences_beyond_tolerance() -> None:
    import numpy as np

    ref = [np.linspace(-1, 1, 100, dtype=np.float32)]
    same = _harness._compare([ref[0] * (1 + 1e-6)], ref)
    assert same["equal"] and same["max_abs_diff"] < 1e-5
    off = _harness._compare([ref[0] + 1e-2], ref)
    assert not off["equal"] and off["max_abs_diff"] == pytest.approx(1e-2, rel=1e-3)
    assert not _harness._compare([ref[0][:10]], ref)["equal"]


def test_without_matplotlib_the_run_skips_the_chart_with_a_note(tmp_path: Path) -> None:
    results = tmp_path / "quick.json"
    results.write_text((BENCHMARKS / "results" / "quick.json").read_text())
    code = (
        "import runpy, sys\n"
        "sys.modules['matplotlib'] = None  # as after a plain pip install .\n"
        f"sys.argv = ['run.py', '--render', {str(results)!r}]\n"
        f"runpy.run_path({str(BENCHMARKS / 'run.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "matplotlib is not installed: no chart" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["quick.json", "quick.md"]


def test_the_serving_sweep_runs_through_run_py_and_checks_every_output(tmp_path: Path) -> None:
    out = tmp_path / "serving.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "run.py"), "serving",
            "--size", "tiny",
            "--models", "mlp",
            "--callers", "3",
            "--configs", "plain:2", "pool:1:batch", "pool:1:batch:serialized",
            "pool:2:batch:views:max4:buckets",
            "--warmup-s", "0.05",
            "--duration-s", "0.2",
            "--out-dir", str(tmp_path / "out"),
            "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (model,) = json.loads(out.read_text())["models"]
    configs = {c["name"]: c for c in model["configs"]}
    assert set(configs) == {
        "plain:2",
        "pool:1:batch",
        "pool:1:batch:serialized",
        "pool:2:batch:views:max4:buckets",
    }
    for c in configs.values():
        assert c["callers"] == 3 and c["requests"] > 0 and c["outputs_equal"], c
        assert c["p50_ms"] <= c["p99_ms"]
    assert configs["pool:1:batch"]["batching"] and not configs["plain:2"]["batching"]
    assert configs["pool:1:batch"]["batches"] > 0


# --------------------------------------------------------------------------------------------
# benchmarks/serving.py: what a window counts


def _closed_loop_spans(callers: int, latency_s: float, until_s: float) -> list[tuple[float, float]]:
    """Synthetic spans: each caller sends back-to-back requests of one latency, staggered."""
    spans = []
    for c in range(callers):
        t = c * latency_s / callers
        while t < until_s:
            spans.append((t, t + latency_s))
            t += latency_s
    return spans


def test_a_window_counts_every_request_that_completes_in_it() -> None:
    # 16 callers at 1 s a request, a 3 s window: 16 req/s. Each caller has one request in
    # flight when the window opens; counting only requests that also started inside it would
    # give 32 requests (10.7 req/s) instead of 48.
    spans = _closed_loop_spans(callers=16, latency_s=1.0, until_s=10.0)
    done = serving.completed_in_window(spans, 2.01, 5.01)
    assert len(done) == 48
    assert done == pytest.approx([1.0] * 48)
    summary = serving.latency_summary(done, 3.0)
    assert summary["requests_per_s"] == pytest.approx(16.0)
    assert summary["p50_ms"] == pytest.approx(1000.0) and summary["p99_ms"] == pytest.approx(1000.0)


def test_a_window_counts_a_request_once_where_it_ends() -> None:
    spans = [(0.0, 1.5), (1.5, 2.5), (2.5, 4.5), (4.5, 5.0)]
    assert serving.completed_in_window(spans, 1.0, 4.0) == [1.0, 1.5]  # ends at 1.5 and 2.5
    assert serving.completed_in_window(spans, 4.0, 4.5) == [2.0]
    assert serving.completed_in_window(spans, 5.0, 6.0) == []
    assert serving.latency_summary([], 1.0)["p50_ms"] is None


def test_a_failing_caller_stops_the_closed_loop_with_its_error() -> None:
    calls = {"n": 0}
    lock = threading.Lock()

    def run(feed: dict[str, Any]) -> list[int]:
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n > 3:  # every caller's first request passes, the loop's first one fails
            raise RuntimeError("the server broke")
        return [0]

    raised: list[BaseException] = []

    def measure() -> None:
        try:  # an hour-long window: only the failure can end it in time
            serving.closed_loop(
                run, [{}], 3, warmup_s=3600.0, duration_s=3600.0, check=lambda c, i, out: None
            )
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=measure, daemon=True)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive(), "the closed loop went on measuring a failed server"
    assert len(raised) == 1 and str(raised[0]) == "the server broke"


def test_a_real_models_symbolic_axes_are_fed_as_batch_and_sequence(tmp_path: Path) -> None:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper

    sys.path.insert(0, str(REPO))
    from tools import realistic_models as rm

    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "seq_len"])
    fixed = helper.make_tensor_value_info("pixels", TensorProto.FLOAT, [1, 3, None])
    out = helper.make_tensor_value_info("out", TensorProto.INT64, None)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["input_ids"], ["out"])], "g", [ids, fixed], [out]
    )
    path = tmp_path / "exported.onnx"
    onnx.save(helper.make_model(graph), path)

    meta = serving._external_model(path)
    assert meta["inputs"] == {
        "input_ids": ["int64", ["batch", "seq"]],
        "pixels": ["float32", [1, 3, "seq"]],
    }
    info = rm.ModelInfo(
        path=str(path),
        name="exported",
        weights_bytes=0,
        inputs={k: (np.dtype(v[0]), tuple(v[1])) for k, v in meta["inputs"].items()},
        description="exported",
        vocab_size=meta["vocab_size"],
    )
    feeds = rm.sample_inputs(info, batch=1, seq=32)
    assert feeds["input_ids"].shape == (1, 32) and feeds["pixels"].shape == (1, 3, 32)


def test_compare_gives_each_output_its_own_scale() -> None:
    import numpy as np

    # Logits off by 1 on a scale of 100 (1%), and an exact small second output: 1%, not 100%.
    ref = [np.array([100.0, -50.0], np.float32), np.array([1.0, 0.5], np.float32)]
    result = _harness._compare([ref[0] + 1, ref[1]], ref)
    assert result["max_abs_diff"] == pytest.approx(1.0)
    assert result["max_rel_diff"] == pytest.approx(0.01)
    assert _harness._compare([ref[0] + 1, ref[1]], ref, rtol=0.05)["equal"]
    lenient, strict = _harness._Checks(rtol=0.05), _harness._Checks()
    for checks in (lenient, strict):
        checks.add([ref[0] + 1, ref[1]], ref)
    assert lenient.as_dict()["outputs_equal"] and not strict.as_dict()["outputs_equal"]
