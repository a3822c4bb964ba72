"""``SessionPool(sessions="auto")``: split the CPU's cores into sessions x threads by measuring.

On the CPU a batching pool can spend its cores as one session of many intra-op threads or as
many sessions of few: S sessions of T threads each (S = cores // T) run S batches side by side.
Which split serves the most rows per second depends on the model and the batch size (a small
MatMul scales badly over threads; a wide one well), so it is measured, once, before the pool
creates its sessions:

- The candidates are T in 1, 2, 4, ... up to the usable cores, and the cores themselves, each
  with S = cores // T sessions of T' = cores // S threads (the most each of S sessions may take).
- For each, one probe session is created from the pool's own route recipe (the same shared
  weights, options and providers; only ``intra_op_num_threads`` differs), fed a batch of
  :data:`CALIBRATION_ROWS` rows (at most ``Batching.max_batch_size``) and a single row, both
  generated from the model's signature (:mod:`sharedml.model._inputs`), each run twice to warm
  up and then timed in turn. Its predicted throughput at each size is
  ``S * rows / seconds_per_batch``. The probe is released before the next one and before the
  pool creates its own sessions.
- :func:`choose` decides whether merged batches pay for their memory: a session's activations
  grow with the rows of its batch (a ResNet-50-like model's pool held 2.6x its unbatched
  memory at 16 rows). The first probe measures what its batch adds to its resident memory over
  single rows; where that is more than :data:`BATCH_MEMORY_SHARE` of what the session itself
  took and one row at a time comes within :data:`ROWS_MARGIN` of the best batch, the pool runs
  one row at a time (``Calibration.max_batch_size`` = 1). Only for inputs whose every size but
  the rows is fixed: where a probe guessed a sequence length or an image size, the traffic's
  own sizes decide what a batch gains (paraphrase-MiniLM-L3 gained 4% from 8-row batches at
  128 tokens here, 15-34% at 32), so the batch size stands. Where batches predict less than
  :data:`BATCH_PAYS` times single rows, whatever their memory, the split is chosen for single
  rows (the pool's scheduler measures on its traffic whether merging pays, and pauses it where
  it does not: :mod:`sharedml.pool._payoff`). Then, among the splits at that size, the fewest
  sessions within :data:`SESSIONS_MARGIN` of the best; a split of more sessions than the
  fewest must win that margin twice: the two are probed again, the contender first, and the
  fewest sessions stand unless it wins again (or where the budget leaves no time for it).

Calibration keeps two budgets, and says what they left unmeasured (``Calibration.skipped``):
time, :data:`HARD_LIMIT_S` (no Run and no probe starts that its prediction says would end past
it), and the probes' batch memory (:data:`PROBE_MEMORY_FLOOR`, :data:`PROBE_AVAILABLE_SHARE`:
a batch whose activations would not fit is probed at the rows that fit, or not at all).

Where nothing can be measured (another provider, runs serialized, no batching, inputs that
cannot be generated, a probe that fails) the pool takes a stated default, and
:attr:`Calibration.reason` says why; ``pool.stats().calibration`` reports either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from sharedml._errors import SharedMLError
from sharedml._host._platform import release_freed_heap, usable_cores
from sharedml.model._inputs import UNNAMED_DIM, generate, input_specs
from sharedml.model._proto import ModelProto
from sharedml.pool._batching import Batching
from sharedml.pool._payoff import PAUSE_BELOW
from sharedml.route._planner import SessionRecipe
from sharedml.runtime._providers import CPU

__all__ = [
    "BATCH_MEMORY_SHARE",
    "BATCH_PAYS",
    "BUDGET_S",
    "CALIBRATION_ROWS",
    "HARD_LIMIT_S",
    "PROBE_AVAILABLE_SHARE",
    "PROBE_MEMORY_FLOOR",
    "ROWS_MEMORY_FLOOR",
    "ROWS_MARGIN",
    "SESSIONS_MARGIN",
    "Calibration",
    "CalibrationCandidate",
    "RowBound",
    "calibrate",
    "candidate_splits",
    "choose",
    "rows_for_memory",
    "timed_run",
]

CALIBRATION_ROWS = 8  # rows per probe batch: a batch that several callers fill quickly
BUDGET_S = 1.0  # seconds of timed Runs, shared by the candidates
# seconds: calibration's time budget. No Run starts, and no probe, that its prediction says
# would end calibration beyond it; only the first single-row Run, which nothing predicts, may.
HARD_LIMIT_S = 10.0

# A probe's batch may add at most this share of the memory the machine has available...
PROBE_AVAILABLE_SHARE = 0.25
# ... and at most what the probe session itself took with single rows (its weights as it
# touched them, its arenas, one row's activations), or this much, whichever is more: a model
# of 100 MiB of activations a row once took calibration to 1.13 GiB for an 8-row batch that
# it then did not use, against 306 MiB for a pool of 2 sessions. Bytes.
PROBE_MEMORY_FLOOR = 64 * 2**20
_MIN_RUNS = 2  # timed Runs per batch size and candidate, budget or not
_MAX_RUNS = 50  # timed Runs per batch size and candidate: a small model's settles long before

# Prefer fewer sessions unless more are faster by more than this share of the best prediction,
# in two measurements (the deciding splits are probed again, in the other order). Each extra
# session holds its own activations, arenas and threads, and halves what a lone caller gets: a
# static-int8 ResNet-50-like pool split into two one-thread sessions served one caller 44-45
# requests/s against 79 for one session of two threads. The probes run one after another on a
# machine that may be busy, and a load that comes or goes between two of them moved their
# predictions by more than the 10% this margin once was (that pool's split changed from run to
# run): leaving the fewest sessions takes a gain beyond such noise.
SESSIONS_MARGIN = 0.25

# Merge rows only where batches serve more than this share more rows/s than single rows. A
# batch's activations grow with its rows and each session's arena keeps its largest batch's;
# where a model's kernels are already busy at one row (convolutions on a few cores), merged
# batches cost that memory for a gain within the noise. Measured here (ResNet-50-like, 2 cores,
# 16 callers): 1, 2, 4, 8 and 16 rows per batch all served 23.6-25.7 requests/s while the
# pool's memory grew from +134 to +370 MiB.
ROWS_MARGIN = 0.25

# ... and only where the batch's activations are a cost worth saving: more than this share of
# what one session took resident (its weights as it touched them, packs, arenas). A transformer
# at 8 rows adds a few MiB to hundreds of MiB of weights, and single rows there would give up
# the batch's gain at the sequence lengths traffic really has (calibration guesses them).
BATCH_MEMORY_SHARE = 0.5

# Where batches predict less than this many times single rows' rows/s, merging will not pay on
# the pool's traffic either (the scheduler then pauses it: pool/_payoff), so the split is
# chosen for single rows; the batch size stands, for the scheduler's own measurement to decide.
BATCH_PAYS = PAUSE_BELOW


@dataclasses.dataclass(frozen=True)
class CalibrationCandidate:
    """One split of the cores that ``sessions="auto"`` measured.

    Attributes:
        threads: Intra-op threads of each session.
        sessions: Sessions of that many threads (``cores // threads``).
        rows: Rows in the probe batch.
        seconds_per_batch: The median time of one ``Run`` of that batch on one session.
        rows_per_s: The predicted throughput: ``sessions * rows / seconds_per_batch``.
    """

    threads: int
    sessions: int
    rows: int
    seconds_per_batch: float
    rows_per_s: float


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What ``SessionPool(sessions="auto")`` measured and chose (``pool.stats().calibration``).

    Attributes:
        candidates: The splits measured, fewest sessions first (empty where nothing was).
        sessions: The sessions the pool holds.
        threads: Intra-op threads per session; None: the provider's own default.
        decided: True where the measurement chose; False where a default or a fixed setting
            applies (``reason`` says why).
        reason: Why this split, in one sentence.
        seconds: How long calibration took (probe sessions created, run and released).
        max_batch_size: The most rows a merged run holds, where calibration lowered it: 1 where
            the batch cost more than :data:`BATCH_MEMORY_SHARE` of a session's memory, single
            rows came within :data:`ROWS_MARGIN` of it and no input size was guessed (the pool
            then runs each request's rows alone); None where the ``Batching`` setting stands.
        batch_memory_share: What the first probe's batch added to its resident memory over
            single rows, as a share of what the session took with single rows; None where not
            measured.
        skipped: What calibration did not measure to keep its budgets, one phrase each (a
            batch size whose predicted memory or time did not fit, splits whose probes would
            have ended past the time budget); empty where it measured everything.
        time_budget_s: The time budget it kept (:data:`HARD_LIMIT_S` unless given).
        memory_budget_bytes: What the first probe allowed a batch to add to its memory (see
            :data:`PROBE_MEMORY_FLOOR`); None where nothing was measured.
        repeated: Where a split of more sessions than the fewest won the first pass, the two
            probed again (the contender first): it is chosen only if it wins again by
            :data:`SESSIONS_MARGIN`. Empty where nothing was repeated.
    """

    candidates: tuple[CalibrationCandidate, ...]
    sessions: int
    threads: int | None
    decided: bool
    reason: str
    seconds: float
    max_batch_size: int | None = None
    batch_memory_share: float | None = None
    skipped: tuple[str, ...] = ()
    time_budget_s: float = HARD_LIMIT_S
    memory_budget_bytes: int | None = None
    repeated: tuple[CalibrationCandidate, ...] = ()


def candidate_splits(cores: int) -> list[tuple[int, int]]:
    """The ``(sessions, threads)`` splits to measure on ``cores`` cores, fewest sessions first.

    Thread counts 1, 2, 4, ... up to ``cores``, and ``cores`` itself, give the session counts
    ``cores // threads``; each session count then takes the most threads it can
    (``cores // sessions``), so no candidate leaves cores idle that an equal split would use.
    """
    if cores < 1:
        raise ValueError(f"cores must be at least 1, not {cores}.")
    threads, t = {cores}, 1
    while t < cores:
        threads.add(t)
        t *= 2
    counts = sorted({cores // t for t in threads})
    return [(s, cores // s) for s in counts]


def choose(
    candidates: Sequence[CalibrationCandidate], *, batch_memory_share: float | None = None
) -> tuple[CalibrationCandidate, str]:
    """The candidate to use, and why.

    First the batch size: where the candidates were measured at several sizes, the batch's
    memory is more than ``BATCH_MEMORY_SHARE`` of a session's (``batch_memory_share``; None:
    unknown, never) and the best at the fewest rows predicts at least
    ``best / (1 + ROWS_MARGIN)``, only the candidates at that size remain (merged rows do not
    pay for their memory). Where the best batch predicts less than ``BATCH_PAYS`` times the
    best single rows, the split is chosen among the single rows' predictions (merging would
    not pay for itself: the pool's scheduler measures that again on its traffic), and the
    batch-size candidate of that split is returned. Otherwise the batch size decides.
    Then, of the remaining candidates whose predicted rows/s is at least
    ``their best / (1 + SESSIONS_MARGIN)``, the one with the fewest sessions (so the most
    threads; on equal sessions, the faster).

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("choose() needs at least one measured candidate.")
    size, unpaid, size_note = _batch_size(candidates, batch_memory_share)
    most = max(c.rows for c in candidates)
    sized = [c for c in candidates if c.rows == size]
    if unpaid:  # only splits whose batch was measured too: that is the candidate returned
        batched = {(c.sessions, c.threads) for c in candidates if c.rows == most}
        sized = [c for c in sized if (c.sessions, c.threads) in batched]
    top = max(sized, key=lambda c: c.rows_per_s)
    good = [c for c in sized if c.rows_per_s * (1 + SESSIONS_MARGIN) >= top.rows_per_s]
    chosen = min(good, key=lambda c: (c.sessions, -c.rows_per_s))
    split = _split_text(chosen.sessions, chosen.threads)
    if chosen is top:
        why = (
            f"{split}: the most rows/s predicted ({chosen.rows_per_s:.0f}) of "
            f"{len(sized)} split(s) measured at {size} row(s).{size_note}"
        )
    else:
        why = (
            f"{split}: {chosen.rows_per_s:.0f} rows/s predicted, within "
            f"{SESSIONS_MARGIN:.0%} of the best ({top.rows_per_s:.0f} with "
            f"{_split_text(top.sessions, top.threads)}), with fewer sessions.{size_note}"
        )
    if unpaid:  # the split of single rows, at the batch size: no cap on the pool's rows
        split_of = (chosen.sessions, chosen.threads)
        chosen = next(
            c for c in candidates if c.rows == most and (c.sessions, c.threads) == split_of
        )
    return chosen, why


def _batch_size(
    candidates: Sequence[CalibrationCandidate], batch_memory_share: float | None
) -> tuple[int, bool, str]:
    """The rows the split is chosen at, whether batches did not pay, and why (see choose)."""
    best = max(candidates, key=lambda c: c.rows_per_s)
    fewest, most = min(c.rows for c in candidates), max(c.rows for c in candidates)
    single = max((c for c in candidates if c.rows == fewest), key=lambda c: c.rows_per_s)
    batch = max((c for c in candidates if c.rows == most), key=lambda c: c.rows_per_s)
    costly = batch_memory_share is not None and batch_memory_share > BATCH_MEMORY_SHARE
    if fewest != most and costly and single.rows_per_s * (1 + ROWS_MARGIN) >= best.rows_per_s:
        return (
            fewest,
            False,
            f" Batches of {most} rows predicted {batch.rows_per_s:.0f} rows/s, within "
            f"{ROWS_MARGIN:.0%} of {fewest} row(s) at a time ({single.rows_per_s:.0f}), and "
            f"added {batch_memory_share:.0%} to a session's memory: not worth it, so each Run "
            f"holds at most {fewest} row(s).",
        )
    if fewest != most and batch.rows_per_s < single.rows_per_s * BATCH_PAYS:
        return (
            fewest,
            True,
            f" Batches of {most} rows predicted {batch.rows_per_s:.0f} rows/s, under "
            f"{BATCH_PAYS:g}x what {fewest} row(s) at a time did ({single.rows_per_s:.0f}): "
            "the split is chosen for single rows, and the pool's own measurement decides "
            "whether merging pays.",
        )
    return most, False, ""  # the batch size stands, even where single rows timed faster


def _split_text(sessions: int, threads: int | None) -> str:
    each = "ORT's default threads" if threads is None else f"{threads} thread(s)"
    return f"{sessions} session(s) of {each}"


def calibrate(
    recipe: SessionRecipe,
    *,
    batching: Batching | None,
    serialized: bool,
    default_sessions: int,
    creation_lock: Any = None,
    cores: int | None = None,
    time_budget_s: float | None = None,
) -> Calibration:
    """Decide a pool's sessions and threads for ``sessions="auto"`` (see the module).

    Args:
        recipe: The pool's route recipe, as its sessions will be created (relaxed graph
            included).
        batching: The pool's batching settings; None: it does not merge requests.
        serialized: The provider runs one ``Run`` at a time.
        default_sessions: The pool's default session count (where nothing is measured).
        creation_lock: Held while a probe session is created (the pool's creation lock), and
            while the first probe's warm-ups read memory.
        cores: The usable cores (default: :func:`sharedml._host._platform.usable_cores`).
        time_budget_s: Calibration's time budget (default: :data:`HARD_LIMIT_S`).

    Returns:
        The decision, with what was measured and what was skipped to keep the budgets; never
        raises for a model that cannot be measured (the reason says so, and a default
        applies).

    Thread safety: creates and runs sessions; call it from the thread that builds the pool.
    """
    start = time.perf_counter()
    cores = usable_cores() if cores is None else cores
    time_budget_s = HARD_LIMIT_S if time_budget_s is None else time_budget_s

    def fallback(sessions: int, threads: int | None, why: str) -> Calibration:
        elapsed = time.perf_counter() - start
        return Calibration((), sessions, threads, False, why, elapsed, time_budget_s=time_budget_s)

    if recipe.plan.primary != CPU:
        return fallback(
            default_sessions,
            None,
            f"sessions='auto' measures on the CPU provider only; {recipe.plan.primary} gets its "
            f"default of {default_sessions} session(s).",
        )
    fixed = _fixed_threads(recipe)
    if serialized:
        threads = fixed or max(1, cores // default_sessions)
        return fallback(
            default_sessions,
            threads,
            "runs are serialized (one Run at a time), so more sessions run no more at once: "
            f"{_split_text(default_sessions, threads)}.",
        )
    if batching is None:
        threads = fixed or max(1, cores // default_sessions)
        return fallback(
            default_sessions,
            threads,
            "the pool does not merge requests (see batching_reason), and calibration measures "
            f"batches: the default of {_split_text(default_sessions, threads)}.",
        )
    if fixed is not None:
        sessions = max(1, cores // fixed)
        return fallback(
            sessions,
            fixed,
            f"sess_options (or configure) sets intra_op_num_threads={fixed}, which fixes the "
            f"split at {_split_text(sessions, fixed)} for {cores} core(s); nothing to measure.",
        )
    splits = candidate_splits(cores)
    on_failure = f"the default for a batching pool, {_split_text(cores, 1)}"
    if len(splits) == 1:
        return fallback(cores, 1, "one usable core: one session of one thread; nothing to measure.")
    rows = min(CALIBRATION_ROWS, batching.max_batch_size)
    graph = recipe.graph  # parsed once for the pool: the feeds and the guessed sizes
    try:
        feeds = {n: _feed(graph, n) for n in sorted({1, rows})}
    except (ValueError, SharedMLError) as exc:  # MeasurementError: a type it cannot generate
        return fallback(
            cores,
            1,
            f"inputs could not be generated from the model's signature ({exc}); {on_failure}.",
        )

    def feed_for(n: int) -> dict[str, Any]:
        if n not in feeds:  # a smaller batch, where the memory budget cut the probe's
            feeds[n] = _feed(graph, n)
        return feeds[n]

    import psutil

    available = psutil.virtual_memory().available  # bytes, once: the memory budget's cap
    budget = _Budget(start, time_budget_s)
    measured: list[CalibrationCandidate] = []
    lock = creation_lock if creation_lock is not None else contextlib.nullcontext()
    share_s = BUDGET_S / len(splits)
    probed = 0
    share: float | None = None
    memory_budget: int | None = None
    memory_cap: int | None = None  # the batch size the memory budget allowed, where it cut it
    batch = rows  # the batch size probes run: the memory budget may lower it
    last: _Probe | None = None
    elapsed: dict[tuple[int, int], float] = {}  # each split's probe, seconds

    def probe_split(sessions: int, threads: int, memory: int | None) -> _Probe:
        return _probe(
            dataclasses.replace(recipe, intra_op_threads=threads),
            feed_for,
            batch,
            threads=threads,
            lock=lock,
            share_s=share_s,
            budget=budget,
            hint=last,
            memory=memory,
        )

    def failed(threads: int, exc: Exception) -> Calibration:
        return fallback(
            cores,
            1,
            f"a probe session of {threads} thread(s) failed on {rows} generated rows "
            f"({type(exc).__name__}: {_short(exc)}); {on_failure}.",
        )

    for sessions, threads in splits:
        # A probe of fewer threads runs its batches about that much slower: none starts that
        # the last one's time says would end beyond the budget.
        if last is not None and not budget.fits(last.elapsed * last.threads / threads):
            break
        try:
            # the first probe measures memory: later ones find the weights touched
            probe = probe_split(sessions, threads, None if probed else available)
        except Exception as exc:  # onnxruntime's own errors have no common base but Exception
            return failed(threads, exc)
        elapsed[(sessions, threads)] = probe.elapsed
        if probed == 0:
            share, memory_budget = probe.batch_memory_share, probe.memory_budget
            if probe.rows < batch:
                memory_cap = batch = probe.rows
        last = probe
        probed += 1
        measured.extend(
            CalibrationCandidate(threads, sessions, n, sec, sessions * n / sec)
            for n, sec in sorted(probe.seconds.items())
        )
    skipped = list(budget.skipped)
    if probed < len(splits):
        skipped.append(
            f"{len(splits) - probed} split(s) with more sessions: their probes would have "
            f"ended past the {time_budget_s:g} s budget"
        )
    # A batch's cost per row depends on the other sizes (a transformer's sequence length): where
    # probes guessed them, the traffic's own may make batches pay, so they are not capped.
    guessed = _guesses_sizes(graph)
    memory_share = None if guessed else share
    chosen, reason = choose(measured, batch_memory_share=memory_share)
    repeated: list[CalibrationCandidate] = []
    default = splits[0]  # the fewest sessions, of the most threads
    contender = (chosen.sessions, chosen.threads)
    if contender != default and default in elapsed:
        # More sessions won: the two splits are probed again, the contender first (a load
        # that came or went during the first pass then favours neither twice), and it must
        # win again by the margin, or the fewest sessions stand.
        stand = next(
            (c for c in measured if (c.sessions, c.threads) == default and c.rows == chosen.rows),
            None,
        )
        again: CalibrationCandidate | None = None
        if stand is not None and budget.fits(elapsed[contender] + elapsed[default]):
            try:
                for sessions, threads in (contender, default):
                    probe = probe_split(sessions, threads, None)
                    last = probe
                    repeated.extend(
                        CalibrationCandidate(threads, sessions, n, sec, sessions * n / sec)
                        for n, sec in sorted(probe.seconds.items())
                    )
            except Exception as exc:  # as in the first pass
                return failed(threads, exc)
            again, _ = choose(repeated, batch_memory_share=memory_share)
        if stand is not None and (again is None or (again.sessions, again.threads) != contender):
            first = reason.split(":", 1)[0]
            if again is None:
                why = "it could not be measured again within the time budget"
            else:
                got = {
                    (c.sessions, c.threads): c.rows_per_s for c in repeated if c.rows == again.rows
                }
                why = (
                    f"measured again, it predicted {got.get(contender, 0.0):.0f} rows/s against "
                    f"{got.get(default, 0.0):.0f}, not beyond the {SESSIONS_MARGIN:.0%} margin"
                )
            _size, _unpaid, size_note = _batch_size(measured, memory_share)
            reason = (
                f"{_split_text(*default)}: the fewest sessions stand. {first} predicted "
                f"{chosen.rows_per_s:.0f} rows/s against {stand.rows_per_s:.0f} in the first "
                f"pass, but {why}.{size_note}"
            )
            chosen = stand
        elif again is not None:
            reason += (
                f" Measured again, in the other order: {again.rows_per_s:.0f} rows/s, still "
                f"beyond the {SESSIONS_MARGIN:.0%} margin over the fewest sessions."
            )
    if skipped:
        reason += f" Not measured, to keep calibration's budgets: {'; '.join(skipped)}."
    if guessed:  # the probes' memory and speed are those of guessed sizes: traffic decides
        cap = None
    elif any(c.rows > 1 for c in measured):
        cap = chosen.rows if chosen.rows < rows else None
    else:  # no batch measured: the memory budget's cap, if any, else the setting stands
        cap = memory_cap
    return Calibration(
        tuple(measured),
        chosen.sessions,
        chosen.threads,
        True,
        reason,
        time.perf_counter() - start,
        max_batch_size=cap,
        batch_memory_share=share,
        skipped=tuple(skipped),
        time_budget_s=time_budget_s,
        memory_budget_bytes=memory_budget,
        repeated=tuple(repeated),
    )


def _fixed_threads(recipe: SessionRecipe) -> int | None:
    """The intra-op threads the caller's template or ``configure`` sets, else None."""
    options = dataclasses.replace(recipe, intra_op_threads=None).options()
    threads = int(options.intra_op_num_threads)
    return threads if threads > 0 else None


def _guesses_sizes(graph: ModelProto) -> bool:
    """Whether an input has a symbolic dimension besides its rows, which probes only guess."""
    return any(d is not None for s in input_specs(graph) for d in s.dim_names[1:])


def _feed(graph: ModelProto, rows: int) -> dict[str, Any]:
    """A batch of ``rows`` rows for the model's inputs, generated from its signature.

    Axis 0 (the rows, dynamic in a batchable model or relaxed) holds ``rows``; other symbolic
    dimensions get the sizes ``inspect`` chooses.

    Raises:
        MeasurementError: an input that cannot be generated.
        ValueError: an input whose axis 0 is fixed.
    """
    specs = input_specs(graph)
    row_dims = {
        d for s in specs if s.dim_names and (d := s.dim_names[0]) is not None and d != UNNAMED_DIM
    }
    specs = input_specs(graph, dict.fromkeys(row_dims, rows))
    feed: dict[str, Any] = {}
    for spec in specs:
        if not spec.shape or spec.dim_names[0] is None:
            raise ValueError(f"input '{spec.name}' has no dynamic axis 0 to hold the rows")
        shape = (rows, *spec.shape[1:])
        feed[spec.name] = generate({"shape": shape, "dtype": spec.dtype})
    return feed


def timed_run(session: Any, feed: Mapping[str, Any], run_options: Any) -> float:
    """Run ``feed`` once on a probe session; the seconds it took (wall clock).

    Every ``Run`` calibration times goes through here: tests replace it with noisy fake
    timings to check that the choice holds under noise.
    """
    start = time.perf_counter()
    session.run(None, dict(feed), run_options)
    return time.perf_counter() - start


class _Budget:
    """Calibration's time budget: which Runs may start, and what was skipped to keep it."""

    def __init__(self, start: float, seconds: float) -> None:
        self.deadline = start + seconds
        self.seconds = seconds
        self.skipped: list[str] = []

    def fits(self, predicted_s: float) -> bool:
        """Whether something predicted to take ``predicted_s`` would end within the budget."""
        return time.perf_counter() + predicted_s <= self.deadline


@dataclasses.dataclass(frozen=True)
class _Probe:
    """What one probe session measured.

    Attributes:
        seconds: Per batch size measured, the median seconds of one Run (of the timed Runs,
            or where the budget left none, the last warm-up Run).
        last: Per batch size, the last Run's seconds: the next probe's prediction.
        rows: The batch size it probed (below the one asked where the memory budget cut it;
            1: no batch).
        threads: Its intra-op threads.
        elapsed: Seconds from its creation to its release.
        batch_memory_share: What its batch added to its resident memory, as a share of what
            it took with single rows; None where not measured.
        memory_budget: What its batch was allowed to add (bytes); None where not measured.
    """

    seconds: dict[int, float]
    last: dict[int, float]
    rows: int
    threads: int
    elapsed: float
    batch_memory_share: float | None = None
    memory_budget: int | None = None


def _anonymous_bytes(process: Any) -> int:
    """Resident memory that no file backs: arenas and activations, not mapped weights.

    On Linux, ``rss - shared`` (statm's file-backed resident pages); elsewhere all of RSS.
    """
    info = process.memory_info()
    return int(info.rss - getattr(info, "shared", 0))


def _probe(
    recipe: SessionRecipe,
    feed_for: Any,
    rows: int,
    *,
    threads: int,
    lock: Any,
    share_s: float,
    budget: _Budget,
    hint: _Probe | None,
    memory: int | None,
) -> _Probe:
    """Time single rows and a batch of ``rows`` on a probe session of ``recipe``, within budget.

    Two warm-up Runs of each size first, single rows then the batch (ORT plans a shape's memory
    on its first Run and allocates the plan on the second); then the sizes in turn, so a moment
    of load slows them alike, until ``share_s`` seconds passed and each ran at least
    ``_MIN_RUNS`` times, or ``_MAX_RUNS``. No Run starts whose predicted time would end past
    ``budget``: a size's last Run predicts its next, single rows predict a batch (linearly in
    its rows, an upper bound), and ``hint`` (the last probe, scaled by its threads over these)
    predicts what this probe has not run yet. Only the very first Run of calibration is
    unpredicted. Where no timed Run fits, a size's last warm-up Run stands for it; where none
    of its Runs fits, it is not measured, and ``budget.skipped`` says so.

    With ``memory`` (the machine's available bytes; the first probe only), the batch's
    predicted growth is checked first: one row's activations (what the single-row warm-ups
    added to the anonymous memory) times its rows must fit within
    ``min(PROBE_AVAILABLE_SHARE * memory, max(PROBE_MEMORY_FLOOR, what the session took))``;
    where it does not, the batch shrinks to the rows that fit, or to none below 2. Also then,
    what the batch added to the resident memory as a share of the session's (the memory
    verdict of :func:`choose`).

    The session is released before returning.
    """
    import onnxruntime as ort
    import psutil

    quiet = ort.RunOptions()
    quiet.log_severity_level = 4  # a failing probe is reported in the reason, not logged too
    me = psutil.Process()
    began = time.perf_counter()
    if memory is not None:  # heap freed earlier and trimmed during creation would read negative
        release_freed_heap()
    before = me.memory_info().rss
    # Reading memory, the creation lock stays held until the batch's warm-ups ran: this
    # process's other session creations would read as this model's session and rows.
    held = contextlib.ExitStack()
    held.enter_context(lock)
    session: list[Any] = []  # a list: released in `finally`, used by run()
    try:
        session.append(recipe.create_session())
        if memory is None:
            held.close()
        created = _anonymous_bytes(me)
        runs: dict[int, list[float]] = {}

        def predict(n: int) -> float:
            own = runs.get(n)
            if own:
                return own[-1]
            if runs:  # another size of this probe: linear in the rows, never less
                m = max(runs)
                return runs[m][-1] * max(1.0, n / m)
            if hint is not None and hint.last:
                m = n if n in hint.last else max(hint.last)
                return hint.last[m] * max(1.0, n / m) * hint.threads / threads
            return 0.0  # calibration's first Run: nothing to predict it from

        def run(n: int) -> float | None:
            first = hint is None and not runs  # calibration's first Run: always made
            if not first and not budget.fits(predict(n)):
                return None
            took = timed_run(session[0], feed_for(n), quiet)
            runs.setdefault(n, []).append(took)
            return took

        def unmeasured(n: int) -> str:
            what = "single rows" if n == 1 else f"batches of {n} rows"
            return (
                f"{what} on {threads} thread(s): a Run predicted at {predict(n):.2g} s would "
                f"have ended past the {budget.seconds:g} s budget"
            )

        sizes: list[int] = []
        for _ in range(2):
            if run(1) is None:
                break
        if runs.get(1):
            sizes.append(1)
        else:
            budget.skipped.append(unmeasured(1))
        single_rss = me.memory_info().rss
        share = allowed = None
        if rows > 1 and memory is not None and sizes:
            session_bytes = max(0, single_rss - before)
            per_row = max(0, _anonymous_bytes(me) - created)
            allowed = int(
                min(PROBE_AVAILABLE_SHARE * memory, max(PROBE_MEMORY_FLOOR, session_bytes))
            )
            # n rows' activations each: ORT's arena takes a new region for a request its
            # single-row one cannot hold, so the batch adds its own n rows, not n - 1.
            fit = allowed // per_row if per_row else rows
            if fit < rows:
                budget.skipped.append(
                    f"batches of {rows} rows: one row's activations took "
                    f"{per_row / 2**20:.1f} MiB, so they would add about "
                    f"{rows * per_row / 2**20:.0f} MiB, over the "
                    f"{allowed / 2**20:.0f} MiB a probe's batch may add"
                    + (f" (probed {fit} rows instead)" if fit >= 2 else "")
                )
                rows = fit if fit >= 2 else 1
        if rows > 1:
            for _ in range(2):
                if run(rows) is None:
                    break
            if runs.get(rows):
                sizes.append(rows)
                if memory is not None and allowed is not None:
                    session_bytes = single_rss - before
                    grown = max(0, me.memory_info().rss - single_rss)
                    share = grown / session_bytes if session_bytes > 0 else None
            else:
                budget.skipped.append(unmeasured(rows))
        held.close()
        timed: dict[int, list[float]] = {n: [] for n in sizes}
        started = time.perf_counter()
        while sizes and budget.fits(sum(predict(n) for n in sizes)):
            for n in sizes:
                took = timed_run(session[0], feed_for(n), quiet)
                timed[n].append(took)
                runs[n].append(took)
            turns = len(timed[sizes[0]])
            if turns >= _MAX_RUNS:
                break
            if turns >= _MIN_RUNS and time.perf_counter() - started >= share_s:
                break
    finally:
        held.close()
        session.clear()
        release_freed_heap()
    # A zero would divide the prediction.
    seconds = {
        n: max(statistics.median(timed[n]) if timed[n] else runs[n][-1], 1e-9) for n in sizes
    }
    return _Probe(
        seconds,
        {n: ts[-1] for n, ts in runs.items()},
        rows,
        threads,
        time.perf_counter() - began,
        batch_memory_share=share,
        memory_budget=allowed,
    )


# A merging pool's batches may always hold this much activation memory: on a model of a few MiB
# (a 256-wide MLP: half a MiB of weights, a tenth of a MiB a row on onnxruntime 1.20) the bound
# would cut batches to a handful of rows to save less than the process's own noise.
ROWS_MEMORY_FLOOR = 8 * 2**20


class RowBound(NamedTuple):
    """The most rows a merging CPU pool runs at once, and why (:func:`rows_for_memory`)."""

    rows: int
    reason: str  # one sentence, for batching_reason
    measured: bool  # one row's activations were measured (else ``rows`` is the limit as given)


def rows_for_memory(
    session: Any,
    recipe: SessionRecipe,
    limit: int,
    *,
    replaces: int,
    lock: Any = None,
    recheck: bool = True,
) -> RowBound:
    """The most rows a merging CPU pool runs at once without holding more than plain sessions.

    A pool of one session that merges ``R`` rows holds its weights once and ``R`` rows'
    activations; the ``replaces`` plain sessions it stands for hold the weights and one row's
    activations each. So ``W + R*A <= S*(W + A)``, where ``A`` is what one row's runs add to
    the process's anonymous memory (the arena of ``session``, a fresh session of ``recipe``:
    the pool's first, run twice on one generated row before it serves, which also warms it up)
    and ``W`` the weights' bytes. Plain sessions keep about twice their activations (ORT's
    memory patterns: ``pool/_arena.py``); a session without them measures ``A`` once, and the
    bound holds with that margin; one with them (a pool whose requests may run side by side)
    measures the chunks and the block, as plain sessions hold them. At least ``replaces``
    rows (where the inequality always holds), at most ``limit``; batches whose activations
    stay within :data:`ROWS_MEMORY_FLOOR` are not cut. An activation-heavy model (a 160x160
    U-Net-like segmenter, 2 MiB of weights) held 1.7-1.8x of four plain sessions in batches
    of 16 rows.

    The process's memory is all there is to read, and whatever another thread allocates
    meanwhile reads as activations: ``lock`` (the pool's creation lock) keeps this process's
    session creations out of the measurement, and a row that would cut the batches is measured
    again, as half of what two rows add (the arena takes a region for them). Where that second
    reading cuts nothing, the first was not the model's and the second stands; else the first
    does (half of two rows read 0.52-0.60 of one row on U-Net-like models: a cut either way,
    and the bound as before; ``benchmarks/row_reading.py``). One burst of a few MiB
    read as a 256-wide MLP's row would otherwise cut a pool of 32 rows to 4 and turn its memory
    patterns off. The second reading stops after one Run where that already cuts: it cost the
    U-Net-like models' constructors 0.05-0.1 s (0.09 -> 0.14 s at 160x160, 0.38 -> 0.44-0.50
    at 320x320). ``recheck=False``: the first reading stands (a model already read as heavy,
    whose rows a burst can only narrow).

    Returns:
        The rows and a sentence saying why (``limit``, and why not, where nothing could be
        measured: inputs that cannot be generated, or a probe that failed).
    """
    import psutil

    try:
        feed = _feed(recipe.graph, 1)
    except (SharedMLError, ValueError) as exc:
        return RowBound(limit, f"Rows per Run are not bounded by memory: {_short(exc)}.", False)
    me = psutil.Process()
    weights = recipe.weights.nbytes

    def fits(row: int) -> int:
        return min(
            limit,
            max(replaces, max(replaces * (weights + row) - weights, ROWS_MEMORY_FLOOR) // row),
        )

    def added(feed: Mapping[str, Any], enough: Callable[[int], bool] | None = None) -> int:
        before = _anonymous_bytes(me)
        for _ in range(2):  # ORT plans a shape's memory on the first Run, allocates on the second
            session.run(None, feed)
            grown = _anonymous_bytes(me) - before
            if enough is not None and enough(grown):
                break  # it only grows on the second Run
        return grown

    with lock if lock is not None else contextlib.nullcontext():
        try:
            row = max(1, added(feed))
        except Exception as exc:  # the pool's own runs will report it where it matters
            why = f"Rows per Run are not bounded by memory: a run failed ({_short(exc)})."
            return RowBound(limit, why, False)
        if recheck and fits(row) < limit:

            def cuts(two_rows: int) -> bool:  # once true, the first reading stands
                return fits(max(1, two_rows // 2)) < limit

            with contextlib.suppress(Exception):  # the first reading stands
                again = max(1, added(_feed(recipe.graph, 2), enough=cuts) // 2)
                if fits(again) == limit:  # the first read another thread's memory too
                    row = again
    rows = fits(row)
    mib = 2**20
    measured = (
        f"one row's activations measured {row / mib:.1f} MiB beside {weights / mib:.1f} MiB of "
        f"weights, and {rows} rows keep the pool within the {replaces} plain sessions it "
        "stands for"
    )
    if rows < limit:
        return RowBound(rows, f"At most {rows} rows per Run: {measured}.", True)
    return RowBound(rows, f"Rows per Run not bounded by memory: {measured}.", True)


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
