"""Soak: 100k runs through one SessionPool, good and bad feeds mixed, RSS sampled all along.

A serving process runs for weeks; a leak of a few hundred bytes per run, or per failed run, is
gigabytes by then. This drives ``--runs`` runs (default 100 000) from ``--threads`` threads
through a pool of ``--sessions`` sessions over a small generated MLP. One run in four (by
default) gets a bad feed: wrong shape, wrong rank, wrong dtype, a missing input or an unknown
input name. It checks, and reports:

- every good output equals the single-session reference for that input, bit for bit;
- every bad feed was rejected (raised), and no good feed raised;
- at the end every session is present and idle (``pool.stats()``), none was replaced;
- RSS: sampled every ``--sample-every`` runs. The first ``--warmup`` fraction of the runs is
  warm-up (allocator arenas, ORT's per-session buffers and Python's caches settle there). The
  bound: RSS after warm-up never exceeds the RSS at the end of warm-up by more than
  ``--max-growth-mib`` (default 5 MiB). The least-squares slope over the post-warm-up samples
  is reported too, in KiB per 10k runs.

Exit status 0 when every check holds, 1 otherwise. ::

    python benchmarks/soak.py                       # 100k runs, summary + benchmarks/out/soak.json
    python benchmarks/soak.py --runs 5000 --json /tmp/soak.json   # what the test suite runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import psutil
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
_MIB = 2**20


def build_model(path: Path, *, dim: int, layers: int, seed: int = 0) -> Path:
    """An MLP ``y = relu(... relu(x @ W0 + b0) ...)`` on ``x: float32[batch, dim]``."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x = "x"
    for i in range(layers):
        w = (rng.standard_normal((dim, dim)) * np.sqrt(2.0 / dim)).astype(np.float32)
        b = (rng.standard_normal(dim) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes += [
            helper.make_node("MatMul", [x, f"W{i}"], [f"mm{i}"]),
            helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"add{i}"]),
            helper.make_node("Relu", [f"add{i}"], [f"h{i}"]),
        ]
        x = f"h{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "soak_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, str(path))
    return path


def bad_feeds(dim: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        ("wrong shape", {"x": np.zeros((2, dim + 1), np.float32)}),
        ("wrong rank", {"x": np.zeros((dim,), np.float32)}),
        ("wrong dtype", {"x": np.zeros((2, dim), np.float64)}),
        ("missing input", {}),
        ("unknown input", {"z": np.zeros((2, dim), np.float32)}),
    ]


@dataclasses.dataclass
class Tally:
    """Outcome counters of the runs (one per thread, summed at the end)."""

    good_ok: int = 0
    good_wrong: int = 0
    good_errors: int = 0
    bad_rejected: int = 0
    bad_accepted: int = 0
    first_problems: list[str] = dataclasses.field(default_factory=list)

    def problem(self, text: str) -> None:
        """Keep the first few problems for the report."""
        if len(self.first_problems) < 10:
            self.first_problems.append(text)


