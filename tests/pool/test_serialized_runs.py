"""Providers that run one Run at a time across the process (DirectML >= 1.18), checked on Linux.

DirectML cannot run here, so its contract is checked on what sharedml controls: with
``serialize_runs=True`` (the DirectML default) no two Runs of any pools on one device may overlap
anywhere in the process, checkouts must not hold that lock, and the lock must be first come,
first served. A real ORT custom op in the graph (``tests/_overlap.py``) counts the Runs inside
it at once; a control test proves it sees overlap when runs are not serialized.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime_extensions")

from _overlap import BATCHING, BIAS, DETECTOR, probe_model, register
from _waiting import DEADLINE_S, wait_until

import sharedml


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return probe_model(tmp_path_factory.mktemp("probe") / "probe.onnx")


@contextlib.contextmanager
def pools(
    model: Path, count: int, *, serialize: bool, sessions: int, batching: bool = False
) -> Iterator[list[sharedml.SessionPool]]:
    with contextlib.ExitStack() as stack:
        opened = [
            stack.enter_context(
                sharedml.SessionPool(
                    model,
                    sessions=sessions,
                    serialize_runs=serialize,
                    per_session_state=True,
                    batching=BATCHING if batching else False,
                    prepacking="off",  # the prepacked build cannot load the custom op library
                    configure=register,
                )
            )
            for _ in range(count)
        ]
        for pool in opened:
            pool.wait_ready(timeout_s=DEADLINE_S)
        DETECTOR.reset()
        yield opened


def hammer(pools_: list[sharedml.SessionPool], threads: int, runs: int) -> list[Any]:
    """``threads`` threads released together, ``runs`` requests each, good and bad mixed."""
    barrier = threading.Barrier(threads, timeout=DEADLINE_S)
    results: list[Any] = []
    lock = threading.Lock()

    def work(t: int) -> None:
        pool = pools_[t % len(pools_)]
        barrier.wait()
        for r in range(runs):
            kind = ("good", "good", "bad-value", "good", "bad-shape")[(t + r) % 5]
            x = np.full((1 + (t + r) % 3, 4), float(t * 100 + r), np.float32)
            if kind == "bad-value":
                x[0, 0] = -1.0
            elif kind == "bad-shape":
                x = np.ones((1, 5), np.float32)
            try:
                out: Any = pool.run(None, {"x": x})[0]
            except Exception as exc:
                out = exc
            with lock:
                results.append((kind, x, out))

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(DEADLINE_S * 4)
        assert not w.is_alive(), "a run hung"
    return results


def test_the_detector_sees_overlap_when_runs_are_not_serialized(model: Path) -> None:
    with pools(model, 2, serialize=False, sessions=2) as opened:
        for _ in range(5):  # five runs per thread: overlap shows every time (tests/_overlap.py)
            hammer(opened, threads=4, runs=5)
            if DETECTOR.max_active >= 2:
                break
    assert DETECTOR.max_active >= 2


@pytest.mark.parametrize("batching", [False, True])
def test_no_two_runs_overlap_anywhere_in_the_process_when_serialized(
    model: Path, batching: bool
) -> None:
    with pools(model, 2, serialize=True, sessions=2, batching=batching) as opened:
        results = hammer(opened, threads=32, runs=6)
        stats = [p.stats() for p in opened]
    assert DETECTOR.max_active == 1, "two Runs overlapped"
    assert len(results) == 32 * 6
    for kind, x, out in results:
        if kind == "good":
            np.testing.assert_array_equal(out, 2 * x + BIAS)
        elif kind == "bad-value":
            assert isinstance(out, sharedml.RunError) and not isinstance(
                out, sharedml.InvalidInputError
            ), out
        else:
            assert isinstance(out, sharedml.InvalidInputError), out
    assert all(s.busy == 0 and s.waiting == 0 for s in stats)
    if batching:
        assert max(DETECTOR.rows) > 3  # requests that queued were merged (one is at most 3 rows)


def test_checkouts_do_not_hold_the_run_lock(model: Path) -> None:
    """Two callers that hold checkouts and wait for each other must not deadlock."""
    with pools(model, 1, serialize=True, sessions=2) as (pool,):
        both_in = threading.Barrier(2, timeout=DEADLINE_S)
        outs: list[Any] = []

        def work(i: int) -> None:
            with pool.session() as sess:
                both_in.wait()  # each holds a checkout while the other takes its own
                outs.append(sess.run(None, {"x": np.full((1, 4), i, np.float32)})[0])

        workers = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(DEADLINE_S * 2)
        assert len(outs) == 2
    assert DETECTOR.max_active == 1  # the checked-out sessions' runs still took turns


def test_the_run_lock_is_handed_over_in_arrival_order() -> None:
    """A thread that releases and takes the lock again at once must not jump the queue.

    (A plain ``threading.Lock`` lets it: 8 threads on one gave run counts of [0, 0, 0, 0, 0,
    2092, 0, 0] on a GPU, where the runs release the GIL.)
    """
    lock = sharedml.pool._runlock.FairLock()
    order: list[int] = []

    def work(i: int) -> None:
        with lock:
            order.append(i)

    with lock:
        workers = []
        for i in range(8):
            w = threading.Thread(target=work, args=(i,))
            w.start()
            wait_until(lambda i=i: len(lock._waiters) == i + 1, what=f"thread {i} to queue")
            workers.append(w)
        lock.release()
        lock.acquire()  # queues behind the eight: returns once each has had its turn, in order
        assert order == list(range(8))
    for w in workers:
        w.join(DEADLINE_S)
