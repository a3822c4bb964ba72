"""Peak memory of ``sharedml prepare`` on a model larger than 2 GB.

Generates a model whose weights (default 2.5 GiB) live in external data (a model that size
cannot be one protobuf), runs ``sharedml prepare`` on it in a child process, samples the child's
RSS every 10 ms and reports the peak against the model's size. The issue's target: peak RSS
under 25% of the model's size.

    python benchmarks/prepare_large.py [--gib 2.5] [--keep DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def peak_rss_of(cmd: list[str]) -> tuple[int, float, int]:
    """Run ``cmd``; returns (peak RSS in bytes, seconds, exit status)."""
    start = time.perf_counter()
    child = subprocess.Popen(cmd)
    proc = psutil.Process(child.pid)
    peak = 0
    while child.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    return peak, time.perf_counter() - start, child.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.5, help="weights to generate (GiB)")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep the files")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    work = args.keep or Path(tempfile.mkdtemp(prefix="sharedml-large-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = work / "large.onnx"
        if not src.exists():
            subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "tools" / "make_large_model.py"),
                    str(src),
                    "--gib",
                    str(args.gib),
                ],
                check=True,
            )
        model_bytes = sum(p.stat().st_size for p in work.iterdir() if p.name.startswith("large."))
        dst = work / "out" / "large.onnx"
        peak, seconds, status = peak_rss_of(
            [sys.executable, "-m", "sharedml.cli", "prepare", str(src), "-o", str(dst), "--json"]
        )
        if status != 0:
            print(f"prepare failed with exit status {status}", file=sys.stderr)
            return status
        result = {
            "model_bytes": model_bytes,
            "weights_file_bytes": (dst.parent / "large.weights").stat().st_size,
            "peak_rss_bytes": peak,
            "peak_rss_fraction_of_model": peak / model_bytes,
            "seconds": seconds,
            "python": sys.version.split()[0],
        }
        print(
            f"prepare of a {model_bytes / 2**30:.2f} GiB model: peak RSS "
            f"{peak / 2**20:.0f} MiB ({peak / model_bytes:.1%} of the model) in {seconds:.1f} s"
        )
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        return 0
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
