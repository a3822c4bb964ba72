"""Measure the PSS growth of N sessions in a fresh subprocess (Linux smaps), for memory tests.

One configuration per process, so one measurement's allocations cannot hide or inflate
another's. The child creates N plain sessions (``naive``) or a pool of N (``shared``) with every
session checked out at once, runs them all concurrently on a barrier, checks that they agree,
and prints its PSS growth over a baseline taken after ``import onnxruntime``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_MEASURE = r"""
import json, sys, threading
import numpy as np, psutil
import onnxruntime as ort
import sharedml

strategy, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
batch, width, mechanism = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
proc = psutil.Process()
base = proc.memory_full_info().pss
feed = {"input": np.ones((batch, width), np.float32)}

if strategy == "naive":
    sessions = [ort.InferenceSession(model, providers=["CPUExecutionProvider"]) for _ in range(n)]
else:
    pool = sharedml.SessionPool(model, sessions=n)
    assert not mechanism or pool.mechanism == mechanism, pool.mechanism
    sessions = [pool.session().__enter__() for _ in range(n)]  # every session checked out at once
assert len({id(s) for s in sessions}) == n

barrier = threading.Barrier(n)
outs = [None] * n
def work(i):
    barrier.wait()  # all sessions run concurrently
    outs[i] = sessions[i].run(None, feed)[0]
threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
pss = proc.memory_full_info().pss - base
for o in outs[1:]:
    assert np.array_equal(o, outs[0])
print(json.dumps({"pss": pss}))
"""


def measure_pss(
    strategy: str,
    model: Path,
    n: int,
    *,
    batch: int,
    width: int,
    expect_mechanism: str = "",
) -> int:
    """PSS growth in bytes of ``n`` sessions by ``strategy`` ("naive" or "shared")."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURE,
            strategy,
            str(model),
            str(n),
            str(batch),
            str(width),
            expect_mechanism,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["pss"])
