"""Scenarios on the real DirectML provider; ``tests/_dml.py`` runs each in a child process.

Each scenario takes JSON arguments, starts its threads together on a barrier, and returns what
it saw as a JSON object (printed after :data:`MARKER`); the test in the parent process asserts
on it. A scenario that crashes the process never prints one: the parent reads the exit status.
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

MARKER = "SHAREDML-DML-RESULT:"
DML = "DmlExecutionProvider"
DEADLINE_S = 240.0  # seconds: a hung scenario fails here, before the parent's timeout
TOLERANCE = 1e-4  # DirectML's float32 kernels round differently from the CPU's


def tiny_model() -> bytes:
    """``y = x @ w`` for ``x: float32[2, 8]``: the smallest model that runs on DML."""
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


def dml_session(model: str, *, fusion: bool = True) -> Any:
    """A plain ORT session on DML, with the settings ORT documents for it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.enable_mem_pattern = False
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if not fusion:
        so.add_session_config_entry("ep.dml.disable_graph_fusion", "1")
    sess = ort.InferenceSession(model, so, providers=[(DML, {"device_id": "0"})])
    if sess.get_providers()[0] != DML:
        raise RuntimeError(f"the session fell back to {sess.get_providers()}")
    return sess


def cpu_reference(model: str) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"x": x})[0]


def _dim(model: str) -> int:
    import onnx

    shape = onnx.load(model, load_external_data=False).graph.input[0].type.tensor_type.shape
    return int(shape.dim[1].dim_value)


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


# --------------------------------------------------------------------------------------------
# Scenarios


def plain_threads(model: str, runs: int, locked: bool) -> dict[str, Any]:
    """Two threads on ONE plain DML session, no sharedml: with ``locked``, one run at a time."""
    sess, ref, dim = dml_session(model), cpu_reference(model), _dim(model)
    tally = Tally()
    guard: Any = threading.Lock() if locked else contextlib.nullcontext()

    def work(i: int, barrier: threading.Barrier) -> None:
        rng = np.random.default_rng(i)
        barrier.wait()
        for r in range(runs):
            x = rng.standard_normal((1 + r % 4, dim)).astype(np.float32)
            try:
                with guard:
                    y = sess.run(None, {"x": x})[0]
            except Exception as exc:
                tally.add("error", exc)
                continue
            tally.check(y, ref(x))

    together(2, work)
    return tally.result()


KINDS = ("good", "bad-shape", "good", "checkout", "bad-dtype", "good", "missing-input")


@contextlib.contextmanager
def dml_pool(model: str, **kwargs: Any) -> Iterator[Any]:
    import sharedml

    with sharedml.SessionPool(model, providers=[DML], **kwargs) as pool:
        if pool.get_providers()[0] != DML:
            raise RuntimeError(f"the pool's sessions fell back to {pool.get_providers()}")
        yield pool


def _request(pool: Any, kind: str, x: np.ndarray, tally: Tally, ref: Any) -> None:
    import sharedml

    feed: dict[str, Any] = {"x": x}
    if kind == "bad-shape":
        feed = {"x": np.ones((1, x.shape[1] + 1), np.float32)}
    elif kind == "bad-dtype":
        feed = {"x": x.astype(np.float64)}
    elif kind == "missing-input":
        feed = {"not_x": x}
    try:
        if kind == "checkout":
            with pool.session(timeout_s=DEADLINE_S) as sess:
                y = sess.run(None, feed)[0]
        else:
            y = pool.run(None, feed)[0]
    except sharedml.InvalidInputError as exc:
        tally.add("refused" if kind.startswith(("bad", "missing")) else "error", exc)
        return
    except Exception as exc:
        tally.add("error", exc)
        return
    if kind.startswith(("bad", "missing")):
        tally.add("accepted-bad")
    else:
        tally.check(y, ref(x))


