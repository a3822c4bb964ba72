"""Check inspect's held and trimmed figures against fresh processes that served traffic.

For each strategy (N plain sessions, one plain session shared by N threads, sharedml's pool of
N), this runs :func:`sharedml.measure.measure` (what ``sharedml inspect`` runs) and then, in
``--repeats`` fresh processes of its own, what a server does: create the N sessions, then N
threads started together on a barrier, each running its session, round after round
(``--rounds``), on the same inputs; PSS is read without ``malloc_trim`` ("held": what such a
server holds) and then after one ("trimmed"), both over a trimmed baseline taken with
sharedml's modules loaded (as inspect's children do, so that the pool's figures leave out
sharedml's own imports, which inspect reports on their own line). The pool is opened as README
shows (sessions created in the background, then every one checked out and run).

Prints one line per strategy and the strategy each side finds least (held), and with ``--json``
writes every figure. Results are in ``docs/inspect.md``.

Command line::

    python tools/inspect_vs_traffic.py MODEL [--sessions 4] [--rounds 5] [--repeats 2]
        [--dim NAME=SIZE ...] [--shape NAME=AxBxC ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["fresh_process", "main"]

STRATEGIES = ("naive", "single", "shared")
MiB = 2**20

_FRESH = r"""
import gc, json, sys, threading
import numpy as np, onnxruntime as ort
import sharedml
from sharedml.inspection._memory import read_memory, trim_heap
from sharedml.model._inputs import generate

spec = json.loads(sys.argv[1])
for name in sharedml.__all__:  # as inspect's children: sharedml's modules before the baseline
    getattr(sharedml, name)
from sharedml.runtime._capabilities import capability  # and its once-per-process probes
from sharedml.weights._store import zero_copy_mechanisms
capability("prepacked-save"), capability("files-in-memory"), zero_copy_mechanisms()
feeds = {i["name"]: generate(i) for i in spec["inputs"]}
warm = ort.InferenceSession(bytes.fromhex(spec["warmup"]), providers=["CPUExecutionProvider"])
del warm

def pss(trim):
    gc.collect()
    if trim:
        trim_heap()
    return read_memory()["pss"]

base = pss(True)
n, strategy = spec["sessions"], spec["strategy"]
if strategy == "shared":
    pool = sharedml.SessionPool(spec["model"], sessions=n)
    pool.wait_ready()
    held = [pool.session() for _ in range(n)]
    sessions = [h.__enter__() for h in held]
elif strategy == "single":
    sessions = [ort.InferenceSession(spec["model"], providers=["CPUExecutionProvider"])] * n
else:
    sessions = [ort.InferenceSession(spec["model"], providers=["CPUExecutionProvider"])
                for _ in range(n)]
barrier = threading.Barrier(n)
def serve(sess):
    for _ in range(spec["rounds"]):
        barrier.wait()
        sess.run(None, feeds)
threads = [threading.Thread(target=serve, args=(s,)) for s in sessions]
for t in threads:
    t.start()
for t in threads:
    t.join()
held_now = pss(False)
print(json.dumps({"held": held_now - base, "trimmed": pss(True) - base}))
"""


def fresh_process(
    model: Path, strategy: str, *, sessions: int, rounds: int, inputs: Sequence[Mapping[str, Any]]
) -> dict[str, int]:
    """``{"held", "trimmed"}``: PSS growth of one fresh process that served ``rounds`` rounds."""
    from sharedml.inspection._child import warmup_model_bytes

    spec = {
        "model": str(model),
        "strategy": strategy,
        "sessions": sessions,
        "rounds": rounds,
        "inputs": list(inputs),
        "warmup": warmup_model_bytes().hex(),
    }
    out = subprocess.run(
        [sys.executable, "-c", _FRESH, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if out.returncode:
        raise RuntimeError(f"{strategy}: {out.stderr.strip().splitlines()[-1:]}")
    result: dict[str, int] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _pairs(values: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep:
            raise SystemExit(f"{what} {value!r}: write NAME=VALUE")
        out[name] = rest
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; prints one line per strategy."""
    import sharedml
    from sharedml.model._graph import load_graph
    from sharedml.model._inputs import input_specs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dim", action="append", default=[])
    parser.add_argument("--shape", action="append", default=[])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    dims = {k: int(v) for k, v in _pairs(args.dim, "--dim").items()}
    shapes = {
        k: tuple(int(d) for d in v.split("x")) for k, v in _pairs(args.shape, "--shape").items()
    }
    inputs = input_specs(load_graph(args.model), dims, shapes=shapes, model_name=str(args.model))
    specs = [i.to_dict() for i in inputs]
    rows: dict[str, Any] = {}
    for strategy in STRATEGIES:
        m = sharedml.measure.measure(args.model, strategy, sessions=args.sessions, inputs=inputs)
        fresh = [
            fresh_process(
                args.model, strategy, sessions=args.sessions, rounds=args.rounds, inputs=specs
            )
            for _ in range(args.repeats)
        ]
        rows[strategy] = {
            "inspect_held": m.total_bytes,
            "inspect_trimmed": m.trimmed_bytes,
            "inspect_rounds": m.points[-1].rounds if m.points else None,
            "fresh_held": [f["held"] for f in fresh],
            "fresh_trimmed": [f["trimmed"] for f in fresh],
        }

    def span(values: Sequence[int]) -> str:
        low, high = min(values) / MiB, max(values) / MiB
        return f"{low:.1f}" if round(low, 1) == round(high, 1) else f"{low:.1f}-{high:.1f}"

    described = ", ".join(i.describe() for i in inputs)
    print(f"{args.model.name}, {args.sessions} sessions ({described})")
    for strategy, r in rows.items():
        print(
            f"  {strategy:7} held: inspect {r['inspect_held'] / MiB:7.1f}, fresh "
            f"{span(r['fresh_held']):>13} | trimmed: inspect {r['inspect_trimmed'] / MiB:7.1f}, "
            f"fresh {span(r['fresh_trimmed']):>13}"
        )
    least_inspect = min(rows, key=lambda s: rows[s]["inspect_held"])
    least_fresh = min(rows, key=lambda s: min(rows[s]["fresh_held"]))
    print(f"  least held: inspect {least_inspect}, fresh processes {least_fresh}")
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"model": str(args.model), "sessions": args.sessions, "inputs": specs}
                | {"strategies": rows},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
