"""Per-session device memory on CUDA: ORT's arena levers, measured on pooled sessions.

Each configuration runs in a fresh process: a pool of N sessions over a model (device weights
shared), every session run concurrently from N threads, then device memory read with
``torch.cuda.mem_get_info`` (the whole device: nothing else may run on it) and runs/s over a
short window. Configurations:

``default``      the pool as shipped.
``shrink``       every run with the run option ``memory.enable_memory_arena_shrinkage=gpu:0``
                 (ORT returns the arena's unused chunks after each run).
``env-arena``    one arena registered in ORT's environment for all sessions
                 (``benchmarks/_arena.py``,
                 ``session.use_env_allocators=1``).
``mempool``      that environment arena with ``arena.use_cuda_mempool=1`` (ORT's CUDA memory
                 pool arena, where the installed build knows the key).
``external``     every session allocating from torch's caching allocator (provider options
                 ``gpu_external_alloc``/``gpu_external_free``/``gpu_external_empty_cache``, ctypes
                 callbacks): one allocator for all sessions.

It also re-probes ``SessionOptions.add_external_initializers`` with device OrtValues in a child
process (upstream PR #29013 made it use them in place; onnxruntime-gpu 1.31.1 crashed there).

Usage: ``python benchmarks/gpu_levers.py --model bert --sessions 8 --json out.json``
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LEVERS = ("default", "shrink", "env-arena", "mempool", "external")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import onnxruntime as ort
    import torch

    sys.path[:0] = [str(REPO / "src"), str(REPO)]
    from _arena import USE_ENV_ALLOCATORS_KEY, register_shared_arena

    import sharedml
    from tools import realistic_models as rm

    ort.preload_dlls()
    torch.cuda.init()
    free0, _ = torch.cuda.mem_get_info()
    lever = spec["lever"]
    configure = None
    if lever in ("env-arena", "mempool"):
        if lever == "mempool":
            info = ort.OrtMemoryInfo(
                "Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            try:
                cfg = ort.OrtArenaCfg({"arena_extend_strategy": 1, "arena.use_cuda_mempool": 1})
                ort.create_and_register_allocator_v2(
                    "CUDAExecutionProvider", info, {"device_id": "0"}, cfg
                )
            except Exception as exc:  # the key is not known to this build
                return {"lever": lever, "error": f"{type(exc).__name__}: {exc}"[:300]}
        elif not register_shared_arena("CUDAExecutionProvider", 0):
            return {"lever": lever, "error": "no environment arena could be registered"}

        def configure(so: Any) -> None:
            so.add_session_config_entry(USE_ENV_ALLOCATORS_KEY, "1")

    meta = json.loads(Path(spec["meta"]).read_text())
    info_ = rm.ModelInfo(
        path=spec["model"],
        name=meta["name"],
        weights_bytes=meta["weights_bytes"],
        inputs={k: (np.dtype(v[0]), tuple(v[1])) for k, v in meta["inputs"].items()},
        description=meta["name"],
        vocab_size=meta.get("vocab_size"),
        max_seq=meta.get("max_seq"),
    )
    feed = rm.sample_inputs(info_, batch=1, seq=spec["seq"], seed=0)
    providers: list[Any] = ["CUDAExecutionProvider"]
    callbacks: tuple[Any, ...] = ()
    if lever == "external":
        import ctypes

        alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(
            lambda size: torch.cuda.caching_allocator_alloc(size) if size else None
        )
        free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(
            lambda ptr: torch.cuda.caching_allocator_delete(ptr) if ptr else None
        )
        empty = ctypes.CFUNCTYPE(None)(torch.cuda.empty_cache)
        callbacks = (alloc, free, empty)  # alive as long as the sessions

        def address(fn: Any) -> str:
            return str(ctypes.cast(fn, ctypes.c_void_p).value)

        providers = [
            (
                "CUDAExecutionProvider",
                {
                    "gpu_external_alloc": address(alloc),
                    "gpu_external_free": address(free),
                    "gpu_external_empty_cache": address(empty),
                },
            )
        ]
    options = None
    if lever == "shrink":
        options = ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "gpu:0")
    n = spec["sessions"]
    pool = sharedml.SessionPool(
        spec["model"],
        sessions=n,
        providers=providers,
        configure=configure,
        cache_dir=spec["cache_dir"],
    )
    pool.wait_ready()
    reference = pool.run(None, feed)[0]
    barrier = threading.Barrier(n)
    counts = [0] * n
    mismatch = [False]
    stop = threading.Event()

    def work(i: int) -> None:
        barrier.wait()
        while not stop.is_set():
            out = pool.run(None, feed, options)[0]
            counts[i] += 1
            if counts[i] == 1 and not np.allclose(out, reference, rtol=1e-3, atol=1e-4):
                mismatch[0] = True

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(spec["duration_s"])
    stop.set()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    result = {
        "lever": lever,
        "sessions": n,
        "device_bytes": int(free0 - free1),
        "runs_per_s": sum(counts) / spec["duration_s"],
        "outputs_equal": not mismatch[0],
        "mechanism": str(pool.mechanism),
    }
    pool.close()
    del callbacks
    return result


PROBE = r"""
import sys, numpy as np, onnxruntime as ort, torch
from onnx import TensorProto, helper, numpy_helper
ort.preload_dlls()
w = np.ones((1024,), np.float32)
g = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "p",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])],
    initializer=[numpy_helper.from_array(np.zeros(1024, np.float32), "w")])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 8
t = torch.full((1024,), 2.0, device="cuda")
value = ort.OrtValue.from_dlpack(t.__dlpack__())
so = ort.SessionOptions()
so.add_external_initializers(["w"], [value])
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CUDAExecutionProvider"])
x = np.ones(1024, np.float32)
a = float(s.run(None, {"x": x})[0][0]); t.fill_(5.0); torch.cuda.synchronize()
b = float(s.run(None, {"x": x})[0][0])
print("PROBE", a, b, "borrowed" if (a, b) == (2.0, 5.0) else "copied")
"""


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        print("RESULT " + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", default="bert")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--duration-s", type=float, default=3.0)
    p.add_argument("--levers", nargs="+", default=list(LEVERS))
    p.add_argument("--out-dir", type=Path, default=HERE / "out")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    sys.path[:0] = [str(HERE)]
    import serving

    meta = serving._model(args.model, argparse.Namespace(out_dir=args.out_dir, size="full"))
    meta_path = args.out_dir / "models" / f"{args.model}-levers.json"
    meta_path.write_text(json.dumps(meta))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]
        ),
    }
    results: list[dict[str, Any]] = []
    for lever in args.levers:
        spec = {
            "lever": lever,
            "model": meta["model"],
            "meta": str(meta_path),
            "sessions": args.sessions,
            "seq": args.seq,
            "duration_s": args.duration_s,
            "cache_dir": str(args.out_dir / "serving-cache"),
        }
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        result = (
            json.loads(line[-1][7:])
            if line
            else {"lever": lever, "error": (proc.stderr or "")[-400:]}
        )
        print(json.dumps(result), flush=True)
        results.append(result)
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    tail = [x for x in probe.stdout.splitlines() if x.startswith("PROBE")]
    probe_result = tail[-1] if tail else f"exit {probe.returncode}: {probe.stderr[-300:]}"
    print("add_external_initializers with device OrtValues:", probe_result, flush=True)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": meta["name"],
                    "levers": results,
                    "add_external_initializers": probe_result,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
