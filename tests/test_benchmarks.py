"""benchmarks/: run.py end to end on tiny models, and the pieces the figures rest on."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

if sys.platform != "linux":
    pytest.skip(
        "the benchmarks measure Linux's PSS and load average (resource, os.getloadavg)",
        allow_module_level=True,
    )

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _arena  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
import _harness  # noqa: E402
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
    assert "## Targets: pool against plain sessions, start-up" in md
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
    nan = ref[0].copy()
    nan[3] = np.nan
    wrong = _harness._compare([nan], ref)  # a NaN where the reference has a number
    assert not wrong["equal"] and wrong["max_abs_diff"] == wrong["max_rel_diff"] == float("inf")
    both = _harness._compare([nan], [nan])  # where the reference has the NaN too: equal there
    assert both["max_abs_diff"] == 0.0


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


# --------------------------------------------------------------------------------------------
def test_serving_configurations_name_sessions_weights_and_auto() -> None:
    assert serving._parse_config("pool:auto:batch:int4") == {
        "kind": "pool",
        "sessions": "auto",
        "flags": {"batch", "int4"},
    }
    assert serving._parse_config("pool:2:batch")["sessions"] == 2
    assert serving._parse_config("pool:2:batch:static")["flags"] == {"batch", "static"}
    assert serving._parse_config("single")["sessions"] == 1
    assert serving._parse_config("pool:1:batch:nocheck:check8")["flags"] == {
        "batch",
        "nocheck",
        "check8",
    }
    assert serving._check_within("check8") == 8 and serving._check_within("nocheck") is None
    for bad in ("plain:auto", "pool:2:int3", "pool:Auto:batch", "pool:1:batch:checkx"):
        with pytest.raises(SystemExit, match="unknown configuration"):
            serving._parse_config(bad)


# benchmarks/peer_openvino.py: sharedml against OpenVINO

import peer_openvino  # noqa: E402


def test_peer_openvino_configurations_are_parsed_and_refused_by_name() -> None:
    assert peer_openvino.parse_ov_config("ov:f32") == {
        "precision": "f32",
        "hint": "THROUGHPUT",
        "requests": None,
        "static": True,
    }
    latency = peer_openvino.parse_ov_config("ov:default:latency:req3:dynamic")
    assert latency == {"precision": "default", "hint": "LATENCY", "requests": 3, "static": False}
    for bad in ("ov:f64", "ov", "ov:f32:fast", "ov:f32:req0"):
        with pytest.raises(SystemExit, match="OpenVINO configuration"):
            peer_openvino.parse_ov_config(bad)
    assert [peer_openvino.family(c) for c in ("pool:2:batch", "plain:2", "ov:default")] == [
        "sharedml",
        "plain",
        "ov:default",
    ]
    configs, ov = ["pool:1"], ["ov:f32", "ov:f32:latency"]
    assert peer_openvino.configs_for(1, configs, ov) == ["pool:1", "ov:f32", "ov:f32:latency"]
    assert peer_openvino.configs_for(16, configs, ov) == ["pool:1", "ov:f32"]
    with pytest.raises(SystemExit, match="--ov-configs"):
        peer_openvino._parse(["--configs", "pool:1", "ov:f32"])


def _peer_row(
    round_: int, callers: int, config: str, rps: float, pss: float, **extra: Any
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "model": "mlp-full",
        "round": round_,
        "callers": callers,
        "config": config,
        "family": peer_openvino.family(config),
        "requests_per_s": rps,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "pss_mib": pss,
        "uss_mib": pss,
        "outputs_equal": True,
        "max_abs_diff": 0.0,
        "max_rel_diff": 0.0,
        "loadavg_start": [2.0, 2.0, 2.0],
        "extras": {},
    }
    if config.startswith("ov:"):
        row["extras"] = {"inference_precision_hint": "bf16" if "default" in config else "f32"}
    return row | extra


def _peer_results() -> list[dict[str, Any]]:
    rows = []
    # Per round at 16 callers: best sharedml / best OV f32 = 1.2, 1.0, 1.5 (median 1.2);
    # per-config medians would give 110 / 100 = 1.1 instead.
    for k, (a, b, ov) in enumerate([(120, 60, 100), (90, 110, 110), (150, 100, 100)]):
        rows += [
            _peer_row(k, 16, "pool:1", a, 50),
            _peer_row(k, 16, "pool:2:batch", b, 80),
            _peer_row(k, 16, "ov:f32", ov, 200),
            _peer_row(k, 16, "ov:default", 2 * ov, 100, max_rel_diff=0.01, outputs_equal=False),
            # fastest of all, but wrong: never the best sharedml configuration
            _peer_row(k, 16, "pool:2", 1000, 10, outputs_equal=False),
            {**_peer_row(k, 16, "pool:4:batch", 0, 0), "error": "exit 1: boom"},
            _peer_row(k, 1, "pool:1", 30, 50),
            _peer_row(k, 1, "ov:f32", 20, 200),
        ]
    return rows


def test_peer_openvino_ratios_are_best_against_best_per_round_then_the_median() -> None:
    (summary,) = peer_openvino.summarize(_peer_results())
    f32 = summary["ratios"]["16"]["ov:f32"]
    assert f32["rounds"] == pytest.approx([1.2, 110 / 110, 1.5])
    assert (f32["median"], f32["min"], f32["max"]) == pytest.approx((1.2, 1.0, 1.5))
    # OpenVINO's reduced precision counts although it differs from the reference
    assert summary["ratios"]["16"]["ov:default"]["median"] == pytest.approx(0.6)
    assert summary["ratios"]["1"]["ov:f32"]["median"] == pytest.approx(1.5)
    assert summary["ratios"]["1"]["ov:default"] is None  # not run with one caller
    # memory at 16 callers: the round's best sharedml config's PSS over the best OV's
    assert summary["memory"]["ov:f32"]["rounds"] == pytest.approx([0.25, 0.4, 0.25])
    assert summary["memory_callers"] == 16
    assert summary["ov_precisions"] == {"ov:f32": ["f32"], "ov:default": ["bf16"]}
    failed = [c for c in summary["configs"] if c["config"] == "pool:4:batch"]
    assert failed[0]["errors"] == ["exit 1: boom"] * 3 and failed[0]["requests_per_s"] is None


def test_peer_openvino_compressed_weights_compete_in_a_class_of_their_own() -> None:
    assert peer_openvino.family("pool:2:batch:int4") == "sharedml:int4"
    assert peer_openvino.family("pool:1:int8") == "sharedml:int8"
    assert peer_openvino.family("pool:2:batch:static") == "sharedml:static"
    rows = _peer_results()
    for k, rps in enumerate([300, 150, 250]):  # faster than every float pool, and it differs
        rows.append(
            _peer_row(k, 16, "pool:2:batch:int4", rps, 20, outputs_equal=False, max_rel_diff=0.05)
        )
    (summary,) = peer_openvino.summarize(rows)
    # The float comparison is unchanged: a compressed pool never counts as float sharedml.
    assert summary["ratios"]["16"]["ov:f32"]["median"] == pytest.approx(1.2)
    int4 = summary["compressed"]["int4"]
    assert int4["ratios"]["16"]["ov:default"]["rounds"] == pytest.approx([1.5, 150 / 220, 1.25])
    assert int4["ratios"]["1"]["ov:f32"] is None  # no compressed run with one caller
    assert int4["memory"]["ov:default"]["median"] == pytest.approx(0.2)
    assert int4["max_rel_diff"] == pytest.approx(0.05) and "int8" not in summary["compressed"]
    doc = {"summary": [summary], "models": [{"name": "mlp-full"}], "results": rows}
    md = peer_openvino.render_markdown(doc)
    assert "| MLP | int4 | 2.50x (1.36-3.00) | 1.25x (0.68-1.50) | n/a | n/a |" in md
    assert md.rstrip().count("| 5.0e-02 |") == 1


def test_peer_openvino_renders_the_comparison_table() -> None:
    doc = {
        "command": "python benchmarks/peer_openvino.py",
        "settings": {"rounds": 3, "warmup_s": 0.5, "duration_s": 3.0},
        "machine": {"cpu_model": "CPU", "logical_cores": 2, "cpu_flags": ["avx512_bf16"]},
        "models": [{"name": "mlp-full", "weights_bytes": 100 * (1 << 20)}],
        "results": _peer_results(),
        "wall_s": 60.0,
    }
    doc["summary"] = peer_openvino.summarize(doc["results"])
    md = peer_openvino.render_markdown(doc)
    assert (
        "| model | 16 callers vs OV f32 | 16 callers vs OV default (bf16) | 1 caller vs OV f32 "
        "| 1 caller vs OV default (bf16) | memory vs OV f32 | memory vs OV default (bf16) |" in md
    )
    assert (
        "| MLP, 100 MiB | 1.20x (1.00-1.50) | 0.60x (0.50-0.75) | 1.50x (1.50-1.50) | n/a "
        "| 0.25x (0.25-0.40) | 0.50x (0.50-0.80) |" in md
    )
    assert "| 16 | pool:4:batch | FAILED: exit 1: boom |" in md
    assert "| 16 | ov:default | 200.0 |" in md and "| bf16 | DIFFER (1.0e-02) |" in md


def test_peer_openvino_without_openvino_says_how_to_install_it(tmp_path: Path) -> None:
    code = (
        "import runpy, sys\n"
        "sys.modules['openvino'] = None  # as without the peer extra\n"
        f"sys.argv = ['peer_openvino.py', '--quick', '--out-dir', {str(tmp_path)!r}]\n"
        f"runpy.run_path({str(BENCHMARKS / 'peer_openvino.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "openvino is not installed: pip install -e '.[peer]' (a benchmark-only extra)"
    ]
    assert not any(tmp_path.iterdir())  # nothing generated before it said so


@pytest.mark.slow
def test_peer_openvino_quick_run_checks_every_configuration(tmp_path: Path) -> None:
    pytest.importorskip("openvino", reason="the peer extra (OpenVINO) is not installed")
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [
            sys.executable, str(BENCHMARKS / "peer_openvino.py"),
            "--quick", "--models", "mlp", "--callers", "2",
            "--out-dir", str(tmp_path / "out"), "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    rows = {r["config"]: r for r in doc["results"]}
    assert set(rows) == {"pool:1", "pool:2:batch", "ov:f32", "ov:default"}
    for row in rows.values():
        assert "error" not in row, row
        assert row["callers"] == 2 and row["requests"] > 0 and row["outputs_checked"] >= 2
        assert row["pss_mib"] > 0 and len(row["loadavg_start"]) == 3
    assert rows["pool:1"]["outputs_equal"] and rows["ov:f32"]["outputs_equal"]
    assert rows["pool:2:batch"]["window_batches"] > 0
    assert 1 <= rows["pool:2:batch"]["mean_batch_rows"] <= 2  # two callers, one row each
    assert rows["ov:f32"]["extras"]["inference_precision_hint"] == "f32"
    assert rows["ov:f32"]["extras"]["performance_hint"] == "THROUGHPUT"
    assert rows["ov:f32"]["extras"]["infer_requests"] == 2  # one per caller
    assert rows["ov:default"]["extras"]["inference_precision_hint"] in ("f32", "bf16", "f16")
    (summary,) = doc["summary"]
    assert summary["ratios"]["2"]["ov:f32"]["median"] > 0
    assert "| model | 2 callers vs OV f32 |" in out.with_suffix(".md").read_text()


def test_shared_arena_is_refused_for_providers_without_one() -> None:
    assert _arena.register_shared_arena("CPUExecutionProvider") is False


def test_a_static_int8_pool_serves_a_model_calibrated_apart_from_the_measured_inputs(
    tmp_path: Path,
) -> None:
    from tools.realistic_models import resnet_like

    info = resnet_like(tmp_path / "resnet.onnx", size="tiny")
    spec = {
        "model": str(info.path),
        "name": info.name,
        "inputs": {k: [str(v[0]), list(v[1])] for k, v in info.inputs.items()},
        "seq": 16,
        "cache_dir": str(tmp_path / "out" / "cache"),
        "providers": ["CPUExecutionProvider"],
        "config": "pool:1:batch:static",
    }
    server, _ = serving._server(spec)
    try:
        static = serving._static_model(spec)
        ops = {n.op_type for n in onnx.load(static).graph.node}
        assert "QuantizeLinear" in ops
        feed = {"pixel_values": np.random.default_rng(0).standard_normal((1, 3, 224, 224))}
        feed = {k: v.astype(np.float32) for k, v in feed.items()}
        got = server.run(feed)[0]
    finally:
        server.close()
    int8 = ort.InferenceSession(static, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    float32 = ort.InferenceSession(str(info.path), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, int8, rtol=0, atol=1e-5 * np.abs(int8).max())
    assert not np.allclose(got, float32.run(None, feed)[0], rtol=0, atol=1e-5)  # not the float


@pytest.mark.slow
def test_activation_memory_runs_each_configuration_in_a_fresh_process(tmp_path: Path) -> None:
    out = tmp_path / "activation.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "activation_memory.py"),
            "--models", "gru",
            "--size", "tiny",
            "--sessions", "2",
            "--rounds", "3",
            "--configs", "plain", "pool:patterns+noarena",
            "--json", str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["config"] for r in results] == ["plain", "pool:patterns+noarena"]
    for r in results:
        assert isinstance(r["held_bytes"], int) and isinstance(r["trimmed_bytes"], int)
        assert r["cpu_ms_per_run"] > 0