def soak(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak in a temporary folder (removed afterwards); returns the JSON report."""
    work = Path(tempfile.mkdtemp(prefix="sharedml-soak-"))
    try:
        return _soak(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _soak(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import onnxruntime as ort

    import sharedml

    model = build_model(work / "mlp.onnx", dim=args.dim, layers=args.layers, seed=args.seed)
    cache = args.cache_dir or str(work / "cache")
    rng = np.random.default_rng(args.seed + 1)
    goods = [
        {"x": rng.standard_normal((1 + i % 4, args.dim)).astype(np.float32)}
        for i in range(args.distinct_inputs)
    ]
    bads = bad_feeds(args.dim)

    proc = psutil.Process()
    with sharedml.SessionPool(model, sessions=args.sessions, cache_dir=cache) as pool:
        # Reference: one of the pool's own sessions (same weights route, same kernels), alone,
        # before any concurrency.
        with pool.session() as single:
            reference = [single.run(None, g)[0] for g in goods]

        tally = Tally()
        lock = threading.Lock()
        next_run = [0]
        # Seconds per run, waiting included. Written in place (every page touched now), so
        # that measuring does not itself grow RSS during the soak.
        latencies = np.full(args.runs, np.nan)
        samples: list[tuple[int, int]] = [(0, proc.memory_info().rss)]
        barrier = threading.Barrier(args.threads)

        def worker() -> None:
            local = Tally()
            barrier.wait()
            while True:
                with lock:
                    i = next_run[0]
                    if i >= args.runs:
                        break
                    next_run[0] += 1
                bad = args.bad_every and i % args.bad_every == args.bad_every - 1
                label, k = "", 0
                if bad:
                    label, feed = bads[(i // args.bad_every) % len(bads)]
                else:
                    k = i % len(goods)
                    feed = goods[k]
                began = time.perf_counter()
                try:
                    out = pool.run(None, feed)[0]
                except Exception as exc:
                    if bad:
                        local.bad_rejected += 1
                    else:
                        local.good_errors += 1
                        local.problem(f"run {i}: good feed raised {type(exc).__name__}: {exc}")
                else:
                    if bad:
                        local.bad_accepted += 1
                        local.problem(f"run {i}: bad feed accepted ({label})")
                    elif np.array_equal(out, reference[k]):
                        local.good_ok += 1
                    else:
                        local.good_wrong += 1
                        local.problem(f"run {i}: output differs from the reference")
                latencies[i] = time.perf_counter() - began
                if (i + 1) % args.sample_every == 0:
                    rss = proc.memory_info().rss
                    with lock:
                        samples.append((i + 1, rss))
            with lock:
                for field in (
                    "good_ok",
                    "good_wrong",
                    "good_errors",
                    "bad_rejected",
                    "bad_accepted",
                ):
                    setattr(tally, field, getattr(tally, field) + getattr(local, field))
                tally.first_problems += local.first_problems[: 10 - len(tally.first_problems)]

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.timeout_s)
        elapsed = time.perf_counter() - start
        hung = sum(t.is_alive() for t in threads)
        stats = pool.stats()

    samples.sort()
    warm_runs = int(args.runs * args.warmup)
    after = [(n, rss) for n, rss in samples if n >= warm_runs]
    baseline = after[0][1] if after else samples[-1][1]
    peak_after = max(rss for _, rss in after) if after else baseline
    growth = peak_after - baseline
    slope = 0.0
    if len(after) >= 3:
        xs = np.array([n for n, _ in after], float)
        ys = np.array([rss for _, rss in after], float)
        slope = float(np.polyfit(xs, ys, 1)[0]) * 10_000 / 1024  # KiB per 10k runs

    n_bad = sum(
        1 for i in range(args.runs) if args.bad_every and i % args.bad_every == args.bad_every - 1
    )
    checks = {
        "no thread hung": hung == 0,
        "every good output correct": tally.good_wrong == 0 and tally.good_errors == 0,
        "every bad feed rejected": tally.bad_accepted == 0 and tally.bad_rejected == n_bad,
        "all runs accounted for": tally.good_ok + tally.bad_rejected == args.runs,
        "all sessions present and idle": stats.sessions == args.sessions and stats.busy == 0,
        "no session replaced": stats.replaced == 0 and stats.created == args.sessions,
        # (+1: the checkout that computed the reference)
        "pool counted every run": stats.runs == args.runs + 1 and stats.failed_runs == n_bad,
        f"RSS growth after warm-up < {args.max_growth_mib} MiB": growth
        < args.max_growth_mib * _MIB,
    }
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "config": {
            k: getattr(args, k)
            for k in (
                "runs",
                "threads",
                "sessions",
                "dim",
                "layers",
                "bad_every",
                "sample_every",
                "warmup",
                "max_growth_mib",
                "distinct_inputs",
                "seed",
            )
        },
        "elapsed_s": round(elapsed, 2),
        "runs_per_s": round(args.runs / elapsed, 1) if elapsed else None,
        "good_ok": tally.good_ok,
        "good_wrong": tally.good_wrong,
        "good_errors": tally.good_errors,
        "bad_rejected": tally.bad_rejected,
        "bad_accepted": tally.bad_accepted,
        "problems": tally.first_problems,
        "final_stats": dataclasses.asdict(stats),
        "latency_ms": _percentiles(latencies),
        "rss": {
            "start_mib": round(samples[0][1] / _MIB, 2),
            "warmup_end_mib": round(baseline / _MIB, 2),
            "peak_after_warmup_mib": round(peak_after / _MIB, 2),
            "final_mib": round(samples[-1][1] / _MIB, 2),
            "growth_after_warmup_mib": round(growth / _MIB, 3),
            "slope_kib_per_10k_runs": round(slope, 2),
            "samples": [[n, round(rss / _MIB, 3)] for n, rss in samples],
        },
        "environment": {
            "python": platform.python_version(),
            "onnxruntime": ort.__version__,
            "sharedml": sharedml.__version__,
            "mechanism": pool.mechanism,
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
    }


def _percentiles(latencies: np.ndarray) -> dict[str, float]:
    if not latencies.size:
        return {}
    ms = latencies * 1000
    points = {"p50": 50, "p90": 90, "p99": 99, "p99.9": 99.9}
    out = {name: round(float(np.percentile(ms, q)), 3) for name, q in points.items()}
    out["max"] = round(float(ms.max()), 3)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bad-every", type=int, default=4, help="every Nth run is bad (0: none)")
    parser.add_argument("--distinct-inputs", type=int, default=16)
    parser.add_argument("--sample-every", type=int, default=0, help="default: runs / 200")
    parser.add_argument("--warmup", type=float, default=0.1, help="fraction of runs")
    parser.add_argument("--max-growth-mib", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "out" / "soak.json"))
    args = parser.parse_args(argv)
    if args.sample_every <= 0:
        args.sample_every = max(1, args.runs // 200)

    result = soak(args)
    rss = result["rss"]
    print(
        f"soak: {args.runs} runs ({result['bad_rejected']} bad) from {args.threads} threads on "
        f"{args.sessions} sessions in {result['elapsed_s']} s ({result['runs_per_s']} runs/s)"
    )
    print(
        f"  good outputs correct {result['good_ok']}, wrong {result['good_wrong']}, raised "
        f"{result['good_errors']}; bad feeds rejected {result['bad_rejected']}, accepted "
        f"{result['bad_accepted']}"
    )
    print(
        f"  RSS start {rss['start_mib']} MiB, after warm-up ({args.warmup:.0%}) "
        f"{rss['warmup_end_mib']} MiB, peak after {rss['peak_after_warmup_mib']} MiB, final "
        f"{rss['final_mib']} MiB: growth {rss['growth_after_warmup_mib']} MiB "
        f"(bound {args.max_growth_mib} MiB), slope {rss['slope_kib_per_10k_runs']} KiB/10k runs"
    )
    print(f"  latency of pool.run (ms, waiting included): {result['latency_ms']}")
    print(f"  final pool stats: {result['final_stats']}")
    for name, passed in result["checks"].items():
        print(f"  [{'ok' if passed else 'FAIL'}] {name}")
    for problem in result["problems"]:
        print(f"  problem: {problem}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"  written: {out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
