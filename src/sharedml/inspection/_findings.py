"""``sharedml inspect``'s recommendation: one rule per finding, every sentence from the figures.

A rule reads the :class:`Facts` of a report (the measurements and what was found before
measuring) and yields the :class:`Finding` it makes, or nothing where it has nothing to say.
:data:`RULES` lists them in the order the report prints them; :func:`findings` walks that list.
A new statement is a new rule in that list, as a linter adds a check.

Comparisons are relative (:data:`SAME_WITHIN`), never absolute: "less", "more" and "about the
same" say what the figures beside them show.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from sharedml._units import human_bytes, human_seconds
from sharedml.inspection._results import (
    DEFAULT_PROJECTION_SESSIONS,
    Measurement,
    compared_per_session,
    compared_projection,
    compared_total,
    compares_after_traffic,
)
from sharedml.inspection._strategies import NAIVE, SHARED, SHARED_PRIVATE_PACKS, SHARED_RAW, SINGLE
from sharedml.model._inputs import InputSpec, chosen_sizes
from sharedml.model._tables import IndexedTable

__all__ = [
    "RULES",
    "SAME_WITHIN",
    "Facts",
    "Finding",
    "Rule",
    "SerializedRuns",
    "findings",
    "recommend",
]

SAME_WITHIN = 0.10
"""Two figures within this fraction of each other are "about the same": wider than what repeat
measurements of one configuration differ by (docs/inspect.md has the figures)."""
_NOTABLE_DERIVED = 1.5  # a plain session holding this many times the file's weights: say why
_NOTABLE_UNSHARED = 0.01  # unshared weights this share of the file's are worth a finding


@dataclasses.dataclass(frozen=True)
class Finding:
    """One statement of the recommendation and the measured figures it rests on.

    Attributes:
        kind: What it is about: ``one-session``, ``pool-vs-plain``, ``single-vs-pool``,
            ``advice``, ``prepacking-off``, ``derived-not-shared``, ``per-session-packing``,
            ``runtime-weights``, ``unshared-weights``, ``numerics``, ``stopped``.
        text: One or two sentences; every figure in them is one of ``figures``.
        figures: The figures (bytes, seconds, ratios, names), JSON-ready.
    """

    kind: str
    text: str
    figures: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"kind": self.kind, "text": self.text, "figures": dict(self.figures)}


@dataclasses.dataclass(frozen=True)
class SerializedRuns:
    """A provider that runs one ``Run`` at a time across the process, for a recommendation.

    Attributes:
        provider: Its name (``DmlExecutionProvider``).
        onnxruntime_version: The installed version, which decides it.
        not_batchable: Why the model cannot be batched (``NotBatchableError``), or None.
        rule: The provider table's rule that serializes it.
    """

    provider: str
    onnxruntime_version: str
    not_batchable: str | None = None
    rule: str = ""


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the rules read: :func:`findings`'s arguments, and the totals several rules compare.

    Attributes:
        measurements: By strategy name.
        sessions: N.
        weights_bytes: Bytes of the file's weights.
        unshared: ``(tensors, bytes)`` of weights that stay in the graph.
        serialized: Where the provider runs one ``Run`` at a time across the process.
        fixed: sharedml's own cost per process, 0 where it was not measured.
        trial: The trial run: its outputs' NaN counts, the sizes it rejected.
        inputs: The inputs measured.
        tables: The tables inputs index.
    """

    measurements: Mapping[str, Measurement]
    sessions: int
    weights_bytes: int
    unshared: tuple[int, int]
    serialized: SerializedRuns | None
    fixed: int
    trial: Mapping[str, Any] | None
    inputs: Sequence[InputSpec]
    tables: Sequence[IndexedTable]

    @property
    def naive(self) -> Measurement | None:
        """Plain sessions, one per thread."""
        return self.measurements.get(NAIVE)

    @property
    def shared(self) -> Measurement | None:
        """The pool, default settings."""
        return self.measurements.get(SHARED)

    @property
    def raw(self) -> Measurement | None:
        """The pool with prepacking off."""
        return self.measurements.get(SHARED_RAW)

    @property
    def packs(self) -> Measurement | None:
        """The pool with ORT's own per-session prepacking."""
        return self.measurements.get(SHARED_PRIVATE_PACKS)

    @property
    def single(self) -> Measurement | None:
        """One plain session shared by the threads."""
        return self.measurements.get(SINGLE)

    @property
    def metric(self) -> str:
        """The headline metric, upper case, as the sentences name it."""
        first = next(iter(self.measurements.values()), None)
        return first.metric.upper() if first is not None else "PSS"

    @property
    def traffic(self) -> bool:
        """Whether the comparisons use the figures after runs over the indexed tables' rows."""
        return compares_after_traffic(self.measurements)

    @property
    def naive_total(self) -> int | None:
        """What N plain sessions take, as compared."""
        return compared_total(self.naive, self.traffic)

    @property
    def shared_total(self) -> int | None:
        """What the pool of N takes, as compared, sharedml's own cost left out."""
        return compared_total(self.shared, self.traffic)

    @property
    def single_total(self) -> int | None:
        """What one plain session shared by N threads takes, as compared."""
        return compared_total(self.single, self.traffic)

    @property
    def pool_cost(self) -> int | None:
        """What the pool costs a process: its total and sharedml's own cost."""
        shared = self.shared_total
        return shared + self.fixed if shared is not None else None

    @property
    def pool_and_plain(self) -> bool:
        """Whether the pool's cost and plain sessions' total are known to compare."""
        return (
            self.naive is not None
            and self.shared is not None
            and bool(self.naive_total)
            and self.pool_cost is not None
        )

    @property
    def known(self) -> dict[str, int]:
        """The totals the advice compares, by strategy (the pool's with sharedml's own cost)."""
        return {
            name: cost
            for name, cost in (
                (SHARED, self.pool_cost),
                (SINGLE, self.single_total),
                (NAIVE, self.naive_total),
            )
            if cost is not None
        }

    @property
    def runtime_stats(self) -> Mapping[str, Any] | None:
        """What ORT's saved optimized model of this model holds, from any pooled strategy."""
        for m in self.measurements.values():
            stats = m.details.get("runtime_weights")
            if isinstance(stats, Mapping):
                return stats
        return None


