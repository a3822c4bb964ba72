"""SessionPool: exclusive sessions, equal outputs, nothing lost whatever callers do."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from _creations import another_pool_opening
from _models import OPSET, PLACEMENTS, batchable_model, build_model, feeds, fixed_at_one, save_model
from _waiting import DEADLINE_S, wait_until
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml.pool import _payoff
from sharedml.pool._options import DEFAULT_SESSIONS
from sharedml.runtime import _providers

DIM = 32


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return save_model(build_model(list(PLACEMENTS), dim=DIM), tmp_path / "m.onnx")


def plain_reference(path: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def test_outputs_equal_a_plain_session_over_the_original_model(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=2) as pool:
        for flag in (True, False):
            out = pool.run(None, feeds(DIM, flag=flag))[0]
            # Prepacking is off in the pool, so MatMul may take another kernel: float tolerance.
            np.testing.assert_allclose(
                out, plain_reference(model, feeds(DIM, flag=flag)), rtol=1e-5, atol=1e-6
            )
            assert pool.run(["y"], feeds(DIM, flag=flag))[0].shape == (1, DIM)


def test_run_has_inference_session_semantics(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1) as pool:
        assert [i.name for i in pool.get_inputs()] == ["x", "flag"]
        assert [o.name for o in pool.get_outputs()] == ["y"]
        opts = ort.RunOptions()
        opts.log_severity_level = 3
        assert len(pool.run(None, feeds(DIM), opts)) == 1


def test_all_sessions_are_really_checked_out_at_once(model: Path, fast_switching: None) -> None:
    n = 4
    with sharedml.SessionPool(model, sessions=n) as pool:
        barrier = threading.Barrier(n, timeout=30)
        seen: list[int] = []
        outputs: list[np.ndarray] = []
        lock = threading.Lock()

        def work() -> None:
            with pool.session(timeout_s=30) as sess:
                barrier.wait()  # every thread holds its session here, at the same time
                with lock:
                    seen.append(id(sess))
                    assert pool.stats().busy == n
                out = sess.run(None, feeds(DIM))[0]
                barrier.wait()
            with lock:
                outputs.append(out)

        threads = [threading.Thread(target=work) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(set(seen)) == n
        reference = pool.run(None, feeds(DIM))[0]
        assert len(outputs) == n
        for out in outputs:
            np.testing.assert_array_equal(out, reference)


def test_never_two_runs_on_one_session_at_once(model: Path, fast_switching: None) -> None:
    threads_n, per_thread = 12, 25
    with sharedml.SessionPool(model, sessions=3) as pool:
        reference = pool.run(None, feeds(DIM))[0]
        active: set[int] = set()
        lock = threading.Lock()
        overlaps: list[int] = []
        mismatches: list[int] = []
        barrier = threading.Barrier(threads_n, timeout=30)

        def work() -> None:
            barrier.wait()
            for _ in range(per_thread):
                with pool.session() as sess:
                    with lock:
                        if id(sess) in active:
                            overlaps.append(id(sess))
                        active.add(id(sess))
                    out = sess.run(None, feeds(DIM))[0]
                    with lock:
                        active.discard(id(sess))
                if not np.array_equal(out, reference):
                    mismatches.append(1)
                out = pool.run(None, feeds(DIM))[0]
                if not np.array_equal(out, reference):
                    mismatches.append(1)

        threads = [threading.Thread(target=work) for _ in range(threads_n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert overlaps == [] and mismatches == []
        stats = pool.stats()
        assert stats.runs == threads_n * per_thread * 2 + 1
        assert stats.sessions == 3 and stats.busy == 0 and stats.created == 3
        assert stats.waits > 0 and stats.wait_seconds > 0


def test_the_session_used_last_is_the_next_one_handed_out(model: Path) -> None:
    # Its threads are the ones still spinning and its buffers the ones in cache; handing out
    # the others in turn keeps every session's intra-op threads awake on a lightly used pool.
    with sharedml.SessionPool(model, sessions=3) as pool:
        pool.wait_ready()
        with pool.session() as first, pool.session() as second:
            pass
        used = []
        for _ in range(4):
            with pool.session() as sess:
                used.append(sess)
    assert first is not second
    assert used == [first] * 4  # released last (the outer block), so handed out first


def test_bad_feeds_raise_and_return_the_session(model: Path, fast_switching: None) -> None:
    bad_feeds = [
        {"x": np.zeros((1, DIM + 1), np.float32), "flag": np.array(True)},  # wrong shape
        {"x": np.zeros((1, DIM), np.float64), "flag": np.array(True)},  # wrong dtype
        {"x": np.zeros((1, DIM), np.float32)},  # missing input
        {"nope": np.zeros(1, np.float32)},  # unknown input
    ]
    with sharedml.SessionPool(model, sessions=2) as pool:
        reference = pool.run(None, feeds(DIM))[0]
        barrier = threading.Barrier(8, timeout=30)
        errors: list[BaseException] = []
        goods: list[np.ndarray] = []

        def work(i: int) -> None:
            barrier.wait()
            for j in range(10):
                feed = bad_feeds[(i + j) % len(bad_feeds)] if (i + j) % 2 else feeds(DIM)
                try:
                    goods.append(pool.run(None, feed)[0])
                except Exception as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(errors) == 40 and len(goods) == 40
        for out in goods:
            np.testing.assert_array_equal(out, reference)
        # The second session is made in the background: on a loaded machine it may come later.
        wait_until(lambda: pool.stats().sessions == 2, what="the second session")
        stats = pool.stats()
        assert stats.busy == 0 and stats.failed_runs == 40
        assert stats.replaced == 0


def test_a_session_left_unusable_is_replaced(model: Path) -> None:
    class EPFail(Exception):  # the name ORT gives provider failures
        pass

    with sharedml.SessionPool(model, sessions=2) as pool:
        pool.wait_ready()
        with pytest.raises(EPFail), pool.session() as broken:
            raise EPFail("device lost")
        stats = pool.stats()
        assert stats.replaced == 1 and stats.sessions == 1
        with pool.session() as a, pool.session() as b:
            assert broken not in (a, b)
        assert pool.stats().sessions == 2 and pool.stats().created == 3


def test_checkout_timeout_is_a_timeout_error(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1) as pool:
        with pool.session():
            start = time.monotonic()
            with pytest.raises(TimeoutError), pool.session(timeout_s=0.2):
                pass
            assert 0.15 < time.monotonic() - start < 5
            with (
                pytest.raises(sharedml.PoolTimeout, match=r"within 0\.05 s"),
                pool.session(timeout_s=0.05),
            ):
                pass
        assert pool.stats().busy == 0 and pool.stats().sessions == 1


def test_close_wakes_waiting_callers_and_waits_for_runs_in_flight(model: Path) -> None:
    pool = sharedml.SessionPool(model, sessions=2)
    inside = threading.Event()
    release = threading.Event()
    results: list[object] = []

    def holder() -> None:
        with pool.session() as sess:
            inside.set()
            release.wait(DEADLINE_S)
            results.append(sess.run(None, feeds(DIM))[0])

    def waiter() -> None:
        try:
            with pool.session(timeout_s=DEADLINE_S):
                pass
        except BaseException as exc:
            results.append(exc)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(DEADLINE_S)
    with pool.session():  # occupy the second session so that `waiter` must wait
        w = threading.Thread(target=waiter)
        w.start()
        wait_until(lambda: pool.stats().waiting == 1, what="the waiter to queue")
        closer = threading.Thread(target=pool.close)
        closer.start()
        # close() wakes the waiter at once: far sooner than its own timeout would.
        w.join(DEADLINE_S / 3)
        assert not w.is_alive(), "close() left a waiting caller asleep"
    assert isinstance(results[0], sharedml.PoolClosedError)
    assert closer.is_alive()  # still waiting for the holder's run
    release.set()
    t.join(DEADLINE_S)
    closer.join(DEADLINE_S)
    assert not closer.is_alive() and isinstance(results[1], np.ndarray)
    assert pool.closed
    with pytest.raises(sharedml.PoolClosedError, match="closed"):
        pool.run(None, feeds(DIM))
    pool.close()  # idempotent


def test_close_timeout(model: Path) -> None:
    pool = sharedml.SessionPool(model, sessions=1)
    with pool.session(), pytest.raises(sharedml.PoolTimeout, match="in flight"):
        pool.close(timeout_s=0.05)
    pool.close()
    assert pool.stats().sessions == 0


def test_run_async_leaves_the_loop_free_while_a_run_waits(model: Path) -> None:
    """The run waits for the pool's one session, held by a thread the loop itself releases.

    If ``run_async`` ran synchronously, the loop would block inside it and never release the
    session: the holder gives up after its deadline and the test fails instead of hanging.
    """

    async def main() -> tuple[np.ndarray, int]:
        with sharedml.SessionPool(model, sessions=1) as pool:
            held, release = threading.Event(), threading.Event()

            def holder() -> None:
                with pool.session():
                    held.set()
                    release.wait(DEADLINE_S)

            thread = threading.Thread(target=holder)
            thread.start()
            assert held.wait(DEADLINE_S)
            pending = asyncio.ensure_future(pool.run_async(None, feeds(DIM)))
            ticks = 0
            while pool.stats().waiting == 0:  # the loop turns while the run queues
                ticks += 1
                await asyncio.sleep(0.001)
                assert ticks < DEADLINE_S * 1000, "run_async never queued its run"
            assert not pending.done()
            release.set()  # from the loop: only possible if run_async did not block it
            out = await asyncio.wait_for(pending, DEADLINE_S)
            thread.join(DEADLINE_S)
            return out[0], ticks

    out, ticks = asyncio.run(main())
    assert ticks >= 1
    np.testing.assert_allclose(out, plain_reference(model, feeds(DIM)), rtol=1e-5)


def test_run_async_on_a_closed_pool(model: Path) -> None:
    pool = sharedml.SessionPool(model, sessions=1)
    pool.close()
    with pytest.raises(sharedml.PoolClosedError):
        asyncio.run(pool.run_async(None, feeds(DIM)))


def test_lazy_growth(model: Path) -> None:
    with sharedml.SessionPool(model, min_sessions=1, max_sessions=3) as pool:
        assert pool.stats().sessions == 1 and pool.max_sessions == 3
        with pool.session(), pool.session(), pool.session():
            assert pool.stats().sessions == 3
            with pytest.raises(sharedml.PoolTimeout), pool.session(timeout_s=0.05):
                pass
        assert pool.stats().created == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"sessions": 0},
            ValueError,
            r"^sessions must be an integer from 1 to 65536 or 'auto', not 0\.",
        ),
        ({"sessions": 2.0}, TypeError, r"^sessions must be an integer or 'auto', not 2\.0\."),
        ({"sessions": "Auto"}, TypeError, r"^sessions must be an integer or 'auto', not 'Auto'\."),
        (
            {"sessions": "auto", "max_sessions": 2},
            ValueError,
            r"^sessions='auto' with max_sessions=2",
        ),
        ({"sessions": True}, ValueError, r"^sessions must be"),
        ({"max_sessions": 0}, ValueError, r"^max_sessions must be"),
        ({"min_sessions": -1}, ValueError, r"^min_sessions must be"),
        ({"min_sessions": 3, "max_sessions": 2}, ValueError, "min_sessions"),
        ({"mechanism": "magic"}, ValueError, "mechanism"),
        ({"batching": "yes"}, ValueError, "batching must be"),
        # 2**63 raised OverflowError deep inside; 1.5 and NaN were taken as thresholds.
        ({"sessions": 2**63}, ValueError, r"^sessions must be an integer from 1 to 65536"),
        ({"max_sessions": 2**63}, ValueError, r"^max_sessions must be an integer from 1"),
        ({"size_threshold_bytes": 1.5}, ValueError, r"^size_threshold_bytes must be a whole"),
        ({"size_threshold_bytes": float("nan")}, ValueError, r"^size_threshold_bytes must be"),
        ({"size_threshold_bytes": -1}, ValueError, r"^size_threshold_bytes must be"),
    ],
)
def test_bad_pool_arguments_are_refused_before_any_work(
    model: Path, kwargs: dict[str, object], error: type[Exception], match: str, tmp_path: Path
) -> None:
    cache = tmp_path / "fresh-cache"
    with pytest.raises(error, match=match):
        sharedml.SessionPool(model, cache_dir=cache, **kwargs)  # type: ignore[arg-type]
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


@pytest.mark.parametrize("timeout_s", [1e300, 2**64, 10**400, float("inf")])
def test_a_timeout_longer_than_a_lock_can_wait_means_wait_forever(
    model: Path, timeout_s: float
) -> None:
    # 1e300 and 2**64 raised OverflowError from the lock's wait, once a caller had to wait.
    with sharedml.SessionPool(model, sessions=1) as pool:
        got: list[object] = []

        def wait_for_the_session() -> None:
            try:
                with pool.session(timeout_s=timeout_s):
                    got.append("session")
            except BaseException as exc:
                got.append(exc)

        with pool.session():
            waiter = threading.Thread(target=wait_for_the_session)
            waiter.start()
            wait_until(lambda: pool.stats().waiting == 1, what="the caller to queue")
        waiter.join(DEADLINE_S)
        assert got == ["session"]


def test_warm_up_with_a_feed_that_does_not_fit_is_an_invalid_input_error(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1) as pool:
        with pytest.raises(sharedml.InvalidInputError, match="missing"):
            pool.warm_up({})  # was onnxruntime's own ValueError
        with pytest.raises(sharedml.InvalidInputError):
            pool.warm_up({"input": np.ones((1, DIM + 1), np.float32)})
        assert pool.stats().busy == 0
        pool.warm_up(feeds(DIM))


@pytest.mark.parametrize(
    ("timeout_s", "error"), [(float("nan"), ValueError), (-1, ValueError), ("1", TypeError)]
)
def test_bad_timeouts_are_refused(model: Path, timeout_s: object, error: type[Exception]) -> None:
    with sharedml.SessionPool(model, sessions=1) as pool:
        with pytest.raises(error, match="timeout_s"), pool.session(timeout_s=timeout_s):  # type: ignore[arg-type]
            pass
        with pool.session(timeout_s=float("inf")):  # inf: wait as long as it takes
            pass
        assert pool.stats().busy == 0


def test_unavailable_provider_is_a_clear_error(model: Path) -> None:
    with pytest.raises(sharedml.ProviderError, match=r"CUDAExecutionProvider.*not available"):
        sharedml.SessionPool(model, providers=["CUDAExecutionProvider"])


def test_pools_over_one_model_share_one_weight_store(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=1) as a, sharedml.SessionPool(model, sessions=1) as b:
        assert a.model_path == b.model_path  # one cache entry, keyed by content
        assert a.weights is b.weights
        assert a.weights.nbytes >= 10 * DIM * DIM * 4


def test_prepared_models_are_used_in_place(model: Path, tmp_path: Path) -> None:
    prepared = sharedml.prepare(model, tmp_path / "prepared" / "m.onnx").model_path
    with sharedml.SessionPool(prepared, sessions=1) as pool:
        assert pool.model_path == prepared
    assert not (tmp_path / "cache" / "models").exists()


@pytest.mark.parametrize(
    "mechanism",
    [
        pytest.param("in-memory-file", marks=pytest.mark.capability("files-in-memory")),
        "add-initializer",
        "ort-mmap",
    ],
)
def test_every_mechanism_gives_the_same_outputs(model: Path, mechanism: str) -> None:
    with sharedml.SessionPool(model, sessions=2, mechanism=mechanism) as pool:
        assert pool.mechanism == mechanism
        for flag in (True, False):
            np.testing.assert_allclose(
                pool.run(None, feeds(DIM, flag=flag))[0],
                plain_reference(model, feeds(DIM, flag=flag)),
                rtol=1e-5,
                atol=1e-6,
            )


def test_session_options_template_is_applied_not_modified(model: Path) -> None:
    template = ort.SessionOptions()
    template.intra_op_num_threads = 1
    template.add_session_config_entry("session.intra_op.allow_spinning", "0")
    configured: list[ort.SessionOptions] = []

    def configure(so: ort.SessionOptions) -> None:
        assert so is not template
        assert so.intra_op_num_threads == 1
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert so.get_session_config_entry("session.disable_prepacking") == "1"
        configured.append(so)

    with sharedml.SessionPool(  # prepacking off: an entry the pool adds to every session's
        model, sessions=3, sess_options=template, configure=configure, prepacking="off"
    ) as pool:
        pool.wait_ready()
        assert len(configured) == 3
    with pytest.raises(RuntimeError):  # the pool added nothing to the caller's object
        template.get_session_config_entry("session.disable_prepacking")


@pytest.mark.parametrize(("old", "new"), [(True, "per-session"), (False, "off"), (None, "auto")])
def test_a_boolean_prepacking_is_refused_and_says_what_to_write(
    model: Path, old: bool | None, new: str
) -> None:
    with pytest.raises(
        ValueError, match=f"prepacking={old} is not a setting: write prepacking='{new}'"
    ):
        sharedml.SessionPool(model, sessions=1, prepacking=old)  # type: ignore[arg-type]


def test_prepacking_can_be_turned_on(model: Path) -> None:
    seen: list[str] = []
    with sharedml.SessionPool(
        model,
        sessions=1,
        prepacking="per-session",
        configure=lambda so: seen.append(so.get_session_config_entry("session.disable_prepacking")),
    ) as pool:
        np.testing.assert_allclose(
            pool.run(None, feeds(DIM))[0], plain_reference(model, feeds(DIM)), rtol=1e-5, atol=1e-6
        )
    assert seen == ["0"]


def test_failed_session_creation_is_a_clear_error(model: Path) -> None:
    def configure(so: ort.SessionOptions) -> None:
        so.add_session_config_entry("session.load_model_format", "ORT")  # not an ORT-format file

    with pytest.raises(sharedml.SessionCreationError, match=r"m\.onnx"):
        sharedml.SessionPool(model, sessions=2, configure=configure)


def test_stats_and_repr(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=2) as pool:
        pool.wait_ready()
        pool.run(None, feeds(DIM))
        stats = pool.stats()
        assert (stats.sessions, stats.idle, stats.busy, stats.runs) == (2, 2, 0, 1)
        assert stats.create_seconds > 0
        assert "sessions=2/2" in repr(pool) and "open" in repr(pool)
    assert "closed" in repr(pool)


class _CountingSessions:
    """Wraps ``ort.InferenceSession`` to count how many are being created at once."""

    def __init__(
        self, model: Path, monkeypatch: pytest.MonkeyPatch, *, fail_on: int | None = None
    ) -> None:
        sharedml.SessionPool(model, sessions=1).close()  # one-off work: prepare, prepacked build
        self.real = ort.InferenceSession
        self.lock = threading.Lock()
        self.active = self.peak = self.calls = 0
        self.fail_on = fail_on
        self.both_in = threading.Barrier(2)
        monkeypatch.setattr(ort, "InferenceSession", self)

    def __call__(self, *args: object, **kwargs: object) -> ort.InferenceSession:
        with self.lock:
            self.calls += 1
            call = self.calls
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            if call <= 2:
                # The first two creations meet here when they run at once; serialized, the
                # first waits out the timeout alone.
                with contextlib.suppress(threading.BrokenBarrierError):
                    self.both_in.wait(timeout=2.0)
            if call == self.fail_on:
                raise RuntimeError("injected creation failure")
            return self.real(*args, **kwargs)
        finally:
            with self.lock:
                self.active -= 1


def test_unserialized_creation_creates_the_first_sessions_in_parallel(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # Linux only
    counting = _CountingSessions(model, monkeypatch)
    with sharedml.SessionPool(model, sessions=4, serialize_creation=False) as pool:
        assert counting.peak == 2 and counting.calls == 4
        assert pool.stats().sessions == 4 and pool.stats().created == 4
        with contextlib.ExitStack() as held:
            sessions = [held.enter_context(pool.session()) for _ in range(4)]
            assert len({id(s) for s in sessions}) == 4
        assert_allclose_to_plain(pool, model)


def test_creation_is_serialized_by_default(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # Linux only
    counting = _CountingSessions(model, monkeypatch)
    counting.both_in = threading.Barrier(1)  # nothing to meet: serialized creation never waits
    with sharedml.SessionPool(model, sessions=3) as pool:
        pool.wait_ready()
        assert counting.peak == 1 and pool.stats().sessions == 3


def test_a_failed_parallel_creation_fails_the_pool_with_the_cause(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # Linux only
    _CountingSessions(model, monkeypatch, fail_on=3)
    with pytest.raises(sharedml.SessionCreationError, match="injected creation failure"):
        sharedml.SessionPool(model, sessions=4, serialize_creation=False)


def assert_allclose_to_plain(pool: sharedml.SessionPool, path: Path) -> None:
    feed = feeds(DIM)
    np.testing.assert_allclose(pool.run(None, feed)[0], plain_reference(path, feed), rtol=1e-5)


def test_parallel_creation_is_refused_with_directml(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The guard reads the planned providers: a bare string, a list, a (name, options) pair.
    dml = "DmlExecutionProvider"
    monkeypatch.setattr(_providers, "available_providers", lambda: [dml, "CPUExecutionProvider"])
    for providers in (dml, [dml], [(dml, {"device_id": 0})]):
        with pytest.raises(ValueError, match="DirectML sessions concurrently"):
            sharedml.SessionPool(model, sessions=2, providers=providers, serialize_creation=False)


def test_a_pool_dropped_without_close_warns_like_an_unclosed_file(model: Path) -> None:
    import gc

    pool = sharedml.SessionPool(model, sessions=1)
    with pytest.warns(ResourceWarning, match="unclosed <SessionPool 'm.onnx'"):
        del pool
        gc.collect()
    closed = sharedml.SessionPool(model, sessions=1)
    closed.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del closed
        gc.collect()


# --------------------------------------------------------------------------------------------
# Serving before the pool is full


class _GatedCreation:
    """``configure=``: sessions after the first wait for ``open`` before they are created."""

    def __init__(self) -> None:
        self.calls = 0
        self.open = threading.Event()

    def __call__(self, so: ort.SessionOptions) -> None:
        self.calls += 1
        if self.calls > 1:
            assert self.open.wait(DEADLINE_S), "the test never opened the gate"


def test_the_pool_serves_once_its_first_session_exists(model: Path) -> None:
    gate = _GatedCreation()
    with sharedml.SessionPool(model, sessions=4, configure=gate) as pool:
        stats = pool.stats()
        assert stats.sessions == 1 and stats.created == 1  # the rest are still coming
        assert pool.run(None, feeds(DIM))[0].shape == (1, DIM)
        with pytest.raises(sharedml.PoolTimeout):
            pool.wait_ready(timeout_s=0.01)
        gate.open.set()
        pool.wait_ready(timeout_s=DEADLINE_S)
        assert pool.stats().sessions == 4 and pool.stats().created == 4


def test_callers_wait_for_the_sessions_still_being_created(model: Path) -> None:
    gate = _GatedCreation()
    with sharedml.SessionPool(model, sessions=2, configure=gate) as pool:
        results: list[np.ndarray] = []
        with pool.session():  # the only session that exists so far
            waiter = threading.Thread(target=lambda: results.append(pool.run(None, feeds(DIM))[0]))
            waiter.start()
            wait_until(lambda: pool.stats().waiting == 1, what="the caller to queue")
            gate.open.set()  # the second session appears and goes to the waiting caller
            waiter.join(DEADLINE_S)
            # Served while the first session is still checked out: by the new one.
            assert len(results) == 1 and pool.stats().busy == 1
        assert pool.stats().sessions == 2


def test_close_during_background_creation_is_clean(model: Path) -> None:
    gate = _GatedCreation()
    pool = sharedml.SessionPool(model, sessions=3, configure=gate)
    wait_until(lambda: gate.calls == 2, what="the second session's creation to start")
    closer = threading.Thread(target=pool.close)
    closer.start()
    wait_until(lambda: pool.closed, what="close() to start")
    assert closer.is_alive()  # it waits for the creation under way
    gate.open.set()
    closer.join(DEADLINE_S)
    assert not closer.is_alive()
    assert pool.stats().sessions == 0 and gate.calls == 2  # no creation after close
    with pytest.raises(sharedml.PoolClosedError):
        pool.run(None, feeds(DIM))


def test_create_in_background_false_returns_a_full_pool(model: Path) -> None:
    with sharedml.SessionPool(model, sessions=3, create_in_background=False) as pool:
        assert pool.stats().sessions == 3 and pool.stats().created == 3


# --------------------------------------------------------------------------------------------
# What InferenceSession users expect of the pool too


def test_a_model_given_as_bytes_works_like_its_path(model: Path) -> None:
    with sharedml.SessionPool(model.read_bytes(), sessions=1) as pool:
        assert pool.source_path.name == "<model bytes>"
        # Keyed as prepare keys what it reads: the path and the bytes find one entry.
        assert pool.model_path == sharedml.prepared_model_for(model)
        np.testing.assert_allclose(
            pool.run(None, feeds(DIM))[0], plain_reference(model, feeds(DIM)), rtol=1e-5
        )
    with pytest.raises(sharedml.InvalidModelError, match="not a valid ONNX model"):
        sharedml.SessionPool(b"not a model", sessions=1)
    with pytest.raises(TypeError, match=r"path .* or the model's bytes"):
        sharedml.SessionPool(12345, sessions=1)  # type: ignore[arg-type]


def test_a_model_in_bytes_cannot_point_at_external_data(tmp_path: Path) -> None:
    external = save_model(
        build_model(["initializer"], dim=DIM), tmp_path / "e.onnx", external="one"
    )
    with pytest.raises(sharedml.ExternalDataError, match="bytes cannot carry"):
        sharedml.SessionPool(external.read_bytes(), sessions=1)


def test_the_pool_answers_what_an_inference_session_answers(model: Path) -> None:
    plain = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    with sharedml.SessionPool(model, sessions=1) as pool:
        assert [i.name for i in pool.get_inputs()] == [i.name for i in plain.get_inputs()]
        assert [o.name for o in pool.get_outputs()] == [o.name for o in plain.get_outputs()]
        assert pool.get_providers() == plain.get_providers()
        assert pool.get_modelmeta().graph_name == plain.get_modelmeta().graph_name


def test_ort_run_errors_are_sharedml_errors_that_keep_orts_message(model: Path) -> None:
    bad = {"x": np.zeros((1, DIM + 1), np.float32), "flag": np.array(True)}
    with (
        sharedml.SessionPool(model, sessions=1) as pool,
        pytest.raises(sharedml.InvalidInputError) as info,
    ):
        pool.run(None, bad)
    error = info.value
    assert isinstance(error, sharedml.RunError) and isinstance(error, ValueError)
    assert error.ort_type == "InvalidArgument" and "INVALID_ARGUMENT" in str(error)
    assert type(error.__cause__).__name__ == "InvalidArgument"


FORKED_CHILD = textwrap.dedent(
    r"""
    import os, sys, threading
    import numpy as np
    import sharedml
    from _models import feeds
    pool = sharedml.SessionPool(sys.argv[1], sessions=1)
    busy = threading.Event()
    def hold():
        with pool.session():
            busy.set()
            threading.Event().wait(2)  # a checkout in flight across the fork
    threading.Thread(target=hold, daemon=True).start()
    busy.wait()
    pid = os.fork()
    if pid == 0:
        try:
            pool.run(None, feeds(32))
        except sharedml.PoolError as exc:
            print("child:", type(exc).__name__, str(exc)[:80], flush=True)
            os._exit(0)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    print("child status", os.waitstatus_to_exitcode(status), flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
def test_a_pool_used_after_fork_raises_instead_of_hanging(tmp_path: Path) -> None:
    model = save_model(build_model(["initializer"], dim=32), tmp_path / "m.onnx")
    out = subprocess.run(
        [sys.executable, "-c", FORKED_CHILD, str(model)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S * 2,
        cwd=Path(__file__).parents[1],  # tests/, where _models lives
    )
    assert "child: PoolError This SessionPool was created in process" in out.stdout, out
    assert "child status 0" in out.stdout, out


# --------------------------------------------------------------------------------------------
# The model is read once and routed once


@dataclasses.dataclass
class Reads:
    """What a pool read on its way to a first result: graphs parsed, and routes planned."""

    parsed: list[str]  # the SHA-256 of every serialized graph parsed, in order
    planned: int = 0

    def of(self, path: Path) -> int:
        """How often the graph in the file at ``path`` was parsed."""
        return self.parsed.count(hashlib.sha256(path.read_bytes()).hexdigest())


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Count every parse of a graph (sharedml parses in one function) and every route planned.

    Each module that imported one of the two functions holds its own name for it: every such
    name is wrapped. The modules a pool may import lazily are imported first, so that none
    binds a wrapper that outlives the test.
    """
    import sharedml.model._inputs
    import sharedml.pool._pool
    import sharedml.weights._prepacked  # noqa: F401
    from sharedml.model import _proto
    from sharedml.route import _planner

    found = Reads([])
    parse, plan = _proto.parse_model, _planner.plan_route

    def parse_counted(data: bytes) -> object:
        found.parsed.append(hashlib.sha256(bytes(data)).hexdigest())
        return parse(data)

    def plan_counted(*args: object, **kwargs: object) -> object:
        found.planned += 1
        return plan(*args, **kwargs)  # type: ignore[arg-type]

    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith("sharedml"):
            continue
        for name, original, counted in (
            ("parse_model", parse, parse_counted),
            ("plan_route", plan, plan_counted),
        ):
            if getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return found


@pytest.mark.parametrize("prepacking", ["auto", "off"])  # both read ORT's optimized form
def test_a_pool_parses_its_prepared_graph_once_and_plans_one_route(
    tmp_path: Path, reads: Reads, prepacking: str
) -> None:
    source = batchable_model(tmp_path / "mlp.onnx", dim=64)
    prepared = sharedml.prepare(source, tmp_path / "prepared.onnx").model_path
    reads.parsed.clear()
    with sharedml.SessionPool(prepared, sessions=2, batching="auto", prepacking=prepacking) as pool:
        assert pool.batching is not None  # the row analysis read the graph as well
        pool.run(None, {"x": np.ones((1, 64), np.float32)})
    assert reads.of(prepared) == 1, reads
    assert reads.planned == 1


def test_a_batching_pool_routes_its_relaxed_graph_from_memory(tmp_path: Path, reads: Reads) -> None:
    source = fixed_at_one(batchable_model(tmp_path / "mlp.onnx"), tmp_path / "fixed.onnx")
    prepared = sharedml.prepare(source, tmp_path / "prepared.onnx").model_path
    reads.parsed.clear()
    with sharedml.SessionPool(prepared, sessions="auto", cores=2, batching="auto") as pool:
        relaxed = pool.model_path  # an entry of the cache: axis 0 relaxed from 1
        assert relaxed != prepared and "relaxed" in pool.batching_reason
        pool.run(None, {"x": np.ones((1, 32), np.float32)})
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.decided  # it read the graph too
        assert reads.of(prepared) == 1, reads
        assert reads.of(relaxed) == 0, reads  # written from memory, and never read back
    assert reads.planned == 1  # the relaxed graph's route only: the prepared one is not loaded


@pytest.mark.parametrize(("cores", "sessions", "threads"), [(2, 1, 2), (16, 1, 16), (32, 2, 16)])
def test_a_merging_pool_runs_a_lone_request_on_several_cores(
    tmp_path: Path, cores: int, sessions: int, threads: int
) -> None:
    """Left to its defaults, a CPU pool whose requests merge does not split the cores into
    sessions of one thread: a lone request would run on one core while the others idle."""
    path = batchable_model(tmp_path / "mlp.onnx")
    with sharedml.SessionPool(path, batching="auto", cores=cores) as pool:
        pool.wait_ready()
        assert pool.batching is not None
        assert pool.max_sessions == sessions, pool.batching_reason
        with pool.session() as sess:
            assert sess.get_session_options().intra_op_num_threads == threads
        assert f"{sessions} of {threads} intra-op thread" in pool.batching_reason
    # Where requests do not merge, the cores are split over the default count as before.
    with sharedml.SessionPool(path, cores=cores) as pool:
        assert pool.batching is None and pool.max_sessions == DEFAULT_SESSIONS
        with pool.session() as sess:
            assert sess.get_session_options().intra_op_num_threads == max(1, cores // 4)


def test_a_merging_pool_bounds_its_rows_by_what_a_row_holds(tmp_path: Path) -> None:
    """Where activations dominate, the default merging pool runs fewer rows at once; where the
    weights dominate it keeps its batch size; a size the caller gave is kept."""
    from tools.realistic_models import unet_like

    heavy = Path(unet_like(tmp_path / "unet.onnx", image=64).path)
    with sharedml.SessionPool(heavy, batching="auto", cache_dir=tmp_path / "c") as pool:
        assert pool.batching is not None
        rows = pool.batching.max_batch_size
        assert DEFAULT_SESSIONS <= rows < sharedml.Batching().max_batch_size
        assert f"At most {rows} rows per Run" in pool.batching_reason
    given = sharedml.Batching(max_batch_size=20)
    with sharedml.SessionPool(heavy, batching=given, cache_dir=tmp_path / "c") as pool:
        assert pool.batching is not None and pool.batching.max_batch_size == 20
    light = batchable_model(tmp_path / "mlp.onnx", dim=256)
    with sharedml.SessionPool(light, batching=True, cache_dir=tmp_path / "c") as pool:
        assert pool.batching is not None
        assert pool.batching.max_batch_size == sharedml.Batching().max_batch_size
        assert "not bounded by memory" in pool.batching_reason


@pytest.mark.parametrize("always", [False, True])
def test_memory_another_thread_takes_while_a_row_is_measured_does_not_cut_the_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, always: bool
) -> None:
    """A row's activations are read off the process's memory: what another thread allocates
    once during the reading must not read as this model's, cutting a light model's batches and
    turning its memory patterns off. Memory that grows with every Run does cut them (nothing
    tells it from activations)."""
    light = batchable_model(tmp_path / "mlp.onnx", dim=256)
    held: list[np.ndarray] = []
    run = ort.InferenceSession.run

    def run_beside_a_burst(self: ort.InferenceSession, names: object, feed: dict) -> object:
        # The model's Runs (not the library's probes of ORT): another thread's 8 MiB, touched,
        # while the first one runs, or while each does.
        if (always or not held) and feed["x"].shape[1:] == (256,):
            held.append(np.ones(2**21, np.float32))
        return run(self, names, feed)

    monkeypatch.setattr(ort.InferenceSession, "run", run_beside_a_burst)
    with sharedml.SessionPool(light, batching="auto", cache_dir=tmp_path / "c") as pool:
        assert pool.batching is not None and held  # the burst met the pool's first Runs
        if always:
            assert pool.batching.max_batch_size < sharedml.Batching().max_batch_size
        else:
            assert pool.batching.max_batch_size == sharedml.Batching().max_batch_size
            assert "not bounded by memory" in pool.batching_reason and _patterns(pool)


def test_no_session_of_this_process_is_created_while_a_row_is_measured(tmp_path: Path) -> None:
    """Creating a session allocates: another pool's creation during the reading would read as
    this model's activations. It waits, then goes ahead."""
    light = batchable_model(tmp_path / "mlp.onnx", dim=256)
    sharedml.SessionPool(light, batching="auto", cache_dir=tmp_path / "c").close()  # prepared
    with (
        another_pool_opening(tmp_path, width=256) as overlapped,
        sharedml.SessionPool(light, batching="auto", cache_dir=tmp_path / "c") as pool,
    ):
        assert pool.batching is not None
    assert overlapped == [False]


def test_a_pool_whose_session_creates_sessions_as_it_runs_measures_its_rows(
    tmp_path: Path,
) -> None:
    """A session per batch bucket creates its bucket's session on its first Run, while the
    pool measures its rows with the process's creation lock held: no deadlock."""
    light = batchable_model(tmp_path / "mlp.onnx", dim=64)
    given = sharedml.Batching(pad_to_buckets=True, session_per_bucket=True)
    seen: list[tuple[str, tuple[int, ...]]] = []

    def open_and_run() -> None:
        with sharedml.SessionPool(light, batching=given, cache_dir=tmp_path / "c") as pool:
            out = pool.run(None, {"x": np.ones((3, 64), np.float32)})[0]
            seen.append((pool.batching_reason, out.shape))

    opener = threading.Thread(target=open_and_run, daemon=True)  # a deadlock must not hang pytest
    opener.start()
    opener.join(DEADLINE_S)
    assert not opener.is_alive() and len(seen) == 1
    reason, shape = seen[0]
    assert "Rows per Run not bounded by memory: one row's" in reason and shape == (3, 64)


def _patterns(pool: sharedml.SessionPool) -> bool:
    with pool.session() as sess:
        return bool(sess.get_session_options().enable_mem_pattern)


def test_memory_patterns_stay_on_only_where_requests_may_run_side_by_side(
    tmp_path: Path,
) -> None:
    """Concurrent Runs on a session without memory patterns take every activation from its one
    arena, so the default merging CPU pool (whose requests may run side by side) keeps them,
    unless one row's activations bound its rows: then they would hold every batch twice. Pools
    that run one request a session at a time keep them off."""
    from tools.realistic_models import unet_like

    cache = tmp_path / "c"
    light = batchable_model(tmp_path / "mlp.onnx", dim=256)
    with sharedml.SessionPool(light, batching="auto", cache_dir=cache) as pool:
        assert pool.max_sessions == 1 and _patterns(pool)
        assert "Memory patterns stay on" in pool.mechanism_reason
        assert "not bounded by memory" in pool.batching_reason
    heavy = Path(unet_like(tmp_path / "unet.onnx", image=64).path)
    with sharedml.SessionPool(heavy, batching="auto", cache_dir=cache) as pool:
        assert pool.max_sessions == 1 and not _patterns(pool)
        assert "Memory patterns are off" in pool.mechanism_reason
        assert "At most" in pool.batching_reason
        assert pool.stats().sessions == 1  # the session measured with patterns was let go
    # A model whose generated row fails (its Reshape wants 35 values a row): nothing measured,
    # so nothing says the activations are small.
    reshape = helper.make_model(
        helper.make_graph(
            [helper.make_node("Reshape", ["x", "shape"], ["y"])],
            "reshape",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5, 7])],
            [numpy_helper.from_array(np.array([0, 5, 7], np.int64), "shape")],
        ),
        opset_imports=[helper.make_opsetid("", OPSET)],
    )
    reshape.ir_version = 8  # what the oldest onnxruntime CI runs reads
    unmeasured = save_model(reshape, tmp_path / "reshape.onnx")
    with sharedml.SessionPool(unmeasured, batching="auto", cache_dir=cache) as pool:
        assert "a run failed" in pool.batching_reason
        assert not _patterns(pool) and pool.stats().sessions == 1
        assert pool.run(None, {"x": np.ones((1, 35), np.float32)})[0].shape == (1, 5, 7)
    for kwargs in ({"per_session_state": True}, {"sessions": 2}, {"batching": False}):
        options = {"batching": "auto", **kwargs}
        with sharedml.SessionPool(light, cache_dir=cache, **options) as pool:  # type: ignore[arg-type]
            assert not _patterns(pool), kwargs
            assert "Memory patterns are off" in pool.mechanism_reason


