"""Faults: racing processes, killed processes, failing sessions, bad timing. Nothing lost or hung.

Every thread is joined with a timeout and every subprocess runs under one, so a deadlock fails
the test instead of hanging CI.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil
import pytest
from _models import PLACEMENTS, build_model, feeds, save_model
from _waiting import DEADLINE_S, wait_until

import sharedml

DIM = 32
JOIN_S = 60  # seconds: far above any legitimate wait here; reaching it means a hang
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return save_model(build_model(list(PLACEMENTS), dim=DIM), tmp_path / "m.onnx")


def start_threads(
    target: Callable[..., None], args: list[tuple[Any, ...]]
) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=a, daemon=True) for a in args]
    for t in threads:
        t.start()
    return threads


def join_all(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"threads still running after {JOIN_S} s (deadlock?): {hung}"


def weights_mappings(path: Path) -> int:
    """How many of this process's memory mappings are of ``path`` (Linux)."""
    target = str(path.resolve())
    with open("/proc/self/maps") as fh:
        return sum(1 for line in fh if line.rstrip().endswith(target))


def finish(proc: subprocess.Popen[str]) -> str:
    """Close ``proc``'s stdin, wait for it (killing it after JOIN_S), return its stderr."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(JOIN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    err = proc.stderr.read() if proc.stderr is not None else ""
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return err


def run_script(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


# --------------------------------------------------------------------------------------------
# Several processes preparing the same model at once

RACE_WORKER = textwrap.dedent(
    r"""
    import hashlib, json, sys
    import sharedml
    src, rounds_dir, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print("ready", flush=True)
    for r in range(rounds):
        sys.stdin.readline()  # every worker starts the round at the same moment
        try:
            entry = sharedml.prepared_model_for(src, cache_dir=f"{rounds_dir}/cache{r}")
            direct = sharedml.prepare(src, f"{rounds_dir}/direct{r}/m.onnx").manifest.sha256
            weights = entry.with_suffix(".weights").read_bytes()
            line = {"entry": str(entry), "sha": hashlib.sha256(weights).hexdigest(),
                    "direct": direct}
        except BaseException as exc:
            line = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(line), flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX process semantics")
