"""What a measurement found: memory points per session count, a fit, and the figures derived.

Byte figures are growth over the measuring child's baseline (Python, numpy and onnxruntime with
its providers loaded). The per-extra-session cost is a least-squares slope over the measured
points, constrained to be non-negative.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from sharedml._strategies import Strategy

__all__ = ["Measurement", "MemoryPoint"]


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """Memory after ``sessions`` sessions were created and each had run once, concurrently.

    Byte figures are growth over the child's baseline; ``None`` where the platform does not
    report that metric.

    Attributes:
        sessions: Sessions that exist at this point.
        pss_bytes: Proportional set size growth (Linux).
        uss_bytes: Unique set size growth.
        rss_bytes: Resident set size growth.
        untrimmed_bytes: Growth of the headline metric *before* freed heap was given back to
            the OS (see :attr:`Measurement.trimmed`): what the process held, free heap that
            the allocator kept included. Varies from run to run.
        device_bytes: Device memory growth of the child (CUDA), else ``None``.
        create_seconds: Time to create the session added at this point (about 0 where the
            strategy reuses one).
        run_seconds: Wall time of the concurrent run of all ``sessions`` sessions.
        outputs_agree: Every session's outputs at this point were bitwise equal to the first
            session's first run.
    """

    sessions: int
    pss_bytes: int | None
    uss_bytes: int | None
    rss_bytes: int
    untrimmed_bytes: int | None
    device_bytes: int | None
    create_seconds: float
    run_seconds: float
    outputs_agree: bool = True

    def value(self, metric: str) -> int | None:
        """The figure of ``metric``: pss, uss, rss, untrimmed or device."""
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
        metric: The headline memory metric: ``"pss"`` (Linux), ``"uss"`` or ``"rss"``.
        points: One point per session count measured, 1..``sessions`` (fewer if
            ``stopped_reason``).
        baseline_bytes: The child's own memory before any session (``metric``): Python,
            numpy and onnxruntime with its providers loaded. Not included in the points.
        trimmed: Whether freed heap was given back to the OS (glibc ``malloc_trim``) before
            each reading, so that the figures are what the sessions hold.
        setup_seconds: Time to set the strategy up before its first session (e.g. a pool
            opening and verifying its weights file).
        concurrent: Whether the runs of each point were concurrent (not with DirectML, which
            cannot run sessions concurrently).
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

    @property
    def matches_plain(self) -> bool | None:
        """Outputs bitwise equal to a default plain session's; None where not compared."""
        if not self.plain_outputs_compared:
            return None
        return self.plain_outputs_comparable and self.plain_max_abs_diff == 0.0

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

    def projected_bytes(self, sessions: int, metric: str | None = None) -> int | None:
        """Memory at ``sessions`` sessions from the fit (``None`` where there is no fit)."""
        fit = self.fit(metric)
        if fit is None:
            return None
        return max(0, round(fit[0] + fit[1] * sessions))

    def total(self, metric: str | None = None) -> int | None:
        """Memory at :attr:`sessions`: measured, or projected if measuring stopped early."""
        metric = metric or self.metric
        if self.points and self.measured_sessions == self.sessions:
            return self.points[-1].value(metric)
        return self.projected_bytes(self.sessions, metric)

    @property
    def total_bytes(self) -> int | None:
        """Memory of all N sessions after each ran once (headline metric)."""
        return self.total()

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
            "total_bytes": self.total_bytes,
            "total_is_projected": bool(self.points) and self.measured_sessions != self.sessions,
            "per_session_bytes": self.per_session_bytes,
            "intercept_bytes": self.intercept_bytes,
            "pss_bytes": self.total("pss"),
            "uss_bytes": self.total("uss"),
            "rss_bytes": self.total("rss"),
            "untrimmed_bytes": self.total("untrimmed"),
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
            "plain_max_abs_diff": self.plain_max_abs_diff,
            "plain_outputs_compared": self.plain_outputs_compared,
            "details": dict(self.details),
            "measured_sessions": self.measured_sessions,
            "stopped_reason": self.stopped_reason,
            "points": [dataclasses.asdict(p) for p in self.points],
        }

    @classmethod
    def _from_child(cls, strategy: Strategy, sessions: int, raw: Mapping[str, Any]) -> Measurement:
        points = tuple(MemoryPoint(**p) for p in raw["points"])
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
        )
