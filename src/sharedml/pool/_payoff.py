"""Whether merging requests pays: merged batches' ``Run`` time against solo runs of theirs.

Merging pays where one ``Run`` of n rows costs less than n runs of one row: a MatMul-bound
model reads its weights once for every row of a batch (the 100 MiB MLP served 4.4x the
requests at 16 callers). Where a model's kernels are already busy at one row (convolutions on
a few cores) a batch of n rows costs n single rows, and merging then only adds its costs: the
wait for rows, the merge and split, the callers' hand-offs, a larger arena (real CNN
classifiers, 16 callers of one row: 357-500 requests/s merged against 440-462 unmerged).

No rule of thumb tells the two apart (the same transformer gained 4% from 8-row batches at 128
tokens and 15-34% at 32), so the pool measures it on its own traffic: a merged batch's
``Run`` time against solo runs of some of its requests, made right after it on the same
session (the defence-in-depth checks already make such runs; while a decision is pending,
one request of every merged batch is rerun alone for its time). The *gain* of a set of
comparisons is the time the solo runs predict for the merged rows over the time the merged
runs took (rows/s merged over rows/s alone, per Run second of a session).

:class:`MergeGain` decides, with hysteresis so that noise cannot flap it:

- **Measuring** (from the start): every merged batch is compared, until :data:`SAMPLES`
  comparisons; a gain under :data:`PAUSE_BELOW` pauses merging, else it goes on. Not counted:
  the first :data:`WARM_RUNS` merged Runs of each row count (ORT plans and allocates a new
  shape's memory then), and solo runs under :data:`MIN_RUN_S` a row, which time the threads
  around them more than the model: :data:`SAMPLES` of those decide to merge.
- **Merging**: the checks' solo runs keep comparing (at most every ``check_within`` batches);
  a window of the last :data:`SAMPLES` whose gain falls under :data:`PAUSE_BELOW` pauses.
- **Paused**: leaders run their own request alone and take no followers (where sessions run
  requests side by side, several such leaders share a session). After
  :data:`FIRST_RETRY_RUNS` such runs (doubling after each retry that failed, up to
  :data:`MAX_RETRY_RUNS`) merging is tried again: **probing** compares every merged batch
  until :data:`SAMPLES` comparisons, and merging resumes only where their gain reaches
  :data:`RESUME_AT` (more than it takes to pause: the hysteresis); else it pauses again.

Where sessions can run requests side by side (a CPU session's ``Run`` is thread-safe), serial
solo runs are not the alternative to merging: ORT spreads requests run at once over the
session's threads. A transformer whose merged batches of 15 rows took 2.3x less Run time per
row than a request alone served fewer requests (343/s) than the same session running the 16
callers' requests side by side (437/s, 16 cores). Rerunning a batch side by side to time it
doubles the work while deciding (on 2 cores the decision then outlasted a 3 s window), so such
pools measure the traffic itself instead: a **trial** follows each decision to merge, one
phase merging and one side by side, each measured once :data:`TRIAL_SETTLE` of its requests
finished, over at least :data:`TRIAL_REQUESTS` requests and :data:`TRIAL_MIN_S`, counting only
requests that arrived within the measured part; the mean time
from a request's arrival to its result, per row, decides (for callers that wait for their
results, as many at a time, that is the inverse of rows/s). Side by side wins only where it is
:data:`TRIAL_MARGIN` faster; merging then pauses as above, and each later trial that pauses it
doubles the runs until merging is measured again, and measures it again by another trial,
not by probing (solo runs one after another are not what such a pool's requests would do). A
trial that keeps merging is made again after :data:`TRIAL_AGAIN_BATCHES` merged batches, twice
as many after each such trial: one phase measured on a session still warming up, or on
traffic that changed since, does not decide for the pool's life (on 16 cores, one default
MiniLM-like pool kept merging at 278 requests/s where another paused it and served 319, and
side by side served 384-408).

Thread safety: none of its own; the scheduler calls it with its lock held.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections import deque
from collections.abc import Callable

__all__ = [
    "FIRST_RETRY_RUNS",
    "MAX_RETRY_RUNS",
    "MIN_RUN_S",
    "PAUSE_BELOW",
    "RESUME_AT",
    "SAMPLES",
    "TRIAL_AGAIN_BATCHES",
    "TRIAL_LOSING",
    "TRIAL_MARGIN",
    "TRIAL_MIN_S",
    "TRIAL_REQUESTS",
    "TRIAL_SETTLE",
    "WARM_RUNS",
    "Comparison",
    "MergeGain",
    "MergeState",
]

# Merging pauses where merged batches serve less than this many times the rows/s of solo runs
# (per Run second). Above 1 because merging has costs outside Run: the wait for rows, the
# callers' hand-offs, the split and copies of outputs, the arena a batch grows.
PAUSE_BELOW = 1.15
# ... and resumes only at this gain or more: between the two, the pool keeps what it does.
RESUME_AT = 1.3
SAMPLES = 6  # comparisons a decision rests on: one merged Run each, against its solo reruns
# Merged Runs of a row count not compared until this many ran: ORT plans a new shape's memory
# on its first Run and allocates the plan on the second, which a small model's first merged
# Runs of 2 rows took 2-4x longer for than the solo runs of an old shape after them.
WARM_RUNS = 2
# Solo runs shorter than this (seconds a row) are not compared: a Run of tens of microseconds
# is timed through the hand-offs of the threads around it (a tiny model's merged Runs of 2 rows
# timed 3-4x its solo Runs in the scheduler, 1.3x when run back to back), and there merging
# pays mostly outside Run, in the pool's per-request work it saves. After SAMPLES of them the
# decision is to merge.
MIN_RUN_S = 0.5e-3
FIRST_RETRY_RUNS = 256  # solo runs while paused before merging is measured again
# A trial's phases (merging, then side by side): requests that arrived within the phase and got
# their results, and seconds, at least; side by side must take this much less time per row.
TRIAL_REQUESTS = 64
TRIAL_MIN_S = 0.5
# Not more than the 5% by which the default may trail its best alternative: at 1.1 a pool
# whose requests side by side served up to 10% more kept merging, and a noisy host reads a
# 15% difference as under 10% in some trials (a 16-core MiniLM-like pool merged throughout at
# 286 requests/s against 329 side by side). Measured with benchmarks/trial_sim.py
# (docs/batching.md).
TRIAL_MARGIN = 1.05
# Requests a phase lets finish before it measures: the first runs side by side grow the arena
# and plan memory for their concurrent runs (on 16 cores a MiniLM-like model's side phase,
# measured from its first request, lost to merging that a warm session beat by 1.3x).
TRIAL_SETTLE = 16
# A side phase this many times slower a row than merging, over TRIAL_SETTLE measured requests,
# ends there: merging wins plainly (the MLP's side phase ran at a fifth of its merged rate, and
# took a tenth of a 3 s benchmark window at full length).
TRIAL_LOSING = 2.0
MAX_RETRY_RUNS = 16384  # the most, after retries that found merging still unpaid
# Merged batches after a trial that kept merging before the next trial (doubling after each
# such trial, up to MAX_RETRY_RUNS). Where merging wins plainly a trial costs its side phase's
# TRIAL_SETTLE settling and TRIAL_SETTLE measured requests (TRIAL_LOSING then ends it), against
# the 32 merged batches before it (about 500 requests at 16 callers), a share that halves with
# each retrial. At 256, a 16-core MiniLM-like pool whose first trial kept merging (0.78x of a
# plain session) merged for 15 s before the next; at 32 the next came within 2 s and paused.
TRIAL_AGAIN_BATCHES = 32


class MergeState(enum.Enum):
    """Where :class:`MergeGain` stands."""

    MEASURING = "measuring"
    MERGING = "merging"
    PAUSED = "paused"
    PROBING = "probing"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One merged ``Run`` against solo runs of some of its requests, on the same session.

    Attributes:
        merged_seconds: The merged ``Run`` (with the merge of its feeds).
        merged_rows: The rows it held (padding not counted).
        solo_seconds: The solo runs, together.
        solo_rows: The rows they held.
    """

    merged_seconds: float
    merged_rows: int
    solo_seconds: float
    solo_rows: int


