r"""Serving benchmark: C callers sending batch-1 requests to one server, one process per config.

What a server here is, for C concurrent callers in a closed loop (each sends its next request
as soon as the last one returned):

``plain:N``            N plain ``InferenceSession``s behind a queue: what users write without
                       sharedml (ORT's default threading in every session).
``plain:N:threads``    the same, each session given ``cores // N`` intra-op threads.
``single``             one plain session that every caller runs concurrently.
``pool:N``             ``sharedml.SessionPool(sessions=N)``.
``pool:N:batch``       ``SessionPool(sessions=N, batching=True)``: waiting requests merge.
``pool:auto:batch``    ``SessionPool(sessions="auto", batching=True)``: the pool splits the cores
                       into sessions x threads by measuring (its choice is recorded).
``pool:default``       ``SessionPool(model, batching="auto")``, the pool as ``sharedml serve`` and
                       ``sharedml.ray`` open it (their default sessions): what ``--defaults``
                       compares with the alternatives (its ``batching_reason`` is recorded).
``...:serialized``     one ``Run`` at a time across the process, as onnxruntime-directml >= 1.18
                       forces: ``plain:N:serialized`` puts one lock around every Run of the N
                       sessions; ``pool:...:serialized`` is ``serialize_runs=True``.
``...:graph``          CUDA graphs (``enable_cuda_graph=1``), where the pool supports them.
``...:nopad``          batching without padding to power-of-two buckets
                       (``Batching(pad_to_buckets=False)``; padding is on by default off the CPU).
``...:delayX``         batching whose sessions wait up to X ms for more rows (``max_delay_ms``;
                       ``delay0``: never wait; without: the adaptive default)
``...:maxN``           batching with at most N rows a batch (``max_batch_size``; default 32)
``...:views``          batching that hands callers views of the batch's outputs
                       (``copy_outputs=False``) instead of copies of their rows
``...:anyshape``       batching with one ORT session per pool session for every batch size
                       (``session_per_bucket=False``)
``...:buckets``        batching with an ORT session per batch bucket (``session_per_bucket=True``;
                       CUDA's default for models with convolutions)
``...:int8``, ``...:int4``  compressed weights (``SessionPool(weights="int8")``; outputs differ from
                       the float reference by design: the checks record by how much).
``...:fp32``           CUDA with TF32 off (``use_tf32=0``), compared with solo runs without TF32.
``...:switchX``        the worker process runs with ``sys.setswitchinterval(X / 1000)`` (X ms;
                       CPython's default is 5 ms): how much of a configuration is GIL hand-off.
``...:nocheck``        batching that checks each class of merged batches against solo runs
                       only until one check could have shown a leak
                       (``Batching(check_within=None)``), against the default's checks at
                       random gaps of at most 64 batches: what the checks cost
                       (``window_check_share``: the sessions' time in check runs).
``...:checkN``         checks within N merged batches (``Batching(check_within=N)``).
``...:nogain``         batching that merges whatever it gains (``Batching(measure_gain=False)``):
                       without the pool's measurement of whether merging pays.
``...:tN``             a pool whose sessions each get N intra-op threads (``sess_options``);
                       ``...:nospin``: their threads do not spin while waiting for work
                       (``session.intra_op.allow_spinning=0``). ``pool:4:t2:nospin`` on 2 cores
                       is the candidate for a default that serves one caller with every core.

Every configuration runs in a fresh process: the server is created (timed), a pool warmed up
(``pool.warm_up``, timed: graphs captured, buckets run once), every caller runs once (outputs
checked against a solo run of the same input), then the callers meet on a barrier and run for
``--duration-s``. Reported: requests/s over the window (every request that completed inside
it, whenever it started: :func:`completed_in_window`), p50/p99 latency of those, PSS growth
(and device memory on CUDA), outputs equal, and for pools the batches' mean rows.

Usage::

    python benchmarks/serving.py --models mlp resnet bert --callers 1 4 16 64 \\
        --json benchmarks/results/serving-cpu.json
    python benchmarks/serving.py --first-result --model-path model.onnx --sessions 8

``--first-result`` measures the pool that serves before it is full instead: time to the first
result of a pool of N against one plain session's create + run, and time to all N sessions.

``--defaults`` asks whether the default pool ever loses to its own alternatives: for each model
and caller count, in interleaved rounds, ``pool:default`` against ``pool:4`` (unbatched),
``single`` and the batching pools; it prints the default's median requests/s over the best
alternative's (target: at least 0.95).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 1 << 20
RTOL, ATOL = 1e-3, 1e-4  # batched kernels may sum in another order: see docs/batching.md
INPUTS = 64  # distinct batch-1 requests per model, cycled through by the callers

# What --defaults compares: the default pool, then its alternatives.
DEFAULTS_CONFIGS = ["pool:default", "pool:4", "single", "pool:1:batch", "pool:4:batch"]
DEFAULTS_TARGET = 0.95  # the default's requests/s over the best alternative's, at least

DEFAULT_CONFIGS = [
    "plain:4",
    "plain:4:threads",
    "single",
    "pool:4",
    "pool:1:batch",
    "pool:2:batch",
    "pool:4:batch",
]
SERIALIZED_CONFIGS = ["plain:8:serialized", "pool:8:serialized", "pool:1:batch:serialized"]


# --------------------------------------------------------------------------------------------
# The closed loop: C callers, one measurement window, and what it counts


def completed_in_window(
    spans: Iterable[tuple[float, float]], start: float, end: float
) -> list[float]:
    """Latencies (seconds, sorted) of the requests that completed inside ``(start, end]``.

    A request counts where it *ends*, whenever it started. In a closed loop every completion
    frees its caller for the next request, so completions per second over the window is the
    throughput, however long one request takes. Counting only the requests that both start and
    end inside the window drops the one each caller has in flight when the window opens: most
    of them once latency is a sizeable share of the window (16 callers at 1 s each in a 3 s
    window: 32 requests counted instead of 48).

    Args:
        spans: ``(start, end)`` of every request, ``time.perf_counter()`` seconds.
        start: When the window opened.
        end: When it closed.

    Returns:
        The counted requests' latencies in seconds, shortest first.
    """
    return sorted(e - s for s, e in spans if start < e <= end)


def latency_summary(latencies: list[float], elapsed_s: float) -> dict[str, Any]:
    """``requests``, ``requests_per_s``, ``p50_ms``, ``p99_ms`` of a window's sorted latencies."""
    n = len(latencies)
    return {
        "requests": n,
        "requests_per_s": n / elapsed_s,
        "p50_ms": 1000 * statistics.median(latencies) if n else None,
        "p99_ms": 1000 * latencies[min(n - 1, int(0.99 * n))] if n else None,
    }


