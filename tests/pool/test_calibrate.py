"""``SessionPool(sessions="auto")``: the split of the cores follows the measurement, or says why.

Nothing here asserts a timing (the machine is shared): the choosing rule is tested on given
timings, and pools are tested for what they chose, report and serve.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _creations import another_pool_opening
from _models import OPSET, batchable_model, conv_model, fixed_at_one, save_model
from _waiting import DEADLINE_S
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml._host._platform import usable_cores
from sharedml.pool import Calibration, CalibrationCandidate, _calibrate
from sharedml.route import SessionRecipe
from sharedml.runtime._providers import plan_providers

DIM = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return batchable_model(tmp_path_factory.mktemp("auto") / "mlp.onnx", dim=DIM)


def _graph_model(path: Path, graph: Any) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return save_model(model, path)


def _at_once(pool: sharedml.SessionPool, xs: list[np.ndarray]) -> list[Any]:
    """``pool.run`` of each ``{"x": x}`` from a thread of its own, all started on a barrier."""
    outs: list[Any] = [None] * len(xs)
    start = threading.Barrier(len(xs))

    def call(i: int) -> None:
        start.wait()
        outs[i] = pool.run(None, {"x": xs[i]})[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def candidate(
    sessions: int, threads: int, rows_per_s: float, rows: int = 8
) -> CalibrationCandidate:
    return CalibrationCandidate(threads, sessions, rows, sessions * rows / rows_per_s, rows_per_s)


# ---------------------------------------------------------------------------------------------
# The candidates and the rule, without a model


@pytest.mark.parametrize(
    ("cores", "splits"),
    [
        (1, [(1, 1)]),
        (2, [(1, 2), (2, 1)]),
        (4, [(1, 4), (2, 2), (4, 1)]),
        (6, [(1, 6), (3, 2), (6, 1)]),
        (12, [(1, 12), (3, 4), (6, 2), (12, 1)]),
    ],
)
def test_the_splits_are_powers_of_two_threads_and_all_cores_each_using_every_core_it_can(
    cores: int, splits: list[tuple[int, int]]
) -> None:
    assert _calibrate.candidate_splits(cores) == splits


def test_the_most_rows_per_second_wins_when_more_sessions_are_clearly_faster() -> None:
    one, two = candidate(1, 2, 1000.0), candidate(2, 1, 1500.0)
    chosen, reason = _calibrate.choose([one, two])
    assert chosen is two
    assert "most rows/s" in reason


def test_fewer_sessions_win_a_tie_and_anything_within_the_margin() -> None:
    one, two = candidate(1, 2, 1000.0), candidate(2, 1, 1000.0)
    assert _calibrate.choose([two, one])[0] is one  # a tie, in either order
    two = candidate(2, 1, 1000.0 * (1 + _calibrate.SESSIONS_MARGIN))  # just at the margin
    chosen, reason = _calibrate.choose([one, two])
    assert chosen is one
    assert f"within {_calibrate.SESSIONS_MARGIN:.0%}" in reason and "fewer sessions" in reason
    two = candidate(2, 1, 1000.0 * (1 + _calibrate.SESSIONS_MARGIN) + 1.0)  # just beyond it
    assert _calibrate.choose([one, two])[0] is two


def test_the_margin_is_measured_from_the_best_not_from_each_neighbour() -> None:
    # 2 sessions are 20% faster than 1, and 4 are 16.7% faster than 2: step by step each gain
    # is inside the 25% margin, but 4 sessions are 40% faster than 1. The fewest sessions
    # within the margin of the best is 2.
    assert _calibrate.SESSIONS_MARGIN == 0.25
    one, two, four = candidate(1, 4, 100.0), candidate(2, 2, 120.0), candidate(4, 1, 140.0)
    assert _calibrate.choose([one, two, four])[0] is two


def test_single_rows_win_where_a_batch_gains_little_and_costs_much_memory() -> None:
    margin, costly = _calibrate.ROWS_MARGIN, _calibrate.BATCH_MEMORY_SHARE + 0.01
    one_b, two_b = candidate(1, 2, 120.0), candidate(2, 1, 124.0)
    one_s = candidate(1, 2, 70.0, rows=1)
    two_s = candidate(2, 1, 124.0 / (1 + margin), rows=1)  # just at the margin
    chosen, reason = _calibrate.choose([one_b, one_s, two_b, two_s], batch_memory_share=costly)
    assert chosen is two_s  # at one row, 2 sessions are clearly faster than 1
    assert "at most 1 row(s)" in reason and "not worth it" in reason
    # The same timings, where the batch's memory is small or unknown: batches.
    both = [one_b, one_s, two_b, two_s]
    for share in (_calibrate.BATCH_MEMORY_SHARE, 0.0, None):
        assert _calibrate.choose(both, batch_memory_share=share)[0] is one_b
    # Single rows just beyond the margin: batches, however costly.
    two_s = candidate(2, 1, 124.0 / (1 + margin) - 1.0, rows=1)
    chosen, reason = _calibrate.choose([one_b, one_s, two_b, two_s], batch_memory_share=9.0)
    assert chosen is one_b and "not worth it" not in reason


@pytest.mark.parametrize("share", [None, 0.0])
def test_single_rows_timed_faster_never_cap_a_batch_whose_memory_is_cheap_or_unknown(
    share: float | None,
) -> None:
    batch, single = candidate(1, 2, 100.0), candidate(1, 2, 130.0, rows=1)
    chosen, reason = _calibrate.choose([batch, single], batch_memory_share=share)
    assert chosen is batch and "not worth it" not in reason


def test_where_batches_do_not_pay_the_split_is_chosen_for_single_rows_without_a_cap() -> None:
    # A CNN on few cores: 8 rows cost 8 single rows, so merging will not pay (the scheduler
    # finds that out on the traffic). Two one-thread sessions run single rows 1.6x faster than
    # one of two threads: that split, returned at the batch size (nothing caps the rows).
    one_b, two_b = candidate(1, 2, 100.0), candidate(2, 1, 160.0)
    one_s, two_s = candidate(1, 2, 100.0, rows=1), candidate(2, 1, 160.0, rows=1)
    chosen, reason = _calibrate.choose([one_b, one_s, two_b, two_s], batch_memory_share=0.0)
    assert chosen is two_b
    assert "the split is chosen for single rows" in reason and "not worth it" not in reason
    # Batches that pay (1.3x single rows): the batch size decides, one session of two threads.
    one_s, two_s = candidate(1, 2, 100.0 / 1.3, rows=1), candidate(2, 1, 100.0 / 1.3, rows=1)
    one_b, two_b = candidate(1, 2, 100.0), candidate(2, 1, 110.0)
    chosen, reason = _calibrate.choose([one_b, one_s, two_b, two_s])
    assert chosen is one_b and "single rows" not in reason


def test_among_single_rows_the_fewest_sessions_within_the_margin_win() -> None:
    batch = candidate(1, 2, 100.0)
    one_s, two_s = candidate(1, 2, 99.0, rows=1), candidate(2, 1, 100.0, rows=1)
    chosen, _ = _calibrate.choose([batch, one_s, two_s], batch_memory_share=1.0)
    assert chosen is one_s


class NoisyTimings:
    """Fake Run times for ``_calibrate.timed_run``: no Run is made.

    A Run of ``rows`` rows on a session of ``threads`` intra-op threads takes
    ``rows * per_row[threads]`` seconds, times a load factor drawn once per probe session from
    ``1 +- load`` (a load that came or went between two probes: they run one after another)
    and a jitter per Run from ``1 +- jitter``. ``factors`` fixes the load factor of the first
    probes instead, in the order they are created.
    """

    def __init__(
        self,
        seed: int,
        per_row: dict[int, float],
        *,
        load: float = 0.08,
        jitter: float = 0.05,
        factors: tuple[float, ...] = (),
    ) -> None:
        self.rng = random.Random(seed)
        self.per_row, self.load, self.jitter = per_row, load, jitter
        self.factors = list(factors)
        self.probes: list[int] = []  # the threads of each probe session, in order

    def __call__(self, session: Any, feed: Any, run_options: Any) -> float:
        threads = session.get_session_options().intra_op_num_threads
        rows = len(next(iter(feed.values())))
        factor = getattr(session, "_noisy_factor", None)
        if factor is None:  # a new probe session
            drawn = self.rng.uniform(1 - self.load, 1 + self.load)
            factor = self.factors.pop(0) if self.factors else drawn
            session._noisy_factor = factor
            self.probes.append(threads)
        jitter = self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        return float(rows * self.per_row[threads] * factor * jitter)


def _auto_split(model: Path, timings: NoisyTimings, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(_calibrate, "timed_run", timings)
    with sharedml.SessionPool(
        model, sessions="auto", batching=True, cores=2, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
    assert calibration is not None and calibration.decided
    return calibration


@pytest.mark.parametrize(
    ("per_row", "split"),
    [
        ({1: 2e-3, 2: 1e-3}, (1, 2)),  # two threads halve a Run: a tie, the fewest sessions
        ({1: 2e-3, 2: 1.6e-3}, (2, 1)),  # two threads barely help: two sessions, 1.6x
    ],
    ids=["tie", "more-sessions-clearly-faster"],
)
def test_the_split_is_the_same_on_every_run_under_noisy_timings(
    model: Path, monkeypatch: pytest.MonkeyPatch, per_row: dict[int, float], split: Any
) -> None:
    # A pool was split into two one-thread sessions on some runs and not on others: the load
    # of a busy machine changed between the probes by more than the margin. With every probe
    # off by up to 8% (and each Run by up to 5% more), the choice must not depend on the draw.
    chosen = set()
    for seed in range(20):
        calibration = _auto_split(model, NoisyTimings(seed, per_row), monkeypatch)
        chosen.add((calibration.sessions, calibration.threads))
    assert chosen == {split}


def test_more_sessions_that_win_only_the_first_pass_are_not_chosen(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first probe (one session of two threads) met a load spike: 1.5x slower. Two
    # one-thread sessions then win the first pass by far, but not when both are probed again.
    timings = NoisyTimings(0, {1: 2e-3, 2: 1e-3}, factors=(1.5, 1.0, 1.0, 1.0))
    calibration = _auto_split(model, timings, monkeypatch)
    assert (calibration.sessions, calibration.threads) == (1, 2)
    assert timings.probes == [2, 1, 1, 2]  # the first pass, then the contender first
    assert [(c.sessions, c.threads) for c in calibration.repeated if c.rows > 1] == [
        (2, 1),
        (1, 2),
    ]
    assert calibration.reason.startswith("1 session(s) of 2 thread(s): the fewest sessions stand.")
    assert "measured again, it predicted" in calibration.reason


def test_more_sessions_that_win_twice_are_chosen_and_the_reason_says_so(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timings = NoisyTimings(0, {1: 2e-3, 2: 1.6e-3}, load=0.0, jitter=0.0)
    calibration = _auto_split(model, timings, monkeypatch)
    assert (calibration.sessions, calibration.threads) == (2, 1)
    assert timings.probes == [2, 1, 1, 2]
    assert "Measured again, in the other order" in calibration.reason


def test_choosing_from_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        _calibrate.choose([])


# ---------------------------------------------------------------------------------------------
# Pools


def test_an_auto_pool_splits_the_cores_as_measured_and_serves_like_plain_ort(
    model: Path, fast_switching: None
) -> None:
    cores = usable_cores()
    with sharedml.SessionPool(
        model, sessions="auto", batching=True, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
        assert isinstance(calibration, Calibration)
        assert calibration.decided and calibration.seconds > 0 and calibration.reason
        measured = [(c.sessions, c.threads, c.rows) for c in calibration.candidates]
        assert measured == [
            (sessions, threads, rows)
            for sessions, threads in _calibrate.candidate_splits(cores)
            for rows in (1, _calibrate.CALIBRATION_ROWS)
        ]
        for c in calibration.candidates:
            assert c.seconds_per_batch > 0
            assert c.rows_per_s == pytest.approx(c.sessions * c.rows / c.seconds_per_batch)
        # An MLP's batch of 8 rows adds next to nothing to a session's memory.
        assert calibration.batch_memory_share is not None
        assert calibration.batch_memory_share < _calibrate.BATCH_MEMORY_SHARE
        best, reason = _calibrate.choose(
            calibration.candidates, batch_memory_share=calibration.batch_memory_share
        )
        if calibration.repeated:  # more sessions won the first pass: they had to win again
            again, _ = _calibrate.choose(
                calibration.repeated, batch_memory_share=calibration.batch_memory_share
            )
            won = (again.sessions, again.threads) == (best.sessions, best.threads)
            expected = (
                (best.sessions, best.threads) if won else _calibrate.candidate_splits(cores)[0]
            )
            assert (calibration.sessions, calibration.threads) == expected
        else:
            assert (calibration.sessions, calibration.threads) == (best.sessions, best.threads)
            assert calibration.reason == reason
        assert calibration.max_batch_size is None and pool.batching is not None
        assert pool.batching.max_batch_size == sharedml.Batching().max_batch_size
        assert calibration.threads == cores // calibration.sessions
        if cores & (cores - 1) == 0:  # a power of two: every split is exact
            assert calibration.sessions * calibration.threads == cores
        # The pool holds what it chose, each session with the threads it chose.
        assert pool.max_sessions == pool.stats().sessions == calibration.sessions
        assert pool.stats().max_sessions == calibration.sessions
        with pool.session() as sess:
            assert sess.get_session_options().intra_op_num_threads == calibration.threads

        so = ort.SessionOptions()
        so.intra_op_num_threads = calibration.threads
        plain = ort.InferenceSession(str(model), so, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(3)
        xs = [rng.standard_normal((1 + i % 3, DIM)).astype(np.float32) for i in range(12)]
        for x, out in zip(xs, _at_once(pool, xs), strict=True):
            # Merged batches may take another kernel blocking than one request alone.
            np.testing.assert_allclose(out, plain.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", ["dynamic", "fixed-at-one"])
def test_probes_run_batches_of_the_calibration_rows_and_go_before_the_pools_sessions_come(
    tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    if shape == "fixed-at-one":  # served from its graph with axis 0 relaxed: probes are too
        model = fixed_at_one(model, tmp_path / "one.onnx")
    created: list[weakref.ref[Any]] = []
    alive_before: list[int] = []
    rows_run: list[list[int]] = []
    create = SessionRecipe.create_session

    def spy(self: SessionRecipe, **kwargs: Any) -> Any:
        alive_before.append(sum(ref() is not None for ref in created))
        sess = create(self, **kwargs)
        me = weakref.ref(sess)  # the spy must not keep the session alive itself
        created.append(me)
        rows: list[int] = []
        rows_run.append(rows)

        def counted(names: Any, feed: dict[str, Any], *args: Any) -> Any:
            rows.append(len(feed["x"]))
            return type(me()).run(me(), names, feed, *args)

        sess.run = counted
        return sess

    monkeypatch.setattr(SessionRecipe, "create_session", spy)
    with sharedml.SessionPool(
        model, sessions="auto", batching=True, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None
        # two batch sizes each, and the deciding splits again where more sessions won
        probes = (len(calibration.candidates) + len(calibration.repeated)) // 2
        assert calibration.decided == (usable_cores() > 1)
        # Each probe, and the pool's first session, found no earlier session alive.
        assert alive_before[: probes + 1] == [0] * (probes + 1)
        assert len(alive_before) == probes + calibration.sessions
        # Per probe: single rows, then the calibration batch, each twice to warm up; then
        # both in turn, at least twice each.
        for rows in rows_run[:probes]:
            assert rows[:4] == [1, 1, _calibrate.CALIBRATION_ROWS, _calibrate.CALIBRATION_ROWS]
            timed = rows[4:]
            assert len(timed) >= 4 and timed == [1, _calibrate.CALIBRATION_ROWS] * (len(timed) // 2)
        assert pool.run(None, {"x": np.ones((1, DIM), np.float32)})[0].shape == (1, DIM)


@pytest.mark.parametrize("pick", ["fewest sessions", "most sessions"])
def test_the_pool_creates_the_split_that_calibration_chose(
    model: Path, monkeypatch: pytest.MonkeyPatch, pick: str
) -> None:
    if usable_cores() == 1:
        pytest.skip("one core: a single split, nothing to choose")

    def forced(measured: Any, **_: Any) -> tuple[CalibrationCandidate, str]:
        batches = [c for c in measured if c.rows == _calibrate.CALIBRATION_ROWS]
        by_sessions = sorted(batches, key=lambda c: c.sessions)
        return (by_sessions[0] if pick == "fewest sessions" else by_sessions[-1]), "forced"

    monkeypatch.setattr(_calibrate, "choose", forced)
    with sharedml.SessionPool(
        model, sessions="auto", batching=True, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.reason.startswith("forced")
        sessions, threads = _calibrate.candidate_splits(usable_cores())[
            0 if pick == "fewest sessions" else -1
        ]
        assert (calibration.sessions, calibration.threads) == (sessions, threads)
        assert pool.max_sessions == pool.stats().sessions == sessions
        with contextlib.ExitStack() as held:  # every session, each with the chosen threads
            for _ in range(sessions):
                sess = held.enter_context(pool.session(timeout_s=DEADLINE_S))
                assert sess.get_session_options().intra_op_num_threads == threads


def test_calibration_stops_probing_at_its_bound_and_says_so(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if usable_cores() == 1:
        pytest.skip("one core: a single split, nothing to probe")
    monkeypatch.setattr(_calibrate, "HARD_LIMIT_S", 0.0)  # spent as soon as it starts
    with sharedml.SessionPool(model, sessions="auto", batching=True) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.decided
        assert calibration.time_budget_s == 0.0
        fewest = _calibrate.candidate_splits(usable_cores())[0]
        # Calibration's first Run, which nothing predicts, and nothing after it.
        assert [(c.sessions, c.threads, c.rows) for c in calibration.candidates] == [(*fewest, 1)]
        assert (calibration.sessions, calibration.threads) == fewest
        skipped = len(_calibrate.candidate_splits(usable_cores())) - 1
        assert calibration.skipped == (
            f"batches of {_calibrate.CALIBRATION_ROWS} rows on {fewest[1]} thread(s): a Run "
            f"predicted at "
            f"{calibration.candidates[0].seconds_per_batch * _calibrate.CALIBRATION_ROWS:.2g} s "
            "would have ended past the 0 s budget",
            f"{skipped} split(s) with more sessions: their probes would have ended past the 0 s "
            "budget",
        )
        assert "Not measured, to keep calibration's budgets: " in calibration.reason
        assert calibration.max_batch_size is None  # time, not memory: the setting stands
        assert pool.batching is not None
        assert pool.batching.max_batch_size == sharedml.Batching().max_batch_size
        assert pool.run(None, {"x": np.ones((1, DIM), np.float32)})[0].shape == (1, DIM)


def _image_model(path: Path, *, symbolic_size: bool = False) -> Path:
    """A convolution whose activations take about 2 MiB a row, over tiny weights."""
    conv_model(path, channels=32, size=96)
    if symbolic_size:
        changed = onnx.load(path)
        for value in (*changed.graph.input, *changed.graph.output):
            for axis in (2, 3):
                dim = value.type.tensor_type.shape.dim[axis]
                dim.Clear()
                dim.dim_param = "height" if axis == 2 else "width"
        save_model(changed, path)
    return path


@pytest.mark.parametrize(
    ("sizes", "rows_margin", "capped"),
    [
        ("fixed", 1e9, True),  # single rows always within the margin: capped
        ("fixed", -0.99, False),  # never within it: the batch stands
        ("symbolic", 1e9, False),  # within it, but the image size was guessed
    ],
)
def test_a_pool_runs_single_rows_only_where_a_costly_batch_measured_no_faster(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fast_switching: None,
    sizes: str,
    rows_margin: float,
    capped: bool,
) -> None:
    if usable_cores() == 1:
        pytest.skip("one core: nothing is measured")
    path = _image_model(tmp_path / "conv.onnx", symbolic_size=sizes == "symbolic")
    monkeypatch.setattr(_calibrate, "ROWS_MARGIN", rows_margin)
    # What this checks is the speed rule; the memory budget (its own tests) stays out of the way
    # (the batch's 8 rows of 2-3 MiB measured over 64 MiB once on a busy machine).
    monkeypatch.setattr(_calibrate, "PROBE_MEMORY_FLOOR", 2**30)
    with sharedml.SessionPool(
        path, sessions="auto", batching=True, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.decided
        # The first probe measured the batch's activations (8 rows of 2-3 MiB each) against a
        # session of 37 KiB of weights: far beyond the share that makes a batch costly.
        assert calibration.batch_memory_share is not None
        assert calibration.batch_memory_share > _calibrate.BATCH_MEMORY_SHARE
        assert pool.batching is not None
        if capped:
            assert calibration.max_batch_size == pool.batching.max_batch_size == 1
            assert "at most 1 row(s)" in calibration.reason
            assert "at most 1 row(s) per Run" in pool.batching_reason
        else:
            assert calibration.max_batch_size is None
            assert pool.batching.max_batch_size == sharedml.Batching().max_batch_size
            assert "row(s) per Run" not in pool.batching_reason

        plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(5)
        xs = [rng.standard_normal((1, 32, 96, 96)).astype(np.float32) for _ in range(8)]
        for x, out in zip(xs, _at_once(pool, xs), strict=True):
            np.testing.assert_allclose(out, plain.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)
        if capped:  # 8 callers at once, yet every Run held one row
            assert pool.stats().max_batch_rows == 1


def test_a_thread_count_in_sess_options_fixes_the_split(model: Path) -> None:
    template = ort.SessionOptions()
    template.intra_op_num_threads = 1
    with sharedml.SessionPool(model, sessions="auto", batching=True, sess_options=template) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and not calibration.decided
        assert calibration.candidates == ()
        assert (calibration.sessions, calibration.threads) == (usable_cores(), 1)
        assert "intra_op_num_threads=1" in calibration.reason
        assert pool.max_sessions == usable_cores()
        x = np.ones((2, DIM), np.float32)
        np.testing.assert_allclose(
            pool.run(None, {"x": x})[0],
            ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
                None, {"x": x}
            )[0],
            rtol=1e-5,
            atol=1e-6,
        )


def _softmax_over_rows(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=0)],
        "softmax0",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    return _graph_model(path, graph)


@pytest.mark.parametrize("case", ["rows-mixed", "batching-off"])
def test_a_pool_that_does_not_batch_takes_the_default_and_says_why(
    tmp_path: Path, model: Path, case: str
) -> None:
    if case == "rows-mixed":  # batching="auto": the analysis refuses Softmax over axis 0
        path, batching, x = _softmax_over_rows(tmp_path / "s.onnx"), "auto", np.eye(3, 4)
    else:
        path, batching, x = model, False, np.ones((3, DIM))
    feed = {"x": x.astype(np.float32)}
    with sharedml.SessionPool(path, sessions="auto", batching=batching) as pool:
        assert pool.batching is None
        calibration = pool.stats().calibration
        assert calibration is not None and not calibration.decided
        assert calibration.candidates == ()
        assert "does not merge requests" in calibration.reason
        assert calibration.sessions == pool.max_sessions == sharedml.pool.DEFAULT_SESSIONS
        assert calibration.threads == max(1, usable_cores() // sharedml.pool.DEFAULT_SESSIONS)
        plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(
            pool.run(None, feed)[0], plain.run(None, feed)[0], rtol=1e-5, atol=1e-6
        )


def test_a_probe_run_that_fails_takes_one_thread_sessions_and_says_why(tmp_path: Path) -> None:
    # Generated integers are 1; a table of one row has no row 1, so the probe's Gather fails,
    # while callers that send index 0 are served.
    table = numpy_helper.from_array(np.arange(4, dtype=np.float32).reshape(1, 4), "table")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)],
        "gather",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        initializer=[table],
    )
    path = _graph_model(tmp_path / "g.onnx", graph)
    with sharedml.SessionPool(path, sessions="auto", batching=True) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and not calibration.decided
        if usable_cores() > 1:
            assert "failed on 8 generated rows" in calibration.reason
            assert "out of data bounds" in calibration.reason
        assert (calibration.sessions, calibration.threads) == (usable_cores(), 1)
        out = pool.run(None, {"ids": np.zeros(3, np.int64)})[0]
        np.testing.assert_array_equal(out, np.tile(np.arange(4, dtype=np.float32), (3, 1)))


def test_inputs_that_cannot_be_generated_take_one_thread_sessions_and_say_why(
    tmp_path: Path,
) -> None:
    graph = helper.make_graph(  # no shape, not even a rank: nothing to generate from
        [helper.make_node("Relu", ["x"], ["y"])],
        "noshape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    path = _graph_model(tmp_path / "n.onnx", graph)
    batching = sharedml.Batching(rows_independent=True)
    with sharedml.SessionPool(path, sessions="auto", batching=batching) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and not calibration.decided
        if usable_cores() > 1:
            assert "inputs could not be generated" in calibration.reason
        assert (calibration.sessions, calibration.threads) == (usable_cores(), 1)
        x = np.array([[-1.0, 2.0]], np.float32)
        np.testing.assert_array_equal(pool.run(None, {"x": x})[0], [[0.0, 2.0]])


def test_serialized_runs_take_one_session_and_say_why(model: Path) -> None:
    with sharedml.SessionPool(model, sessions="auto", batching=True, serialize_runs=True) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and not calibration.decided
        assert "serialized" in calibration.reason
        assert calibration.sessions == pool.max_sessions == 1
        assert calibration.threads == usable_cores()
        assert pool.run(None, {"x": np.ones((2, DIM), np.float32)})[0].shape == (2, DIM)


def test_another_provider_keeps_its_default_without_measuring(model: Path) -> None:
    # No GPU here: the CPU pool's recipe, planned as if for CUDA. calibrate() decides from the
    # plan alone, before it creates anything.
    with sharedml.SessionPool(model, sessions=1, batching=True) as pool:
        cuda = plan_providers(
            ["CUDAExecutionProvider"], available=["CUDAExecutionProvider", "CPUExecutionProvider"]
        )
        recipe = dataclasses.replace(pool.recipe, plan=cuda, intra_op_threads=None)
        calibration = _calibrate.calibrate(
            recipe, batching=pool.batching, serialized=False, default_sessions=4
        )
        assert pool.stats().calibration is None  # a pool given a number
    assert not calibration.decided and calibration.candidates == ()
    assert (calibration.sessions, calibration.threads) == (4, None)
    assert "CPU provider only" in calibration.reason
    assert "CUDAExecutionProvider" in calibration.reason


@pytest.mark.parametrize(
    ("sessions", "error"),
    [("Auto", TypeError), ("", TypeError), (b"auto", TypeError), (2.0, TypeError),
     (0, ValueError), (-1, ValueError), (True, ValueError)],
)  # fmt: skip
def test_bad_session_counts_are_refused_before_anything_is_prepared(
    tmp_path: Path, sessions: object, error: type[Exception]
) -> None:
    missing = tmp_path / "missing.onnx"  # a check that came later would say the file is missing
    with pytest.raises(error, match=r"sessions must be an integer .*or 'auto'"):
        sharedml.SessionPool(missing, sessions=sessions)


@pytest.mark.parametrize(
    "bounds", [{"min_sessions": 1}, {"max_sessions": 4}, {"min_sessions": 1, "max_sessions": 4}]
)
def test_auto_with_min_or_max_sessions_is_refused_naming_both(
    tmp_path: Path, bounds: dict[str, int]
) -> None:
    with pytest.raises(ValueError, match="sessions='auto' with") as raised:
        sharedml.SessionPool(tmp_path / "missing.onnx", sessions="auto", **bounds)
    for name, value in bounds.items():
        assert f"{name}={value}" in str(raised.value)


def test_cores_given_to_the_pool_are_what_it_splits_and_divides(model: Path) -> None:
    with sharedml.SessionPool(
        model, sessions="auto", batching=True, cores=3, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.decided
        assert {(c.sessions, c.threads) for c in calibration.candidates} == set(
            _calibrate.candidate_splits(3)
        )
    pool = sharedml.SessionPool(model, sessions=2, cores=6, create_in_background=False)
    with pool, pool.session() as sess:
        assert sess.get_session_options().intra_op_num_threads == 3


@pytest.mark.parametrize(
    ("cores", "error"), [(0, ValueError), (-2, ValueError), (True, ValueError), (2.0, TypeError)]
)
def test_bad_core_counts_are_refused_before_anything_is_prepared(
    tmp_path: Path, cores: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match="cores must be an integer"):
        sharedml.SessionPool(tmp_path / "missing.onnx", cores=cores)


# ---------------------------------------------------------------------------------------------
# Budgets: a slow model and an activation-heavy one


def _slow_model(path: Path, *, trips: int = 20000, dim: int = 256) -> Path:
    """y = Loop(trips) { h = tanh(h @ W) }: long Runs (each row ``trips`` MatMuls) over 256 KiB."""
    w = (np.random.default_rng(0).standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "w"], ["m"]),
            helper.make_node("Tanh", ["m"], ["h_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_in", TensorProto.FLOAT, ["batch", dim]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("h_out", TensorProto.FLOAT, ["batch", dim]),
        ],
    )
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "x"], ["y"], body=body)],
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim])],
        [
            numpy_helper.from_array(np.array(trips, np.int64), "trips"),
            numpy_helper.from_array(w, "w"),
        ],
    )
    return _graph_model(path, graph)


def test_a_slow_model_is_calibrated_within_the_time_budget_and_says_what_it_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A model whose one-row Run took 4.9 s made its pool ready after 48.5 s: the first probe
    # ran every warm-up and timed Run whatever they cost.
    if usable_cores() == 1:
        pytest.skip("one core: nothing is measured")
    path = _slow_model(tmp_path / "slow.onnx")
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.ones((1, 256), np.float32)
    one_row = []
    for _ in range(3):
        began = time.perf_counter()
        plain.run(None, {"x": x})
        one_row.append(time.perf_counter() - began)
    del plain
    # A budget of three single-row Runs (the fastest seen here): single rows fit, a batch of
    # 8 rows (predicted at 8 single rows, an upper bound) cannot, whatever this machine's speed.
    budget = 3 * min(one_row)
    monkeypatch.setattr(_calibrate, "HARD_LIMIT_S", budget)
    with sharedml.SessionPool(
        path, sessions="auto", batching=True, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.decided
        assert calibration.time_budget_s == budget
        rows = _calibrate.CALIBRATION_ROWS
        assert all(c.rows == 1 for c in calibration.candidates)  # no batch Run was started
        fewest = _calibrate.candidate_splits(usable_cores())[0]
        assert calibration.skipped[0].startswith(
            f"batches of {rows} rows on {fewest[1]} thread(s): a Run predicted at "
        )
        assert calibration.skipped[0].endswith(f"would have ended past the {budget:g} s budget")
        assert "Not measured, to keep calibration's budgets" in calibration.reason
        # Time is no reason to cap the batch: the pool's setting stands, and it batches.
        assert calibration.max_batch_size is None and pool.batching is not None
        out = pool.run(None, {"x": x})[0]
    np.testing.assert_allclose(
        out, ort.InferenceSession(str(path)).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6
    )


def _activation_heavy_model(path: Path, *, width: int = 1024, fan: int = 12800) -> Path:
    """x[N, 1024] -> an outer product with a [1, 12800] row -> Relu -> sum: [N, 1024].

    About 50 MiB of activations a row (``width * fan`` floats, twice) over 50 KiB of weights.
    """
    w = np.random.default_rng(0).standard_normal((1, fan)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["x", "axis2"], ["col"]),
            helper.make_node("MatMul", ["col", "w"], ["outer"]),
            helper.make_node("Relu", ["outer"], ["r"]),
            helper.make_node("ReduceSum", ["r", "axis2"], ["y"], keepdims=0),
        ],
        "heavy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])],
        [
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        ],
    )
    return _graph_model(path, graph)


def test_an_activation_heavy_model_probes_no_batch_past_the_memory_budget(
    tmp_path: Path,
) -> None:
    # ~100 MiB of activations a row once took calibration to 1.13 GiB for an 8-row batch,
    # against 306 MiB for sessions=2, and it then picked single rows anyway.
    if usable_cores() == 1:
        pytest.skip("one core: nothing is measured")
    path = _activation_heavy_model(tmp_path / "heavy.onnx")
    with sharedml.SessionPool(
        path, sessions="auto", batching=True, create_in_background=False
    ) as pool:
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.decided
        assert calibration.memory_budget_bytes is not None
        rows = _calibrate.CALIBRATION_ROWS
        probed = max(c.rows for c in calibration.candidates)
        assert probed < rows
        (memory,) = [s for s in calibration.skipped if "a probe's batch may add" in s]
        assert memory.startswith(f"batches of {rows} rows: one row's activations took ")
        # What the budget allowed is what the pool may merge: no Run holds more rows.
        assert calibration.max_batch_size is not None and calibration.max_batch_size <= probed
        assert pool.batching is not None
        assert pool.batching.max_batch_size == calibration.max_batch_size
        assert f"at most {calibration.max_batch_size} row(s) per Run" in pool.batching_reason


_PEAK = """
import json, resource, sys
import numpy as np, psutil
import sharedml
sharedml.SessionPool  # the modules load lazily: before the baseline
model, sessions = sys.argv[1], sys.argv[2]
x = np.ones((1, 1024), np.float32)
base = psutil.Process().memory_info().rss
with sharedml.SessionPool(
    model, sessions="auto" if sessions == "auto" else int(sessions), batching=True
) as pool:
    pool.wait_ready()
    for _ in range(3):  # steady state: ORT allocates a shape's planned memory on its 2nd Run
        pool.run(None, {"x": x})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