Rule = Callable[[Facts], Iterator[Finding]]
"""A rule yields the findings it makes from the facts: none, one, or (one per strategy) more."""


# --------------------------------------------------------------------------------------------
# Words


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def _compare(a: float, b: float) -> str:
    """``"less"``, ``"same"`` (within :data:`SAME_WITHIN` of ``b``) or ``"more"``.

    The band is a share of ``b``'s size: a total is growth, which a reading that shrank makes
    negative, and a value is always the same as itself.
    """
    band = SAME_WITHIN * abs(b)
    if a < b - band:
        return "less"
    if a > b + band:
        return "more"
    return "same"


def _than(a: int, b: int, what: str) -> str:
    """``a`` against ``b`` (called ``what``) in words: "46% less than the pool's 54.0 MiB"."""
    verdict = _compare(a, b)
    if verdict == "less":
        return f"{_pct(b - a, b)} less than {what}"
    if verdict == "more":
        return f"{a / b:.1f}x {what}" if b and a >= 2 * b else f"{_pct(a - b, b)} more than {what}"
    return f"about as much as {what} (within {SAME_WITHIN:.0%})"


# What the advice calls each strategy, and the order it prefers them in where their figures
# are within SAME_WITHIN of the least (README, `sharedml inspect`): the pool gives every thread a
# session of its own and is at least as good where both work; one shared session needs no
# dependency; plain sessions last.
_ADVICE_ORDER = (SHARED, SINGLE, NAIVE)


def _called(name: str, sessions: int) -> str:
    return {
        SHARED: f"sharedml's pool of {sessions}",
        SINGLE: "one plain session shared by the threads",
        NAIVE: f"{sessions} plain sessions",
    }[name]


def _rejected(rejected: Sequence[Mapping[str, Any]]) -> str:
    """The sizes a plain session refused, and why: ``x float32[1, 8]: bad dims; ...``."""
    return "; ".join(f"{', '.join(r['inputs'])}: {str(r['error']).rstrip('.')}" for r in rejected)


# --------------------------------------------------------------------------------------------
# The rules, in the order of RULES


