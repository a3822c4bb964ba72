"""Scenarios on the real WebGPU plugin EP; ``tests/_webgpu.py`` runs each in a child process.

Two WebGPU sessions in ``Run`` at once crash the process (ORT issue #32561), so every scenario
runs in a fresh child: a crash is an outcome the parent reads from the exit status, never the
end of the test run. Each scenario starts its threads together on a barrier, and returns what
it saw as one JSON object (printed after :data:`MARKER`).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

MARKER = "SHAREDML-WEBGPU-RESULT:"
WEBGPU = "WebGpuExecutionProvider"
DEADLINE_S = 240.0  # seconds: a hung scenario fails here, before the parent's timeout
TOLERANCE = 1e-4  # WebGPU's float32 kernels round differently from the CPU's (<= 1e-6 seen)


def tiny_model() -> bytes:
    """``y = x @ w`` for ``x: float32[2, 8]``: loads the WebGPU runtime and its device."""
    from onnx import TensorProto, helper, numpy_helper

    w = (np.arange(64, dtype=np.float32).reshape(8, 8) / 64).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return bytes(model.SerializeToString())


def webgpu_device() -> Any:
    """The WebGPU ``OrtEpDevice``, registering the plugin's library as a user would."""
    import onnxruntime as ort
    import onnxruntime_ep_webgpu

    if not any(d.ep_name == WEBGPU for d in ort.get_ep_devices()):
        ort.register_execution_provider_library(WEBGPU, onnxruntime_ep_webgpu.get_library_path())
    found = [d for d in ort.get_ep_devices() if d.ep_name == WEBGPU]
    if not found:
        raise RuntimeError("the WebGPU plugin offers no device")
    return found[0]


def plain_session(model: str | bytes) -> Any:
    """A plain ORT session on WebGPU, as ORT's documentation creates one."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.add_provider_for_devices([webgpu_device()], {})
    sess = ort.InferenceSession(model, sess_options=so)
    if sess.get_providers()[0] != WEBGPU:
        raise RuntimeError(f"the session fell back to {sess.get_providers()}")
    return sess


def cpu_reference(model: str) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"x": x})[0]


def _shape(model: str, rows: int) -> tuple[int, ...]:
    import onnx

    dims = onnx.load(model, load_external_data=False).graph.input[0].type.tensor_type.shape.dim
    return (rows, *(int(d.dim_value) for d in dims[1:]))


def _inputs(model: str, count: int, rows: int = 2, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(_shape(model, rows), dtype=np.float32) for _ in range(count)]


class Tally:
    """Counts by kind and the first few unexpected errors, from any thread."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: list[str] = []
        self.max_diff = 0.0
        self._lock = threading.Lock()

    def add(self, kind: str, error: BaseException | None = None, diff: float = 0.0) -> None:
        with self._lock:
            self.counts[kind] += 1
            self.max_diff = max(self.max_diff, diff)
            if error is not None and len(self.errors) < 5:
                self.errors.append(f"{type(error).__name__}: {str(error)[:300]}")

    def check(self, y: np.ndarray, expected: np.ndarray) -> None:
        diff = float(np.abs(y - expected).max()) if y.shape == expected.shape else np.inf
        self.add("ok" if diff <= TOLERANCE else "wrong", diff=diff)

    def result(self, **more: Any) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "errors": self.errors,
            "max_diff": self.max_diff,
            **more,
        }


