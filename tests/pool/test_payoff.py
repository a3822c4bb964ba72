"""Whether merging pays, decided on its own: comparisons and trials on a fake clock."""

from __future__ import annotations

import pytest

from sharedml.pool import _payoff
from sharedml.pool._payoff import Comparison, MergeGain, MergeState


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def merging(clock: Clock, *, side_by_side: int | None = 8) -> MergeGain:
    """A MergeGain that decided to merge: merged rows cost a quarter of solo rows' Run time."""
    gain = MergeGain(side_by_side=side_by_side, clock=clock)
    for _ in range(_payoff.WARM_RUNS + _payoff.SAMPLES):
        gain.add(Comparison(merged_seconds=1e-2, merged_rows=4, solo_seconds=1e-2, solo_rows=1))
    assert gain.state is MergeState.MERGING
    return gain


def phase(
    gain: MergeGain, clock: Clock, per_row_s: float, *, requests: int | None = None
) -> list[str | None]:
    """Requests of one row arriving now and each getting its result ``per_row_s`` later."""
    changes = []
    n = _payoff.TRIAL_SETTLE + (requests if requests is not None else _payoff.TRIAL_REQUESTS)
    step = max(_payoff.TRIAL_MIN_S / n, 1e-4) * 1.01
    for _ in range(n):
        arrived = clock.now
        clock.now += per_row_s
        changes.append(gain.observe(arrived, 1))
        clock.now += step
    return changes


def test_a_decision_to_merge_is_tried_against_requests_side_by_side() -> None:
    clock = Clock()
    gain = merging(clock)
    assert gain.trial == "merged" and not gain.runs_side_by_side and gain.merges()
    phase(gain, clock, per_row_s=0.2)
    assert gain.trial == "side" and gain.runs_side_by_side and not gain.merges()
    changes = phase(gain, clock, per_row_s=0.2 / (_payoff.TRIAL_MARGIN * 1.05))
    assert gain.state is MergeState.PAUSED and gain.trial is None and gain.runs_side_by_side
    (change,) = [c for c in changes if c is not None]
    assert change.startswith("merging paused: requests run side by side got their results in")
    assert "up to 8 on a session" in change and gain.pauses == 1


@pytest.mark.parametrize("side_per_row_s", [0.2, 0.2 / _payoff.TRIAL_MARGIN * 1.01, 0.5])
def test_merging_goes_on_where_side_by_side_is_not_clearly_faster(side_per_row_s: float) -> None:
    clock = Clock()
    gain = merging(clock)
    phase(gain, clock, per_row_s=0.2)
    assert not [c for c in phase(gain, clock, per_row_s=side_per_row_s) if c is not None]
    assert gain.state is MergeState.MERGING and gain.trial is None and gain.merges()


@pytest.mark.parametrize("faster", [1.06, 1.08, 1.15])
def test_side_by_side_faster_by_more_than_the_defaults_tolerance_pauses_merging(
    faster: float,
) -> None:
    # The default pool may trail its best alternative by 5% at most: side by side serving
    # more than that must not leave the pool merging.
    clock = Clock()
    gain = merging(clock)
    phase(gain, clock, per_row_s=0.2)
    phase(gain, clock, per_row_s=0.2 / faster)
    assert gain.state is MergeState.PAUSED and gain.runs_side_by_side


def test_a_phase_counts_only_requests_that_arrived_within_it() -> None:
    clock = Clock()
    gain = merging(clock)
    early = clock.now - 1.0  # arrived before the trial: slow, from before merging was decided
    for _ in range(10 * _payoff.TRIAL_REQUESTS):
        assert gain.observe(early, 1) is None
    assert gain.trial == "merged"
    phase(gain, clock, per_row_s=0.2)
    before_side = clock.now - 1e-3  # arrived while merging, answered in the side phase
    for _ in range(10 * _payoff.TRIAL_REQUESTS):
        gain.observe(before_side, 1)
    assert gain.trial == "side"
    phase(gain, clock, per_row_s=0.1)
    assert gain.state is MergeState.PAUSED


def test_a_phase_lasts_its_requests_and_its_seconds() -> None:
    clock = Clock()
    gain = merging(clock)
    for _ in range(_payoff.TRIAL_SETTLE + _payoff.TRIAL_REQUESTS - 1):  # time, a request short
        clock.now += 1.0
        gain.observe(clock.now - 0.5, 1)
    assert gain.trial == "merged"
    gain = merging(clock)
    for _ in range(5 * _payoff.TRIAL_REQUESTS):  # requests enough, no time
        gain.observe(clock.now, 1)
        clock.now += 1e-9
    assert gain.trial == "merged"
    clock.now += _payoff.TRIAL_MIN_S
    gain.observe(clock.now, 1)
    assert gain.trial == "side"


