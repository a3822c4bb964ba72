"""What a measurement found: memory points per session count, a fit, and the figures derived.

Byte figures are growth over the measuring child's baseline (Python, numpy and onnxruntime with
its providers loaded). The per-extra-session cost is a least-squares slope over the measured
points, constrained to be non-negative. The points are read after ``malloc_trim`` (repeatable);
the headline total is what a second fresh process that created the N sessions and served them
holds without trimming (``held``), as a server does, with its trimmed figure beside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sharedml.inspection._strategies import NAIVE, SHARED, SINGLE, Strategy

__all__ = [
    "DEFAULT_PROJECTION_SESSIONS",
    "Measurement",
    "MemoryPoint",
    "compared_per_session",
    "compared_projection",
    "compared_total",
    "compares_after_traffic",
]


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """Memory after ``sessions`` sessions were created and had run concurrently until it settled.

    Byte figures are growth over the child's baseline; ``None`` where the platform does not
    report that metric.

    Attributes:
        sessions: Sessions that exist at this point.
        pss_bytes: Proportional set size growth (Linux).
        uss_bytes: Unique set size growth.
        rss_bytes: Resident set size growth (the working set on Windows).
        untrimmed_bytes: Growth of the headline metric *before* freed heap was given back to
            the OS (see :attr:`Measurement.trimmed`): what the process held, free heap that
            the allocator kept included. Varies from run to run.
        device_bytes: Device memory growth of the child (CUDA), else ``None``.
        create_seconds: Time to create the session added at this point (about 0 where the
            strategy reuses one).
        run_seconds: Wall time of the concurrent run of all ``sessions`` sessions.
        outputs_agree: Every session's outputs at this point were bitwise equal to the first
            session's first run.
        private_bytes: Private bytes growth (Windows: memory no other process can share;
            mapped files are not in it), else ``None``.
        rounds: How many times the sessions ran together before memory was read: until a
            round added no memory (ORT allocates a shape's planned activation memory on its
            second run), at most five.
        settled: The last round added no memory; False where the rounds ran out first.
    """

    sessions: int
    pss_bytes: int | None
    uss_bytes: int | None
    rss_bytes: int | None
    untrimmed_bytes: int | None
    device_bytes: int | None
    create_seconds: float
    run_seconds: float
    outputs_agree: bool = True
    private_bytes: int | None = None
    rounds: int = 1
    settled: bool = True

    def value(self, metric: str) -> int | None:
        """The figure of ``metric``: pss, uss, rss, private, untrimmed or device."""
        value: int | None = getattr(self, f"{metric}_bytes")
        return value


def _fit(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of y over x, the slope constrained to be >= 0.

    An extra session cannot make the others smaller; a negative slope is measurement noise
    (a few hundred KiB of thread stacks and allocator state) and would project memory
    shrinking towards zero. The constrained optimum is then the flat line through the mean.

    Returns:
        ``None`` with fewer than two distinct x.
    """
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = max(0.0, sxy / sxx)
    return mean_y - slope * mean_x, slope


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What one strategy cost at one session count, measured in a fresh process.

    Attributes:
        strategy: The strategy's name.
        summary: The strategy's one-line description.
        sessions: The session count asked for.
        metric: The headline memory metric: ``"pss"`` (Linux), ``"uss"``, ``"rss"`` or
            ``"private"``, the first of them this platform let the child read.
        points: One point per session count measured, 1..``sessions`` (fewer if
            ``stopped_reason``).
        baseline_bytes: The child's own memory before any session (``metric``): Python,
            numpy and onnxruntime with its providers loaded. Not included in the points.
        trimmed: Whether freed heap was given back to the OS (glibc ``malloc_trim``) before
            each point's reading, so that the points are what the sessions hold.
        setup_seconds: Time to set the strategy up before its first session (e.g. a pool
            opening and verifying its weights file).
        concurrent: Whether the runs of each point were concurrent (not where the provider
            table serializes runs: DirectML, WebGPU, a provider it does not know).
        device_metric: How device memory was read (``"nvml"``, ``"nvidia-smi"``), or ``None``.
        device_note: Why device memory is missing, where a GPU provider was used.
        stopped_reason: Why fewer sessions than asked were created (memory running out).
        onnxruntime_version: The onnxruntime version of the child.
        details: What the strategy reported about its sessions (a pool's ``mechanism``,
            ``mechanism_reason`` and ``runtime_weights``), see :class:`~sharedml.SessionSet`.
        plain_max_abs_diff: The largest absolute difference of the first session's first
            outputs from a default plain session's (``inspect``'s trial run), None where not
            compared (or shapes differ: see ``plain_outputs_comparable``).
        plain_outputs_compared: How many (numeric array) outputs that compared.
        plain_outputs_comparable: Every compared output had the plain session's shape, dtype
            and NaN positions.
        metric_note: Why the headline metric is not PSS and what that metric leaves out or
            counts twice (psutil could not read PSS here), else None.
        plain_outputs_nonfinite: NaN and infinite values in the first session's first outputs
            (or in the plain session's it was compared with): where there are any, the outputs
            are not called equal (:attr:`matches_plain` is None).
        traffic_points: Where the model has tables that inputs index (embeddings: see
            :func:`sharedml.model._tables.indexed_tables`), memory after the sessions ran over
            inputs
            whose indices cover the tables' rows, as traffic does over time: point k is all
            :attr:`measured_sessions` sessions, sessions 1..k having run over them. Empty where
            there are no such tables or the runs failed (:attr:`traffic`).
        traffic: How those runs went: ``runs`` per session, ``rows`` covered per table,
            ``seconds``, ``error`` (why they failed), ``partial`` (stopped before covering
            every row, ``seconds`` ran out).
        held_growth: Growth per metric (``pss``, ``uss``, ``rss``, ``private``) of a second
            fresh process that created all N sessions, then ran them together round after
            round (:attr:`served_rounds`, until memory settled) and never trimmed: what a
            server that served such traffic holds, the freed heap that glibc keeps included.
            Empty where it was not measured (measuring stopped early: projected instead).
        trimmed_growth: The same process's growth once ``malloc_trim`` gave that freed heap
            back: what its sessions themselves hold.
        served_rounds: How many rounds that process ran its sessions together.
    """

    strategy: str
    summary: str
    sessions: int
    metric: str
    points: tuple[MemoryPoint, ...]
    baseline_bytes: int
    trimmed: bool
    setup_seconds: float
    concurrent: bool
    device_metric: str | None = None
    device_note: str | None = None
    stopped_reason: str | None = None
    onnxruntime_version: str = ""
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    plain_max_abs_diff: float | None = None
    plain_outputs_compared: int = 0
    plain_outputs_comparable: bool = True
    metric_note: str | None = None
    plain_outputs_nonfinite: int = 0
    traffic_points: tuple[MemoryPoint, ...] = ()
    traffic: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    held_growth: Mapping[str, int | None] = dataclasses.field(default_factory=dict)
    trimmed_growth: Mapping[str, int | None] = dataclasses.field(default_factory=dict)
    served_rounds: int = 0

    @property
    def matches_plain(self) -> bool | None:
        """Outputs bitwise equal to a default plain session's; None where that is not known.

        Not known where nothing was compared, and where the outputs hold NaN or infinite
        values: NaN in the same places is no evidence that two runs computed the same thing
        (a mask of all False gives NaN everywhere, whatever the weights).
        """
        if not self.plain_outputs_compared or self.plain_outputs_nonfinite:
            return None
        return self.plain_outputs_comparable and self.plain_max_abs_diff == 0.0

    @property
    def matches_plain_reason(self) -> str | None:
        """Why :attr:`matches_plain` is not True: one clause, or None where it is True."""
        if not self.plain_outputs_compared:
            return "not compared: no numeric outputs, or no plain session's outputs to compare"
        if self.plain_outputs_nonfinite:
            return (
                f"not compared: the outputs hold {self.plain_outputs_nonfinite} NaN or infinite "
                "values"
            )
        if not self.plain_outputs_comparable:
            return "the outputs differ in shape or type from a plain session's"
        if self.plain_max_abs_diff:
            return f"the outputs differ by up to {self.plain_max_abs_diff:.3g}"
        return None

    @property
    def measured_sessions(self) -> int:
        """The largest session count actually measured."""
        return self.points[-1].sessions if self.points else 0

    def fit(self, metric: str | None = None) -> tuple[float, float] | None:
        """(intercept, per-session slope) in bytes: least squares over the points, slope >= 0.

        Returns ``None`` with fewer than two points or where the metric is missing.
        """
        metric = metric or self.metric
        pts = [(p.sessions, p.value(metric)) for p in self.points]
        known = [(x, float(y)) for x, y in pts if y is not None]
        if len(known) != len(pts):
            return None
        return _fit(known)

    @property
    def per_session_bytes(self) -> int | None:
        """What each extra session costs (slope of the fit); ``None`` from a single point."""
        fit = self.fit()
        return None if fit is None else round(fit[1])

    @property
    def intercept_bytes(self) -> int | None:
        """The fit's value at zero sessions: what the strategy costs once, whatever N is."""
        fit = self.fit()
        return None if fit is None else round(fit[0])

    def kept_bytes(self, metric: str | None = None) -> int:
        """The freed heap a serving process kept: held less trimmed at N (0 where not read).

        At least 0: a trim gives memory back, and a trimmed reading above the held one is the
        noise of PSS (other processes mapping the same libraries move it).
        """
        metric = metric or self.metric
        held, trimmed = self.held_growth.get(metric), self.trimmed_growth.get(metric)
        return max(0, int(held) - int(trimmed)) if held is not None and trimmed is not None else 0

    def projected_bytes(self, sessions: int, metric: str | None = None) -> int | None:
        """Memory held at ``sessions`` sessions: the fit plus :meth:`kept_bytes` (None: no fit)."""
        fit = self.fit(metric)
        if fit is None:
            return None
        return max(0, round(fit[0] + fit[1] * sessions) + self.kept_bytes(metric))

    def total(self, metric: str | None = None) -> int | None:
        """Memory held at :attr:`sessions`: measured, or projected if measuring stopped early.

        Measured: the serving process's untrimmed figure (:attr:`held_growth`), where it has
        one for ``metric``; else the last point's.
        """
        metric = metric or self.metric
        held = self.held_growth.get(metric)
        if held is not None:
            return int(held)
        if self.points and self.measured_sessions == self.sessions:
            return self.points[-1].value(metric)
        return self.projected_bytes(self.sessions, metric)

    @property
    def total_bytes(self) -> int | None:
        """Memory of all N sessions, served until it settled, held (headline metric).

        As a server holds it: the freed heap the C library keeps after the sessions were
        created and ran is in it (nothing was trimmed), which is what the advice compares.
        The same as :attr:`held_bytes`; :attr:`trimmed_bytes` is the figure after a trim.
        """
        return self.total()

    @property
    def held_bytes(self) -> int | None:
        """:attr:`total_bytes`: what the process holds after traffic, untrimmed."""
        return self.total()

    def trimmed_total(self, metric: str | None = None) -> int | None:
        """Memory of all N sessions once ``malloc_trim`` gave freed heap back.

        The serving process's trimmed figure where it has one; else the points' (which are
        trimmed): the last one, or the fit's projection where measuring stopped early.
        """
        metric = metric or self.metric
        trimmed = self.trimmed_growth.get(metric)
        if trimmed is not None:
            return int(trimmed)
        if self.points and self.measured_sessions == self.sessions:
            return self.points[-1].value(metric)
        fit = self.fit(metric)
        return None if fit is None else max(0, round(fit[0] + fit[1] * self.sessions))

    @property
    def trimmed_bytes(self) -> int | None:
        """:meth:`trimmed_total` of the headline metric."""
        return self.trimmed_total()

    def _traffic_fit(self, metric: str | None = None) -> tuple[float, float] | None:
        """(intercept, slope) of what running over the tables added, against sessions run."""
        metric = metric or self.metric
        if not self.traffic_points or not self.points:
            return None
        before = self.points[-1].value(metric)
        added = [(p.sessions, p.value(metric)) for p in self.traffic_points]
        if before is None or any(v is None for _k, v in added):
            return None
        known = [(k, float(v) - before) for k, v in added if v is not None]
        if len(known) == 1:  # one session: what it added, none of it known to be shared
            return 0.0, known[0][1]
        return _fit(known)

    def traffic_total(self, metric: str | None = None) -> int | None:
        """Memory of all N sessions once each ran over the tables' rows (measured or projected).

        None where there are no indexed tables, or running over them failed.
        """
        metric = metric or self.metric
        if not self.traffic_points:
            return None
        if self.measured_sessions == self.sessions and len(self.traffic_points) == self.sessions:
            value = self.traffic_points[-1].value(metric)
            return None if value is None else value + self.kept_bytes(metric)
        return self.traffic_projected_bytes(self.sessions, metric)

    @property
    def traffic_bytes(self) -> int | None:
        """:meth:`traffic_total` of the headline metric."""
        return self.traffic_total()

    @property
    def traffic_per_session_bytes(self) -> int | None:
        """What each extra session costs once every session has run over the tables' rows."""
        fit, added = self.fit(), self._traffic_fit()
        if fit is None or added is None:
            return None
        return round(fit[1] + added[1])

    def traffic_projected_bytes(self, sessions: int, metric: str | None = None) -> int | None:
        """Memory at ``sessions`` sessions that all ran over the tables' rows (two fits)."""
        fit, added = self.fit(metric), self._traffic_fit(metric)
        if fit is None or added is None:
            return None
        kept = self.kept_bytes(metric)
        return max(0, round(fit[0] + added[0] + (fit[1] + added[1]) * sessions) + kept)

    @property
    def init_seconds(self) -> float:
        """Setup plus creating every session."""
        return self.setup_seconds + sum(p.create_seconds for p in self.points)

    @property
    def outputs_agree(self) -> bool:
        """Every run of every session gave the same outputs as the first one."""
        return all(p.outputs_agree for p in self.points)

    @property
    def first_run_seconds(self) -> float | None:
        """The first run of the first session, alone."""
        return self.points[0].run_seconds if self.points else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (what ``sharedml inspect --json`` prints under ``strategies``)."""
        last = self.points[-1] if self.points else None
        return {
            "summary": self.summary,
            "metric": self.metric,
            "metric_note": self.metric_note,
            "total_bytes": self.total_bytes,
            "total_is_projected": bool(self.points) and self.measured_sessions != self.sessions,
            "per_session_bytes": self.per_session_bytes,
            "intercept_bytes": self.intercept_bytes,
            "pss_bytes": self.total("pss"),
            "uss_bytes": self.total("uss"),
            "rss_bytes": self.total("rss"),
            "private_bytes": self.total("private"),
            "untrimmed_bytes": self.total("untrimmed"),
            "held_bytes": self.held_bytes,
            "trimmed_bytes": self.trimmed_bytes,
            "kept_bytes": self.kept_bytes(),
            "held_growth": dict(self.held_growth),
            "trimmed_growth": dict(self.trimmed_growth),
            "served_rounds": self.served_rounds,
            "device_bytes": last.device_bytes if last is not None else None,
            "device_metric": self.device_metric,
            "device_note": self.device_note,
            "baseline_bytes": self.baseline_bytes,
            "trimmed": self.trimmed,
            "init_seconds": self.init_seconds,
            "setup_seconds": self.setup_seconds,
            "first_run_seconds": self.first_run_seconds,
            "concurrent_runs": self.concurrent,
            "outputs_agree": self.outputs_agree,
            "matches_plain": self.matches_plain,
            "matches_plain_reason": self.matches_plain_reason,
            "plain_outputs_nonfinite": self.plain_outputs_nonfinite,
            "plain_max_abs_diff": self.plain_max_abs_diff,
            "plain_outputs_compared": self.plain_outputs_compared,
            "details": dict(self.details),
            "measured_sessions": self.measured_sessions,
            "stopped_reason": self.stopped_reason,
            "points": [dataclasses.asdict(p) for p in self.points],
            "traffic_bytes": self.traffic_bytes,
            "traffic_per_session_bytes": self.traffic_per_session_bytes,
            "traffic": dict(self.traffic),
            "traffic_points": [dataclasses.asdict(p) for p in self.traffic_points],
        }

    @classmethod
    def _from_child(
        cls,
        strategy: Strategy,
        sessions: int,
        raw: Mapping[str, Any],
        served: Mapping[str, Any] | None = None,
    ) -> Measurement:
        points = tuple(MemoryPoint(**p) for p in raw["points"])
        traffic_points = tuple(MemoryPoint(**p) for p in raw.get("traffic_points") or ())
        return cls(
            strategy=strategy.name,
            summary=strategy.summary,
            sessions=sessions,
            metric=raw["metric"],
            points=points,
            baseline_bytes=int(raw["baseline_bytes"]),
            trimmed=bool(raw["trimmed"]),
            setup_seconds=float(raw["setup_seconds"]),
            concurrent=bool(raw["concurrent"]),
            device_metric=raw.get("device_metric"),
            device_note=raw.get("device_note"),
            stopped_reason=raw.get("stopped_reason"),
            onnxruntime_version=str(raw.get("onnxruntime", "")),
            details=dict(raw.get("details") or {}),
            plain_max_abs_diff=raw.get("plain_max_abs_diff"),
            plain_outputs_compared=int(raw.get("plain_outputs_compared") or 0),
            plain_outputs_comparable=bool(raw.get("plain_outputs_comparable", True)),
            metric_note=raw.get("metric_note"),
            plain_outputs_nonfinite=int(raw.get("plain_outputs_nonfinite") or 0),
            traffic_points=traffic_points,
            traffic=dict(raw.get("traffic") or {}),
            held_growth=dict(served["held"]) if served else {},
            trimmed_growth=dict(served["trimmed"]) if served else {},
            served_rounds=int(served["rounds"]) if served else 0,
        )


# --------------------------------------------------------------------------------------------
# The figures a report compares: after runs over the indexed tables' rows, where every compared
# strategy has them (traffic reads such tables whole over time), else as measured.

DEFAULT_PROJECTION_SESSIONS = (1, 2, 4, 8, 16, 32)
"""The session counts a report projects memory to unless given others."""


def compares_after_traffic(measurements: Mapping[str, Measurement]) -> bool:
    """Compare figures after the table-covering runs: only where every compared one has them."""
    compared = [measurements[n] for n in (NAIVE, SHARED, SINGLE) if n in measurements]
    return bool(compared) and all(m.traffic_bytes is not None for m in compared)


def compared_total(m: Measurement | None, traffic: bool) -> int | None:
    """``m``'s memory at N sessions, after traffic where ``traffic``; None without ``m``."""
    if m is None:
        return None
    return m.traffic_bytes if traffic else m.total_bytes


def compared_per_session(m: Measurement, traffic: bool) -> int | None:
    """What each extra session of ``m`` costs, after traffic where ``traffic``."""
    return m.traffic_per_session_bytes if traffic else m.per_session_bytes


def compared_projection(m: Measurement, sessions: int, traffic: bool) -> int | None:
    """``m``'s memory projected to ``sessions`` sessions, after traffic where ``traffic``."""
    return m.traffic_projected_bytes(sessions) if traffic else m.projected_bytes(sessions)