def _input_sizes(facts: Facts) -> Iterator[Finding]:
    """input-sizes, degenerate-inputs: the sizes inspect chose for symbolic dimensions.

    A model's memory depends on them; a size of 1 is degenerate (a detector at 1x1 holds a
    fraction of what it holds at 320x320) and is said so loudly, never passed silently.
    """
    inputs, trial = facts.inputs, facts.trial
    chosen = [c for c in chosen_sizes(inputs) if c.role != "batch"]
    if not chosen:
        return
    degenerate = [c for c in chosen if c.degenerate]
    listed = "; ".join(f"{c.describe()} ({c.why})" for c in chosen)
    rejected = list(trial.get("rejected_sizes") or ()) if trial is not None else []
    if degenerate:
        text = (
            f"These inputs are degenerate: {', '.join(c.describe() for c in degenerate)}. "
            "inspect set them to 1"
        )
        if rejected:
            text += (
                f" because a plain session refused the sizes tried first ({_rejected(rejected)})"
            )
        text += (
            ", and every figure below is for that size, not for the sizes traffic has: "
            "activations, and what the inputs read of the weights, grow with them."
        )
    else:
        text = (
            f"inspect chose sizes nobody gave: {listed}. Memory depends on them (activations, "
            "and what the inputs read of the weights)"
        )
        if rejected:
            text += f"; a plain session refused the sizes tried first ({_rejected(rejected)})"
        text += "."
    named = sorted({c.dim for c in chosen if c.dim != "?"})
    ways = [f"--dim {' --dim '.join(f'{d}=SIZE' for d in named)}"] if named else []
    for spec in inputs:
        images = sorted(c.axis for c in spec.chosen if c.role == "image")
        letters = {axis: "HW"[i] if i < 2 else "S" for i, axis in enumerate(images)}
        letters |= {c.axis: "L" for c in spec.chosen if c.role == "length"}
        if letters:
            shape = "x".join(letters.get(axis, str(size)) for axis, size in enumerate(spec.shape))
            ways.append(f"--shape {spec.name}={shape}")
    text += (
        " Measure at the sizes your traffic has: "
        + ", ".join(ways)
        + " (dims=/shapes= in Python), or real inputs with --inputs feeds.npz."
    )
    figures = {
        "chosen": [c.to_dict() for c in chosen],
        "degenerate": [c.describe() for c in degenerate],
        "rejected": rejected,
    }
    yield Finding("degenerate-inputs" if degenerate else "input-sizes", text, figures)


def _serialized_runs(facts: Facts) -> Iterator[Finding]:
    """serialized-runs: a provider that runs one ``Run`` at a time gets one batched session."""
    serialized = facts.serialized
    if serialized is None:
        return
    provider, version = serialized.provider, serialized.onnxruntime_version
    rule = serialized.rule or "ORT issue #20713"
    text = (
        f"{provider} on onnxruntime {version} runs one Run at a time across the process "
        f"({rule}): {facts.sessions} sessions run no more at once than one, and each uploads "
        "its own device copy of the weights (no device route shares them there). "
    )
    if serialized.not_batchable is None:
        text += (
            "Use one session with batching, the pool's default on this provider "
            f"(SessionPool(model, providers=['{provider}']) is sessions=1, batching=True): "
            "requests that queue while it runs merge into its next Run."
        )
    else:
        text += (
            f"Use one session (the pool's default on this provider); this model cannot be "
            f"batched: {serialized.not_batchable}"
        )
    yield Finding(
        "serialized-runs",
        text,
        {
            "provider": provider,
            "onnxruntime_version": version,
            "batchable": serialized.not_batchable is None,
        },
    )


def _indexed_tables(facts: Facts) -> Iterator[Finding]:
    """indexed-tables: which tables inputs index, what running over their rows added."""
    tables, measurements = facts.tables, facts.measurements
    if not tables:
        return
    hb = human_bytes
    total = sum(t.nbytes for t in tables)
    shown = sorted(tables, key=lambda t: t.nbytes, reverse=True)[:3]
    named = ", ".join(
        f"'{t.name}' {t.dtype}[{'x'.join(map(str, t.shape))}] {hb(t.nbytes)}"
        + (f" by input '{t.input}'" if t.input else " by indices the graph computes")
        for t in shown
    ) + (f" and {len(tables) - len(shown)} more" if len(tables) > len(shown) else "")
    text = (
        f"{len(tables)} weight table{'s' if len(tables) > 1 else ''} ({hb(total)}) "
        f"{'are' if len(tables) > 1 else 'is'} read only at the rows the inputs index "
        f"({named}): a mapped weights file holds only the pages read, so a run on generated "
        "inputs counts a few rows, and traffic reads every row over time."
    )
    figures: dict[str, Any] = {"tables": [t.to_dict() for t in tables], "total_bytes": total}
    measured = {n: m for n, m in measurements.items() if m.traffic_points}
    traffic = facts.traffic
    if traffic:
        info = next(iter(measured.values())).traffic
        rows = dict(info.get("rows") or {})
        covered = ", ".join(
            f"{rows[t.name]} of {t.rows} rows of '{t.name}'" for t in shown if t.name in rows
        )
        changes = "; ".join(
            f"{n} {hb(m.total_bytes)} -> {hb(m.traffic_bytes)}"
            for n, m in measured.items()
            if n in (NAIVE, SHARED, SINGLE)
        )
        text += (
            f" Each session then ran {info.get('runs')} times on inputs whose ids covered "
            f"{covered}"
            + (" (stopped early: the time for it ran out)" if info.get("partial") else "")
            + f", and memory grew ({facts.sessions} sessions): {changes}. The comparisons and "
            "the advice below use these figures after traffic."
        )
        figures |= {"runs": info.get("runs"), "rows": rows, "partial": bool(info.get("partial"))}
    else:
        errors = sorted(
            {str(m.traffic.get("error")) for m in measurements.values() if m.traffic.get("error")}
        )
        why = (
            f"running over their rows failed ({errors[0]})"
            if errors
            else "no input's values reach them unchanged, so inspect cannot choose ids that "
            "cover their rows"
        )
        text += (
            f" The figures below count only what the generated inputs read: {why}. Under "
            f"traffic, up to {hb(total)} more may become resident for each copy of the tables "
            "a strategy keeps."
        )
    figures["after_traffic"] = traffic
    yield Finding("indexed-tables", text, figures)


