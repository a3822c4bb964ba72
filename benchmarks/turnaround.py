r"""Where a batching pool's time goes between two batches, for callers in a closed loop.

C callers (threads, or asyncio tasks on one event loop with ``--asyncio``) each send a one-row
request and send the next once the result is back; one batching pool serves them. A session
runs a batch, then waits while the batch's callers come back with their next requests: the
*turnaround*. This measures:

- the ceiling: one pool session running ``--callers``-row batches back to back, one thread;
- the closed loop's requests/s over a window, against that ceiling;
- per batch (one session): the gap from a batch's end to the next batch's start, and when the
  k-th of the batch's callers was back in the pool after the batch ended (``back``: the
  caller's call returned; ``again``: its next request arrived).

``--uvloop`` runs the tasks on uvloop's event loop, which uvicorn (``sharedml serve``) picks
where it is installed.

``--pin N`` keeps the callers' threads on the first N CPUs the process may use
(``sched_setaffinity``): the GIL runs one of them at a time anyway, and a thread woken on the
CPU that the GIL's last holder leaves needs no other CPU woken (on a VM, no halted vCPU).
ORT's own threads keep every CPU.

``--simulate`` replaces each ``Run`` by a real run of a small generated model (a Gather into
``[rows, 128, 768]`` floats, 384 KiB a row, as BERT-base's output at sequence 128) padded
with sleep to the milliseconds a BERT-like session took per batch size on an H100
(``benchmarks/results/gpu-ceiling-bert-h100.json``): the pool's side of a GPU run, on any
machine. Without it, ``--model bert`` runs the BERT-base-like model of tools/realistic_models
on the given provider.

Usage::

    python benchmarks/turnaround.py --simulate --sessions 1 2 --json out.json
    python benchmarks/turnaround.py --model bert --providers CUDAExecutionProvider

The trace patches two of the scheduler's methods (timestamps only); nothing else changes.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import sharedml  # noqa: E402
from sharedml.pool import _scheduler  # noqa: E402

# ms per run of a BERT-like pool session on an H100 by rows (gpu-ceiling-bert-h100.json, "pool")
H100_BERT_MS = {1: 2.85, 2: 3.14, 4: 3.04, 8: 3.56, 16: 4.19, 32: 7.43}
SEQ, HIDDEN = 128, 768


def _simulated_model(folder: str) -> str:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = np.random.default_rng(0).standard_normal((1000, HIDDEN)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["last_hidden_state"])],
        "gather",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", SEQ])],
        [
            helper.make_tensor_value_info(
                "last_hidden_state", TensorProto.FLOAT, ["batch", SEQ, HIDDEN]
            )
        ],
        [numpy_helper.from_array(table, "table")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = os.path.join(folder, "gather.onnx")
    onnx.save(model, path)
    return path


def _simulate(ms_by_rows: dict[int, float]) -> None:
    """Pad every Run of the pool's sessions with sleep to ``ms_by_rows`` (next bucket up)."""
    from sharedml.pool import _pool

    real = _pool._Sessions.run
    buckets = sorted(ms_by_rows)

    def run(self: Any, sess: Any, request: Any, feed: Any) -> list[Any]:
        rows = next(iter((feed or request.feed).values())).shape[0]
        target = ms_by_rows[next((b for b in buckets if rows <= b), buckets[-1])] / 1000
        start = time.perf_counter()
        out: list[Any] = real(self, sess, request, feed)
        left = target - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return out

    _pool._Sessions.run = run  # type: ignore[method-assign]