def pool_threads(
    model: str, threads: int, runs: int, batching: bool, sessions: int
) -> dict[str, Any]:
    """``threads`` threads on one pool, good and bad requests and checkouts mixed."""
    ref, dim = cpu_reference(model), _dim(model)
    tally = Tally()
    kwargs: dict[str, Any] = {"batching": batching, "sessions": sessions}
    if sessions > 1:
        kwargs["per_session_state"] = True  # several sessions on purpose: runs still serialized
    with dml_pool(model, create_in_background=False, **kwargs) as pool:

        def work(i: int, barrier: threading.Barrier) -> None:
            rng = np.random.default_rng(i)
            barrier.wait()
            for r in range(runs):
                x = rng.standard_normal((1 + (i + r) % 3, dim)).astype(np.float32)
                _request(pool, KINDS[(i + r) % len(KINDS)], x, tally, ref)

        together(threads, work)
        stats = pool.stats()
        return tally.result(
            batches=stats.batches,
            max_batch_rows=stats.max_batch_rows,
            busy=stats.busy,
            waiting=stats.waiting,
        )


def two_models(model_a: str, model_b: str, threads: int, runs: int) -> dict[str, Any]:
    """Two models' pools on one device, used from the same threads at once."""
    refs = [cpu_reference(model_a), cpu_reference(model_b)]
    dims = [_dim(model_a), _dim(model_b)]
    tally = Tally()
    with dml_pool(model_a) as pool_a, dml_pool(model_b) as pool_b:
        pools = [pool_a, pool_b]

        def work(i: int, barrier: threading.Barrier) -> None:
            rng = np.random.default_rng(i)
            barrier.wait()
            for r in range(runs):
                which = (i + r) % 2
                x = rng.standard_normal((1 + r % 3, dims[which])).astype(np.float32)
                _request(pools[which], "good", x, tally, refs[which])

        together(threads, work)
    return tally.result()


def create_while_serving(
    model_a: str, model_b: str, threads: int, creations: int
) -> dict[str, Any]:
    """Pools of model B created, run and closed while model A's pool serves ``threads`` loops."""
    ref_a, ref_b = cpu_reference(model_a), cpu_reference(model_b)
    dim_a, dim_b = _dim(model_a), _dim(model_b)
    tally, created = Tally(), Tally()
    stop = threading.Event()
    served: list[int] = []  # runs of A completed before each creation, and at the end
    with dml_pool(model_a) as pool_a:

        def work(i: int, barrier: threading.Barrier) -> None:
            rng = np.random.default_rng(i)
            barrier.wait()
            while not stop.is_set():
                x = rng.standard_normal((1 + i % 3, dim_a)).astype(np.float32)
                _request(pool_a, "good", x, tally, ref_a)

        def create(_: int, barrier: threading.Barrier) -> None:
            barrier.wait()
            try:
                for c in range(creations):
                    deadline = time.monotonic() + DEADLINE_S
                    # A is serving: more runs of it finished since the last creation.
                    while tally.counts["ok"] <= (served[-1] if served else 0):
                        if time.monotonic() > deadline:
                            raise RuntimeError("model A's pool served nothing")
                        time.sleep(0.01)
                    served.append(tally.counts["ok"])
                    with dml_pool(model_b) as pool_b:
                        x = np.full((2, dim_b), 0.5 + c, np.float32)
                        created.check(pool_b.run(None, {"x": x})[0], ref_b(x))
            except Exception as exc:
                created.add("error", exc)
            finally:
                stop.set()

        def role(i: int, barrier: threading.Barrier) -> None:
            (create if i == threads else work)(i, barrier)

        together(threads + 1, role)
    return {"serving": tally.result(), "created": created.result(), "served_before": served}


def close_under_load(model: str, threads: int) -> dict[str, Any]:
    """``close()`` while ``threads`` threads loop on the pool: each ends with PoolClosedError."""
    import sharedml

    ref, dim = cpu_reference(model), _dim(model)
    tally = Tally()
    ended: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    pool_cm = dml_pool(model)
    pool = pool_cm.__enter__()

    def work(i: int, barrier: threading.Barrier) -> None:
        rng = np.random.default_rng(i)
        barrier.wait()
        if i == threads:  # the closer: once every thread has been served at least once
            deadline = time.monotonic() + DEADLINE_S
            while tally.counts["ok"] < 2 * threads and time.monotonic() < deadline:
                time.sleep(0.01)
            pool.close(timeout_s=DEADLINE_S)
            return
        while True:
            x = rng.standard_normal((1 + i % 3, dim)).astype(np.float32)
            try:
                y = pool.run(None, {"x": x})[0]
            except sharedml.PoolClosedError:
                how = "closed"
                break
            except Exception as exc:
                tally.add("error", exc)
                how = "error"
                break
            tally.check(y, ref(x))
        with lock:
            ended[how] += 1

    try:
        together(threads + 1, work)
    finally:
        pool_cm.__exit__(None, None, None)
    return tally.result(ended=dict(ended), closed=pool.closed)


