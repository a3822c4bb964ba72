"""A pool's counters: the live tally its scheduler keeps, and the snapshot callers read."""

from __future__ import annotations

import dataclasses
from typing import Any

from sharedml.pool._calibrate import Calibration

__all__ = ["COUNTERS", "GAUGES", "Counters", "PoolStats"]


@dataclasses.dataclass
class Counters:
    """What a pool has done so far, tallied by its scheduler (with its lock held).

    :class:`PoolStats` documents each field; ``split_failures`` counts merged runs whose outputs
    did not split back into their requests' rows (the pool stops merging after a few).
    """

    runs: int = 0
    failed_runs: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    created: int = 0
    replaced: int = 0
    create_seconds: float = 0.0
    creation_failures: int = 0
    batches: int = 0
    batched_rows: int = 0
    max_batch_rows: int = 0
    padded_rows: int = 0
    fill_wait_seconds: float = 0.0
    run_seconds: float = 0.0
    batch_checks: int = 0
    batch_mismatches: int = 0
    check_runs: int = 0
    check_seconds: float = 0.0
    cancelled: int = 0
    split_failures: int = 0
    gain_runs: int = 0
    gain_seconds: float = 0.0

    def published(self) -> dict[str, Any]:
        """The counters that :class:`PoolStats` shows, by field name."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name in _PUBLISHED
        }


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's counters (``pool.stats()``).

    Attributes:
        sessions: Sessions that exist now.
        busy: Sessions in use now (checked out, or running a request or batch).
        waiting: Requests and checkouts queued for a session now.
        max_sessions: The most sessions the pool will create.
        runs: Requests and checkouts completed.
        failed_runs: Those that raised.
        waits: Requests and checkouts that had to queue.
        wait_seconds: Total time they spent queued.
        created: Sessions created over the pool's life (replacements included).
        replaced: Sessions dropped after a provider failure.
        create_seconds: Total time spent creating sessions.
        creation_failures: Background creations that failed (each was retried or reported).
        batches: ``Run`` calls made for requests while batching (merged or alone).
        batched_rows: Rows those runs processed.
        max_batch_rows: The most rows in one of them.
        padded_rows: Rows of padding those runs added (``Batching.pad_to_buckets``).
        fill_wait_seconds: Total time sessions waited for more rows before a batch ran
            (``Batching.max_delay_ms``).
        run_seconds: Total time sessions spent running the requests of ``run`` and
            ``run_async`` (their ``Run`` calls, with a merged batch's merge of its feeds and
            split of its outputs; checkouts through ``session()`` are the caller's own). Over
            a window, divided by the window and the sessions, it is how busy they were: the
            rest went to waiting for rows, handing results back, and idling. Requests run side
            by side on a session (merging paused on CPU) count each their own Run, so the
            share can pass 1 then.
        batching: Whether the pool merges requests now (see ``SessionPool.batching_reason``):
            False where it never does, stopped, or paused because merging did not pay.
        batch_checks: Merged batches checked against solo runs of their requests: the first
            of every class of batches (input signature and row bucket), then batches at random
            gaps of at most ``Batching.check_within`` (see ``docs/batching.md``, defence in
            depth).
        batch_mismatches: Checks whose merged rows differed from the solo runs: the pool then
            gave every caller of that batch its solo result and stopped merging.
        check_runs: Solo runs those checks made (every request of a full check, one of a spot
            check; every request of a batch that failed its check).
        check_seconds: Total time sessions spent in those runs (part of ``run_seconds``): what
            the checks cost.
        cancelled: Requests whose callers left before they ran (a cancelled ``run_async``, a
            caller interrupted while its request waited in a batch): they never ran.
        merge_gain: Whether merging pays, as measured on the pool's traffic: the rows/s that
            merged batches served over the rows/s of the same requests run alone on the same
            session, per Run second, over the comparisons its latest decision rested on (see
            :mod:`sharedml.pool._payoff`); None until enough were made.
        merge_comparisons: Merged batches compared with solo runs of their requests (the
            checks' solo runs, and ``gain_runs``).
        merge_pauses: Times merging paused because merged batches gained too little over solo
            runs (``batching`` is then False, and ``SessionPool.batching_reason`` says why).
        merge_trials: Trials of merging against requests side by side on the traffic (pools
            whose sessions run requests side by side: :mod:`sharedml.pool._payoff`).
        gain_runs: Solo runs made only to time a merged batch's request alone, while a
            decision on merging was pending (part of ``run_seconds``).
        gain_seconds: Total time sessions spent in those runs.
        arena_shrinks: Runs that gave a CPU session's arena memory back after a peak of rows
            had passed (see :mod:`sharedml.pool._arena`).
        calibration: For ``SessionPool(sessions="auto")``, how the pool split the cores into
            sessions and threads: what it measured, what it chose, and why
            (:class:`~sharedml.pool.Calibration`); None for a pool given a number.
        serialized_runs: Each ``Run`` takes the device's process-wide run lock (one at a time
            across every pool on the device).
        runs_rule: Why runs are or are not serialized: the caller's ``serialize_runs``, or the
            provider table's rule for the provider (or for a provider the table lacks).
        device: The device the sessions run on, in words (a plugin EP's hardware).
    """

    sessions: int
    busy: int
    waiting: int
    max_sessions: int
    runs: int
    failed_runs: int
    waits: int
    wait_seconds: float
    created: int
    replaced: int
    create_seconds: float
    creation_failures: int = 0
    batches: int = 0
    batched_rows: int = 0
    max_batch_rows: int = 0
    padded_rows: int = 0
    fill_wait_seconds: float = 0.0
    run_seconds: float = 0.0
    batching: bool = False
    batch_checks: int = 0
    batch_mismatches: int = 0
    calibration: Calibration | None = None
    arena_shrinks: int = 0
    check_runs: int = 0
    check_seconds: float = 0.0
    cancelled: int = 0
    merge_gain: float | None = None
    merge_comparisons: int = 0
    merge_pauses: int = 0
    merge_trials: int = 0
    gain_runs: int = 0
    gain_seconds: float = 0.0
    serialized_runs: bool = False
    runs_rule: str = ""
    device: str = ""

    @property
    def idle(self) -> int:
        """Sessions free now."""
        return self.sessions - self.busy

    @property
    def mean_batch_rows(self) -> float:
        """Rows per batch, on average (0 without batching)."""
        return self.batched_rows / self.batches if self.batches else 0.0