def _one_session(facts: Facts) -> Iterator[Finding]:
    """one-session: with N = 1 there is nothing to share; ask for more sessions."""
    if facts.sessions != 1 or not facts.pool_and_plain:
        return
    hb, fixed = human_bytes, facts.fixed
    shared_total, naive_total = facts.shared_total, facts.naive_total
    itself = f" and sharedml's own {hb(fixed)} once per process" if fixed else ""
    yield Finding(
        "one-session",
        f"With one session there is nothing to share: the pool takes "
        f"{hb(shared_total)} ({facts.metric}){itself}, a plain session {hb(naive_total)}. "
        "Measure with --sessions 2 or more (sessions=2) to see what each extra "
        "session costs.",
        {"pool_bytes": shared_total, "plain_bytes": naive_total, "fixed_bytes": fixed},
    )


def _pool_vs_plain(facts: Facts) -> Iterator[Finding]:
    """pool-vs-plain: the pool of N (sharedml's own cost included) against N plain sessions."""
    naive, shared = facts.naive, facts.shared
    if facts.sessions == 1 or naive is None or shared is None or not facts.pool_and_plain:
        return
    hb, sessions, traffic, fixed = human_bytes, facts.sessions, facts.traffic, facts.fixed
    big = max(DEFAULT_PROJECTION_SESSIONS[-1], sessions * 2)
    naive_total, shared_total = facts.naive_total or 0, facts.shared_total or 0
    pool = shared_total + fixed
    verdict = _compare(pool, naive_total)
    figures: dict[str, Any] = {
        "sessions": sessions,
        "pool_bytes": shared_total,
        "fixed_bytes": fixed,
        "plain_bytes": naive_total,
        "ratio": pool / naive_total if naive_total else None,
        "verdict": verdict,
        "after_traffic": traffic,
        "plain_per_session_bytes": compared_per_session(naive, traffic),
        "pool_per_session_bytes": compared_per_session(shared, traffic),
    }
    when = (
        "After runs over every row of the tables the inputs index (as traffic reads them over "
        "time), with"
        if traffic
        else "With"
    )
    takes = (
        f"sharedml's pool takes {hb(shared_total)} ({facts.metric}) and sharedml itself "
        f"{hb(fixed)} once per process (its imports and threads), {hb(pool)} in all"
        if fixed
        else f"sharedml's pool takes {hb(shared_total)} ({facts.metric})"
    )
    if verdict == "less":
        text = (
            f"{when} {sessions} sessions, {takes}{',' if fixed else ''} where {sessions} plain "
            "sessions take "
            f"{hb(naive_total)}: {hb(naive_total - pool)} "
            f"({_pct(naive_total - pool, naive_total)}) less."
        )
    elif verdict == "same":
        text = (
            f"{when} {sessions} sessions, {takes}{',' if fixed else ''} and {sessions} plain "
            "sessions "
            f"{hb(naive_total)}: within {SAME_WITHIN:.0%} of each other, so sharing saves "
            "nothing material here."
        )
    else:
        text = (
            f"{when} {sessions} sessions, {takes}: more than {sessions} plain sessions, "
            + _than(pool, naive_total, f"their {hb(naive_total)}")
            + "."
        )
    per_naive = compared_per_session(naive, traffic)
    per_shared = compared_per_session(shared, traffic)
    if per_naive is not None and per_shared is not None:
        text += (
            f" Each extra plain session adds {hb(per_naive)}, each extra pooled "
            f"session {hb(per_shared)}"
        )
        far_naive = compared_projection(naive, big, traffic)
        far_shared = compared_projection(shared, big, traffic)
        if far_naive is not None and far_shared is not None:
            far_pool = far_shared + fixed
            text += (
                f"; at {big} sessions that would be about {hb(far_naive)} against "
                f"{hb(far_pool)} (projected)."
            )
            figures |= {"projected_sessions": big, "plain_projected_bytes": far_naive}
            figures["pool_projected_bytes"] = far_pool
        else:
            text += "."
    yield Finding("pool-vs-plain", text, figures)


