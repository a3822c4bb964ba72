"""Plain ONNX Runtime's WebGPU crash, reproduced: a canary that says when ORT fixes it.

ORT issue #32561 (open): WebGPU sessions of one process share one WebGPU context, and two of
them in ``Run`` at once crash the process. sharedml's pools serialize WebGPU runs per device
for that reason (its provider table). This script runs the crash the way a user meets it, with
no sharedml at all: ``--sessions`` plain WebGPU sessions of one MLP, one thread each, all
running at once, in ``--tries`` fresh processes, and reports how each process ended.

It never fails on the outcome (exit 0 either way): while processes crash, the table's rule is
still needed; the day none crashes, the WebGPU row of ``sharedml.runtime.PROVIDER_FACTS`` (and
``docs/webgpu.md``) are worth measuring again. Exit 3: WebGPU cannot run here at all.

usage: python tools/webgpu/canary.py [--tries 3] [--sessions 4] [--runs 200] [--json]
needs: onnxruntime-ep-webgpu, and without a GPU ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import subprocess
import sys
import threading
import time

_DIM = 256  # MLP width: about 1 MiB of weights, runs of a few ms on lavapipe


def _child(sessions: int, runs: int) -> int:
    import numpy as np
    import onnxruntime as ort
    import onnxruntime_ep_webgpu as ep
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(3):
        w = (rng.standard_normal((_DIM, _DIM)) / np.sqrt(_DIM)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"])]
        nodes += [helper.make_node("Relu", [f"m{i}"], [f"h{i}"])]
        x = f"h{i}"
    graph = helper.make_graph(
        [*nodes, helper.make_node("Identity", [x], ["y"])],
        "canary",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", _DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", _DIM])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data = model.SerializeToString()
    ort.register_execution_provider_library(ep.get_ep_name(), ep.get_library_path())
    devices = [d for d in ort.get_ep_devices() if d.ep_name == ep.get_ep_name()]
    if not devices:
        print("NO-DEVICE", flush=True)
        return 3
    made = []
    for _ in range(sessions):
        so = ort.SessionOptions()
        so.add_provider_for_devices(devices[:1], {})
        made.append(ort.InferenceSession(data, so))
    feed = {"x": rng.standard_normal((4, _DIM)).astype(np.float32)}
    expected = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)[0]
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    barrier = threading.Barrier(sessions)

    def work(sess: object) -> None:
        barrier.wait()
        for _ in range(runs):
            try:
                y = sess.run(None, feed)[0]  # type: ignore[attr-defined]
                kind = "ok" if np.abs(y - expected).max() <= 1e-4 else "wrong"
            except Exception:  # "CommandEncoder is already finished", ...
                kind = "error"
            with lock:
                counts[kind] += 1

    threads = [threading.Thread(target=work, args=(s,)) for s in made]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("RESULT " + json.dumps(dict(counts)), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=3, help="fresh processes (default 3)")
    parser.add_argument("--sessions", type=int, default=4, help="plain sessions at once")
    parser.add_argument("--runs", type=int, default=200, help="runs per session")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="per process")
    parser.add_argument("--json", action="store_true", help="print the JSON summary only")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args.sessions, args.runs)
    outcomes: collections.Counter[str] = collections.Counter()
    rows = []
    for _ in range(args.tries):
        start = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", f"--sessions={args.sessions}",
                 f"--runs={args.runs}"],
                capture_output=True, text=True, timeout=args.timeout_s, check=False,
            )  # fmt: skip
            code: int | str = proc.returncode
            out = proc.stdout
        except subprocess.TimeoutExpired:
            code, out = "timeout", ""
        if "NO-DEVICE" in out:
            print("canary: the WebGPU plugin offers no device here (without a GPU, set "
                  "ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1)", file=sys.stderr)  # fmt: skip
            return 3
        lines = [x[len("RESULT ") :] for x in out.splitlines() if x.startswith("RESULT ")]
        result = json.loads(lines[-1]) if lines else None
        if isinstance(code, int) and code < 0:
            kind = f"crashed ({signal.Signals(-code).name})"
        elif code == 0 and result is not None and set(result) == {"ok"}:
            kind = "clean"
        elif code == 0 and result is not None:
            kind = "errors or wrong outputs"
        else:
            kind = f"failed ({code})"
        outcomes[kind] += 1
        rows.append({"kind": kind, "result": result, "seconds": round(time.monotonic() - start, 1)})
    import onnxruntime as ort

    summary = {
        "onnxruntime": ort.__version__,
        "sessions": args.sessions,
        "runs": args.runs,
        "tries": args.tries,
        "outcomes": dict(outcomes),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    broken = args.tries - outcomes["clean"]
    verdict = (
        "still open: sharedml's per-device WebGPU run lock is needed"
        if broken
        else "NO process failed: ORT may have fixed #32561; measure WebGPU's row of the provider "
        "table again (docs/webgpu.md)"
    )
    print(
        f"WebGPU canary (ORT #32561), plain onnxruntime {ort.__version__}, {args.sessions} "
        f"sessions at once: {broken}/{args.tries} processes failed "
        f"({', '.join(f'{n} {k}' for k, n in outcomes.items())}): {verdict}"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
