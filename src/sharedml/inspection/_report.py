"""``sharedml inspect``'s report: what was inspected, measured and found, in one frozen object.

Every figure the CLI prints comes from :class:`InspectReport`, which users also get from
:func:`sharedml.inspect`; ``to_dict`` is the JSON that ``sharedml inspect --json`` prints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sharedml.inspection._compressed import CompressedAccuracy
from sharedml.inspection._findings import Finding
from sharedml.inspection._measure import FixedCost
from sharedml.inspection._results import (
    Measurement,
    compared_projection,
    compares_after_traffic,
)
from sharedml.inspection._strategies import NAIVE, SHARED, SHARED_PRIVATE_PACKS, SHARED_RAW, SINGLE
from sharedml.inspection._weights_summary import WeightsSummary
from sharedml.model._inputs import InputSpec
from sharedml.model._tables import IndexedTable

__all__ = ["InspectReport", "RuntimeWeights", "runtime_weights_by_strategy"]


@dataclasses.dataclass(frozen=True)
class InspectReport:
    """What ``sharedml inspect`` reports; every figure the CLI prints comes from here.

    Attributes:
        model_path: The model inspected.
        demo: Whether it is sharedml's built-in demo model.
        sessions: The session count measured (N).
        providers: The execution providers every strategy used, CPU last.
        inputs: The inputs generated (or given) for the runs.
        weights: The static part.
        measurements: One :class:`~sharedml.inspection._measure.Measurement` per strategy, in the
        order
            measured (none where the trial run failed).
        projection_sessions: The session counts :meth:`projection` covers.
        recommendation: The findings' sentences, as one paragraph.
        onnxruntime_version: The onnxruntime that measured.
        platform: ``platform.platform()`` of the machine.
        findings: The recommendation, one :class:`Finding` per statement, with its figures.
        trial: The trial run (one plain session, ORT's defaults, run once before measuring):
            ``error``, ``outputs``, ``run_seconds``; None where it was not made.
        error: Why the report is partial (the trial run failed), else None.
        fixed_cost: sharedml's own cost per process (imports, its creation thread), measured
            in a fresh process where the pool was measured; None otherwise.
        tables: Weights that inputs index (embeddings), read only where they point: every
            strategy ran over inputs covering their rows after its points
            (:attr:`Measurement.traffic_points`).
        compressed: With ``compress``: the compressed model's accuracy against the float
            model on the same inputs (its memory and run time are the measurement of its
            strategy, :attr:`CompressedAccuracy.strategy`); else None.
        device: The device measured, in words (``"CPU"``; a plugin EP's hardware, as the
            trial run's process chose it).
    """

    model_path: Path
    demo: bool
    sessions: int
    providers: tuple[str, ...]
    inputs: tuple[InputSpec, ...]
    weights: WeightsSummary
    measurements: tuple[Measurement, ...]
    projection_sessions: tuple[int, ...]
    recommendation: str
    onnxruntime_version: str
    platform: str
    findings: tuple[Finding, ...] = ()
    trial: Mapping[str, Any] | None = None
    error: str | None = None
    fixed_cost: FixedCost | None = None
    tables: tuple[IndexedTable, ...] = ()
    compressed: CompressedAccuracy | None = None
    device: str = ""

    @property
    def after_traffic(self) -> bool:
        """Whether the comparisons use figures after runs over the indexed tables' rows."""
        return compares_after_traffic(self.strategies)

    @property
    def fixed_bytes(self) -> int | None:
        """:attr:`fixed_cost` in the headline metric, or None where it was not measured."""
        if self.fixed_cost is None or self.fixed_cost.error is not None:
            return None
        shared = self.strategies.get(SHARED)
        # Both trimmed: the fixed-cost child reads after malloc_trim.
        return self.fixed_cost.bytes(self.metric, shared.trimmed_bytes if shared else None)

    @property
    def weights_bytes(self) -> int:
        """Bytes of every weight of the model."""
        return self.weights.total_bytes

    @property
    def metric(self) -> str:
        """The headline memory metric (``"pss"`` on Linux)."""
        return self.measurements[0].metric if self.measurements else "pss"

    @property
    def strategies(self) -> dict[str, Measurement]:
        """Measurements by strategy name."""
        return {m.strategy: m for m in self.measurements}

    def projection(self, strategy: str) -> dict[int, int | None]:
        """Projected memory of ``strategy`` at each of :attr:`projection_sessions` (fit).

        After runs over the indexed tables' rows where :attr:`after_traffic`.
        """
        m = self.strategies[strategy]
        traffic = self.after_traffic
        return {n: compared_projection(m, n, traffic) for n in self.projection_sessions}

    @property
    def runtime_weights(self) -> dict[str, dict[str, Any]]:
        """What each strategy's sessions hold as weights at run time, beside the file's.

        Per strategy: the measured growth per extra session, the weights ORT derives from the
        file's (``derived_bytes``: fused, folded, dequantized) and packs (``prepacked_bytes``),
        read from ORT's saved optimized model where a pooled strategy built it, and how the
        strategy holds each: ``"once"`` (mapped once for every session), ``"per session"``,
        ``"none"`` (not made: prepacking off) or ``"-"`` (ORT makes none for this model).
        The JSON form of :func:`runtime_weights_by_strategy`.
        """
        return {
            name: dataclasses.asdict(row) for name, row in runtime_weights_by_strategy(self).items()
        }

    def to_dict(self) -> dict[str, Any]:
        """The JSON object that ``sharedml inspect --json`` prints."""
        return {
            "model": str(self.model_path),
            "demo": self.demo,
            "sessions": self.sessions,
            "providers": list(self.providers),
            "device": self.device,
            "onnxruntime": self.onnxruntime_version,
            "platform": self.platform,
            "inputs": [i.to_dict() for i in self.inputs],
            "weights_bytes": self.weights_bytes,
            "tensors": self.weights.tensors,
            "weights": self.weights.to_dict(),
            "error": self.error,
            "trial": dict(self.trial) if self.trial is not None else None,
            "sharedml_fixed_bytes": self.fixed_bytes,
            "indexed_tables": [t.to_dict() for t in self.tables],
            "after_traffic": self.after_traffic,
            "sharedml_fixed": self.fixed_cost.to_dict() if self.fixed_cost is not None else None,
            "memory_metric": self.metric,
            "strategies": {
                m.strategy: m.to_dict()
                | {"projection": {str(n): v for n, v in self.projection(m.strategy).items()}}
                for m in self.measurements
            },
            "runtime_weights": self.runtime_weights,
            "findings": [f.to_dict() for f in self.findings],
            "recommendation": self.recommendation,
            "compressed": self.compressed.to_dict() if self.compressed is not None else None,
        }


@dataclasses.dataclass(frozen=True)
class RuntimeWeights:
    """What one strategy's sessions hold as weights at run time, beside the file's.

    One row of :attr:`InspectReport.runtime_weights` (its JSON form).

    Attributes:
        file_bytes: The file's weights.
        per_session_bytes: The measured growth per extra session (None from one point).
        derived_bytes: Weights ORT derives from the file's (fused, folded, dequantized), read
            from its saved optimized model where a pooled strategy built it; else None.
        prepacked_bytes: Weights ORT packs, from the same model; else None.
        file_weights: How the strategy holds the file's weights: ``"once"``, ``"per
            session"``, ``"once per device"``.
        derived: How it holds the derived ones (``"-"``: ORT derives none for this model).
        packed: How it holds the packed ones (``"none"``: prepacking off; ``"-"``: none).
    """

    file_bytes: int
    per_session_bytes: int | None
    derived_bytes: int | None
    prepacked_bytes: int | None
    file_weights: str
    derived: str
    packed: str


def runtime_weights_by_strategy(report: InspectReport) -> dict[str, RuntimeWeights]:
    """:attr:`InspectReport.runtime_weights`, typed: one :class:`RuntimeWeights` per strategy."""
    stats: Mapping[str, Any] = {}
    for m in report.measurements:
        found = m.details.get("runtime_weights")
        if isinstance(found, Mapping):
            stats = found
            break
    out: dict[str, RuntimeWeights] = {}
    for m in report.measurements:
        raw, derived, packed = _HOLDING.get(
            str(m.details.get("mechanism", "")) if m.details else m.strategy,
            _HOLDING.get(m.strategy, ("?", "?", "?")),
        )
        if m.strategy == SHARED_RAW:
            packed = "none"
        elif m.strategy == SHARED_PRIVATE_PACKS:
            packed = "per session"
        if stats.get("derived_bytes") == 0:
            derived = "-"  # ORT derives nothing from this model
        if stats.get("prepacked_bytes") == 0:
            packed = "-"
        out[m.strategy] = RuntimeWeights(
            file_bytes=report.weights_bytes,
            per_session_bytes=m.per_session_bytes,
            derived_bytes=stats.get("derived_bytes"),
            prepacked_bytes=stats.get("prepacked_bytes"),
            file_weights=raw,
            derived=derived,
            packed=packed,
        )
    return out


# How each mechanism (or plain strategy) holds the file's weights, the derived ones, the packed.
_HOLDING = {
    NAIVE: ("per session", "per session", "per session"),
    SINGLE: ("once", "once", "once"),
    "prepacked-file": ("once", "once", "once"),
    "optimized-file": ("once", "once", "none"),
    "in-memory-file": ("once", "per session", "per session"),
    "add-initializer": ("once", "per session", "per session"),
    "ort-mmap": ("once", "per session", "per session"),
    "device": ("once per device", "per session", "per session"),
}
