"""Many worker processes on one host share one copy of the weights through the page cache.

Servers run several worker processes (gunicorn, uvicorn workers, multiprocessing). Here four
real worker processes each open a ``SessionPool`` over the same prepared ~96 MiB model and run
it; four plain-ORT workers each open an ``InferenceSession`` over the original model (ORT's
defaults). PSS (proportional set size) splits each shared page among the processes that map
it, so the sum of the workers' PSS is what the group of workers really costs the host.

Every worker reports its PSS while all four are alive: each prints ``ready`` once its sessions
exist and have run, then waits on stdin; the test asks all of them to measure, and only then
releases them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import sharedml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps"),
]

WORKERS = 4
SESSIONS_PER_WORKER = 2  # a pool sized for two request threads; the plain worker has one session
WIDTH = 2048
WEIGHTS_MIB = 96  # six 2048x2048 float32 MatMul weights
ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 180

WORKER = textwrap.dedent(
    r"""
    import json, sys
    import numpy as np, psutil

    kind, model, sessions = sys.argv[1], sys.argv[2], int(sys.argv[3])
    x = np.random.default_rng(0).standard_normal((1, 2048)).astype(np.float32)
    if kind == "sharedml":
        import sharedml
        # As README's worker recipe says: sessions created by the worker's own thread (a
        # background creation thread keeps a malloc arena of its own in every worker).
        pool = sharedml.SessionPool(model, sessions=sessions, create_in_background=False)
        checkouts = [pool.session() for _ in range(sessions)]
        held = [c.__enter__() for c in checkouts]  # every session created and run once
        outs = [s.run(None, {"input": x})[0] for s in held]
        for c in checkouts:
            c.__exit__(None, None, None)
        extra = {"mechanism": pool.mechanism}
    else:
        import onnxruntime as ort
        session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        outs = [session.run(None, {"input": x})[0]]
        extra = {}
    print(json.dumps({"ready": True, "checksum": float(np.abs(outs[0]).sum()), **extra}),
          flush=True)
    sys.stdin.readline()  # "measure": every worker is alive and holds its sessions now
    info = psutil.Process().memory_full_info()
    print(json.dumps({"pss": info.pss, "uss": info.uss, "rss": info.rss}), flush=True)
    sys.stdin.readline()  # "exit"
    """
)


def run_workers(kind: str, model: Path) -> list[dict[str, float]]:
    """Start WORKERS workers at once; returns each one's ready line merged with its memory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, kind, str(model), str(SESSIONS_PER_WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for _ in range(WORKERS)
    ]
    reports: list[dict[str, float]] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line, f"{kind} worker died: {p.stderr.read() if p.stderr else ''}"
            reports.append(json.loads(line))
            assert time.monotonic() < deadline
        for p in procs:  # all alive: measure
            assert p.stdin is not None
            p.stdin.write("measure\n")
            p.stdin.flush()
        for p, report in zip(procs, reports, strict=True):
            assert p.stdout is not None
            report.update(json.loads(p.stdout.readline()))
        for p in procs:  # release
            assert p.stdin is not None
            p.stdin.write("exit\n")
            p.stdin.flush()
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            for pipe in (p.stdout, p.stderr):
                if pipe is not None:
                    pipe.close()
    assert all(p.returncode == 0 for p in procs)
    return reports


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(original model, prepared model): prepared once, as a deployment step would."""
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("multiprocess")
    info = mlp(folder / "mlp.onnx", target_bytes=WEIGHTS_MIB * 2**20, width=WIDTH)
    prepared = sharedml.prepare(info.path, folder / "prepared" / "mlp.onnx")
    assert prepared.bytes_moved >= WEIGHTS_MIB * 2**20
    return Path(info.path), prepared.model_path


def test_four_workers_share_one_copy_of_the_weights(models: tuple[Path, Path]) -> None:
    original, prepared = models
    shared = run_workers("sharedml", prepared)
    plain = run_workers("plain", original)

    # Same outputs: sharing changed where the weights live, not what the model computes.
    for report in shared + plain:
        np.testing.assert_allclose(report["checksum"], plain[0]["checksum"], rtol=1e-4)

    shared_pss = sum(r["pss"] for r in shared)
    plain_pss = sum(r["pss"] for r in plain)
    mib = 2**20
    print(
        f"\n{WORKERS} workers, {WEIGHTS_MIB} MiB of weights: plain ORT PSS "
        f"{[round(r['pss'] / mib) for r in plain]} = {plain_pss / mib:.0f} MiB; sharedml "
        f"({SESSIONS_PER_WORKER} sessions each, {shared[0]['mechanism']}) "
        f"{[round(r['pss'] / mib) for r in shared]} = {shared_pss / mib:.0f} MiB "
        f"({shared_pss / plain_pss:.2f}x); sharedml RSS each "
        f"{[round(r['rss'] / mib) for r in shared]} MiB"
    )
    # Each plain worker really holds at least its own copy of the weights ...
    assert min(r["pss"] for r in plain) > WEIGHTS_MIB * mib
    # ... while the sharedml workers all map one: RSS counts the whole file in every worker,
    # PSS a quarter of it.
    assert min(r["rss"] for r in shared) > WEIGHTS_MIB * mib
    assert shared_pss <= 0.5 * plain_pss