_PUBLISHED = frozenset(field.name for field in dataclasses.fields(PoolStats))


# What servers export of PoolStats (sharedml serve's /metrics, a Ray replica's metrics), in one
# table so that both say the same: field -> (metric name stem, help). Each server prefixes the
# stem its own way (``sharedml_pool_`` and ``sharedml_``).
COUNTERS: dict[str, tuple[str, str]] = {
    "runs": ("requests", "Requests the pool completed (failed ones included)."),
    "failed_runs": ("failed_requests", "Requests whose run raised."),
    "waits": ("queued_requests", "Requests that queued for a session."),
    "wait_seconds": ("queue_seconds", "Seconds requests spent queued for a session."),
    "batches": ("batches", "Runs the pool made for requests while batching."),
    "batched_rows": ("batched_rows", "Rows those runs processed."),
    "run_seconds": ("run_seconds", "Seconds the pool's sessions spent running requests."),
    "arena_shrinks": (
        "arena_shrinks",
        "Runs that gave a session's CPU arena memory back after a peak of rows.",
    ),
    "batch_checks": ("batch_checks", "Merged batches checked against solo runs."),
    "batch_mismatches": (
        "batch_mismatches",
        "Checked batches whose rows differed from solo runs (merging then stops).",
    ),
    "check_runs": ("check_runs", "Solo runs the checks of merged batches made."),
    "check_seconds": ("check_seconds", "Seconds those solo runs took."),
    "cancelled": ("cancelled_requests", "Requests cancelled before they ran (never run)."),
    "replaced": ("replaced_sessions", "Sessions replaced after a provider failure."),
}
GAUGES: dict[str, tuple[str, str]] = {
    "sessions": ("sessions", "Sessions in the pool."),
    "busy": ("busy_sessions", "Sessions running a request now."),
    "waiting": ("waiting_requests", "Requests queued for a session now."),
    "max_batch_rows": ("max_batch_rows", "The most rows one batched run has held."),
    "batching": (
        "batching",
        "1 where the pool merges requests, 0 where each runs alone (the server's log says why).",
    ),
}
