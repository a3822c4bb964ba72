"""What ``SessionPool(serialize_creation=False)`` costs in memory against the default.

Two measurements, each configuration in fresh processes, cache warm (one pool is opened first):

- one process, a pool of ``--sessions`` sessions: PSS growth and anonymous memory afterwards;
- ``--workers`` processes starting at once, a pool of 2 each (a pre-forked server): each
  worker's PSS while all are alive.

Parallel creation serves the helper threads from their own glibc arenas, whose freed top
``malloc_trim`` cannot return; this shows how much of the load-time heap stays.

Usage::

    python tools/realistic_models.py mlp -o /tmp/mlp.onnx
    python benchmarks/parallel_start_memory.py /tmp/mlp.onnx [--sessions 8] [--workers 4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence

ONE_PROCESS = r"""
import sys, psutil, sharedml
model, serialized, n = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
before = psutil.Process().memory_full_info().pss
pool = sharedml.SessionPool(model, sessions=n, serialize_creation=serialized)
after = psutil.Process().memory_full_info().pss
with open("/proc/self/smaps_rollup") as fh:
    anon = next(int(line.split()[1]) for line in fh if line.startswith("Anonymous:"))
print((after - before) / 2**20, anon / 1024)
"""

WORKER = r"""
import sys, psutil, sharedml
pool = sharedml.SessionPool(sys.argv[1], sessions=2, serialize_creation=sys.argv[2] == "1")
print("ready", flush=True)
sys.stdin.readline()  # every worker is alive now
print(psutil.Process().memory_full_info().pss / 2**20, flush=True)
sys.stdin.readline()
"""


def one_process(model: str, serialized: bool, sessions: int, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS, model, "1" if serialized else "0", str(sessions)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    growth, anon = (float(v) for v in out.stdout.split())
    return f"PSS growth {growth:.0f} MiB, anonymous {anon:.0f} MiB"


def workers(model: str, serialized: bool, count: int, env: dict[str, str]) -> str:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, model, "1" if serialized else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(count)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        pss = []
        for p in procs:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("measure\n")
            p.stdin.flush()
            pss.append(float(p.stdout.readline()))
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(60)
    return f"PSS each {[round(v) for v in pss]} MiB, sum {sum(pss):.0f} MiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "SHAREDML_CACHE_DIR": cache}
        subprocess.run(  # one-off work (prepare, prepacked build) outside the measurements
            [sys.executable, "-c", ONE_PROCESS, args.model, "1", "1"],
            env=env,
            check=True,
            capture_output=True,
        )
        for serialized in (True, False):
            name = "serialized (default)" if serialized else "serialize_creation=False"
            print(
                f"{name:26s} 1 process, {args.sessions} sessions: "
                + one_process(args.model, serialized, args.sessions, env)
            )
            print(
                f"{name:26s} {args.workers} workers x 2 sessions: "
                + workers(args.model, serialized, args.workers, env)
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