def _single_vs_pool(facts: Facts) -> Iterator[Finding]:
    """single-vs-pool: one plain session shared by the N threads against the pool."""
    single_total, pool_cost, sessions = facts.single_total, facts.pool_cost, facts.sessions
    if single_total is None or not pool_cost or sessions <= 1:
        return
    hb, fixed = human_bytes, facts.fixed
    verdict = _compare(single_total, pool_cost)
    pool_what = f"the pool's {hb(pool_cost)}" + (
        f" (sharedml's own {hb(fixed)} included)" if fixed else ""
    )
    text = f"One plain session shared by all {sessions} threads takes {hb(single_total)}, " + _than(
        single_total, pool_cost, pool_what
    )
    text += (
        ": ORT lets several threads run one CPU session at once, so on the CPU that is "
        "the smaller choice; the pool is for threads that each need a session of their "
        "own (DirectML, CUDA graphs, per-thread state)."
        if verdict == "less"
        else "; its threads share that one session's intra-op thread pool, where the "
        "pool gives each thread a session of its own."
    )
    yield Finding(
        "single-vs-pool",
        text,
        {
            "single_bytes": single_total,
            "pool_bytes": pool_cost,
            "fixed_bytes": fixed,
            "verdict": verdict,
        },
    )


def _advice_on(known: Mapping[str, int], sessions: int) -> Finding | None:
    """Name the strategy to use, by the rule README states, from the totals compared.

    The least total is "the least memory"; a strategy within :data:`SAME_WITHIN` of it took
    "about as little", never "the least". Among those, :data:`_ADVICE_ORDER` decides.

    Args:
        known: Bytes by strategy (shared, single, naive), as the comparison counts them.
        sessions: N.
    """
    if sessions < 2 or SHARED not in known or len(known) < 2:
        return None
    least = min(known, key=lambda name: (known[name], _ADVICE_ORDER.index(name)))
    tied = [n for n in _ADVICE_ORDER if n in known and _compare(known[n], known[least]) == "same"]
    chosen = tied[0]
    figures: dict[str, Any] = {
        "least": least,
        "least_bytes": known[least],
        "chosen": chosen,
        "about_as_little": [n for n in tied if n != least],
        "totals": dict(known),
    }
    hb = human_bytes
    if chosen == least:
        measured = ", ".join(
            f"{_called(n, sessions)}: {hb(known[n])}" for n in _ADVICE_ORDER if n in known
        )
        claim = f"of the strategies measured it took the least memory ({measured})"
    else:
        claim = (
            f"it took {hb(known[chosen])}, about as little as the least measured "
            f"({_called(least, sessions)}: {hb(known[least])}, within {SAME_WITHIN:.0%})"
        )
    if chosen == SHARED:
        text = f"Use sharedml.SessionPool(model, sessions={sessions}): {claim}."
        if chosen != least:
            text += " Where figures are that close, README's rule prefers the pool: it gives "
            text += "each thread a session of its own."
    elif chosen == SINGLE:
        text = (
            f"Use one plain session shared by the threads where the provider runs concurrent "
            f"Run calls on one session (CPU): {claim}. Use sharedml.SessionPool(model, "
            f"sessions={sessions}) where each thread needs a session of its own."
        )
    else:
        text = (
            f"Use {sessions} plain sessions: {claim}; sharing does not pay for this model at "
            "this session count."
        )
    return Finding("advice", text, figures)


def _advice(facts: Facts) -> Iterator[Finding]:
    """advice: the strategy to use, by README's rule, from the held totals compared."""
    advice = _advice_on(facts.known, facts.sessions)
    if advice is not None:
        yield advice