def gain_of(comparisons: list[Comparison] | deque[Comparison]) -> float | None:
    """Rows/s merged over rows/s alone; None without a usable comparison.

    The solo runs' time per row, times the merged rows, over the merged runs' time.
    """
    merged = sum(c.merged_seconds for c in comparisons)
    predicted = sum(c.solo_seconds / c.solo_rows * c.merged_rows for c in comparisons)
    return predicted / merged if merged > 0 and predicted > 0 else None


class MergeGain:
    """Decides from comparisons whether a pool's leaders take followers (see the module).

    Args:
        enabled: False: never pauses (``Batching(measure_gain=False)``); comparisons that
            the checks give are still recorded.
        side_by_side: The most requests a session runs side by side while merging is
            paused (the reason says so); None: one at a time.
        cores: The cores those requests share: a gain over solo runs of this many times (and
            the trial's margin) is not tried against them. None: always tried.
        clock: What times the trial's phases (tests give a fake one).
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        side_by_side: int | None = None,
        cores: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self.side_by_side = side_by_side
        self._cores = cores
        self._now = clock
        # The trial (side_by_side pools): the phase measured ("merged", "side") or None; when
        # it began; its requests still to settle; seconds from arrival to result and rows of
        # the requests measured, and how many.
        self.trial: str | None = None
        self._began = 0.0
        self._settling = 0
        self._seconds = 0.0
        self._rows = 0
        self._requests = 0
        self._merged_per_row = 0.0
        self._trial_retry = 0  # runs paused after the last trial that paused merging
        self._trial_again = 0  # merged batches after the last trial that kept merging
        self._until_trial = 0  # merged batches left until the next trial (0: none due)
        self._trial_paused = False  # the last pause was a trial's: its retry is a trial
        self.state = MergeState.MEASURING if enabled else MergeState.MERGING
        self.window: deque[Comparison] = deque(maxlen=SAMPLES)
        self.comparisons = 0  # over the pool's life
        self.pauses = 0
        self.trials = 0  # trials begun (merging, then side by side)
        self.gain: float | None = None  # of the window, as last decided on
        self._alone = 0  # solo runs since merging paused
        self._shapes: dict[int, int] = {}  # merged Runs seen per row count (WARM_RUNS)
        self._short = 0  # comparisons of solo runs under MIN_RUN_S, since the last decision
        self._retry = FIRST_RETRY_RUNS

    def merges(self) -> bool:
        """Whether a leader takes followers now; a paused pool counts the lead as alone.

        Call once per leader that could merge.
        """
        if self.trial == "side":
            return False
        if self.state is not MergeState.PAUSED:
            if self._until_trial and self.trial is None and self.state is MergeState.MERGING:
                self._until_trial -= 1
                if not self._until_trial:
                    self._try_side_by_side()
            return True
        self._alone += 1
        if self._alone < self._retry:
            return False
        if self._trial_paused:
            # Side by side beat merging on the traffic: measure the two again the same way.
            # A probe would compare merged runs with serial solo ones, which merging wins here
            # by design, and merge again until the trial after it paused once more: on 16
            # cores each such round cost a MiniLM-like pool a second at 0.6-0.8x its rate.
            self._merging()
            return True
        self.state = MergeState.PROBING  # measure again on the traffic of now
        self.window.clear()
        return True

    @property
    def runs_side_by_side(self) -> bool:
        """Whether requests run side by side now: merging paused, or a trial's second phase."""
        return self.state is MergeState.PAUSED or self.trial == "side"

    def observe(self, arrived: float, rows: int) -> str | None:
        """A request that arrived at ``arrived`` (the clock's) got its result now.

        Returns a sentence where a trial paused merging, else None.
        """
        if self.trial is None or arrived < self._began:
            return None
        now = self._now()
        if self._settling:
            self._settling -= 1
            if not self._settling:
                self._began = now  # measured from here: requests that arrive from now on
            return None
        self._seconds += now - arrived
        self._rows += rows
        self._requests += 1
        per_row = self._seconds / self._rows
        if (
            self.trial == "side"
            and self._requests >= TRIAL_SETTLE
            and per_row > TRIAL_LOSING * self._merged_per_row
        ):
            self.trial = None  # plainly slower than merging: no need to measure it longer
            self._kept_merging()
            return None
        if self._requests < TRIAL_REQUESTS or now - self._began < TRIAL_MIN_S:
            return None
        if self.trial == "merged":
            self._merged_per_row = per_row
            self._begin("side")
            return None
        self.trial = None
        merged = self._merged_per_row
        if per_row * TRIAL_MARGIN > merged or self.state is not MergeState.MERGING:
            self._kept_merging()
            return None
        self._pause(by_trial=True)
        self._trial_again = 0  # side by side won: a later decision to merge starts afresh
        # Probes that resume merging start their retries afresh; trials keep their own count.
        self._trial_retry = (
            min(MAX_RETRY_RUNS, self._trial_retry * 2) if self._trial_retry else FIRST_RETRY_RUNS
        )
        self._retry = self._trial_retry
        return self._paused_text(
            f"requests run side by side got their results in {per_row * 1e3:.1f} ms a row, "
            f"against {merged * 1e3:.1f} ms merged ({TRIAL_REQUESTS}+ requests each, one "
            f"after the other)"
        )

    def _begin(self, phase: str | None) -> None:
        if phase == "merged":
            self.trials += 1
        self.trial = phase
        self._began = self._now()
        self._settling = TRIAL_SETTLE
        self._seconds, self._rows, self._requests = 0.0, 0, 0

    def _merging(self) -> None:
        """Merging decided on (again): where requests could run side by side, try that too."""
        self.state = MergeState.MERGING
        self._try_side_by_side()

    def _try_side_by_side(self) -> None:
        """Begin a trial, where requests could run side by side and might serve more."""
        self._until_trial = 0
        if self.side_by_side is None:
            return
        # Requests side by side serve at most ``cores`` times the rows/s of one alone (a run
        # keeps its calling thread busy throughout): a gain over solo runs past that, with the
        # margin, cannot lose to them, and the trial would only cost its side phase.
        if self._cores and self.gain is not None and self.gain >= self._cores * TRIAL_MARGIN:
            return
        self._begin("merged")

    def _kept_merging(self) -> None:
        """A trial kept merging: the next one comes after twice the merged batches of the last."""
        if self.state is not MergeState.MERGING:
            return
        gap = self._trial_again * 2 if self._trial_again else TRIAL_AGAIN_BATCHES
        self._trial_again = self._until_trial = min(MAX_RETRY_RUNS, gap)

    @property
    def deciding(self) -> bool:
        """Whether a decision is pending (measuring at first, or probing after a pause)."""
        return self.state in (MergeState.MEASURING, MergeState.PROBING)

    def wants_comparison(self, rows: int) -> bool:
        """Whether a merged batch of ``rows`` rows should be compared where no check is due.

        Not while the shape's first Runs are not compared (:data:`WARM_RUNS`): those count
        their own Runs here.
        """
        if not self.deciding:
            return False
        seen = self._shapes.get(rows, 0)
        if seen < WARM_RUNS:
            self._shapes[rows] = seen + 1
            return False
        return True

    def add(self, comparison: Comparison) -> str | None:
        """Record a comparison; returns a sentence where the decision changed, else None."""
        if comparison.merged_rows < 2 or comparison.solo_rows < 1:
            return None
        if comparison.merged_seconds <= 0 or comparison.solo_seconds <= 0:
            return None
        seen = self._shapes.get(comparison.merged_rows, 0)
        if seen < WARM_RUNS:  # a shape's first Runs plan and allocate its memory
            self._shapes[comparison.merged_rows] = seen + 1
            return None
        if comparison.solo_seconds / comparison.solo_rows < MIN_RUN_S:
            self._short += 1
            if self._short >= SAMPLES and self.deciding:
                self._merging()  # too short to judge: merging saves the rest
                self._short = 0
                self._retry = FIRST_RETRY_RUNS
            return None
        self.comparisons += 1
        self.window.append(comparison)
        if len(self.window) < SAMPLES or not self.enabled:
            if not self.enabled:
                self.gain = gain_of(self.window)
            return None
        gain = gain_of(self.window)
        if gain is None:
            return None
        self.gain = gain
        rows = sum(c.merged_rows for c in self.window) / len(self.window)
        measured = (
            f"merged batches of {rows:.1f} rows on average served {gain:.2f}x the rows/s of "
            f"the same requests run alone on the same session ({len(self.window)} comparisons)"
        )
        if self.state is MergeState.PROBING:
            if gain >= RESUME_AT:
                self._merging()
                self._retry = FIRST_RETRY_RUNS
                return f"merging again: {measured}, at least {RESUME_AT:g}x"
            self._pause()
            self._retry = min(MAX_RETRY_RUNS, self._retry * 2)
            return self._paused_text(f"{measured}, short of the {RESUME_AT:g}x that resumes it")
        if gain < PAUSE_BELOW:
            self._pause()
            return self._paused_text(
                f"{measured}, under the {PAUSE_BELOW:g}x that pays for waiting for rows"
            )
        if self.state is MergeState.MEASURING:
            self._merging()
        return None

    def _pause(self, *, by_trial: bool = False) -> None:
        """Pause merging; ``by_trial``: a trial paused it (else the comparisons did)."""
        self.trial = None
        self._trial_paused = by_trial
        self._until_trial = 0
        self.state = MergeState.PAUSED
        self.pauses += 1
        self._alone = 0
        self._short = 0
        self.window.clear()

    def _paused_text(self, measured: str) -> str:
        runs = (
            "each request runs alone"
            if self.side_by_side is None
            else f"requests run side by side, each its own Run, up to {self.side_by_side} on "
            "a session"
        )
        return (
            f"merging paused: {measured}; {runs}, and merging is measured again after "
            f"{self._retry} runs"
        )
