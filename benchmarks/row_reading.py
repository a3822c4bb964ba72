"""What a merging CPU pool reads as one row's activations, and what reading it costs at start-up.

A pool whose batch size is left to it (``batching="auto"``) bounds its rows by what one
generated row adds to the process's anonymous memory (``rss - shared``), read over two Runs,
and reads a bound again as half of what two rows add (``pool/_calibrate.py``,
``rows_for_memory``). This measures, for generated models:

- ``one``, ``half_of_two``: MiB a row, read the pool's two ways on a plain ORT session with
  memory patterns on and off, each reading in a fresh process;
- ``constructor_s``: ``SessionPool(model, batching="auto")``'s seconds, ``--repeats`` times in
  one process after a constructor that prepared the model (the sharedml cache warm).

Usage::

    python benchmarks/row_reading.py --models mlp unet64 unet160 unet320 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]


def _model(kind: str, folder: Path) -> tuple[Path, object | None]:
    from tools import realistic_models

    if kind == "mlp":  # the 256-wide MLP of the pool tests: x [N, 256] -> [N, 256]
        sys.path.insert(0, str(ROOT / "tests"))
        from _models import batchable_model

        return Path(batchable_model(folder / "mlp.onnx", dim=256)), None
    info = realistic_models.unet_like(folder / f"{kind}.onnx", image=int(kind.removeprefix("unet")))
    return Path(info.path), info


def _feed(info: object | None, rows: int) -> dict:
    import numpy as np

    if info is None:
        return {"x": np.ones((rows, 256), np.float32)}
    from tools.realistic_models import sample_inputs

    return sample_inputs(info, batch=rows)


def _readings(kind: str, patterns: bool) -> dict[str, float]:
    """In this process: one row's reading, then half of two rows' (as rows_for_memory does)."""
    import onnxruntime as ort
    import psutil

    path, info = _model(kind, Path(tempfile.mkdtemp()))
    so = ort.SessionOptions()
    so.enable_mem_pattern = patterns
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    me = psutil.Process()

    def added(rows: int) -> int:
        feed = _feed(info, rows)
        before = me.memory_info().rss - me.memory_info().shared
        for _ in range(2):
            session.run(None, feed)
        return me.memory_info().rss - me.memory_info().shared - before

    mib = 2**20
    return {"one": added(1) / mib, "half_of_two": added(2) / 2 / mib}


def _constructor_s(kind: str, repeats: int) -> list[float]:
    import sharedml

    folder = Path(tempfile.mkdtemp())
    path, _ = _model(kind, folder)
    sharedml.SessionPool(path, batching="auto", cache_dir=folder / "c").close()  # prepared
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        pool = sharedml.SessionPool(path, batching="auto", cache_dir=folder / "c")
        seconds.append(round(time.perf_counter() - began, 3))
        pool.close()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["mlp", "unet64", "unet160", "unet320"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)  # KIND on|off: one reading
    args = p.parse_args()
    if args.child:
        print(json.dumps(_readings(args.child[0], args.child[1] == "on")))
        return
    results = []
    for kind in args.models:
        row: dict[str, object] = {"model": kind}
        for setting in ("on", "off"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", kind, setting],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            row[f"patterns_{setting}_mib"] = {
                k: round(v, 2) for k, v in json.loads(out.splitlines()[-1]).items()
            }
        row["constructor_s"] = _constructor_s(kind, args.repeats)
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