def outputs_and_route(model: str) -> dict[str, Any]:
    """The pool's outputs against the CPU's, and what its route planner said (and warned)."""
    ref, dim = cpu_reference(model), _dim(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dml_pool(model) as pool:
            rng = np.random.default_rng(0)
            diffs = {}
            for rows in (1, 3, 8):
                x = rng.standard_normal((rows, dim)).astype(np.float32)
                diffs[rows] = float(np.abs(pool.run(None, {"x": x})[0] - ref(x)).max())
            plain = dml_session(model)
            plain_diff = float(np.abs(plain.run(None, {"x": x})[0] - ref(x)).max())
            return {
                "diffs": diffs,
                "plain_dml_diff": plain_diff,
                "mechanism": pool.mechanism.value,
                "reason": pool.mechanism_reason,
                "max_sessions": pool.max_sessions,
                "batching": pool.batching is not None,
                "providers": pool.get_providers(),
                "warnings": [str(w.message) for w in caught],
            }


def _rss() -> int:
    import psutil

    # The working set. Under Wine it is the Linux process's resident set (psutil's other
    # Windows figures read there: private bytes a constant, USS not at all).
    return int(psutil.Process().memory_info().rss)


def memory(
    model: str, config: str, sessions: int, threads: int, pool_sessions: int = 0
) -> dict[str, Any]:
    """Resident memory that ``config`` adds, from a fresh process's baseline.

    ``plain`` / ``plain-fusion-off``: ``sessions`` plain DML sessions, each run once.
    ``pool``: the pool as shipped, serving ``threads`` threads at once.
    ``pool:<mechanism>``: a pool whose weights come by that host mechanism.
    With ``pool_sessions``, the pool holds that many sessions (``per_session_state``), each run.
    """
    import onnxruntime as ort

    import sharedml

    dim = _dim(model)
    # The DirectML runtime's one-time cost (its DLLs, the adapter) stays out of the figure.
    warm = ort.InferenceSession(tiny_model(), providers=[(DML, {"device_id": "0"})])
    warm.run(None, {"x": np.ones((2, 8), np.float32)})
    del warm
    before = _rss()
    keep: list[Any] = []
    x = np.ones((2, dim), np.float32)
    if config.startswith("plain"):
        for _ in range(sessions):
            sess = dml_session(model, fusion=config != "plain-fusion-off")
            sess.run(None, {"x": x})
            keep.append(sess)
    else:
        _, _, mechanism = config.partition(":")
        kwargs: dict[str, Any] = {"mechanism": mechanism} if mechanism else {}
        if pool_sessions:
            kwargs.update(
                sessions=pool_sessions, per_session_state=True, create_in_background=False
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            pool = sharedml.SessionPool(model, providers=[DML], **kwargs)
        keep.append(pool)
        if pool_sessions:  # every session checked out at once, each run
            with contextlib.ExitStack() as stack:
                held = [stack.enter_context(pool.session()) for _ in range(pool_sessions)]
                for sess in held:
                    sess.run(None, {"x": x})
        else:

            def work(i: int, barrier: threading.Barrier) -> None:
                barrier.wait()
                for _ in range(3):
                    pool.run(None, {"x": x})

            together(threads, work)
    after = _rss()
    for item in keep:
        if hasattr(item, "close"):
            item.close()
    return {"added_bytes": after - before, "baseline_bytes": before}


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    f.__name__: f
    for f in (
        plain_threads,
        pool_threads,
        two_models,
        create_while_serving,
        close_under_load,
        outputs_and_route,
        memory,
    )
}


def main(argv: list[str]) -> int:
    """``name json-arguments``: run that scenario, print its result after :data:`MARKER`."""
    name, arguments = argv[0], json.loads(argv[1])
    result = SCENARIOS[name](**arguments)
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover - run through tests/_dml.py
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main(sys.argv[1:]))