def together(count: int, work: Callable[[int, threading.Barrier], None]) -> None:
    """Run ``work(i, barrier)`` on ``count`` threads; fail if any outlives the deadline."""
    barrier = threading.Barrier(count, timeout=DEADLINE_S)
    threads = [threading.Thread(target=work, args=(i, barrier), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + DEADLINE_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    if hung:
        raise RuntimeError(f"{hung} of {count} threads were still running after {DEADLINE_S} s")


@contextlib.contextmanager
def webgpu_pool(model: str, **kwargs: Any) -> Iterator[Any]:
    import sharedml

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = sharedml.SessionPool(model, providers=[WEBGPU], **kwargs)
    pool.caught = [str(w.message) for w in caught]  # type: ignore[attr-defined]
    try:
        yield pool
    finally:
        pool.close()


# --------------------------------------------------------------------------------------------
# Scenarios


def outputs_and_route(models: list[str]) -> dict[str, Any]:
    """Plain WebGPU sessions and default pools against the CPU EP, and what the pool chose."""
    out: dict[str, Any] = {"models": {}}
    for model in models:
        ref = cpu_reference(model)
        xs = _inputs(model, 3)
        plain = plain_session(model)
        plain_diff = max(float(np.abs(plain.run(None, {"x": x})[0] - ref(x)).max()) for x in xs)
        del plain
        with webgpu_pool(model) as pool:
            pool_diff = max(float(np.abs(pool.run(None, {"x": x})[0] - ref(x)).max()) for x in xs)
            stats = pool.stats()
            out["models"][Path(model).name] = {
                "plain_max_diff": plain_diff,
                "pool_max_diff": pool_diff,
                "providers": pool.get_providers(),
                "mechanism": str(pool.mechanism),
                "mechanism_reason": pool.mechanism_reason,
                "max_sessions": pool.max_sessions,
                "batching": pool.batching is not None,
                "serialized_runs": stats.serialized_runs,
                "runs_rule": stats.runs_rule,
                "device": stats.device,
                "spec": pool.plan.to_spec(),
                "warnings": pool.caught,
            }
    return out


def plain_sessions(model: str, sessions: int, runs: int) -> dict[str, Any]:
    """``sessions`` plain WebGPU sessions of one model, one thread each, at once (the crash)."""
    ref = cpu_reference(model)
    xs = _inputs(model, 4)
    expected = [ref(x) for x in xs]
    made = [plain_session(model) for _ in range(sessions)]
    tally = Tally()

    def work(i: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for k in range(runs):
            try:
                y = made[i].run(None, {"x": xs[k % len(xs)]})[0]
                tally.check(y, expected[k % len(xs)])
            except Exception as exc:
                tally.add("error", exc)

    together(sessions, work)
    return tally.result()


def pool_threads(model: str, threads: int, runs: int, sessions: int = 0) -> dict[str, Any]:
    """``threads`` threads on one pool (its defaults, or ``sessions`` sessions), all at once."""
    ref = cpu_reference(model)
    xs = _inputs(model, 8)
    expected = [ref(x) for x in xs]
    kwargs: dict[str, Any] = {}
    if sessions:
        kwargs.update(sessions=sessions, per_session_state=True, create_in_background=False)
    tally = Tally()
    with webgpu_pool(model, **kwargs) as pool:

        def work(i: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for k in range(runs):
                j = (i + k) % len(xs)
                try:
                    if k % 4 == 3:  # an exclusive checkout now and then
                        with pool.session() as sess:
                            tally.check(sess.run(None, {"x": xs[j]})[0], expected[j])
                    else:
                        tally.check(pool.run(None, {"x": xs[j]})[0], expected[j])
                except Exception as exc:
                    tally.add("error", exc)

        together(threads, work)
        stats = pool.stats()
        return tally.result(
            sessions=stats.sessions,
            batches=stats.batches,
            serialized_runs=stats.serialized_runs,
            warnings=pool.caught,
        )


def two_models(model_a: str, model_b: str, threads: int, runs: int) -> dict[str, Any]:
    """Two models' pools served from the same threads at once: one device, one run lock."""
    jobs = []
    for model in (model_a, model_b):
        ref = cpu_reference(model)
        xs = _inputs(model, 4)
        jobs.append((model, xs, [ref(x) for x in xs]))
    tally = Tally()
    with webgpu_pool(model_a) as pool_a, webgpu_pool(model_b) as pool_b:
        pools = (pool_a, pool_b)

        def work(i: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for k in range(runs):
                which = (i + k) % 2
                _, xs, expected = jobs[which]
                try:
                    y = pools[which].run(None, {"x": xs[k % len(xs)]})[0]
                    tally.check(y, expected[k % len(xs)])
                except Exception as exc:
                    tally.add("error", exc)

        together(threads, work)
    return tally.result()


def create_while_serving(
    model_a: str, model_b: str, threads: int, cycles: int, runs: int = 0
) -> dict[str, Any]:
    """Pools of model B created, run and closed while model A's pool serves looping threads."""
    ref_a, ref_b = cpu_reference(model_a), cpu_reference(model_b)
    xa, xb = _inputs(model_a, 1)[0], _inputs(model_b, 1)[0]
    ya, yb = ref_a(xa), ref_b(xb)
    tally = Tally()
    stop = threading.Event()
    created = 0
    with webgpu_pool(model_a) as pool_a:

        def serve(i: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            while not stop.is_set():
                try:
                    tally.check(pool_a.run(None, {"x": xa})[0], ya)
                except Exception as exc:
                    tally.add("error", exc)

        def create(_: int, barrier: threading.Barrier) -> None:
            nonlocal created
            barrier.wait()
            try:
                for _ in range(cycles):
                    with webgpu_pool(model_b) as pool_b:
                        for _ in range(3):
                            tally.check(pool_b.run(None, {"x": xb})[0], yb)
                    created += 1
            except Exception as exc:
                tally.add("error", exc)
            finally:
                stop.set()

        def role(i: int, barrier: threading.Barrier) -> None:
            (create if i == 0 else serve)(i, barrier)

        together(threads + 1, role)
    return tally.result(created=created)


def inspect_cli(model: str, sessions: int) -> dict[str, Any]:
    """``sharedml inspect MODEL --providers WebGpuExecutionProvider --json``, as a user runs it."""
    import subprocess

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharedml",
            "inspect",
            model,
            "--providers",
            WEBGPU,
            "--sessions",
            str(sessions),
            "--strategy",
            "naive",
            "--strategy",
            "shared",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    report = None
    if proc.returncode == 0:
        report = json.loads(proc.stdout)
    return {"returncode": proc.returncode, "stderr": proc.stderr[-3000:], "report": report}


def _memory() -> dict[str, int]:
    import psutil

    gc.collect()
    info = psutil.Process().memory_full_info()
    return {"rss": int(info.rss), "pss": int(getattr(info, "pss", info.uss))}


def memory(model: str, config: str, sessions: int, threads: int) -> dict[str, Any]:
    """Memory that ``config`` adds, from a fresh process's baseline (WebGPU's device loaded).

    On Mesa's lavapipe the device's memory is this process's own, so it shows here; on a GPU
    it would not. ``plain``: ``sessions`` plain WebGPU sessions, each run (one at a time: at
    once they crash). ``pool``: the pool as shipped, serving ``threads`` threads at once.
    ``pool:<mechanism>``: a pool whose weights come by that host mechanism.
    """
    import sharedml

    x = _inputs(model, 1)[0]
    # WebGPU's one-time cost (its library, the adapter and device) stays out of the figure.
    warm = plain_session(tiny_model())
    warm.run(None, {"x": np.ones((2, 8), np.float32)})
    del warm
    sharedml.SessionPool  # noqa: B018 - sharedml's modules load lazily: before the baseline
    before = _memory()
    keep: list[Any] = []
    if config == "plain":
        for _ in range(sessions):
            sess = plain_session(model)
            for _ in range(2):
                sess.run(None, {"x": x})
            keep.append(sess)
    else:
        _, _, mechanism = config.partition(":")
        kwargs: dict[str, Any] = {"mechanism": mechanism} if mechanism else {}
        pool = sharedml.SessionPool(model, providers=[WEBGPU], **kwargs)
        keep.append(pool)

        def work(i: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            for _ in range(3):
                pool.run(None, {"x": x})

        together(threads, work)
    after = _memory()
    for item in keep:
        if hasattr(item, "close"):
            item.close()
    return {key: after[key] - before[key] for key in before}


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f
    for f in (
        outputs_and_route,
        plain_sessions,
        pool_threads,
        two_models,
        create_while_serving,
        inspect_cli,
        memory,
    )
}


def main(argv: list[str]) -> int:
    """``name json-arguments``: run that scenario, print its result after :data:`MARKER`."""
    name, arguments = argv[0], json.loads(argv[1])
    result = SCENARIOS[name](**arguments)
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - run through tests/_webgpu.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