def _held_vs_trimmed(facts: Facts) -> Iterator[Finding]:
    """held-vs-trimmed: what the compared strategies hold once glibc gave its freed heap back.

    The advice is on the held figures (a server never trims). This says how much of each is
    heap the C library kept, and whether the trimmed figures would have named another
    strategy, so that a reader who trims (or measures after a trim) sees why the two differ.
    """
    held, sessions, fixed = facts.known, facts.sessions, facts.fixed
    advice = _advice_on(held, sessions)
    if advice is None:
        return
    trimmed: dict[str, int] = {}
    for name in held:
        m = facts.measurements.get(name)
        served = m is not None and m.trimmed and bool(m.held_growth)
        value = m.trimmed_bytes if m is not None and served else None
        if value is None:  # not served, or no malloc_trim here: nothing to set beside held
            return
        trimmed[name] = value + (fixed if name == SHARED else 0)
    hb = human_bytes
    kept = {n: held[n] - trimmed[n] for n in held}
    listed = "; ".join(
        f"{_called(n, sessions)}: {hb(held[n])} held, {hb(trimmed[n])} trimmed"
        for n in _ADVICE_ORDER
        if n in held
    )
    text = (
        "These figures are what a process holds after its sessions ran"
        + (" over the tables' rows" if facts.traffic else "")
        + ", untrimmed, as a server that never calls malloc_trim holds it; against the same "
        f"processes after malloc_trim: {listed}."
    )
    alternative = _advice_on(trimmed, sessions)
    other = alternative.figures["chosen"] if alternative is not None else None
    if other is not None and other != advice.figures["chosen"]:
        text += (
            f" Trimmed, the advice would name {_called(other, sessions)} instead: the freed heap "
            f"that glibc keeps decides it here (up to {hb(max(kept.values()))})."
        )
    yield Finding(
        "held-vs-trimmed",
        text,
        {
            "held": dict(held),
            "trimmed": trimmed,
            "kept_bytes": kept,
            "trimmed_choice": other,
            "after_traffic": facts.traffic,
        },
    )


def _prepacking_off(facts: Facts) -> Iterator[Finding]:
    """prepacking-off: the pool without prepacking, its memory and creation time."""
    raw, shared = facts.raw, facts.shared
    if raw is None or shared is None or not facts.shared_total or raw.total_bytes is None:
        return
    raw_total, shared_total = raw.total_bytes or 0, shared.total_bytes or 0
    rt, dt = raw.init_seconds, shared.init_seconds
    if rt < (1 - SAME_WITHIN) * dt:
        speed = "faster"
    elif rt > (1 + SAME_WITHIN) * dt:
        speed = "slower"
    else:
        speed = "about as fast"
    default = f"the default's {human_bytes(shared_total)}"
    text = (
        f"With prepacking off (prepacking='off') the pool took {human_bytes(raw_total)}, "
        f"{_than(raw_total, shared_total, default)}, and created its sessions in "
        f"{human_seconds(rt)} against {human_seconds(dt)} ({speed}). Its MatMul/Gemm/Conv "
        "kernels run on unpacked weights, slower for batched inputs (docs/cpu-prepacking.md "
        "has figures; inspect does not measure run speed)."
    )
    yield Finding(
        "prepacking-off",
        text,
        {
            "bytes": raw_total,
            "default_bytes": shared_total,
            "memory": _compare(raw_total, shared_total),
            "init_seconds": rt,
            "default_init_seconds": dt,
            "creation": speed,
        },
    )


def _derived_not_shared(facts: Facts) -> Iterator[Finding]:
    """derived-not-shared: a pool setting that leaves ORT's derived weights to each session."""
    raw = facts.raw
    for m in (raw, facts.packs):
        own = m.details.get("runtime_weights") if m is not None else None
        if m is None or not isinstance(own, Mapping) or not own.get("derived_bytes"):
            continue
        derived = int(own["derived_bytes"])
        setting = "prepacking='off'" if m is raw else "prepacking='per-session'"
        yield Finding(
            "derived-not-shared",
            f"{setting} ({m.strategy}) shares only the file's weights: ORT's optimizers "
            f"derive {human_bytes(derived)} of weights from them (fused, folded or dequantized), "
            "which every session derives and keeps for itself.",
            {"strategy": m.strategy, "derived_bytes": derived},
        )


def _per_session_packing(facts: Facts) -> Iterator[Finding]:
    """per-session-packing: what ORT's own per-session prepacking adds per session."""
    shared, packs, naive = facts.shared, facts.packs, facts.naive
    if shared is None or packs is None:
        return
    a, b = shared.per_session_bytes, packs.per_session_bytes
    if a is None or b is None:
        return
    hb, stats = human_bytes, facts.runtime_stats
    basis = max(naive.per_session_bytes or 0 if naive else 0, facts.weights_bytes, 1)
    extra = b - a
    if extra <= SAME_WITHIN * basis:
        text = (
            "ORT's own per-session prepacking (prepacking='per-session') costs about as "
            f"much per session as the default ({hb(b)} against {hb(a)})."
        )
    else:
        text = (
            f"ORT's own per-session prepacking (prepacking='per-session') adds "
            f"{hb(extra)} more per session than the default ({hb(packs.total_bytes)} in "
            f"all at {facts.sessions})"
        )
        packed = int(stats.get("prepacked_bytes") or 0) if stats is not None else None
        derived = int(stats.get("derived_bytes") or 0) if stats is not None else 0
        if packed and derived:
            text += (
                f": each session packs a private copy of the {hb(packed)} of packed "
                f"weights and derives its own {hb(derived)}, which the default shares."
            )
        elif packed:
            text += (
                f": each session packs a private copy of the {hb(packed)} of packed "
                "weights, which the default shares."
            )
        elif derived:
            text += (
                f": ORT packs nothing here, but each session derives its own copy of "
                f"the {hb(derived)} of derived weights, which the default shares."
            )
        else:
            text += "."
    yield Finding(
        "per-session-packing",
        text,
        {"per_session_bytes": b, "default_per_session_bytes": a, "extra_bytes": extra},
    )