@dataclasses.dataclass(frozen=True)
class Window:
    """What :func:`closed_loop` measured.

    Attributes:
        start: When the window opened (``time.perf_counter()`` seconds).
        end: When it closed.
        spans: ``(start, end)`` of every request sent after the barrier, by every caller.
    """

    start: float
    end: float
    spans: list[tuple[float, float]]

    def latencies(self) -> list[float]:
        """The counted requests' latencies (:func:`completed_in_window`)."""
        return completed_in_window(self.spans, self.start, self.end)

    def summary(self) -> dict[str, Any]:
        """Requests, requests/s and p50/p99 latency of the window (:func:`latency_summary`)."""
        return latency_summary(self.latencies(), self.end - self.start)


def closed_loop(
    run: Callable[[dict[str, Any]], Any],
    feeds: Sequence[dict[str, Any]],
    callers: int,
    *,
    warmup_s: float,
    duration_s: float,
    check: Callable[[int, int, Any], None],
    check_every: int = 16,
    at_start: Callable[[], None] | None = None,
    at_end: Callable[[], None] | None = None,
) -> Window:
    """``callers`` threads sending requests to ``run`` in a closed loop, for one window.

    Every caller runs once (checked) before they all meet on a barrier; then each sends its
    next request as soon as the last one returned, for ``warmup_s`` and then the ``duration_s``
    window, and keeps going until the window has closed, so that the contention is the same
    from its first second to its last. Every request's ``(start, end)`` is recorded and what
    counts is decided after the threads have joined, so no caller races the window's edges.

    Args:
        run: One request: a feed in, the outputs out (thread-safe).
        feeds: The distinct requests, cycled through (caller ``c`` starts at ``c``).
        callers: How many threads.
        warmup_s: Seconds between the barrier and the window.
        duration_s: The window's length.
        check: ``check(caller, feed_index, outputs)``: every caller's first outputs, then
            every ``check_every``-th.
        check_every: See ``check``.
        at_start: Called on this thread just before the window opens.
        at_end: Called on this thread just after it closed.

    Returns:
        The window and every request's span.

    Raises:
        BaseException: The first exception a caller raised (the others are stopped).
    """
    n = len(feeds)
    spans: list[list[tuple[float, float]]] = [[] for _ in range(callers)]
    barrier = threading.Barrier(callers + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def caller(c: int) -> None:
        try:
            check(c, c % n, run(feeds[c % n]))
            barrier.wait()
            k = 0
            mine = spans[c]
            while not stop.is_set():
                i = (c * 7 + k) % n
                k += 1
                t0 = time.perf_counter()
                out = run(feeds[i])
                mine.append((t0, time.perf_counter()))
                if k % check_every == 0:
                    check(c, i, out)
        except threading.BrokenBarrierError:
            pass  # another caller failed first: its exception is the one raised
        except BaseException as exc:
            errors.append(exc)
            stop.set()  # wakes the window's timer: no point measuring a broken server
            barrier.abort()

    threads = [threading.Thread(target=caller, args=(c,), daemon=True) for c in range(callers)]
    for t in threads:
        t.start()
    start = end = 0.0
    try:
        barrier.wait()
        if not stop.wait(warmup_s):
            if at_start is not None:
                at_start()
            start = time.perf_counter()
            stop.wait(duration_s)
            end = time.perf_counter()
            if at_end is not None:
                at_end()
    except threading.BrokenBarrierError:
        pass
    finally:
        stop.set()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return Window(start, end, [span for mine in spans for span in mine])


# --------------------------------------------------------------------------------------------
# The child: one configuration


def _delay_ms(flag: str) -> float | None:
    """``delayX`` -> X ms (``Batching.max_delay_ms``); None for other flags."""
    try:
        return float(flag[5:]) if flag.startswith("delay") else None
    except ValueError:
        return None


def _switch_ms(flag: str) -> float | None:
    """``switchX`` -> X ms (the GIL's switch interval); None for other flags."""
    try:
        return float(flag[6:]) if flag.startswith("switch") else None
    except ValueError:
        return None


def _max_rows(flag: str) -> int | None:
    """``maxN`` -> N rows (``Batching.max_batch_size``); None for other flags."""
    return int(flag[3:]) if flag.startswith("max") and flag[3:].isdigit() else None


def _threads(flag: str) -> int | None:
    """``tN`` -> N intra-op threads per pooled session; None for other flags."""
    return int(flag[1:]) if flag.startswith("t") and flag[1:].isdigit() else None


def _check_within(flag: str) -> int | None:
    """``checkN`` -> N merged batches (``Batching.check_within``); None for other flags."""
    return int(flag[5:]) if flag.startswith("check") and flag[5:].isdigit() else None


def _parse_config(name: str) -> dict[str, Any]:
    parts = name.split(":")
    kind = parts[0]
    named = kind == "pool" and len(parts) > 1 and parts[1] in ("auto", "default")
    counted = len(parts) > 1 and (parts[1].isdigit() or named)
    sessions: int | str = (parts[1] if named else int(parts[1])) if counted else 1
    flags = set(parts[2:] if counted else parts[1:])
    known = {
        "batch",
        "nopad",
        "anyshape",
        "serialized",
        "threads",
        "graph",
        "fp32",
        "views",
        "buckets",
        "int8",
        "int4",
        "static",
        "nocheck",
        "nogain",
        "parallel",
        "nospin",
    }
    unknown = {
        f
        for f in flags - known
        if _delay_ms(f) is None
        and _switch_ms(f) is None
        and _max_rows(f) is None
        and _check_within(f) is None
        and _threads(f) is None
    }
    if kind not in ("plain", "pool", "single") or unknown:
        raise SystemExit(f"unknown configuration {name!r}")
    return {"kind": kind, "sessions": sessions, "flags": flags}


class _PlainQueue:
    """N plain sessions behind a queue, as a user without sharedml writes it."""

    def __init__(self, sessions: list[Any], lock: threading.Lock | None) -> None:
        import queue

        self._free: queue.Queue[Any] = queue.Queue()
        for s in sessions:
            self._free.put(s)
        self._lock = lock
        self.sessions = sessions

    def run(self, feed: dict[str, Any]) -> Any:
        sess = self._free.get()
        try:
            if self._lock is not None:
                with self._lock:
                    return sess.run(None, feed)
            return sess.run(None, feed)
        finally:
            self._free.put(sess)

    def close(self) -> None:
        self.sessions.clear()


def _server(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import onnxruntime as ort

    import sharedml

    cfg = _parse_config(spec["config"])
    providers = spec["providers"]
    n, flags = cfg["sessions"], cfg["flags"]
    providers = _with_options(providers, flags)
    if cfg["kind"] == "pool":
        batching = sharedml.Batching(
            pad_to_buckets=False if "nopad" in flags else None,
            session_per_bucket=(
                True if "buckets" in flags else False if "anyshape" in flags else None
            ),
            max_delay_ms=next((d for f in flags if (d := _delay_ms(f)) is not None), None),
            max_batch_size=next((m for f in flags if (m := _max_rows(f)) is not None), 32),
            copy_outputs="views" not in flags,
            check_within=(
                None
                if "nocheck" in flags
                else next((c for f in flags if (c := _check_within(f)) is not None), 64)
            ),
            measure_gain="nogain" not in flags,
        )
        template = None
        threads = next((t for f in flags if (t := _threads(f)) is not None), None)
        if threads is not None or "nospin" in flags:
            template = ort.SessionOptions()
            if threads is not None:
                template.intra_op_num_threads = threads
            if "nospin" in flags:
                template.add_session_config_entry("session.intra_op.allow_spinning", "0")
        default = n == "default"  # as sharedml serve opens it: default sessions, "auto"
        chosen: Any = batching if "batch" in flags else False
        if default:
            chosen = batching if "nogain" in flags else "auto"
        pool = sharedml.SessionPool(
            _static_model(spec) if "static" in flags else spec["model"],
            sessions=None if default else n,
            providers=providers,
            sess_options=template,
            batching=chosen,
            serialize_runs=True if "serialized" in flags else None,
            per_session_state="serialized" in flags and n != 1,
            cache_dir=spec["cache_dir"],
            weights=next((w for w in ("int8", "int4") if w in flags), "float"),
        )
        pool.wait_ready()

        class _Pool:
            def run(self, feed: dict[str, Any]) -> Any:
                return pool.run(None, feed)

            def warm_up(self, feed: dict[str, Any]) -> None:
                pool.warm_up(feed)  # what a server does before it serves: graphs, buckets

            def stats(self) -> Any:
                return pool.stats()

            def batching_reason(self) -> str:
                return pool.batching_reason

            def close(self) -> None:
                pool.close()

        extras: dict[str, Any] = {
            "mechanism": str(pool.mechanism),
            "pool_sessions": pool.max_sessions,
        }
        calibration = pool.stats().calibration
        if calibration is not None:  # sessions="auto": what it measured and chose
            extras["calibration"] = dataclasses.asdict(calibration)
        return _Pool(), extras
    so = ort.SessionOptions()
    if "threads" in flags:
        so.intra_op_num_threads = max(1, len(os.sched_getaffinity(0)) // n)
    count = 1 if cfg["kind"] == "single" else n
    sessions = [ort.InferenceSession(spec["model"], so, providers=providers) for _ in range(count)]
    if cfg["kind"] == "single":
        one = sessions[0]

        class _Single:
            def run(self, feed: dict[str, Any]) -> Any:
                return one.run(None, feed)

            def close(self) -> None:
                sessions.clear()

        return _Single(), {}
    lock = threading.Lock() if "serialized" in flags else None
    return _PlainQueue(sessions, lock), {}


def _with_options(providers: list[Any], flags: set[str]) -> list[Any]:
    """The first provider with the options the flags ask for (graph: CUDA graphs; fp32: no TF32)."""
    options = {}
    if "graph" in flags:
        options["enable_cuda_graph"] = "1"
    if "fp32" in flags:
        options["use_tf32"] = "0"
    return [(providers[0], options), *providers[1:]] if options else providers


def _preload(providers: list[Any]) -> None:
    """Load CUDA's libraries the way onnxruntime-gpu wants, before the first CUDA session."""
    import onnxruntime as ort

    name = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if name == "CUDAExecutionProvider" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()


def _device_bytes(providers: list[Any]) -> int | None:
    name = providers[0] if isinstance(providers[0], str) else providers[0][0]
    if name != "CUDAExecutionProvider":
        return None
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(total - free)
    except Exception:
        return None


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import psutil

    sys.path.insert(0, str(REPO))
    refs = np.load(spec["references"], allow_pickle=False)
    feeds = [
        {k[len(f"in{i}_") :]: refs[k] for k in refs.files if k.startswith(f"in{i}_")}
        for i in range(INPUTS)
    ]
    cfg = _parse_config(spec["config"])
    switch = next((x for f in cfg["flags"] if (x := _switch_ms(f))), None)
    if switch is not None:
        sys.setswitchinterval(switch / 1000)
    prefix = "fp32out" if "fp32" in cfg["flags"] and "fp32out0" in refs.files else "out"
    expected = [refs[f"{prefix}{i}"] for i in range(INPUTS)]
    me = psutil.Process()
    _preload(spec["providers"])  # onnxruntime's import and libraries are not the server's memory

    base_pss = me.memory_full_info().pss
    base_device = _device_bytes(spec["providers"])
    start = time.perf_counter()
    server, extras = _server(spec)
    create_s = time.perf_counter() - start
    start = time.perf_counter()
    if hasattr(server, "warm_up"):
        server.warm_up(feeds[0])
    warm_s = time.perf_counter() - start
    callers = spec["callers"]
    mismatches = [0] * callers
    max_diff = [0.0] * callers

    def check(c: int, i: int, out: Any) -> None:
        diff = float(np.max(np.abs(out[0] - expected[i]))) if out[0].size else 0.0
        max_diff[c] = max(max_diff[c], diff)
        if not np.allclose(out[0], expected[i], rtol=RTOL, atol=ATOL):
            mismatches[c] += 1

    pooled = hasattr(server, "stats")
    marks: dict[str, Any] = {}
    window = closed_loop(
        server.run,
        feeds,
        callers,
        warmup_s=spec["warmup_s"],
        duration_s=spec["duration_s"],
        check=check,
        at_start=(lambda: marks.update(before=server.stats())) if pooled else None,
        at_end=(lambda: marks.update(after=server.stats())) if pooled else None,
    )
    before, after = marks.get("before"), marks.get("after")
    pss = me.memory_full_info().pss - base_pss
    device = _device_bytes(spec["providers"])
    elapsed = window.end - window.start
    stats: dict[str, Any] = {}
    if before is not None and after is not None:
        s = server.stats()
        # The window's share of the sessions' time in Run; the rest went to waiting for rows
        # (window_fill_wait_s), handing results back and taking new requests, and idling.
        run_s = after.run_seconds - before.run_seconds
        stats = {
            "batching_reason": getattr(server, "batching_reason", lambda: None)(),
            "merge_gain": s.merge_gain,
            "merge_pauses": s.merge_pauses,
            "merge_trials": s.merge_trials,
            "merge_comparisons": s.merge_comparisons,
            "batches": s.batches,
            "mean_batch_rows": s.mean_batch_rows,
            "padded_rows": s.padded_rows,
            "fill_wait_s": s.fill_wait_seconds,
            "waits": s.waits,
            "window_run_s": run_s,
            "window_fill_wait_s": after.fill_wait_seconds - before.fill_wait_seconds,
            "busy_share": run_s / (after.sessions * elapsed),
            "window_batches": after.batches - before.batches,
            "window_batch_checks": after.batch_checks - before.batch_checks,
            "window_check_runs": after.check_runs - before.check_runs,
            # The share of the sessions' time in Run that went to checks' solo runs.
            "window_check_share": (after.check_seconds - before.check_seconds) / run_s
            if run_s
            else 0.0,
        }
    server.close()
    return {
        "config": spec["config"],
        "callers": callers,
        "create_s": create_s,
        "warm_up_s": warm_s,
        **window.summary(),
        "pss_bytes": pss,
        "device_bytes": (
            device - base_device if device is not None and base_device is not None else None
        ),
        "outputs_equal": not any(mismatches),
        "max_abs_diff": max(max_diff),
        "output_max_abs": float(max(np.max(np.abs(e)) for e in expected)),
        **extras,
        **stats,
    }


def _info(spec: dict[str, Any]) -> Any:
    """The spec's model as ``tools.realistic_models.sample_inputs`` takes it."""
    import numpy as np

    sys.path.insert(0, str(REPO))
    from tools import realistic_models as rm

    return rm.ModelInfo(
        path=spec["model"],
        name=spec["name"],
        weights_bytes=0,
        inputs={k: (np.dtype(v[0]), tuple(v[1])) for k, v in spec["inputs"].items()},
        description=spec["name"],
        vocab_size=spec.get("vocab_size"),
        max_seq=spec.get("max_seq"),
    )


STATIC_CALIBRATION = 16  # feeds, seeded apart from the measured inputs (seeds 0..INPUTS-1)


def _static_model(spec: dict[str, Any]) -> str:
    """The spec's model as ``sharedml.prepared.compress_static`` writes it, built once.

    Calibrated on ``STATIC_CALIBRATION`` generated inputs that none of the measured requests
    repeats (a user calibrates on real inputs; here the real ones are generated too).
    """
    from sharedml.prepared import compress_static

    sys.path.insert(0, str(REPO))
    from tools import realistic_models as rm

    dst = Path(spec["cache_dir"]).parent / "static" / f"{spec['name']}.onnx"
    if not dst.is_file():
        info = _info(spec)
        calibration = [
            rm.sample_inputs(info, batch=1, seq=spec["seq"], seed=10_000 + i)
            for i in range(STATIC_CALIBRATION)
        ]
        compress_static(spec["model"], dst, calibration=calibration)
    return str(dst)


def references(spec: dict[str, Any]) -> dict[str, Any]:
    """Solo runs of every input on one plain session, saved for the workers.

    With ORT's defaults, and on CUDA also with TF32 off (``fp32out``): the ``fp32`` configs are
    compared with those, so that what batching changes is told apart from what TF32 does.
    """
    import numpy as np
    import onnxruntime as ort

    sys.path.insert(0, str(REPO))
    from tools import realistic_models as rm

    info = _info(spec)
    _preload(spec["providers"])
    sess = ort.InferenceSession(spec["model"], providers=spec["providers"])
    exact = None
    if spec["providers"][0] == "CUDAExecutionProvider":
        exact = ort.InferenceSession(
            spec["model"], providers=_with_options(spec["providers"], {"fp32"})
        )
    arrays: dict[str, Any] = {}
    for i in range(INPUTS):
        feed = rm.sample_inputs(info, batch=1, seq=spec["seq"], seed=i)
        for k, v in feed.items():
            arrays[f"in{i}_{k}"] = v
        outputs = sess.run(None, feed)
        arrays[f"out{i}"] = outputs[0]
        for j, value in enumerate(outputs):  # every output, for benchmarks that check them all
            arrays[f"out{i}_{j}"] = value
        if exact is not None:
            arrays[f"fp32out{i}"] = exact.run(None, feed)[0]
    np.savez(spec["references"], **arrays)
    return {"inputs": INPUTS}


FIRST_RESULT_CONFIGS = ("plain", "pool", "pool:parallel")
COMPILE_EACH_RUN = False  # --compile-each-run: children keep the environment's bytecode setting


def _cpu_s() -> float:
    """This process's CPU time so far, every thread's, user + system (seconds)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def first_result(spec: dict[str, Any]) -> dict[str, Any]:
    """Time to a first result: one plain session, or a pool of N that serves before it is full.

    ``spec["config"]``: ``plain`` (``InferenceSession`` + one ``run``), ``pool`` (a pool of N,
    as created by default: the first session up front, the rest in the background, one at a
    time) or ``pool:parallel`` (``serialize_creation=False``: all N before the constructor
    returns, on every core). Besides the wall-clock times, the process's CPU time at each mark
    (``*_cpu_s``): what the work cost, which a busy machine inflates far less.
    """
    import numpy as np
    import onnxruntime as ort

    import sharedml

    refs = np.load(spec["references"], allow_pickle=False)
    feed = {k[len("in0_") :]: refs[k] for k in refs.files if k.startswith("in0_")}
    cpu = _cpu_s()
    start = time.perf_counter()
    if spec["config"] == "plain":
        sess = ort.InferenceSession(spec["model"], providers=spec["providers"])
        sess.run(None, feed)
        return {
            "first_result_s": time.perf_counter() - start,
            "first_result_cpu_s": _cpu_s() - cpu,
        }
    pool = sharedml.SessionPool(
        spec["model"],
        sessions=spec["sessions"],
        cache_dir=spec["cache_dir"],
        serialize_creation=spec["config"] != "pool:parallel",
    )
    pool.run(None, feed)
    first, first_cpu = time.perf_counter() - start, _cpu_s() - cpu
    pool.wait_ready()
    ready, ready_cpu = time.perf_counter() - start, _cpu_s() - cpu
    pool.close()
    return {
        "first_result_s": first,
        "all_sessions_s": ready,
        "first_result_cpu_s": first_cpu,
        "all_sessions_cpu_s": ready_cpu,
        "mechanism": str(pool.mechanism),
    }


def ceiling(spec: dict[str, Any]) -> dict[str, Any]:
    """What one session does with batches run back to back: the bound batching can approach.

    One thread, no callers, no queue: ``spec["config"]`` is ``plain`` (an ``InferenceSession``
    with the provider's defaults), ``pool`` (a pool of one session, its ``session()`` run
    directly: the pool's weights and settings without its dispatch), ``graph`` (the same with
    CUDA graphs: the graph session's ``run``, feeds copied in and outputs out) or
    ``graph-replay`` (its ``slot``/``replay``: the data stays on the device, nothing is
    copied; what a graph costs with the thread hop but without the copies). For each batch size the
    rows of the first requests are stacked and run for ``duration_s``; samples/s is rows x runs
    over the time. Numpy in, numpy out, as the serving configurations run.
    """
    import numpy as np
    import onnxruntime as ort

    import sharedml

    refs = np.load(spec["references"], allow_pickle=False)
    names = sorted({k.split("_", 1)[1] for k in refs.files if k.startswith("in0_")})
    _preload(spec["providers"])
    pool = None
    if spec["config"] == "plain":
        sess = ort.InferenceSession(spec["model"], providers=spec["providers"])
        run = sess.run
    else:
        graphs = spec["config"].startswith("graph")
        providers = _with_options(spec["providers"], {"graph"} if graphs else set())
        pool = sharedml.SessionPool(
            spec["model"], sessions=1, providers=providers, cache_dir=spec["cache_dir"]
        )
        checkout = pool.session()
        sess = checkout.__enter__()
        run = sess.run
        if spec["config"] == "graph-replay":
            slots: dict[int, Any] = {}

            def run(_names: Any, feed: dict[str, Any]) -> None:
                rows = len(next(iter(feed.values())))
                if rows not in slots:
                    slots[rows] = sess.slot(feed)  # captured once; its buffers hold this feed
                sess.replay(slots[rows])

    rows_out = []
    for rows in spec["batch_sizes"]:
        feed = {
            n: np.concatenate([refs[f"in{i % INPUTS}_{n}"] for i in range(rows)]) for n in names
        }
        for _ in range(3):
            run(None, feed)  # kernels chosen, arena grown for this shape
        runs, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < spec["duration_s"]:
            run(None, feed)
            runs += 1
        rows_out.append(
            {
                "rows": rows,
                "ms_per_run": 1000 * elapsed / runs,
                "samples_per_s": rows * runs / elapsed,
            }
        )
    if pool is not None:
        checkout.__exit__(None, None, None)
        pool.close()
    return {"batches": rows_out}


# --------------------------------------------------------------------------------------------
# The parent


def _child(
    mode: str, spec: dict[str, Any], timeout_s: float, script: Path | None = None
) -> dict[str, Any]:
    """``script --child mode spec`` (this file by default) in a fresh interpreter.

    Returns:
        What the child printed after ``RESULT``, or ``{"error": ...}`` with its last lines.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    # Bytecode as an installed package has it (pip compiles on install): with
    # PYTHONDONTWRITEBYTECODE every child compiled sharedml's modules again, 0.3-0.4 s of a
    # pool's start-up here that no deployed server pays. Kept apart from the source tree.
    if not COMPILE_EACH_RUN:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(HERE / "out" / "pycache")
    script = script or Path(__file__).resolve()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), "--child", mode, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Generate (or reuse) a benchmark model with tools/realistic_models.py."""
    sys.path.insert(0, str(REPO))
    from tools import realistic_models as rm

    folder = args.out_dir / "models"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{args.size}-seed0.onnx"
    meta_path = path.with_suffix(".serving.json")
    if path.is_file() and meta_path.is_file():
        return dict(json.loads(meta_path.read_text()))
    info = rm.REGISTRY[name](path, size=args.size, seed=0)
    meta = {
        "model": str(path),
        "name": info.name,
        "weights_bytes": info.weights_bytes,
        "inputs": {k: [str(v[0]), list(v[1])] for k, v in info.inputs.items()},
        "vocab_size": info.vocab_size,
        "max_seq": info.max_seq,
    }
    meta_path.write_text(json.dumps(meta))
    return meta


def _external_model(path: Path) -> dict[str, Any]:
    """The inputs of an ONNX file as ``references`` feeds them.

    A symbolic (or unnamed) axis 0 is the batch (one row a request), any other symbolic axis
    the sequence (``--seq``); fixed dimensions are kept, so a model exported with its batch
    fixed at 1 is fed one row.
    """
    import onnx

    graph = onnx.load_model(str(path), load_external_data=False).graph
    names = {t.name for t in graph.initializer}
    inputs = {}
    for value in graph.input:
        if value.name in names:
            continue
        tensor = value.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        dims = [
            d.dim_value if d.HasField("dim_value") else ("batch" if axis == 0 else "seq")
            for axis, d in enumerate(tensor.shape.dim)
        ]
        inputs[value.name] = [str(dtype), dims]
    return {
        "model": str(path),
        "name": path.stem,
        "weights_bytes": sum(len(t.raw_data) for t in graph.initializer if t.HasField("raw_data")),
        "inputs": inputs,
        "vocab_size": 1000,
        "max_seq": None,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        mode, spec = argv[1], json.loads(argv[2])
        run = {
            "worker": worker,
            "references": references,
            "first-result": first_result,
            "ceiling": ceiling,
        }[mode]
        print("RESULT " + json.dumps(run(spec)), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--models", nargs="+", default=["mlp", "resnet", "bert"])
    p.add_argument(
        "--model-path", type=Path, nargs="+", help="ONNX files instead of generated models"
    )
    p.add_argument("--configs", nargs="+", help=f"default: {' '.join(DEFAULT_CONFIGS)}")
    p.add_argument("--serialized", action="store_true", help="also the DirectML-like configs")
    p.add_argument("--callers", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--providers", nargs="+", default=["CPUExecutionProvider"])
    p.add_argument("--duration-s", type=float, default=3.0)
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--seq", type=int, default=128, help="sequence length of transformers")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--out-dir", type=Path, default=HERE / "out")
    p.add_argument(
        "--json", type=Path, help="write results here ('{model}' in the name: a file per model)"
    )
    p.add_argument("--first-result", action="store_true", help="time to first result instead")
    p.add_argument(
        "--first-result-configs",
        nargs="+",
        default=["plain", "pool"],
        choices=FIRST_RESULT_CONFIGS,
        help="what --first-result starts (pool:parallel: serialize_creation=False)",
    )
    p.add_argument(
        "--compile-each-run",
        action="store_true",
        help="children keep PYTHONDONTWRITEBYTECODE as the environment sets it (figures before "
        "this option: every child compiled sharedml's modules again)",
    )
    p.add_argument(
        "--defaults",
        action="store_true",
        help=f"the default pool against its alternatives ({' '.join(DEFAULTS_CONFIGS)}), "
        "in --repeats interleaved rounds (default callers: 1 16)",
    )
    p.add_argument(
        "--ceiling",
        nargs="*",
        type=int,
        metavar="ROWS",
        help="one session's samples/s at these batch sizes, run back to back (default 1..32)",
    )
    p.add_argument(
        "--ceiling-configs",
        nargs="+",
        default=["plain", "pool"],
        choices=("plain", "pool", "graph", "graph-replay"),
        help="what --ceiling runs (graph, graph-replay: CUDA graphs; see ceiling())",
    )
    p.add_argument("--sessions", type=int, default=8, help="pool size for --first-result")
    p.add_argument("--repeats", type=int, default=3, help="repeats for --first-result")
    p.add_argument("--timeout-s", type=float, default=900)
    args = p.parse_args(argv)
    global COMPILE_EACH_RUN
    COMPILE_EACH_RUN = args.compile_each_run
    providers = list(args.providers)
    if "CPUExecutionProvider" not in providers:
        providers.append("CPUExecutionProvider")
    configs = args.configs or DEFAULT_CONFIGS + (SERIALIZED_CONFIGS if args.serialized else [])
    models = (
        [_external_model(path) for path in args.model_path]
        if args.model_path
        else [_model(m, args) for m in args.models]
    )
    if args.defaults:
        configs = args.configs or DEFAULTS_CONFIGS
        if args.callers == [1, 4, 16, 64]:  # left at its default
            args.callers = [1, 16]
    cache_dir = str(args.out_dir / "serving-cache")
    report: dict[str, Any] = {
        "device": _describe_device(providers),
        "platform": platform.platform(),
        "cores": len(os.sched_getaffinity(0)),
        "models": [],
    }
    for meta in models:
        with tempfile.TemporaryDirectory() as tmp:
            base = {
                **meta,
                "providers": providers,
                "seq": args.seq,
                "cache_dir": cache_dir,
                "references": str(Path(tmp) / "refs.npz"),
            }
            ref = _child("references", base, args.timeout_s)
            if "error" in ref:
                print(f"{meta['name']}: references failed: {ref['error']}", flush=True)
                continue
            entry: dict[str, Any] = {
                "model": meta["name"],
                "weights_bytes": meta["weights_bytes"],
                "onnxruntime": _ort_version(),
                "configs": [],
            }
            if args.ceiling is not None:
                for config in args.ceiling_configs:
                    spec = {
                        **base,
                        "config": config,
                        "batch_sizes": args.ceiling or [1, 2, 4, 8, 16, 32],
                        "duration_s": args.duration_s,
                    }
                    result = _child("ceiling", spec, args.timeout_s) | {"name": config}
                    entry["configs"].append(result)
                    for b in result.get("batches", []):
                        print(
                            f"{meta['name']} {config} one session, {b['rows']} rows: "
                            f"{b['ms_per_run']:.2f} ms, {b['samples_per_s']:,.0f} samples/s",
                            flush=True,
                        )
                    if "error" in result:
                        print(f"{meta['name']} {config}: {result['error']}", flush=True)
            elif args.first_result:
                # Round -1 is not recorded: it builds the cache entries, the bytecode and the
                # stamps that spare hashing unchanged files, and warms the page cache, as a
                # server's restart finds them (the first round took 2.6x longer here).
                for repeat in range(-1, args.repeats):
                    for config in args.first_result_configs:
                        spec = {**base, "config": config, "sessions": args.sessions}
                        result = _child("first-result", spec, args.timeout_s)
                        result |= {"name": config, "repeat": repeat}
                        if repeat >= 0:
                            entry["configs"].append(result)
                        print(json.dumps(result), flush=True)
                print(_first_result_summary(meta["name"], entry["configs"]), flush=True)
            elif args.defaults:
                for repeat in range(args.repeats):
                    for callers in args.callers:
                        # The order rotates each round: a load that comes or goes during a
                        # round then favours no configuration every time.
                        shift = repeat % len(configs)
                        for config in configs[shift:] + configs[:shift]:
                            result = _serve_window(base, config, callers, args)
                            result |= {"name": config, "callers": callers, "repeat": repeat}
                            entry["configs"].append(result)
                            print(_line(meta["name"], result), flush=True)
                summary, entry["defaults"] = _defaults_summary(meta["name"], entry["configs"])
                print(summary, flush=True)
            else:
                for callers in args.callers:
                    for config in configs:
                        result = _serve_window(base, config, callers, args)
                        cfg = _parse_config(config)
                        result |= {
                            "name": config,
                            "sessions": cfg["sessions"],
                            "batching": "batch" in cfg["flags"],
                            "cuda_graph": "graph" in cfg["flags"],
                            "tf32": "fp32" not in cfg["flags"],
                            "callers": callers,
                        }
                        entry["configs"].append(result)
                        print(_line(meta["name"], result), flush=True)
            report["models"].append(entry)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if "{model}" not in args.json.name:
            args.json.write_text(json.dumps(report, indent=1) + "\n")
        for entry in report["models"] if "{model}" in args.json.name else ():
            # One file per model: {"device", "onnxruntime", "model", "weights_bytes", "configs"}
            name = entry["model"].split("-")[0].removesuffix("_like")
            one = {"device": report["device"], **entry}
            path = args.json.with_name(args.json.name.replace("{model}", name))
            path.write_text(json.dumps(one, indent=1) + "\n")
    return 0


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _serve_window(
    base: dict[str, Any], config: str, callers: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One configuration served to ``callers`` for one window, in a worker process of its own."""
    spec = {
        **base,
        "config": config,
        "callers": callers,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
    }
    return _child("worker", spec, args.timeout_s)


def _first_result_summary(model: str, results: list[dict[str, Any]]) -> str:
    """Each pool configuration's medians over plain's: first result, all sessions (wall, CPU)."""
    plain = _median([r["first_result_s"] for r in results if r.get("name") == "plain"])
    plain_cpu = _median([r["first_result_cpu_s"] for r in results if r.get("name") == "plain"])
    lines = [f"{model}: plain create + run {plain or 0:.3f} s (CPU {plain_cpu or 0:.3f} s)"]
    for name in dict.fromkeys(r["name"] for r in results if r.get("name", "plain") != "plain"):
        mine = [r for r in results if r.get("name") == name and "error" not in r]
        parts = []
        for key, base in (("first_result_s", plain), ("all_sessions_s", plain)):
            value = _median([r[key] for r in mine])
            if value is not None and base:
                parts.append(f"{key[:-2]} {value:.3f} s ({value / base:.2f}x)")
        for key, base in (("first_result_cpu_s", plain_cpu), ("all_sessions_cpu_s", plain_cpu)):
            value = _median([r[key] for r in mine])
            if value is not None and base:
                parts.append(f"{key[:-2]} {value / base:.2f}x")
        lines.append(f"  {name}: " + ", ".join(parts))
    return "\n".join(lines)


def _defaults_summary(model: str, results: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    """The default pool's median requests/s over the best alternative's, per caller count."""
    lines, rows = [], []
    for callers in sorted({r["callers"] for r in results}):
        medians = {}
        for name in DEFAULTS_CONFIGS:
            done = [
                r["requests_per_s"]
                for r in results
                if r["name"] == name and r["callers"] == callers and "error" not in r
            ]
            if done:
                medians[name] = statistics.median(done)
        default = medians.pop(DEFAULTS_CONFIGS[0], None)
        if default is None or not medians:
            continue
        best = max(medians, key=lambda k: medians[k])
        ratio = default / medians[best]
        verdict = "meets" if ratio >= DEFAULTS_TARGET else "MISSES"
        lines.append(
            f"{model} x{callers}: default {default:.1f} req/s, best alternative {best} "
            f"{medians[best]:.1f}: {ratio:.2f}x ({verdict} {DEFAULTS_TARGET})"
        )
        rows.append({"callers": callers, "default": default, "best": best, "ratio": ratio})
    return "\n".join(lines), rows


def _line(model: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{model} {r['name']} x{r['callers']}: FAILED {r['error']}"
    if r.get("p50_ms") is None:
        return f"{model} {r['name']:<24} x{r['callers']:<3} no request finished in the window"
    batch = f", {r['mean_batch_rows']:.1f} rows/batch" if r.get("batches") else ""
    if r.get("busy_share") is not None:
        batch += f", sessions {100 * r['busy_share']:.0f}% in Run"
    if r.get("window_batch_checks"):
        batch += (
            f", {r['window_batch_checks']} checks of {r['window_batches']} batches "
            f"({100 * r['window_check_share']:.1f}% of Run)"
        )
    device = f", device {r['device_bytes'] / MIB:.0f} MiB" if r.get("device_bytes") else ""
    return (
        f"{model} {r['name']:<24} x{r['callers']:<3} {r['requests_per_s']:8.1f} req/s  "
        f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  PSS {r['pss_bytes'] / MIB:6.0f} "
        f"MiB{device}{batch}, outputs {'equal' if r['outputs_equal'] else 'DIFFER'} "
        f"(max diff {r['max_abs_diff']:.1e} of {r['output_max_abs']:.1e})"
    )


def _ort_version() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import onnxruntime as o; print(o.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip()


def _describe_device(providers: list[str]) -> str:
    if providers[0] == "CUDAExecutionProvider":
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "CUDA device"
    return (
        f"CPU: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores"
    )


if __name__ == "__main__":
    sys.exit(main())