def test_processes_preparing_one_model_at_once_publish_one_valid_entry(tmp_path: Path) -> None:
    workers, rounds = 4, 4
    # ~4 MiB of weights: big enough that the prepares really overlap, small enough to be quick.
    src = save_model(
        build_model(["initializer"] * 4 + ["if_constant"], dim=448), tmp_path / "m.onnx"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE_WORKER, str(src), str(tmp_path), str(rounds)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for _ in range(workers)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for r in range(rounds):
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            lines = [json.loads(p.stdout.readline()) for p in procs if p.stdout is not None]
            errors = [line["error"] for line in lines if "error" in line]
            assert not errors, errors
            models = tmp_path / f"cache{r}" / "models"
            assert len({line["entry"] for line in lines}) == 1
            # One published entry, no temporary folders left behind by the losers.
            assert [p.name for p in models.iterdir()] == [Path(lines[0]["entry"]).parent.name]
            entry = Path(lines[0]["entry"])
            store = sharedml.weights.WeightStore.open(entry, verify=True)  # the recorded hash holds
            assert {line["sha"] for line in lines} == {store.manifest.sha256}
            # prepare() racing on one destination: the last rename wins, each result complete.
            direct = tmp_path / f"direct{r}"
            assert {line["direct"] for line in lines} == {store.manifest.sha256}
            assert sorted(p.name for p in direct.iterdir()) == ["m.onnx", "m.weights"]
            sharedml.weights.WeightStore.open(direct / "m.onnx", verify=True)
            del store
        with sharedml.SessionPool(src, sessions=1, cache_dir=tmp_path / "cache0") as pool:
            np.testing.assert_allclose(
                pool.run(None, feeds(448))[0],
                ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(
                    None, feeds(448)
                )[0],
                rtol=1e-4,
                atol=1e-5,
            )
    finally:
        errors = [finish(p) for p in procs]
    for p, err in zip(procs, errors, strict=True):
        assert p.returncode == 0, err


# --------------------------------------------------------------------------------------------
# A process killed mid-prepare

KILLED_WORKER = textwrap.dedent(
    r"""
    import sys, time
    import sharedml, sharedml.prepared._prepare as prep
    real_prepare = prep.prepare

    def stalled(progress_done, progress_total):
        if progress_done >= progress_total // 3:  # a third of the weights written: stop here
            print("writing", flush=True)
            time.sleep(3600)

    mode, src, target = sys.argv[1], sys.argv[2], sys.argv[3]
    if mode == "cache":
        prep.prepare = lambda s, d, **kw: real_prepare(s, d, progress=stalled, **kw)
        sharedml.prepared_model_for(src, cache_dir=target)
    else:
        sharedml.prepare(src, target, progress=stalled)
    print("finished (the test should have killed this process)", flush=True)
    """
)


def kill_mid_prepare(mode: str, src: Path, target: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WORKER, mode, str(src), str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
    finally:
        proc.send_signal(signal.SIGKILL)
        err = finish(proc)
    assert line == "writing", (line, err)
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture
def big_source(tmp_path: Path) -> Path:
    # Six 448x448 weights (4.6 MiB), written in many progress steps.
    return save_model(build_model(["initializer"] * 6, dim=448), tmp_path / "src" / "m.onnx")


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_killed_cache_prepare_leaves_nothing_that_is_ever_used(
    big_source: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    kill_mid_prepare("cache", big_source, root)
    models = root / "models"
    leftovers = list(models.iterdir())
    # Only a temporary folder holding a partial weights file; nothing published.
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tmp"), leftovers
    partial = [p for p in leftovers[0].iterdir() if ".weights" in p.name]
    assert partial and partial[0].stat().st_size > 0

    with sharedml.SessionPool(big_source, sessions=2, cache_dir=root) as pool:
        assert not pool.model_path.is_relative_to(leftovers[0])
        out = pool.run(None, feeds(448))[0]
    reference = ort.InferenceSession(str(big_source), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(out, reference.run(None, feeds(448))[0], rtol=1e-4, atol=1e-5)
    # The dead process's folder went with the next publish: its name says its process is gone.
    assert [p.name for p in models.iterdir()] == [pool.model_path.parent.name]


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_killed_prepare_over_an_earlier_output_leaves_the_earlier_output_intact(
    big_source: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "out" / "m.onnx"
    old = save_model(build_model(["initializer"] * 2, dim=448, seed=5), tmp_path / "old.onnx")
    first = sharedml.prepare(old, dst)
    kill_mid_prepare("direct", big_source, dst)
    names = sorted(p.name for p in dst.parent.iterdir())
    assert names[-2:] == ["m.onnx", "m.weights"] and all(n.endswith(".tmp") for n in names[:-2])
    # dst is still the complete earlier result, and verifies.
    store = sharedml.weights.WeightStore.open(dst, verify=True)
    assert store.manifest == first.manifest
    with sharedml.SessionPool(dst, sessions=1) as pool:
        expected = ort.InferenceSession(str(old), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(
            pool.run(None, feeds(448))[0], expected.run(None, feeds(448))[0], rtol=1e-4, atol=1e-5
        )


CRASH_BETWEEN_RENAMES = textwrap.dedent(
    r"""
    import os, signal, sys
    import sharedml

    real_replace, calls = os.replace, []
    def replace_then_die(a, b):
        real_replace(a, b)
        calls.append(b)
        if len(calls) == 1:  # the new weights file is in place, the graph is not yet
            os.kill(os.getpid(), signal.SIGKILL)
    os.replace = replace_then_die
    sharedml.prepare(sys.argv[1], sys.argv[2])
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_crash_between_the_two_renames_is_caught_by_the_recorded_hash(
    big_source: Path, tmp_path: Path
) -> None:
    dst = tmp_path / "out" / "m.onnx"
    old = save_model(build_model(["initializer"] * 6, dim=448, seed=9), tmp_path / "old.onnx")
    sharedml.prepare(old, dst)
    out = run_script(CRASH_BETWEEN_RENAMES, str(big_source), str(dst))
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    # The old graph now sits beside the new weights (same size): never used, always refused.
    with pytest.raises(sharedml.WeightsMismatchError, match="SHA-256"):
        sharedml.SessionPool(dst, sessions=1)
    sharedml.prepare(big_source, dst)  # preparing again repairs it
    with sharedml.SessionPool(dst, sessions=1) as pool:
        assert pool.run(None, feeds(448))[0].shape == (1, 448)


# --------------------------------------------------------------------------------------------
# Session creation failing part-way through a pool


def _fail_on(kind: str, calls_that_fail: Callable[[int], bool]) -> Callable[[Any], None]:
    calls = [0]

    def configure(so: Any) -> None:
        calls[0] += 1
        if calls_that_fail(calls[0]):
            if kind == "callback":
                raise RuntimeError(f"configure failed on session {calls[0]}")
            # A setting ORT itself rejects at session creation.
            so.add_session_config_entry("session.intra_op_thread_affinities", "not-a-cpu")
            so.intra_op_num_threads = 2

    return configure


@pytest.fixture
def prepared_model(tmp_path: Path, model: Path) -> sharedml.PrepareResult:
    prepared = sharedml.prepare(model, tmp_path / "p" / "m.onnx")
    with sharedml.SessionPool(prepared.model_path, sessions=2) as warm:  # ORT's globals exist now
        warm.wait_ready()
        warm.run(None, feeds(DIM))
    del warm
    gc.collect()
    return prepared


def thread_ids() -> set[int]:
    return {thread.id for thread in psutil.Process().threads()}


def assert_nothing_left(prepared: sharedml.PrepareResult, threads_before: set[int]) -> None:
    gc.collect()
    # Every thread alive now was alive before (ORT's and the pool's threads ended). Compared by
    # id, not counted: a thread an earlier test left behind may end meanwhile.
    wait_until(lambda: thread_ids() <= threads_before, what="the sessions' threads to end")
    assert weights_mappings(prepared.weights_path) == 0  # and the store's mapping
    assert not [
        key
        for key in list(sharedml.weights.WeightStore._registry)
        if key[0] == str(prepared.model_path)
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("kind", ["callback", "bad_option"])
def test_a_first_session_that_fails_leaks_nothing(
    prepared_model: sharedml.PrepareResult, kind: str
) -> None:
    threads_before = thread_ids()
    assert weights_mappings(prepared_model.weights_path) == 0
    with pytest.raises(Exception) as info:
        sharedml.SessionPool(
            prepared_model.model_path, sessions=4, configure=_fail_on(kind, lambda n: n == 1)
        )
    if kind == "callback":
        assert isinstance(info.value, RuntimeError) and "session 1" in str(info.value)
    else:
        assert isinstance(info.value, sharedml.SessionCreationError)
        assert str(prepared_model.model_path) in str(info.value)
        assert "not-a-cpu" in str(info.value)
    del info  # its traceback holds the half-built pool
    assert_nothing_left(prepared_model, threads_before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("kind", ["callback", "bad_option"])
def test_a_background_creation_that_fails_once_is_retried(
    prepared_model: sharedml.PrepareResult, kind: str
) -> None:
    threads_before = thread_ids()
    configure = _fail_on(kind, lambda n: n == 3)
    with sharedml.SessionPool(prepared_model.model_path, sessions=4, configure=configure) as pool:
        pool.wait_ready(timeout_s=DEADLINE_S)
        stats = pool.stats()
        assert stats.sessions == 4 and stats.creation_failures == 1 and stats.created == 4
        assert pool.run(None, feeds(DIM))[0].shape == (1, DIM)
    del pool
    assert_nothing_left(prepared_model, threads_before)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("kind", ["callback", "bad_option"])
def test_a_background_creation_that_keeps_failing_is_reported_never_lost(
    prepared_model: sharedml.PrepareResult, kind: str
) -> None:
    threads_before = thread_ids()
    configure = _fail_on(kind, lambda n: n >= 3)
    pool = sharedml.SessionPool(prepared_model.model_path, sessions=4, configure=configure)
    with pool:
        reported: list[BaseException] = []
        with pool.session(), pool.session():  # both sessions busy: the next caller must wait
            waiter = threading.Thread(target=_run_and_catch, args=(pool, reported))
            waiter.start()
            waiter.join(DEADLINE_S)
        # The waiter needed a session that failed to come: it was told, not left waiting.
        assert len(reported) == 1 and isinstance(reported[0], sharedml.SessionCreationError)
        with pytest.raises(sharedml.SessionCreationError):
            pool.wait_ready(timeout_s=DEADLINE_S)  # the retries are spent
        stats = pool.stats()
        assert stats.sessions == 2 and stats.creation_failures >= 5
        assert pool.run(None, feeds(DIM))[0].shape == (1, DIM)  # still serving with two
    del pool, reported
    assert_nothing_left(prepared_model, threads_before)


def _run_and_catch(pool: sharedml.SessionPool, errors: list[BaseException]) -> None:
    try:
        pool.run(None, feeds(DIM))
    except BaseException as exc:
        errors.append(exc)


def test_lazy_creation_failing_keeps_the_pool_consistent(model: Path) -> None:
    failing, calls = [True], [0]

    def configure(so: Any) -> None:
        calls[0] += 1
        if failing[0] and calls[0] > 1:  # the first session (created up front) succeeds
            raise RuntimeError("no more sessions today")

    with sharedml.SessionPool(model, min_sessions=1, max_sessions=3, configure=configure) as pool:
        with pool.session():
            for _ in range(3):
                with pytest.raises(RuntimeError, match="today"), pool.session(timeout_s=1):
                    pass
            stats = pool.stats()
            assert stats.sessions == 1 and stats.busy == 1 and stats.created == 1
        failing[0] = False
        with pool.session(), pool.session(), pool.session():
            assert pool.stats().sessions == 3
        stats = pool.stats()
        assert stats.sessions == 3 and stats.busy == 0 and stats.created == 3


# --------------------------------------------------------------------------------------------
# close() under load


def test_close_under_load_finishes_runs_in_flight_and_refuses_new_ones(
    model: Path, fast_switching: None
) -> None:
    pool = sharedml.SessionPool(model, sessions=4)
    reference = pool.run(None, feeds(DIM))[0]
    barrier = threading.Barrier(9, timeout=JOIN_S)
    lock = threading.Lock()
    done: list[tuple[float, str]] = []  # (finish time, outcome)
    closing_at: list[float] = []

    def worker(i: int) -> None:
        barrier.wait()
        while True:
            try:
                if i % 2:
                    out = pool.run(None, feeds(DIM))[0]
                else:
                    with pool.session(timeout_s=JOIN_S) as sess:
                        time.sleep(0.001)  # hold the session across close() now and then
                        out = sess.run(None, feeds(DIM))[0]
            except sharedml.PoolClosedError:
                with lock:
                    done.append((time.monotonic(), "closed"))
                return
            except BaseException as exc:
                with lock:
                    done.append((time.monotonic(), f"unexpected {type(exc).__name__}: {exc}"))
                return
            outcome = "ok" if np.array_equal(out, reference) else "wrong output"
            with lock:
                done.append((time.monotonic(), outcome))

    threads = start_threads(worker, [(i,) for i in range(8)])
    barrier.wait()
    # Close once every worker has finished a run: close() then lands among runs in flight.
    wait_until(lambda: len(done) >= 8, what="eight runs before close()")
    closing_at.append(time.monotonic())
    closer = threading.Thread(target=pool.close, kwargs={"timeout_s": JOIN_S}, daemon=True)
    closer.start()
    join_all([closer, *threads])
    closed_at = time.monotonic()
    outcomes = [o for _, o in done]
    assert set(outcomes) <= {"ok", "closed"}, {o for o in outcomes if o not in ("ok", "closed")}
    assert outcomes.count("closed") == 8 and outcomes.count("ok") >= 8
    assert pool.closed and pool.stats().busy == 0
    assert closing_at[0] <= closed_at
    with pytest.raises(sharedml.PoolClosedError):
        pool.run(None, feeds(DIM))


def test_close_waits_for_a_held_session_and_then_returns(model: Path) -> None:
    pool = sharedml.SessionPool(model, sessions=2)
    inside, go_on = threading.Event(), threading.Event()
    result: list[object] = []

    def holder() -> None:
        with pool.session() as sess:
            inside.set()
            go_on.wait(JOIN_S)
            result.append(sess.run(None, feeds(DIM))[0])  # a run in flight during close()

    t = start_threads(holder, [()])
    assert inside.wait(JOIN_S)
    closer = start_threads(pool.close, [()])
    wait_until(lambda: pool.closed, what="close() to start refusing work")
    assert closer[0].is_alive()  # the run in flight holds it: close() is still waiting
    with pytest.raises(sharedml.PoolClosedError):
        pool.run(None, feeds(DIM))
    go_on.set()
    join_all(t + closer)
    assert isinstance(result[0], np.ndarray)
    assert pool.stats().sessions == 0 and pool.stats().busy == 0


# --------------------------------------------------------------------------------------------
# KeyboardInterrupt and timeouts in waiting callers


def interrupt_main_after(delay_s: float) -> threading.Timer:
    """Deliver a real SIGINT to the main thread: it wakes a blocked lock wait, like Ctrl-C."""
    timer = threading.Timer(
        delay_s, signal.pthread_kill, args=(threading.main_thread().ident, signal.SIGINT)
    )
    timer.daemon = True
    timer.start()
    return timer


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_keyboard_interrupt_in_a_waiting_caller_loses_nothing(
    model: Path, sigint_raises: None, timeout_s: float | None
) -> None:
    with sharedml.SessionPool(model, sessions=2) as pool:
        held, release = threading.Event(), threading.Event()

        def holder() -> None:
            with pool.session(), pool.session():  # every session busy: the main thread must wait
                held.set()
                release.wait(JOIN_S)

        t = start_threads(holder, [()])
        assert held.wait(JOIN_S)
        for _ in range(3):
            timer = interrupt_main_after(0.2)
            start = time.monotonic()
            with pytest.raises(KeyboardInterrupt), pool.session(timeout_s=timeout_s):
                pytest.fail("got a session although all were busy")
            assert time.monotonic() - start < 10
            timer.join(JOIN_S)
            stats = pool.stats()
            assert stats.sessions == 2 and stats.busy == 2
        release.set()
        join_all(t)
        stats = pool.stats()
        assert stats.sessions == 2 and stats.busy == 0 and stats.failed_runs == 0
        with pool.session(timeout_s=1), pool.session(timeout_s=1):  # both really came back
            pass


def test_keyboard_interrupt_inside_a_checkout_returns_the_session(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1) as pool:
        with pytest.raises(KeyboardInterrupt), pool.session():
            raise KeyboardInterrupt
        stats = pool.stats()
        assert stats.sessions == 1 and stats.busy == 0 and stats.replaced == 0
        assert pool.run(None, feeds(DIM))[0].shape == (1, DIM)


def test_checkout_timeouts_under_contention_lose_nothing(model: Path, fast_switching: None) -> None:
    with sharedml.SessionPool(model, sessions=2) as pool:
        barrier = threading.Barrier(12, timeout=JOIN_S)
        outcomes: list[str] = []
        lock = threading.Lock()

        def worker(i: int) -> None:
            barrier.wait()
            for _ in range(20):
                try:
                    with pool.session(timeout_s=0.002) as sess:
                        sess.run(None, feeds(DIM))
                        time.sleep(0.002)
                    outcome = "ok"
                except TimeoutError as exc:  # PoolTimeout is a TimeoutError ...
                    assert isinstance(exc, sharedml.PoolTimeout)  # ... and a SharedMLError
                    assert "Raise max_sessions or the timeout" in str(exc)
                    outcome = "timeout"
                with lock:
                    outcomes.append(outcome)

        join_all(start_threads(worker, [(i,) for i in range(12)]))
        assert len(outcomes) == 240 and outcomes.count("timeout") > 0 and "ok" in outcomes
        stats = pool.stats()
        assert stats.sessions == 2 and stats.busy == 0 and stats.created == 2
        assert stats.runs == outcomes.count("ok")


def test_a_waiting_caller_is_not_overtaken(model: Path) -> None:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # the releasing thread keeps the GIL: it asks again at once
    try:
        with sharedml.SessionPool(model, sessions=1) as pool:
            order: list[str] = []
            checkout = pool.session()
            checkout.__enter__()

            def waiter() -> None:
                with pool.session(timeout_s=JOIN_S):
                    order.append("waiter")

            t = start_threads(waiter, [()])
            while pool.stats().waits < 1:  # the waiter is queued
                time.sleep(0.001)
            checkout.__exit__(None, None, None)
            try:
                with pool.session(timeout_s=0):
                    order.append("releaser again")
            except sharedml.PoolTimeout:
                order.append("releaser waits its turn")
            join_all(t)
            assert order == ["releaser waits its turn", "waiter"]
            assert pool.stats().busy == 0 and pool.stats().sessions == 1
    finally:
        sys.setswitchinterval(old)


# --------------------------------------------------------------------------------------------
# Stress: 32 threads on a pool of 4, good and bad feeds mixed

BAD_FEEDS: list[tuple[str, dict[str, np.ndarray]]] = [
    ("wrong shape", {"x": np.zeros((1, DIM + 3), np.float32), "flag": np.array(True)}),
    ("wrong rank", {"x": np.zeros((DIM,), np.float32), "flag": np.array(True)}),
    ("wrong dtype", {"x": np.zeros((1, DIM), np.float64), "flag": np.array(True)}),
    ("wrong flag dtype", {"x": np.zeros((1, DIM), np.float32), "flag": np.array(1.5)}),
    ("missing input", {"x": np.zeros((1, DIM), np.float32)}),
    ("unknown input", {"nope": np.zeros((1, DIM), np.float32), "flag": np.array(True)}),
]


def test_stress_32_threads_on_a_pool_of_4(model: Path, fast_switching: None) -> None:
    n_threads, per_thread, sessions = 32, 100, 4
    good_inputs = [feeds(DIM, flag=bool(i % 2), seed=i) for i in range(8)]
    with sharedml.SessionPool(model, sessions=sessions) as pool:
        # Reference: the pool's own sessions, one run at a time before any thread starts (its
        # route decides the kernels: whether ORT packs the weights; tests/route compares that
        # with plain ORT). Under the threads, every output must be bitwise the same.
        reference = [pool.run(None, f)[0] for f in good_inputs]
        barrier = threading.Barrier(n_threads, timeout=JOIN_S)
        lock = threading.Lock()
        holders: dict[int, int] = {}  # id(session) -> threads inside it now
        most_at_once = [0]
        problems: list[str] = []
        counts = {"good": 0, "bad": 0}

        def worker(t: int) -> None:
            barrier.wait()
            for j in range(per_thread):
                k = (t * per_thread + j) % 11
                bad = k in (3, 7, 9)
                feed = BAD_FEEDS[(t + j) % len(BAD_FEEDS)][1] if bad else good_inputs[k % 8]
                try:
                    if j % 2:
                        out = pool.run(None, feed)[0]
                    else:
                        with pool.session(timeout_s=JOIN_S) as sess:
                            with lock:
                                holders[id(sess)] = holders.get(id(sess), 0) + 1
                                most_at_once[0] = max(most_at_once[0], len(holders))
                                if holders[id(sess)] > 1:
                                    problems.append("two callers in one session")
                            try:
                                out = sess.run(None, feed)[0]
                            finally:
                                with lock:
                                    holders[id(sess)] -= 1
                                    if not holders[id(sess)]:
                                        del holders[id(sess)]
                except Exception as exc:
                    with lock:
                        counts["bad"] += 1
                        if not bad:
                            problems.append(f"good feed raised {type(exc).__name__}: {exc}")
                    continue
                with lock:
                    counts["good"] += 1
                    if bad:
                        problems.append(
                            f"bad feed accepted: {BAD_FEEDS[(t + j) % len(BAD_FEEDS)][0]}"
                        )
                    elif not np.array_equal(out, reference[k % 8]):
                        problems.append("good output differs from the single-session reference")

        join_all(start_threads(worker, [(t,) for t in range(n_threads)]))
        assert not problems, problems[:5]
        total = n_threads * per_thread
        assert counts["good"] + counts["bad"] == total and counts["bad"] > total // 5
        assert 1 < most_at_once[0] <= sessions
        stats = pool.stats()
        assert stats.sessions == sessions and stats.busy == 0  # no session lost
        assert stats.created == sessions and stats.replaced == 0
        assert stats.runs == total + len(reference) and stats.failed_runs == counts["bad"]


# --------------------------------------------------------------------------------------------
# Soak (short): the full 100k-run soak is benchmarks/soak.py


@pytest.mark.slow
def test_soak_short(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "soak.py"),
            "--runs",
            "5000",
            "--json",
            str(report),
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(report.read_text())
    assert result["ok"], result
    assert result["good_wrong"] == 0 and result["bad_accepted"] == 0
    assert result["good_errors"] == 0
    assert result["good_ok"] + result["bad_rejected"] == 5000
    assert result["final_stats"]["sessions"] == result["config"]["sessions"]
    assert result["final_stats"]["busy"] == 0


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
@pytest.mark.parametrize("family", [False, True], ids=["prepare", "family"])
def test_the_next_prepare_removes_what_killed_prepares_left_and_never_a_live_ones(
    big_source: Path, tmp_path: Path, family: bool
) -> None:
    # Five kills of a family prepare left 462 MiB of hidden .weights.*.tmp files that nothing
    # removed.
    dst = tmp_path / "out" / "m.onnx"
    kill_mid_prepare("direct", big_source, dst)
    dead = sorted(p.name for p in dst.parent.iterdir())
    assert dead and all(n.startswith(".") and n.endswith(".tmp") for n in dead)
    live = subprocess.Popen(  # another prepare into the folder, still writing
        [sys.executable, "-c", KILLED_WORKER, "direct", str(big_source), str(dst)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "writing"
        writing = sorted(p.name for p in dst.parent.iterdir() if p.name not in dead)
        assert writing and all(n.endswith(".tmp") for n in writing)
        other = save_model(build_model(["initializer"], dim=64), tmp_path / "other.onnx")
        if family:
            sharedml.prepare_family([other], dst.parent)
        else:
            sharedml.prepare(other, dst.parent / "other.onnx")
        left = {p.name for p in dst.parent.iterdir() if p.name.endswith(".tmp")}
        assert left == set(writing)  # the dead prepare's are gone, the live one's kept
    finally:
        live.send_signal(signal.SIGKILL)
        finish(live)
    sharedml.prepare(big_source, dst)  # and once that one is dead too
    assert not [p for p in dst.parent.iterdir() if p.name.endswith(".tmp")]
