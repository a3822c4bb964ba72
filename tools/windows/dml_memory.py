"""The DirectML memory table of docs/directml.md: each configuration in a fresh child process.

Run with the Windows Python of tools/windows (DirectML on lavapipe, whose device memory is this
process's memory, so the working set shows it)::

    tools/windows/wpy tools/windows/dml_memory.py --mib 256 --sessions 2

Prints, for an MLP with about ``--mib`` MiB of float32 weights, the resident memory that 1 and
``--sessions`` sessions add in each configuration (tests/_dml_child.py's ``memory`` scenario),
and the same divided by the plain ORT session's: lavapipe inflates every session, so only the
ratios and differences mean anything.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS.parent)]

from _dml import missing, run_scenario  # noqa: E402  (tests/ is a folder of helpers)
from _models import batchable_model  # noqa: E402

CONFIGS = (
    ("plain", "plain ORT session(s), graph fusion on (ORT's default)"),
    ("plain-fusion-off", "plain ORT session(s), graph fusion off"),
    ("pool:ort-mmap", "SessionPool, ORT loads the weights from the file (the DML default)"),
    ("pool:add-initializer", "SessionPool, each tensor lent with add_initializer"),
    ("pool:in-memory-file", "SessionPool, the mapped file lent in memory"),
)
MIB = 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of weights (default 256)")
    parser.add_argument("--sessions", type=int, default=2, help="the larger count (default 2)")
    args = parser.parse_args()
    if (why := missing()) is not None:
        print(f"DirectML is not available here: {why}")
        return 1
    layers = max(1, round(args.mib * MIB / (2048 * 2048 * 4)))
    with tempfile.TemporaryDirectory() as folder:
        model = str(batchable_model(Path(folder) / "m.onnx", dim=2048, layers=layers))
        weights = Path(model).stat().st_size / MIB
        print(f"model: {layers} x 2048x2048 float32, {weights:.0f} MiB")
        baseline = None
        for config, what in CONFIGS:
            row = []
            for n in (1, args.sessions):
                pool = config.startswith("pool")
                result = run_scenario(  # a pool holds n sessions (per_session_state)
                    "memory",
                    model=model,
                    config=config,
                    sessions=n,
                    threads=1,
                    pool_sessions=n if pool else 1,
                    timeout_s=900,
                ).ok()
                row.append(result["added_bytes"] / MIB)
            baseline = baseline or row
            ratios = ", ".join(f"{r / b:.2f}x" for r, b in zip(row, baseline, strict=True))
            print(
                f"{config:<22} 1: {row[0]:7.0f} MiB   {args.sessions}: {row[1]:7.0f} MiB   "
                f"({ratios} of plain)   {what}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