def _runtime_weights(facts: Facts) -> Iterator[Finding]:
    """runtime-weights: what plain sessions hold beyond the file's weights, where ORT shows it.

    Only with the saved optimized model's figures: a session's own growth (thread pools,
    arena, kernel state) is no evidence of derived weights by itself.
    """
    naive, stats, weights_bytes = facts.naive, facts.runtime_stats, facts.weights_bytes
    per = naive.per_session_bytes if naive is not None else None
    derived = int(stats.get("derived_bytes") or 0) if stats is not None else 0
    packed = int(stats.get("prepacked_bytes") or 0) if stats is not None else 0
    if per is None or not weights_bytes or not derived + packed:
        return
    if per < _NOTABLE_DERIVED * weights_bytes:
        return
    text = (
        f"Each plain session holds {human_bytes(per)} more than the one before, "
        f"{per / weights_bytes:.1f}x the file's {human_bytes(weights_bytes)} of weights: at load "
        f"ORT derives {human_bytes(derived)} of weights from them (fused, folded, dequantized)"
        + (f" and packs {human_bytes(packed)}" if packed else "")
        + ", and each plain session keeps its own. The pool's saved optimized model holds "
        "them, mapped once for all its sessions."
    )
    figures = {
        "plain_per_session_bytes": per,
        "file_bytes": weights_bytes,
        "derived_bytes": derived,
        "prepacked_bytes": packed,
    }
    yield Finding("runtime-weights", text, figures)


def _unshared_weights(facts: Facts) -> Iterator[Finding]:
    """unshared-weights: weights prepare cannot move, which every session copies."""
    tensors, nbytes = facts.unshared
    if not nbytes or nbytes < _NOTABLE_UNSHARED * max(facts.weights_bytes, 1):
        return
    yield Finding(
        "unshared-weights",
        f"{human_bytes(nbytes)} of weights in {tensors} node attributes or sparse "
        "initializers (ai.onnx.ml parameters, tensor attributes) stay in the graph: "
        "prepare cannot move them, so every session keeps its own copy and no route "
        "shares them.",
        {"tensors": tensors, "bytes": nbytes},
    )


def _nonfinite_outputs(facts: Facts) -> Iterator[Finding]:
    """nonfinite-outputs: the trial run's outputs hold NaN or infinite values, and why."""
    trial = facts.trial
    outputs = list(trial.get("outputs") or ()) if trial is not None else []
    bad = [o for o in outputs if o.get("nonfinite")]
    if not bad:
        return

    def size(o: Mapping[str, Any]) -> int:
        count = 1
        for d in o.get("shape") or ():
            count *= int(d)
        return count

    listed = ", ".join(f"{o['name']}: {o['nonfinite']} of {size(o)}" for o in bad)
    text = (
        f"The outputs of a plain session on these inputs hold NaN or infinite values ({listed}): "
        "a finding in itself, and no strategy's outputs are called equal to a plain session's "
        "where they hold any."
    )
    masks = [i.name for i in facts.inputs if i.dtype == "bool" and i.source != "file"]
    if masks:
        text += (
            f" inspect generated the boolean inputs ({', '.join(masks)}) all False: a mask "
            "that hides every position makes attention divide by zero."
        )
    text += " Give real inputs with --inputs feeds.npz (feeds= in Python)."
    figures = {
        "outputs": {o["name"]: {"nonfinite": o["nonfinite"], "size": size(o)} for o in bad},
        "generated_bool_inputs": masks,
    }
    yield Finding("nonfinite-outputs", text, figures)