def test_each_later_trial_that_pauses_merging_waits_twice_as_long_then_tries_again() -> None:
    clock = Clock()
    gain = merging(clock)
    retries = []
    for _ in range(3):
        phase(gain, clock, per_row_s=0.2)
        phase(gain, clock, per_row_s=0.05)
        assert gain.state is MergeState.PAUSED
        runs = 0
        while not gain.merges():  # paused: solo leaders until merging is measured again
            runs += 1
        retries.append(runs + 1)
        # Measured again by a trial, not a probe: merged Runs beat serial solo ones here, and a
        # probe would only merge again until the trial after it.
        assert gain.state is MergeState.MERGING and gain.trial == "merged"
        assert not gain.deciding and not gain.wants_comparison(4)
    assert retries == [
        _payoff.FIRST_RETRY_RUNS,
        2 * _payoff.FIRST_RETRY_RUNS,
        4 * _payoff.FIRST_RETRY_RUNS,
    ]


def test_pools_whose_sessions_run_one_request_at_a_time_never_try() -> None:
    clock = Clock()
    gain = merging(clock, side_by_side=None)
    assert gain.trial is None
    assert all(c is None for c in phase(gain, clock, per_row_s=0.2))
    assert gain.state is MergeState.MERGING and not gain.runs_side_by_side


def test_a_phase_measures_once_its_first_requests_finished() -> None:
    # The first runs side by side grow the arena for their concurrent runs: slow, once.
    clock = Clock()
    gain = merging(clock)
    phase(gain, clock, per_row_s=0.2)
    assert gain.trial == "side"
    for _ in range(_payoff.TRIAL_SETTLE):
        arrived = clock.now
        clock.now += 5.0
        assert gain.observe(arrived, 1) is None
    phase(gain, clock, per_row_s=0.1, requests=_payoff.TRIAL_REQUESTS - _payoff.TRIAL_SETTLE)
    assert gain.state is MergeState.PAUSED


def test_a_side_phase_plainly_slower_than_merging_ends_early() -> None:
    clock = Clock()
    gain = merging(clock)
    phase(gain, clock, per_row_s=0.01)
    assert gain.trial == "side"
    phase(gain, clock, per_row_s=0.01 * _payoff.TRIAL_LOSING * 1.5, requests=_payoff.TRIAL_SETTLE)
    assert gain.trial is None and gain.state is MergeState.MERGING and gain.merges()


def batches_until_a_trial(gain: MergeGain) -> int:
    """Merged batches (leaders that merge) until the next trial begins."""
    batches = 0
    while gain.trial is None:
        assert gain.merges() and gain.state is MergeState.MERGING
        batches += 1
        assert batches <= 2 * _payoff.MAX_RETRY_RUNS, "no trial came"
    return batches


def test_a_trial_that_kept_merging_is_made_again_ever_later_until_one_pauses() -> None:
    # One phase measured on a session still warming up must not decide for the pool's life.
    clock = Clock()
    gain = merging(clock)
    gaps = []
    for slower in (0.3, 0.2 * _payoff.TRIAL_LOSING * 1.5, 0.25):
        phase(gain, clock, per_row_s=0.2)
        phase(gain, clock, per_row_s=slower)  # side by side loses (the second: plainly)
        assert gain.trial is None and gain.state is MergeState.MERGING
        gaps.append(batches_until_a_trial(gain))
        assert gain.trial == "merged"
    first = _payoff.TRIAL_AGAIN_BATCHES
    assert gaps == [first, 2 * first, 4 * first] and gain.trials == 4
    phase(gain, clock, per_row_s=0.2)
    phase(gain, clock, per_row_s=0.1)  # the traffic changed: side by side now wins
    assert gain.state is MergeState.PAUSED and gain.pauses == 1


def test_trials_are_not_made_again_where_they_cannot_win() -> None:
    clock = Clock()
    gain = merging(clock, side_by_side=None)
    for _ in range(4 * _payoff.TRIAL_AGAIN_BATCHES):
        assert gain.merges() and gain.trial is None


def test_a_gain_over_solo_runs_past_the_cores_is_not_tried_against_side_by_side() -> None:
    # Requests side by side serve at most `cores` times a solo run's rows/s: merged batches
    # 4x faster a row than solo runs cannot lose to them on 2 cores, and can on 8.
    clock = Clock()
    gain = MergeGain(side_by_side=8, cores=2, clock=clock)
    for _ in range(_payoff.WARM_RUNS + _payoff.SAMPLES):
        gain.add(Comparison(merged_seconds=1e-2, merged_rows=4, solo_seconds=1e-2, solo_rows=1))
    assert gain.state is MergeState.MERGING and gain.gain == pytest.approx(4.0)
    assert gain.trial is None
    gain = MergeGain(side_by_side=8, cores=8, clock=clock)
    for _ in range(_payoff.WARM_RUNS + _payoff.SAMPLES):
        gain.add(Comparison(merged_seconds=1e-2, merged_rows=4, solo_seconds=1e-2, solo_rows=1))
    assert gain.trial == "merged"
