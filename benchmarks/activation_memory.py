"""Memory and CPU time of N sessions under concurrent traffic, per arena setting, fresh processes.

Each configuration runs in a process of its own: N sessions (plain ORT sessions, one plain
session shared by N threads, or a sharedml pool of N), N threads started together on a barrier,
each running its own session (checked out, for a pool) for ``--rounds`` rounds; PSS is read
untrimmed ("held", what a server holds) and after ``malloc_trim`` ("trimmed"), over a trimmed
baseline taken with sharedml's modules loaded. CPU ms per run and wall ms per round are taken
over the rounds after the first two (indications: run it on a quiet machine for speed).

Settings (``--configs``, each ``STRATEGY`` or ``STRATEGY:SETTING+SETTING``):
``patterns`` (memory patterns on: ORT's default, a pool's before it turned them off),
``nopatterns``, ``noarena`` (``enable_cpu_mem_arena=False``), ``envarena`` (one arena in ORT's
environment for every session: ``create_and_register_allocator`` and
``session.use_env_allocators=1``), ``sameasrequested`` (that arena grows by what is asked),
``threads1`` (one intra-op thread each). Results: ``docs/memory.md``.

Command line::

    python benchmarks/activation_memory.py --models unet unet1d gru --sessions 4 --rounds 8
        [--model PATH --shape NAME=AxBxC] [--cycle NAME=AxBxC,DxExF] [--size tiny] [--json OUT]
        [--configs plain pool pool:patterns pool:noarena pool:envarena single]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_CONFIGS = (
    "plain",
    "single",
    "pool",
    "pool:patterns",
    "pool:noarena",
    "pool:envarena",
    "pool:envarena+patterns",
)
SETTINGS = ("patterns", "nopatterns", "noarena", "envarena", "sameasrequested", "threads1")

_CHILD = r"""
import gc, json, sys, threading, time
import numpy as np, onnxruntime as ort
import sharedml
from sharedml.inspection._memory import read_memory, trim_heap

model, strategy, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
settings, shapes = set(json.loads(sys.argv[5])), json.loads(sys.argv[6])
for name in sharedml.__all__:  # sharedml's modules before the baseline, for every strategy
    getattr(sharedml, name)

def pss(trim):
    gc.collect()
    if trim:
        trim_heap()
    return read_memory()["pss"]

first = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
def value(i):
    shape = shapes.get(i.name) or [d if isinstance(d, int) and d > 0 else 1 for d in i.shape]
    if "int" in i.type:
        return rng.integers(0, 2, shape).astype(np.int64 if "int64" in i.type else np.int32)
    return rng.standard_normal(shape).astype(np.float32)
feed = {i.name: value(i) for i in first.get_inputs()}
cycle = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
feeds = [feed]
for name, options in cycle.items():  # each thread takes these shapes in turn, round by round
    feeds = [{**feed, name: rng.standard_normal(shape).astype(np.float32)} for shape in options]
first.run(None, feeds[0])  # ORT's environment and this model's first load: not counted
del first
if settings & {"envarena", "sameasrequested"}:
    cfg = ort.OrtArenaCfg(0, 1 if "sameasrequested" in settings else -1, -1, -1)
    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                             ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, cfg)

def configure(so):
    if "patterns" in settings:
        so.enable_mem_pattern = True
    if "nopatterns" in settings:
        so.enable_mem_pattern = False
    if "noarena" in settings:
        so.enable_cpu_mem_arena = False
    if "threads1" in settings:
        so.intra_op_num_threads = 1
    if settings & {"envarena", "sameasrequested"}:
        so.add_session_config_entry("session.use_env_allocators", "1")

base = pss(True)
if strategy == "pool":
    pool = sharedml.SessionPool(model, sessions=n, configure=configure,
                                create_in_background=False)
    held = [pool.session() for _ in range(n)]
    sessions = [h.__enter__() for h in held]