class _Trace:
    """Timestamps of batches (start, end) and of callers' calls (arrived, returned)."""

    def __init__(self) -> None:
        self.batches: list[tuple[float, float]] = []
        self.arrived: list[float] = []
        self.returned: list[float] = []
        run_batch, run = _scheduler.Scheduler._run_batch, _scheduler.Scheduler.run
        trace = self

        def traced_batch(self: Any, sess: Any, batch: Any) -> bool:
            start = time.perf_counter()
            try:
                return run_batch(self, sess, batch)  # type: ignore[no-any-return]
            finally:
                trace.batches.append((start, time.perf_counter()))

        def traced_run(self: Any, request: Any) -> Any:
            trace.arrived.append(time.perf_counter())
            try:
                return run(self, request)
            finally:
                trace.returned.append(time.perf_counter())

        _scheduler.Scheduler._run_batch = traced_batch  # type: ignore[method-assign]
        _scheduler.Scheduler.run = traced_run  # type: ignore[method-assign]

    def turnaround(self, start: float, end: float, callers: int) -> dict[str, Any]:
        """Per batch in [start, end]: the gap to the next, and the k-th caller back after it."""
        batches = sorted(b for b in self.batches if start <= b[0] and b[1] <= end)
        arrived, returned = sorted(self.arrived), sorted(self.returned)
        gaps: list[float] = []
        back: dict[int, list[float]] = {}
        again: dict[int, list[float]] = {}
        marks = sorted({0, callers // 4, callers // 2, (3 * callers) // 4, callers - 1})
        for (_, end_a), (start_b, _) in itertools.pairwise(batches):
            gaps.append(start_b - end_a)
            for times, into in ((returned, back), (arrived, again)):
                i = bisect.bisect_left(times, end_a)
                after = [t - end_a for t in times[i : i + callers] if t < start_b]
                for k in marks:
                    if k < len(after):
                        into.setdefault(k + 1, []).append(after[k])

        def ms(values: list[float]) -> float:
            return round(statistics.median(values) * 1e3, 3) if values else float("nan")

        runs = [b - a for a, b in batches]
        return {
            "batches": len(batches),
            "run_ms_median": ms(runs),
            "gap_ms_median": ms(gaps),
            "gap_ms_p90": round(sorted(gaps)[int(0.9 * len(gaps))] * 1e3, 3) if gaps else None,
            "kth_back_ms": {k: ms(v) for k, v in sorted(back.items())},
            "kth_again_ms": {k: ms(v) for k, v in sorted(again.items())},
        }


def measure(
    args: argparse.Namespace,
    sessions: int,
    model: str,
    feeds: list[dict[str, Any]],
    big: dict[str, Any],
    trace: _Trace,
) -> dict[str, Any]:
    batching = sharedml.Batching(copy_outputs=not args.views, pad_to_buckets=True, share_rows=True)
    pool = sharedml.SessionPool(
        model, sessions=sessions, batching=batching, providers=args.providers
    )
    try:
        for _ in range(10):
            pool.run(None, big)
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.ceiling_s:
            pool.run(None, big)
            runs += 1
        ceiling = args.callers * runs / (time.perf_counter() - start)

        stop = threading.Event()
        counts = [0] * args.callers
        ready = threading.Barrier(2 if args.asyncio else args.callers + 1)

        def pin() -> None:
            if args.pin:
                os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.pin])

        def caller(c: int) -> None:
            pin()
            ready.wait()
            k = 0
            while not stop.is_set():
                pool.run(None, feeds[(c * 7 + k) % len(feeds)])
                k += 1
                counts[c] += 1

        async def task(c: int) -> None:
            k = 0
            while not stop.is_set():
                await pool.run_async(None, feeds[(c * 7 + k) % len(feeds)])
                k += 1
                counts[c] += 1

        def loop() -> None:
            async def main() -> None:
                pin()
                ready.wait()
                await asyncio.gather(*(task(c) for c in range(args.callers)))

            if args.uvloop:
                import uvloop

                uvloop.run(main())
            else:
                asyncio.run(main())

        threads = (
            [threading.Thread(target=loop)]
            if args.asyncio
            else [threading.Thread(target=caller, args=(c,)) for c in range(args.callers)]
        )
        for t in threads:
            t.start()
        ready.wait()
        time.sleep(args.warmup_s)
        before, n0, t0 = pool.stats(), sum(counts), time.perf_counter()
        time.sleep(args.duration_s)
        after, n1, t1 = pool.stats(), sum(counts), time.perf_counter()
        stop.set()
        for t in threads:
            t.join()
        window = t1 - t0
        batches = max(after.batches - before.batches, 1)
        result: dict[str, Any] = {
            "sessions": sessions,
            "views": args.views,
            "asyncio": args.asyncio,
            "uvloop": args.asyncio and args.uvloop,
            "callers": args.callers,
            "pinned_cpus": args.pin,
            "ceiling_rows_per_s": round(ceiling, 1),
            "requests_per_s": round((n1 - n0) / window, 1),
            "of_ceiling": round((n1 - n0) / window / ceiling, 3),
            "mean_batch_rows": round((after.batched_rows - before.batched_rows) / batches, 2),
            "busy_share": round((after.run_seconds - before.run_seconds) / window / sessions, 3),
            "fill_wait_share": round(
                (after.fill_wait_seconds - before.fill_wait_seconds) / window / sessions, 3
            ),
            "check_share": round(
                (after.check_seconds - before.check_seconds) / window / sessions, 3
            ),
        }
        if sessions == 1:
            result.update(trace.turnaround(t0, t1, args.callers))
        return result
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--simulate", action="store_true", help="sleep-padded runs (see above)")
    p.add_argument("--model", default="bert", help="with a provider: bert (tools/realistic_models)")
    p.add_argument("--providers", nargs="+", default=["CPUExecutionProvider"])
    p.add_argument("--sessions", nargs="+", type=int, default=[1, 2])
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--views", action="store_true", help="Batching(copy_outputs=False)")
    p.add_argument("--asyncio", action="store_true", help="callers are tasks on one event loop")
    p.add_argument(
        "--uvloop", action="store_true", help="with --asyncio: uvloop's loop (uvicorn's choice)"
    )
    p.add_argument(
        "--pin", type=int, default=0, help="callers' threads on the first N CPUs (0: all)"
    )
    p.add_argument("--ceiling-s", type=float, default=1.5)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, default=3.0)
    p.add_argument(
        "--out-dir", default=None, help="where the model is written (default: a temp dir)"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    folder = args.out_dir or tempfile.mkdtemp(prefix="sharedml-turnaround-")
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    if args.simulate:
        model, vocab = _simulated_model(folder), 1000
        _simulate(H100_BERT_MS)
        inputs = ["input_ids"]
    else:
        from tools import realistic_models as rm

        model = os.path.join(folder, f"{args.model}.onnx")
        if args.model != "bert":
            p.error("--model: bert (or --simulate)")
        if not os.path.exists(model):
            rm.bert_like(model, external_data=True)
        vocab, inputs = 30522, ["input_ids", "attention_mask"]

    def feed(rows: int) -> dict[str, Any]:
        ids = rng.integers(0, vocab, (rows, SEQ))
        return {name: ids if name == "input_ids" else np.ones_like(ids) for name in inputs}

    feeds, big = [feed(1) for _ in range(32)], feed(args.callers)
    trace = _Trace()
    results = []
    for sessions in args.sessions:
        result = measure(args, sessions, model, feeds, big, trace)
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        info = {
            "simulated": args.simulate,
            "model": "gather (simulated H100 BERT-like run times)" if args.simulate else args.model,
            "providers": args.providers,
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "results": results,
        }
        Path(args.json).write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
