r"""Whether a merging pool's trial picks the mode that serves more, on a session timed by sleeps.

The pool's scheduler (``sharedml.pool._scheduler``, with its merge decisions) runs one session
whose runs sleep instead of computing: a run of n rows alone takes ``a + b * n`` seconds, and k
runs at once on the session each take ``max(1, k / C)`` times that (``C``: how many runs the
session's threads carry at once before they slow each other down). So merged batches and
requests side by side can be set to serve any ratio of rows/s, with none of a real host's noise
in the runs themselves, and the decision can be watched over many runs.

``--mode default`` runs the pool as shipped (merging, trials, pauses); ``side`` never merges,
``merge`` never stops merging. Each run prints the requests/s, the rate in each state the pool
was in (sampled every 0.25 s), its pauses and trials. ``--margin`` sets
``_payoff.TRIAL_MARGIN`` for an A/B of the trial's margin.

Usage::

    python benchmarks/trial_sim.py --mode side merge default default default --C 2.3
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

import numpy as np  # noqa: E402

from sharedml import Batching  # noqa: E402
from sharedml.pool import _payoff  # noqa: E402
from sharedml.pool._batching import Request  # noqa: E402
from sharedml.pool._scheduler import Scheduler  # noqa: E402


class SleepingSession:
    """A session source whose runs compute ``2 * x + 1`` and sleep for their modelled time."""

    def __init__(self, a: float, b: float, carried: float) -> None:
        self.a, self.b, self.carried = a, b, carried
        self.lock = threading.Lock()
        self.running = 0

    def create(self) -> Any:
        """A new session: any object."""
        return object()

    def run(self, session: Any, request: Request, feed: Mapping[str, Any] | None) -> list[Any]:
        """The request's (or the merged ``feed``'s) outputs, after its modelled time."""
        x = (feed if feed is not None else request.feed)["x"]
        with self.lock:
            self.running += 1
            at_once = self.running
        try:
            time.sleep((self.a + self.b * len(x)) * max(1.0, at_once / self.carried))
            return [x * 2.0 + 1.0]
        finally:
            with self.lock:
                self.running -= 1

    def discard(self, session: Any) -> None:
        """Nothing to let go."""


def one(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``--duration-s`` in ``mode``: its rates, decisions and batches."""
    source = SleepingSession(args.a, args.b, args.C)
    scheduler = Scheduler(
        source,
        max_sessions=1,
        batching=Batching(max_batch_size=32, measure_gain=mode != "merge"),
        share_runs=args.callers * 2,
        cores=args.cores,
    )
    scheduler.add_sessions([source.create()])
    gain = scheduler._gain  # the decision: sampled, and for --mode side held paused
    forced = mode == "side"
    stop, counts = threading.Event(), [0] * args.callers

    def caller(i: int) -> None:
        k = 0
        while not stop.is_set():
            x = np.full((1, 3), float(i * 100_000 + k))
            result = scheduler.run(Request(None, {"x": x}, None, 1, key=("x", (3,))))
            assert np.array_equal(result[0], x * 2.0 + 1.0)
            k += 1
            counts[i] += 1

    if forced:
        gain.enabled = False
        gain.state = _payoff.MergeState.PAUSED
        gain._retry = 1 << 60  # never measured again
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(args.callers)]
    for t in threads:
        t.start()
    start = time.monotonic()
    samples = []
    while time.monotonic() < start + args.duration_s:
        time.sleep(0.25)
        samples.append((time.monotonic() - start, sum(counts), gain.trial or gain.state.value))
    stop.set()
    for t in threads:
        t.join()
    states: dict[str, list[float]] = {}
    for (t0, n0, s0), (t1, n1, s1) in itertools.pairwise(samples):
        if s0 == s1:
            acc = states.setdefault(s0, [0.0, 0.0])
            acc[0] += n1 - n0
            acc[1] += t1 - t0
    stats = scheduler.stats()
    scheduler.close(None, deadline=None)
    return {
        "mode": mode,
        "requests_per_s": round(samples[-1][1] / samples[-1][0], 1),
        "by_state": {
            k: {"requests_per_s": round(n / s, 1), "s": round(s, 2)} for k, (n, s) in states.items()
        },
        "pauses": stats.merge_pauses,
        "trials": stats.merge_trials,
        "mean_batch_rows": round(stats.batched_rows / max(stats.batches, 1), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", nargs="+", default=["side", "merge", "default"])
    p.add_argument("--a", type=float, default=4e-3, help="seconds a run takes, rows aside")
    p.add_argument("--b", type=float, default=3e-3, help="seconds a row adds to a run")
    p.add_argument("--C", type=float, default=2.3, help="runs at once the session carries")
    p.add_argument("--callers", type=int, default=16)
    p.add_argument("--cores", type=int, default=16, help="as the pool would count them")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--margin", type=float, help="_payoff.TRIAL_MARGIN for this run")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.margin is not None:
        _payoff.TRIAL_MARGIN = args.margin
    results = []
    for mode in args.mode:
        result = one(mode, args)
        result["margin"] = _payoff.TRIAL_MARGIN
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