else:
    def make():
        so = ort.SessionOptions()
        configure(so)
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    sessions = [make()] * n if strategy == "single" else [make() for _ in range(n)]
barrier = threading.Barrier(n + 1)
def serve(index, sess):
    for r in range(rounds):
        barrier.wait()
        sess.run(None, feeds[(index + r) % len(feeds)])
threads = [threading.Thread(target=serve, args=(i, s)) for i, s in enumerate(sessions)]
for t in threads:
    t.start()
cpu = wall = 0.0
for r in range(rounds):
    if r == 2:
        cpu, wall = time.process_time(), time.perf_counter()
    barrier.wait()  # round r starts once every thread finished round r - 1
for t in threads:
    t.join()
timed = max(rounds - 2, 1)
result = {
    "held_bytes": pss(False) - base,
    "trimmed_bytes": pss(True) - base,
    "cpu_ms_per_run": (time.process_time() - cpu) / (timed * n) * 1000 if rounds > 2 else None,
    "wall_ms_per_round": (time.perf_counter() - wall) / timed * 1000 if rounds > 2 else None,
}
print(json.dumps(result))
"""


def run_config(
    model: Path,
    config: str,
    *,
    sessions: int,
    rounds: int,
    shapes: dict[str, list[int]],
    cycle: dict[str, list[list[int]]] | None = None,
) -> dict[str, Any]:
    """One configuration in a fresh process: its figures, or the error it ended with."""
    strategy, _, rest = config.partition(":")
    settings = [s for s in rest.split("+") if s]
    unknown = [s for s in settings if s not in SETTINGS]
    if strategy not in ("plain", "single", "pool") or unknown:
        raise SystemExit(
            f"unknown configuration {config!r}: strategies plain, single, pool; "
            f"settings {', '.join(SETTINGS)}"
        )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(model),
            strategy,
            str(sessions),
            str(rounds),
            json.dumps(settings),
            json.dumps(shapes),
            json.dumps(cycle or {}),
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        env=os.environ.copy(),
    )
    if out.returncode:
        return {"config": config, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return {"config": config} | figures


def _generated(name: str, folder: Path, size: str) -> Path:
    from tools import realistic_models

    make = realistic_models.REGISTRY[name]
    return Path(make(folder / f"{name}-{size}.onnx", size=size).path)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: one JSON line per configuration."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        nargs="*",
        default=["unet", "unet1d", "gru"],
        help="generated models (tools/realistic_models.py)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        action="append",
        default=[],
        help="an ONNX file of your own (repeatable)",
    )
    parser.add_argument("--shape", action="append", default=[], help="NAME=AxBxC")
    parser.add_argument(
        "--cycle",
        action="append",
        default=[],
        help="NAME=AxBxC,DxExF,...: each thread runs these shapes in turn (varying traffic)",
    )
    parser.add_argument("--size", choices=("tiny", "full"), default="full")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    shapes = {}
    for value in args.shape:
        name, _, dims = value.partition("=")
        shapes[name] = [int(d) for d in dims.split("x")]
    cycle = {}
    for value in args.cycle:
        name, _, options = value.partition("=")
        cycle[name] = [[int(d) for d in o.split("x")] for o in options.split(",")]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="activation-memory-") as scratch:
        os.environ.setdefault("SHAREDML_CACHE_DIR", str(Path(scratch) / "cache"))
        models = [_generated(m, Path(scratch), args.size) for m in args.models] + args.model
        for model in models:
            import sharedml

            # The pool's one-off prepare and prepacked build go to the cache here, not into
            # the first pooled configuration's figures.
            sharedml.SessionPool(model, sessions=1, create_in_background=False).close()
            for config in args.configs:
                row = {"model": model.name} | run_config(
                    model,
                    config,
                    sessions=args.sessions,
                    rounds=args.rounds,
                    shapes=shapes,
                    cycle=cycle,
                )
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"sessions": args.sessions, "rounds": args.rounds, "size": args.size}
        args.json.write_text(json.dumps(meta | {"results": results}, indent=1) + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