print(json.dumps({"grown": peak - base}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB: Linux")
def test_an_auto_pool_of_an_activation_heavy_model_peaks_about_as_a_fixed_one(
    tmp_path: Path,
) -> None:
    """Fresh processes: the peak of building an auto pool and serving single rows, against a
    pool of 2 sessions doing the same."""
    if usable_cores() == 1:
        pytest.skip("one core: nothing is measured")
    path = _activation_heavy_model(tmp_path / "heavy.onnx")
    with sharedml.SessionPool(path, sessions=1, batching=True) as warm:  # cache entries, built
        warm.run(None, {"x": np.ones((1, 1024), np.float32)})

    def peak(sessions: str) -> int:
        out = subprocess.run(
            [sys.executable, "-c", _PEAK, str(path), sessions],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return int(json.loads(out.stdout.strip().splitlines()[-1])["grown"])

    fixed, auto = peak("2"), peak("auto")
    print(f"peak growth: sessions=2 {fixed / 2**20:.0f} MiB, auto {auto / 2**20:.0f} MiB")
    # Before the budget: an 8-row probe batch of ~100 MiB a row, several times the fixed
    # pool's peak (131 MiB for both here since).
    assert auto < 1.5 * fixed


def test_no_session_of_this_process_is_created_while_the_probe_reads_memory(
    tmp_path: Path, model: Path
) -> None:
    """The first probe reads what its session and its rows add to the process's memory: another
    pool's session created meanwhile would read as theirs. It waits, then goes ahead."""
    sharedml.SessionPool(model, batching=True, cache_dir=tmp_path / "c").close()  # prepared
    with (
        another_pool_opening(tmp_path, width=DIM) as overlapped,
        sharedml.SessionPool(
            model, sessions="auto", batching=True, cache_dir=tmp_path / "c"
        ) as pool,
    ):
        assert pool.stats().calibration is not None
    assert overlapped == [False]
