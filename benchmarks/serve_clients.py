r"""``sharedml serve`` under real clients: tritonclient callers against the in-process pool.

For C concurrent callers in a closed loop (each sends its next request as soon as the last
one returned), one row per configuration:

``inprocess``     the callers are threads calling ``SessionPool.run`` in the pool's own process
                  (no network, no codec): the ceiling a server can approach.
``serve:http``    ``sharedml serve`` (a child process, the same pool) and C tritonclient.http
                  callers with the client's defaults (binary tensors in and out).
``serve:grpc``    the same over gRPC (tritonclient.grpc: raw contents).
``plain:http``,   the same server with N plain ``InferenceSession``s behind a queue in place
``plain:grpc``    of the pool (what a server gives without sharedml: N copies of the weights).

Reported per row: requests/s over the window (requests that completed inside it), p50/p99
latency, the server process's PSS after the run (for ``inprocess``, the process of pool and
callers), and the ratio of requests/s to ``inprocess`` at the same C. Each server and each
in-process run is a fresh process; the callers run in this process.

Usage (the full run; a quiet machine)::

    python benchmarks/serve_clients.py --callers 16 64 --duration-s 10 --sessions 4 \\
        --json benchmarks/results/serve-clients.json

Dry run (proves it works, measures nothing)::

    python benchmarks/serve_clients.py --callers 2 --duration-s 0.2 --sessions 1 --rows 1
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


class PlainSessions:
    """N plain ONNX Runtime sessions behind a queue, shaped like a pool for the server."""

    def __init__(self, path: str, sessions: int) -> None:
        import onnxruntime as ort

        self._sessions: queue.Queue[Any] = queue.Queue()
        for _ in range(sessions):
            self._sessions.put(ort.InferenceSession(path, providers=["CPUExecutionProvider"]))
        first = self._sessions.queue[0]
        self._inputs, self._outputs = first.get_inputs(), first.get_outputs()
        self.count = sessions
        self.closed = False
        self.runs = 0

    def get_inputs(self) -> Any:
        """The sessions' inputs."""
        return self._inputs

    def get_outputs(self) -> Any:
        """The sessions' outputs."""
        return self._outputs

    def get_providers(self) -> list[str]:
        """CPU only."""
        return ["CPUExecutionProvider"]

    def stats(self) -> Any:
        """What the server's start-up line and metrics read."""
        import types

        return types.SimpleNamespace(sessions=self.count, busy=0, waiting=0, runs=self.runs)

    def _run(self, names: Any, feed: Any) -> Any:
        session = self._sessions.get()
        try:
            return session.run(names, feed)
        finally:
            self._sessions.put(session)
            self.runs += 1

    async def run_async(self, names: Any, feed: Any) -> Any:
        """One run on a free session, off the event loop."""
        import asyncio

        return await asyncio.to_thread(self._run, names, feed)

    def close(self, timeout_s: float | None = None) -> None:
        """Nothing to wait for: runs in flight finish on their own."""
        self.closed = True


def _pss(pid: int) -> int:
    import psutil

    return int(psutil.Process(pid).memory_full_info().pss)


def _feed(rows: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)


def _summary(spans: list[tuple[float, float]], window: tuple[float, float]) -> dict[str, Any]:
    begin, end = window
    done = [b - a for a, b in spans if begin <= b <= end]
    latencies = sorted(done) or [float("nan")]
    return {
        "requests": len(done),
        "rps": len(done) / (end - begin),
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
    }