def _numerics(facts: Facts) -> Iterator[Finding]:
    """numerics: every strategy's outputs against a default plain session's (the trial run)."""
    measurements = facts.measurements
    compared = {n: m for n, m in measurements.items() if m.matches_plain is not None}
    if not compared:
        return
    differ = {n: m for n, m in compared.items() if not m.matches_plain}
    figures: dict[str, Any] = {
        n: {"max_abs_diff": m.plain_max_abs_diff, "comparable": m.plain_outputs_comparable}
        for n, m in compared.items()
    }
    unknown = [n for n in measurements if n not in compared]
    if not differ:
        if unknown:
            text = (
                f"The outputs of {', '.join(compared)} were bitwise equal to a default plain "
                f"session's; those of {', '.join(unknown)} were not compared."
            )
        else:
            text = "Every strategy's outputs were bitwise equal to a default plain session's."
        yield Finding("numerics", text, figures)
        return
    parts = [
        f"{n} by up to {m.plain_max_abs_diff:.3g}"
        if m.plain_max_abs_diff is not None
        else f"{n} in shape or type"
        for n, m in differ.items()
    ]
    text = (
        "Outputs differ from a default plain session's (largest absolute difference): "
        f"{', '.join(parts)}."
    )
    if SHARED_RAW in differ:
        text += " prepacking='off' runs unpacked kernels, which round differently."
    if any(n not in (NAIVE, SINGLE, SHARED_RAW) for n in differ):
        text += (
            f" The pool gives each CPU session cores // {facts.sessions} intra-op threads, and "
            "dynamically quantizing kernels (DynamicQuantizeLSTM, MatMulInteger) round "
            "differently with another thread count; a plain session given the same "
            "intra_op_num_threads matches the pool (README, SessionPool)."
        )
    yield Finding("numerics", text, figures)


def _stopped(facts: Facts) -> Iterator[Finding]:
    """stopped: a strategy measured fewer sessions than asked, and why (one per strategy)."""
    for m in facts.measurements.values():
        if m.stopped_reason:
            yield Finding("stopped", f"{m.strategy}: {m.stopped_reason}.", {})


RULES: tuple[Rule, ...] = (
    _input_sizes,
    _serialized_runs,
    _indexed_tables,
    _one_session,
    _pool_vs_plain,
    _single_vs_pool,
    _advice,
    _held_vs_trimmed,
    _prepacking_off,
    _derived_not_shared,
    _per_session_packing,
    _runtime_weights,
    _unshared_weights,
    _nonfinite_outputs,
    _numerics,
    _stopped,
)
"""Every rule, in the order the report states their findings: what to measure with first,
then the comparisons and the advice, then what the pool's settings change, then what the
figures rest on (numerics, strategies stopped early)."""


def findings(
    measurements: Mapping[str, Measurement],
    *,
    sessions: int,
    weights_bytes: int,
    unshared: tuple[int, int] = (0, 0),
    serialized: SerializedRuns | None = None,
    fixed_bytes: int | None = None,
    trial: Mapping[str, Any] | None = None,
    inputs: Sequence[InputSpec] = (),
    tables: Sequence[IndexedTable] = (),
) -> tuple[Finding, ...]:
    """The recommendation, computed from the measurements: one :class:`Finding` per statement.

    Comparisons are relative (:data:`SAME_WITHIN`), never absolute: "less", "more" and "about
    the same" say what the figures beside them show, and the advice names the strategy that
    took the least memory, or one that took about as little by the rule README states
    (:data:`_ADVICE_ORDER`). Nothing is said about run speed, which inspect does not measure,
    except as a pointer to the documented figures.

    Where every compared strategy was measured after running over the rows of the tables that
    inputs index (:attr:`Measurement.traffic_bytes`), those figures are compared: traffic reads
    such tables whole over time. Where ``fixed_bytes`` is given, a pool's figures count it when
    they are compared with plain sessions: a process that uses plain onnxruntime does not pay
    for sharedml's imports and threads.

    Args:
        measurements: By strategy name.
        sessions: N.
        weights_bytes: Bytes of the file's weights.
        unshared: ``(tensors, bytes)`` of weights that stay in the graph
            (:attr:`WeightsSummary.unshared`).
        serialized: Where the provider runs one ``Run`` at a time across the process.
        fixed_bytes: sharedml's own cost per process (:class:`FixedCost`), or None.
        trial: The trial run (:attr:`InspectReport.trial`): its outputs' NaN counts.
        inputs: The inputs measured, to name generated masks and guessed sizes.
        tables: The tables inputs index, for what traffic reads of them.
    """
    facts = Facts(
        measurements=measurements,
        sessions=sessions,
        weights_bytes=weights_bytes,
        unshared=unshared,
        serialized=serialized,
        fixed=fixed_bytes or 0,
        trial=trial,
        inputs=inputs,
        tables=tables,
    )
    found = tuple(finding for rule in RULES for finding in rule(facts))
    return found or (
        Finding("none", "Measure at least 'naive' and 'shared' for a recommendation."),
    )


def recommend(measurements: Mapping[str, Measurement], *, sessions: int, weights_bytes: int) -> str:
    """The recommendation as one paragraph: the sentences of :func:`findings`."""
    return " ".join(
        f.text for f in findings(measurements, sessions=sessions, weights_bytes=weights_bytes)
    )
