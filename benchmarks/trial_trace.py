r"""What a default merging CPU pool decides over time, under C callers in a closed loop.

One default pool (``batching="auto"``, the pool's own sessions and threads) of a generated
model serves ``--callers`` threads, each sending a one-row request and the next once the result
is back, for ``--duration-s``. Printed (and written with ``--json``):

- every second: the requests served in it, whether merging is paused, trials and pauses so far;
- every trial phase that ends (merging, then side by side, ``sharedml.pool._payoff``): the
  seconds per row its measured requests took, the merged phase's, the rows/s the callers got
  over the measured part (the same quantity counted the other way: a check on the trial's
  figure), and what was decided.

This is how the 16-core probing rounds of docs/batching.md were found: each pause a trial
decided ended in probing, which merged again until the next trial paused once more.

Usage::

    python benchmarks/trial_trace.py --model minilm --callers 16 --duration-s 40 --json out.json

``--margin 1.1`` runs it with the trial margin of earlier versions (1.05 now).

The trace wraps ``MergeGain.observe`` (timestamps and the phase's figures only); nothing else
changes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import sharedml  # noqa: E402
from sharedml.pool import _payoff  # noqa: E402

BATCH_S = 1e-3  # results this close to a phase's first are of its batch


def _trace_trials(start: float, phases: list[dict[str, Any]]) -> None:
    """Record each trial phase that ends, as ``MergeGain.observe`` ends it.

    Beside the phase's own figure (seconds from arrival to result, per row, of the requests
    that arrived within its measured part), each phase gets the rows/s its callers got over
    that part: the rows of every result after the part's first (and its batch's), over the
    time from that first result to the phase's last.
    """
    observe = _payoff.MergeGain.observe
    results: list[tuple[float, int]] = []  # (when, rows) of each result since the phase began

    def traced(self: _payoff.MergeGain, arrived: float, rows: int) -> str | None:
        phase, began, settling = self.trial, self._began, self._settling
        change = observe(self, arrived, rows)
        if phase is not None and not settling:
            results.append((time.monotonic(), rows))
        if phase is not None and self.trial != phase:
            # A side phase ends the trial: its figures are still there. A merged phase hands
            # over to the side phase, which starts afresh: its figure is _merged_per_row.
            per_row = self._seconds / self._rows if phase == "side" and self._rows else None
            measured = [(t, r) for t, r in results if t >= began]
            rate = None
            if measured and measured[-1][0] - measured[0][0] > BATCH_S:
                # A merged batch's results come at once: the first one's rows are not counted
                first = measured[0][0]
                after = sum(r for t, r in measured if t > first + BATCH_S)
                rate = after / (measured[-1][0] - first)
            results.clear()
            phases.append(
                {
                    "t_s": round(time.monotonic() - start, 2),
                    "ended": phase,
                    "side_s_per_row": per_row,
                    "merged_s_per_row": self._merged_per_row,
                    "requests": self._requests if phase == "side" else None,
                    "rows_per_s": None if rate is None else round(rate, 1),
                    "state_after": self.state.value,
                    "paused": change is not None,
                }
            )
            print("phase", json.dumps(phases[-1]), flush=True)
        return change

    _payoff.MergeGain.observe = traced  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="minilm", help="a tools/realistic_models name")
    p.add_argument("--size", choices=("full", "tiny"), default="full")
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--seq", type=int, default=128, help="sequence length of transformers")
    p.add_argument("--out-dir", default=None, help="where the model is written (temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--margin", type=float, help="_payoff.TRIAL_MARGIN for this run (an A/B)")
    args = p.parse_args(argv)
    if args.margin is not None:
        _payoff.TRIAL_MARGIN = args.margin

    from tools import realistic_models as rm

    if args.model not in rm.REGISTRY:
        p.error(f"--model: one of {', '.join(sorted(rm.REGISTRY))}")
    folder = args.out_dir or tempfile.mkdtemp(prefix="sharedml-trial-trace-")
    path = os.path.join(folder, f"{args.model}-{args.size}.onnx")
    info = rm.REGISTRY[args.model](path, size=args.size, seed=0)
    feeds = [rm.sample_inputs(info, batch=1, seq=args.seq, seed=k) for k in range(32)]

    phases: list[dict[str, Any]] = []
    seconds: list[dict[str, Any]] = []
    with sharedml.SessionPool(path, batching="auto") as pool:
        counts = [0] * args.callers
        stop = threading.Event()
        ready = threading.Barrier(args.callers + 1)

        def caller(c: int) -> None:
            ready.wait()
            k = 0
            while not stop.is_set():
                pool.run(None, feeds[(c + k) % len(feeds)])
                k += 1
                counts[c] += 1

        threads = [threading.Thread(target=caller, args=(c,)) for c in range(args.callers)]
        for t in threads:
            t.start()
        start = time.monotonic()
        _trace_trials(start, phases)
        ready.wait()
        served = 0
        for second in range(1, int(args.duration_s) + 1):
            time.sleep(max(0.0, start + second - time.monotonic()))
            stats, now = pool.stats(), sum(counts)
            seconds.append(
                {
                    "second": second,
                    "requests": now - served,
                    "merging": stats.batching,  # False while paused (pool.batching is the setting)
                    "trials": stats.merge_trials,
                    "pauses": stats.merge_pauses,
                }
            )
            served = now
            print("second", json.dumps(seconds[-1]), flush=True)
        stop.set()
        for t in threads:
            t.join()
        reason = pool.batching_reason
    if args.json:
        out = {
            "model": info.name,
            "callers": args.callers,
            "cpus": os.cpu_count(),
            "seconds": seconds,
            "phases": phases,
            "batching_reason": reason,
            "trial_margin": _payoff.TRIAL_MARGIN,
        }
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