def _closed_loop(callers: int, duration_s: float, make_call: Any) -> dict[str, Any]:
    """C threads started together, each calling in a loop for the window; the summary."""
    start = threading.Barrier(callers + 1)
    stop = threading.Event()
    spans: list[tuple[float, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def caller(index: int) -> None:
        try:
            call = make_call(index)
            call()  # once before the window: connections and sessions warm
            start.wait()
            while not stop.is_set():
                t0 = time.perf_counter()
                call()
                t1 = time.perf_counter()
                with lock:
                    spans.append((t0, t1))
        except BaseException as exc:
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(callers)]
    for thread in threads:
        thread.start()
    start.wait(timeout=300)
    begin = time.perf_counter()
    time.sleep(duration_s)
    end = time.perf_counter()
    stop.set()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return _summary(spans, (begin, end))


# ------------------------------------------------------------------------------------------
# Children


def child_inprocess(args: argparse.Namespace) -> None:
    import sharedml

    with sharedml.SessionPool(args.model, sessions=args.sessions, batching="auto") as pool:
        name = pool.get_inputs()[0].name

        def make_call(index: int) -> Any:
            x = _feed(args.rows, args.width, index)
            return lambda: pool.run(None, {name: x})

        result = _closed_loop(args.callers[0], args.duration_s, make_call)
        result["pss_bytes"] = _pss(os.getpid())
        result["batching"] = pool.batching_reason
    print(json.dumps(result), flush=True)


def child_serve(args: argparse.Namespace) -> None:
    from sharedml.serve._server import ModelSpec, Server

    open_pool = None
    if args.child == "plain":
        open_pool = lambda spec: PlainSessions(str(spec.path), args.sessions)  # noqa: E731
    server = Server(
        [ModelSpec("model", Path(args.model))],
        http_port=0,
        grpc_port=0,
        pool_options={"sessions": args.sessions},
        open_pool=open_pool,
    )
    server.run(loop=args.loop)


# ------------------------------------------------------------------------------------------
# The parent: servers in children, tritonclient callers here


def _serve(kind: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--model",
            args.model,
            "--sessions",
            str(args.sessions),
            "--loop",
            args.loop,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    lines = []
    while True:
        line = process.stderr.readline()
        if not line:
            raise RuntimeError(f"the server exited: {''.join(lines)}")
        lines.append(line)
        found = re.search(r"http://([\d.]+:\d+), gRPC on ([\d.]+:\d+)", line)
        if found:
            return process, found.group(1), found.group(2)


def _clients(protocol: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    import importlib

    t = importlib.import_module(f"tritonclient.{protocol}")

    def make_call(index: int) -> Any:
        client = t.InferenceServerClient(url)
        x = _feed(args.rows, args.width, index)
        item = t.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)  # binary (HTTP) / raw (gRPC): the clients' defaults
        return lambda: client.infer("model", [item]).as_numpy("output")

    return _closed_loop(args.callers_now, args.duration_s, make_call)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        help="an ONNX model with input 'input' [batch, width] "
        "(default: a generated MLP, tools/realistic_models.py)",
    )
    parser.add_argument("--width", type=int, default=256, help="the generated MLP's width")
    parser.add_argument("--rows", type=int, default=1, help="rows per request")
    parser.add_argument("--callers", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--protocols", nargs="+", default=["http", "grpc"])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument(
        "--loop",
        choices=("auto", "asyncio", "uvloop"),
        default="auto",
        help="the servers' event loop (sharedml serve --loop)",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        choices=("pool", "plain"),
        default=["pool", "plain"],
        help="servers to run: the pool's, N plain sessions",
    )
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--child", choices=("inprocess", "pool", "plain"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "inprocess":
        child_inprocess(args)
        return 0
    if args.child in ("pool", "plain"):
        child_serve(args)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        if args.model is None:
            from tools.realistic_models import mlp

            args.model = mlp(Path(folder) / "mlp.onnx", size="tiny", width=args.width).path
        rows = []
        for callers in args.callers:
            done = subprocess.run(
                [sys.executable, __file__, "--child", "inprocess", "--model", args.model,
                 "--sessions", str(args.sessions), "--callers", str(callers), "--rows",
                 str(args.rows), "--width", str(args.width), "--duration-s",
                 str(args.duration_s)],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            base = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"config": "inprocess", "callers": callers, **base})
            for kind in args.kinds:
                process, http, grpc = _serve(kind, args)
                try:
                    for protocol in args.protocols:
                        args.callers_now = callers
                        url = http if protocol == "http" else grpc
                        result = _clients(protocol, url, args)
                        result["pss_bytes"] = _pss(process.pid)
                        config = f"{'serve' if kind == 'pool' else 'plain'}:{protocol}"
                        result["vs_inprocess"] = result["rps"] / base["rps"] if base["rps"] else 0
                        rows.append({"config": config, "callers": callers, **result})
                finally:
                    process.send_signal(signal.SIGTERM)
                    process.communicate(timeout=120)
    print(
        f"{'config':<12} {'C':>3} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'PSS MiB':>8} "
        f"{'x inproc':>8}"
    )
    for row in rows:
        print(
            f"{row['config']:<12} {row['callers']:>3} {row['rps']:>9.1f} {row['p50_ms']:>8.2f} "
            f"{row['p99_ms']:>8.2f} {row['pss_bytes'] / 2**20:>8.1f} "
            f"{row.get('vs_inprocess', 1.0):>8.2f}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