@pytest.mark.parametrize("per_session_state", [False, True])
def test_a_merging_pool_runs_requests_side_by_side_where_merging_does_not_pay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_session_state: bool
) -> None:
    """The default merging CPU pool, once merging paused, lets several requests run on its one
    session at once (ORT's CPU Run is thread-safe) instead of one after another: the Run
    seconds of its requests then add up to more than the wall time they took. Not where the
    caller said each needs a session of its own."""
    from tools.realistic_models import sample_inputs, unet_like

    monkeypatch.setattr(_payoff, "PAUSE_BELOW", float("inf"))  # no merged batch pays
    info = unet_like(tmp_path / "unet.onnx", image=64)
    path, feed = Path(info.path), sample_inputs(info, batch=1)
    stop = threading.Event()
    with sharedml.SessionPool(
        path,
        batching="auto",
        cores=2,
        cache_dir=tmp_path / "c",
        per_session_state=per_session_state,
    ) as pool:
        assert pool.max_sessions == 1

        def caller() -> None:
            while not stop.is_set():
                pool.run(None, feed)

        barrier = threading.Barrier(8)
        threads = [
            threading.Thread(target=lambda: (barrier.wait(), caller()), daemon=True)
            for _ in range(8)
        ]
        for thread in threads:
            thread.start()
        try:
            wait_until(lambda: pool.stats().merge_pauses == 1, what="merging to pause")
            before, began = pool.stats(), time.perf_counter()
            wait_until(lambda: pool.stats().runs >= before.runs + 40, what="40 runs")
            after, elapsed = pool.stats(), time.perf_counter() - began
        finally:
            stop.set()
            for thread in threads:
                thread.join(DEADLINE_S)
        assert after.sessions == 1
        run_s = after.run_seconds - before.run_seconds
        if per_session_state:
            assert "side by side" not in pool.batching_reason
            # A run in flight at the first snapshot counts whole: a few milliseconds of slack.
            assert run_s <= 1.2 * elapsed
        else:
            assert "side by side" in pool.batching_reason
            assert run_s > 1.5 * elapsed
