r"""C threads on one CPU session: plain ORT against the pool's session and its side-by-side runs.

Each configuration runs in its own process (``--config`` picks one; without it every one in
``--configs`` runs, each in a fresh child): C caller threads send one-row requests in a closed
loop, and the requests/s over ``--duration-s`` after ``--warmup-s`` are printed as one JSON line.

``plain``                 one ``InferenceSession`` (ORT's defaults), run by every caller at once
``plain:nopatterns``      the same with ``enable_mem_pattern=False``
``plain:noarena``         ``enable_mem_pattern=False`` and ``enable_cpu_mem_arena=False``
``plain:cores``           ORT's defaults but ``intra_op_num_threads`` = the usable cores, as the
                          pool's session has them (ORT's own default counts physical cores)
``pool:session``          the default merging pool's own session, checked out and run directly
                          by every caller (no scheduler)
``pool:side``             the default merging pool, merging forced off: every request side by
                          side on its session (through the scheduler)
``pool:default``          the default merging pool (``batching="auto"``) as shipped
``...:patterns`` / ``...:nopatterns`` on ``pool:*``: ``configure`` turning memory patterns on /
                          off after the pool's own choice

Usage::

    python benchmarks/side_by_side.py --models minilm --callers 16 --json out.json

Forcing ``pool:side`` patches the pool's merge decision (``MergeGain``); nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [
    "plain",
    "plain:cores",
    "plain:nopatterns",
    "plain:noarena",
    "pool:session",
    "pool:side",
    "pool:side:nopatterns",
    "pool:default",
]
GENERATORS = {"minilm": "minilm_like", "resnet": "resnet_like", "mlp": "mlp", "bert": "bert_like"}


def _feeds(sess: Any, n: int, seq: int) -> list[dict[str, Any]]:
    import numpy as np

    feeds = []
    for i in range(n):
        rng, feed = np.random.default_rng(i), {}
        for x in sess.get_inputs():
            shape = [
                1 if k == 0 else (d if isinstance(d, int) else seq) for k, d in enumerate(x.shape)
            ]
            if "int64" in x.type:
                high = 2 if "mask" in x.name else 1000
                feed[x.name] = (
                    np.ones(shape, np.int64) if high == 2 else rng.integers(0, high, shape)
                )
            else:
                feed[x.name] = rng.standard_normal(shape).astype(np.float32)
        feeds.append(feed)
    return feeds


def _host() -> dict[str, Any]:
    """The CPUs, and the onnxruntime that ran (the figures are per host and version)."""
    import onnxruntime as ort
    import psutil

    return {
        "cpus": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "onnxruntime": ort.__version__,
    }


def _threads() -> int:
    """This process's threads now (Linux), else 0."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _configure(config: str) -> Any:
    if config.endswith(":patterns") or config.endswith(":nopatterns"):
        on = config.endswith(":patterns")

        def configure(so: Any) -> None:
            so.enable_mem_pattern = on

        return configure
    return None


def child(
    config: str, model: str, callers: int, warmup_s: float, duration_s: float, seq: int
) -> dict[str, Any]:
    import onnxruntime as ort

    import sharedml

    probe = ort.InferenceSession(model)
    feeds = _feeds(probe, 32, seq)
    del probe
    info: dict[str, Any] = {"config": config, "callers": callers}
    pool = None
    if config.startswith("plain"):
        so = ort.SessionOptions()
        if config == "plain:cores":
            so.intra_op_num_threads = len(os.sched_getaffinity(0))
        elif config != "plain":
            so.enable_mem_pattern = False
        if config == "plain:noarena":
            so.enable_cpu_mem_arena = False
        threads = _threads()
        sess = ort.InferenceSession(model, so)
        info["session_threads"] = _threads() - threads  # its intra-op pool, less the caller

        def run(feed: dict[str, Any]) -> Any:
            return sess.run(None, feed)
    else:
        if config.startswith("pool:side"):
            from sharedml.pool import _payoff

            _payoff.MergeGain.runs_side_by_side = property(lambda self: True)  # type: ignore[method-assign,assignment]
            _payoff.MergeGain.merges = lambda self: False  # type: ignore[method-assign]
        pool = sharedml.SessionPool(model, batching="auto", configure=_configure(config))
        info["mechanism_reason"] = pool.mechanism_reason
        if config.startswith("pool:session"):
            checkout = pool.session()
            own = checkout.__enter__()
            info["memory_patterns"] = bool(own.get_session_options().enable_mem_pattern)

            def run(feed: dict[str, Any]) -> Any:
                return own.run(None, feed)
        else:

            def run(feed: dict[str, Any]) -> Any:
                return pool.run(None, feed)

    for feed in feeds[:4]:
        run(feed)
    stop, counts = threading.Event(), [0] * callers
    ready = threading.Barrier(callers + 1)

    def caller(c: int) -> None:
        ready.wait()
        k = 0
        while not stop.is_set():
            run(feeds[(c * 7 + k) % len(feeds)])
            k += 1
            counts[c] += 1

    threads = [threading.Thread(target=caller, args=(c,)) for c in range(callers)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(warmup_s)
    n0, t0, c0 = sum(counts), time.perf_counter(), time.process_time()
    time.sleep(duration_s)
    n1, t1, c1 = sum(counts), time.perf_counter(), time.process_time()
    stop.set()
    for t in threads:
        t.join()
    info["requests_per_s"] = round((n1 - n0) / (t1 - t0), 1)
    info["cpu_cores_busy"] = round((c1 - c0) / (t1 - t0), 2)
    if pool is not None and not config.startswith("pool:session"):
        stats = pool.stats()
        info["merge_pauses"] = stats.merge_pauses
        info["mean_batch_rows"] = round(stats.batched_rows / max(stats.batches, 1), 2)
        info["batching_reason"] = pool.batching_reason
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["minilm"], choices=sorted(GENERATORS))
    p.add_argument("--configs", nargs="+", default=CONFIGS)
    p.add_argument("--config", help=argparse.SUPPRESS)  # the child's one configuration
    p.add_argument("--model-path", help=argparse.SUPPRESS)
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--duration-s", type=float, default=5.0)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "out")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.config:
        print(
            json.dumps(
                child(
                    args.config,
                    args.model_path,
                    args.callers,
                    args.warmup_s,
                    args.duration_s,
                    args.seq,
                )
            )
        )
        return 0

    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    from tools import realistic_models as rm

    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        ),
    )
    results = []
    for name in args.models:
        path = args.out_dir / f"{name}-full-seed0.onnx"
        if not path.exists():
            getattr(rm, GENERATORS[name])(path)
        for r in range(args.rounds):
            for config in args.configs:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--config",
                        config,
                        "--model-path",
                        str(path),
                        "--callers",
                        str(args.callers),
                        "--seq",
                        str(args.seq),
                        "--warmup-s",
                        str(args.warmup_s),
                        "--duration-s",
                        str(args.duration_s),
                    ],
                    capture_output=True,
                    text=True,
                    env=env,
                    check=False,
                )
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                if not lines:
                    print(f"{name} {config}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                result = {"model": name, "round": r + 1, **json.loads(lines[-1])}
                results.append(result)
                rate = result["requests_per_s"]
                print(f"{name:7} {config:22} round {r + 1}: {rate:8.1f} requests/s", flush=True)
    if args.json:
        args.json.write_text(json.dumps({**_host(), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
