r"""A plugin execution provider on a real GPU: the facts sharedml's provider table needs.

Made for the TensorRT-RTX plugin (``pip install onnxruntime-ep-nv-tensorrt-rtx``, EP name
``nv_tensorrt_rtx``) on a lent NVIDIA GPU, whose row of ``sharedml.runtime.PROVIDER_FACTS`` is
not measured yet (its runs are serialized until they are); any plugin EP works
(``--provider``, ``--library``). Each step runs in a fresh process, so a crash is a result:

``devices``
    register the library, list the EP's devices (type, vendor, ids, metadata).
``plain``
    one plain session (``add_provider_for_devices``), its outputs against the CPU EP's.
``overlap``
    ``--sessions`` plain sessions, one thread each, all in ``Run`` at once, ``--tries`` fresh
    processes: crashes or errors mean the table's "runs serialized" must stay.
``threads``
    one plain session, ``--sessions`` threads (ORT serializes ``Run`` within some EPs).
``pool``
    ``sharedml.SessionPool(model, providers=[EP])`` as shipped, 16 threads: outputs, the rule
    and device it reports (``stats().runs_rule``, ``stats().device``).
``pool-overlap``
    the pool with ``--sessions`` sessions and ``serialize_runs=False``, 16 threads: what the
    table would allow if ``overlap`` is clean.
``memory``
    device memory this process holds (``nvidia-smi``, per process) after 1 and ``--sessions``
    plain sessions, and after the default pool served 16 threads.

Usage (on the GPU machine; prints one JSON summary, ``--out`` writes it)::

    pip install onnxruntime-gpu onnxruntime-ep-nv-tensorrt-rtx   # or -cu12 for CUDA 12
    python benchmarks/plugin_ep_gpu.py --out benchmarks/results/plugin-trt-rtx.json
    # dry run anywhere (seconds, any plugin): a tiny model, few runs, one try
    ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1 python benchmarks/plugin_ep_gpu.py \
        --provider WebGpuExecutionProvider --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RESULT = "PLUGIN-EP-RESULT "
TOLERANCE = 1e-3  # float32 on TensorRT may use TF32 and other kernels


def _model(path: Path, dim: int, layers: int) -> str:
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"])]
        nodes += [helper.make_node("Relu", [f"m{i}"], [f"h{i}"])]
        x = f"h{i}"
    graph = helper.make_graph(
        [*nodes, helper.make_node("Identity", [x], ["y"])],
        "plugin_ep_gpu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    save(model, str(path))
    return str(path)


# --------------------------------------------------------------------------------------------
# The child: one step


def _plan(provider: str, library: str | None) -> Any:
    from sharedml.runtime._providers import plan_providers

    return plan_providers([provider], ep_libraries={provider: library} if library else None)


def _plain(plan: Any, model: str) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    sess = ort.InferenceSession(model, so, **plan.session_kwargs(so))
    plan.check_session(sess, "A plain session")
    return sess


def _device_mib() -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    return sum(
        float(used) for pid, used in (line.split(",") for line in out.splitlines() if "," in line)
        if int(pid) == os.getpid()
    )  # fmt: skip


def _threads(count: int, work: Any) -> None:
    barrier = threading.Barrier(count)
    threads = [threading.Thread(target=work, args=(i, barrier)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _child(step: str, args: argparse.Namespace, model: str) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort

    import sharedml

    plan = _plan(args.provider, args.library)
    x = np.random.default_rng(1).standard_normal((4, args.dim)).astype(np.float32)
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[
        0
    ]
    seen = {"ok": 0, "wrong": 0, "error": 0, "first_error": None}
    lock = threading.Lock()

    def check(run: Any) -> None:
        try:
            y = run()
            kind = "ok" if float(np.abs(y - expected).max()) <= TOLERANCE else "wrong"
        except Exception as exc:
            kind = "error"
            with lock:
                seen["first_error"] = seen["first_error"] or f"{type(exc).__name__}: {exc}"[:300]
        with lock:
            seen[kind] += 1  # type: ignore[operator]

    out: dict[str, Any] = {"device": plan.device, "spec": plan.to_spec()}
    if step == "devices":
        out["devices"] = [
            {
                "ep_name": d.ep_name,
                "type": str(d.device.type),
                "vendor": d.device.vendor,
                "vendor_id": d.device.vendor_id,
                "device_id": d.device.device_id,
                "metadata": dict(d.device.metadata),
                "ep_metadata": dict(d.ep_metadata),
            }
            for d in ort.get_ep_devices()
            if d.ep_name == args.provider
        ]
        return out
    if step == "plain":
        start = time.perf_counter()
        sess = _plain(plan, model)
        out["create_s"] = time.perf_counter() - start
        out["providers"] = sess.get_providers()
        check(lambda: sess.run(None, {"x": x})[0])
        return out | seen
    if step in ("overlap", "threads"):
        count = args.sessions if step == "overlap" else 1
        made = [_plain(plan, model) for _ in range(count)]

        def work(i: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for _ in range(args.runs):
                check(lambda: made[i % len(made)].run(None, {"x": x})[0])

        _threads(args.sessions, work)
        return out | seen
    if step in ("pool", "pool-overlap"):
        kwargs: dict[str, Any] = {}
        if step == "pool-overlap":
            kwargs = {"sessions": args.sessions, "serialize_runs": False, "per_session_state": True}
        with sharedml.SessionPool(model, providers=[args.provider], **kwargs) as pool:

            def serve(i: int, barrier: threading.Barrier) -> None:
                barrier.wait()
                for _ in range(args.runs):
                    check(lambda: pool.run(None, {"x": x})[0])

            start = time.perf_counter()
            _threads(16, serve)
            stats = pool.stats()
            out |= {
                "seconds": time.perf_counter() - start,
                "sessions": stats.sessions,
                "batches": stats.batches,
                "runs_rule": stats.runs_rule,
                "mechanism": str(pool.mechanism),
            }
        return out | seen
    if step == "memory":
        base = _device_mib()
        held = [_plain(plan, model)]
        held[0].run(None, {"x": x})
        one = _device_mib()
        for _ in range(args.sessions - 1):
            held.append(_plain(plan, model))
            held[-1].run(None, {"x": x})
        many = _device_mib()
        held.clear()
        pool = sharedml.SessionPool(model, providers=[args.provider])
        _threads(16, lambda i, b: (b.wait(), [pool.run(None, {"x": x}) for _ in range(3)]))
        pooled = _device_mib()
        pool.close()
        return out | {
            "device_mib": {"base": base, "plain_1": one, f"plain_{args.sessions}": many,
                           "pool_16_threads_incl_freed_plain": pooled},
            "note": "nvidia-smi per process; the pool figure follows the plain sessions' release",
        }  # fmt: skip
    raise ValueError(step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--provider", default="nv_tensorrt_rtx")
    parser.add_argument("--library", help="the plugin library (default: its package's)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--runs", type=int, default=200, help="runs per thread")
    parser.add_argument("--tries", type=int, default=3, help="fresh processes for 'overlap'")
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8, help="MatMuls of dim x dim (128 MiB)")
    parser.add_argument("--steps", nargs="+", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, 10 runs, one try")
    parser.add_argument("--out", help="write the JSON summary here too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.dry_run:
        args.dim, args.layers, args.runs, args.tries = 64, 2, 10, 1
    if args.child:
        print(RESULT + json.dumps(_child(args.child, args, args.model)), flush=True)
        return 0
    steps = args.steps or ["devices", "plain", "overlap", "threads", "pool", "pool-overlap",
                           "memory"]  # fmt: skip
    import onnxruntime as ort

    summary: dict[str, Any] = {"onnxruntime": ort.__version__, "provider": args.provider,
                               "dim": args.dim, "layers": args.layers, "steps": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="plugin-ep-gpu-") as folder:
        model = _model(Path(folder) / "mlp.onnx", args.dim, args.layers)
        for step in steps:
            tries = []
            for _ in range(args.tries if step == "overlap" else 1):
                forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                             if k in ("provider", "library", "sessions", "runs", "dim", "layers")
                             and v is not None]  # fmt: skip
                start = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, __file__, f"--child={step}", f"--model={model}", *forwarded],
                    capture_output=True, text=True, timeout=900, check=False,
                )  # fmt: skip
                lines = [x[len(RESULT) :] for x in proc.stdout.splitlines() if x.startswith(RESULT)]
                ended = (
                    f"crashed ({signal.Signals(-proc.returncode).name})" if proc.returncode < 0
                    else "exited 0" if proc.returncode == 0 else f"exited {proc.returncode}"
                )  # fmt: skip
                tail = [x for x in proc.stderr.splitlines() if x.strip()][-2:]
                tries.append({"ended": ended, "seconds": round(time.perf_counter() - start, 1),
                              "result": json.loads(lines[-1]) if lines else None,
                              "stderr_tail": tail})  # fmt: skip
            summary["steps"][step] = tries
            print(f"{step}: " + "; ".join(t["ended"] for t in tries), file=sys.stderr, flush=True)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
