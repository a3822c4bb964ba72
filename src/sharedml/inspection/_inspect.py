"""``sharedml.inspect``: what a model's weights are, and what N sessions of it cost per strategy.

The report has a static part, read from the model's protobuf without loading external data
(how many bytes of weights, where they sit, the largest tensors, what ``prepare`` would move),
and a measured part: each strategy (:mod:`sharedml.inspection._measure`) measured in a fresh
subprocess,
one after another, with a least-squares fit of memory against the session count that projects
other counts, and a recommendation computed from those figures. The CLI (``sharedml inspect``)
only renders this report.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._units import human_bytes, human_seconds
from sharedml.inspection._compressed import CompressedAccuracy
from sharedml.inspection._measure import FixedCost, measure
from sharedml.inspection._results import Measurement
from sharedml.inspection._strategies import (
    NAIVE,
    SHARED,
    SHARED_PRIVATE_PACKS,
    SHARED_RAW,
    SINGLE,
    get_strategy,
    registered_strategies,
)
from sharedml.model._dtypes import onnx_name
from sharedml.model._graph import (
    ExternalData,
    Placement,
    iter_attribute_weights,
    iter_tensors,
    tensor_nbytes,
)
from sharedml.model._inputs import SIZE_CHOICES, InputSpec, chosen_sizes, input_specs
from sharedml.model._tables import IndexedTable, indexed_tables

__all__ = [
    "DEFAULT_PROJECTION_SESSIONS",
    "SAME_WITHIN",
    "Finding",
    "InspectProgress",
    "InspectReport",
    "PlacementSummary",
    "SerializedRuns",
    "TensorInfo",
    "WeightsSummary",
    "findings",
    "inspect",
    "recommend",
    "summarize_weights",
]

DEFAULT_PROJECTION_SESSIONS = (1, 2, 4, 8, 16, 32)
_LARGEST_SHOWN = 5

InspectProgress = Callable[[str, int, int], None]
"""Called as ``progress(description, steps_done, steps_total)``; a step is one session measured."""

# Weights prepare leaves in the graph, which every session therefore copies for itself.
UNSHARED_PLACEMENTS = ("node attributes", "sparse initializers")
# Where a tensor's bytes sit; exclusive, in the order reports list them.
PLACEMENTS = (
    "initializers",
    "Constant nodes",
    "node attributes",
    "subgraphs",
    "external files",
    "sparse initializers",
)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One weight of the model.

    Attributes:
        name: The tensor's name (a Constant node's output name).
        dtype: ONNX element type, lower case (``"float"``, ``"int64"``...).
        shape: Its dimensions.
        nbytes: Its data size in bytes.
        placement: One of :data:`PLACEMENTS`.
        file: The external data file, for tensors stored in one.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    placement: str
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self) | {"shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class PlacementSummary:
    """The tensors of one placement: how many, how many bytes."""

    placement: str
    tensors: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class WeightsSummary:
    """The static part of the report: the model's weights, read without loading them.

    Attributes:
        total_bytes: Bytes of every weight (initializers, Constant nodes, subgraphs, external,
            node attributes: ``ai.onnx.ml`` parameters count, 4 bytes a float, 8 an int).
        tensors: How many tensors (and parameter attributes) that is.
        placements: Tensors and bytes per placement (only placements that occur).
        external_files: ``(file, bytes)`` of each external data file the model refers to.
        largest: The largest tensors, largest first.
        already_prepared: The model was written by ``sharedml.prepare``.
        prepare_moves_tensors: Tensors ``prepare`` would put in the weights file.
        prepare_moves_bytes: Their bytes.
        prepare_leaves_tensors: Tensors it would leave in the graph (small initializers and
            ``Constant`` nodes; node attributes are counted in ``unshared``).
        prepare_leaves_bytes: Their bytes.
        prepare_converts_constants: Constant nodes it would turn into initializers.
    """

    total_bytes: int
    tensors: int
    placements: tuple[PlacementSummary, ...]
    external_files: tuple[tuple[str, int], ...]
    largest: tuple[TensorInfo, ...]
    already_prepared: bool
    prepare_moves_tensors: int
    prepare_moves_bytes: int
    prepare_leaves_tensors: int
    prepare_leaves_bytes: int
    prepare_converts_constants: int

    @property
    def unshared(self) -> tuple[int, int]:
        """``(tensors, bytes)`` that stay in the graph where no route can share them.

        Node attributes (``ai.onnx.ml`` parameters, tensor attributes other than a
        ``Constant``'s) and sparse initializers: prepare cannot move them, so ORT copies them
        into every session.
        """
        chosen = [p for p in self.placements if p.placement in UNSHARED_PLACEMENTS]
        return sum(p.tensors for p in chosen), sum(p.nbytes for p in chosen)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "total_bytes": self.total_bytes,
            "tensors": self.tensors,
            "unshared": {"tensors": self.unshared[0], "bytes": self.unshared[1]},
            "placements": {
                p.placement: {"tensors": p.tensors, "bytes": p.nbytes} for p in self.placements
            },
            "external_files": [{"file": f, "bytes": b} for f, b in self.external_files],
            "largest": [t.to_dict() for t in self.largest],
            "prepare": {
                "already_prepared": self.already_prepared,
                "moves_tensors": self.prepare_moves_tensors,
                "moves_bytes": self.prepare_moves_bytes,
                "leaves_tensors": self.prepare_leaves_tensors,
                "leaves_bytes": self.prepare_leaves_bytes,
                "converts_constants": self.prepare_converts_constants,
            },
        }


def _dtype_name(data_type: int) -> str:
    try:
        return onnx_name(data_type)
    except ValueError:
        return f"type{data_type}"


def _tensor_bytes(tensor: Any) -> int:
    size = tensor_nbytes(tensor)
    if size is not None:
        return size
    if ExternalData.of(tensor) is None:  # inline strings: what they hold
        return sum(len(s) for s in tensor.string_data)
    return 0


_PLACEMENT_NAMES = {
    Placement.INITIALIZER: "initializers",
    Placement.CONSTANT: "Constant nodes",
    Placement.ATTRIBUTE: "node attributes",
    Placement.SPARSE: "sparse initializers",
}


def summarize_weights(model: Any, model_path: str | os.PathLike[str]) -> WeightsSummary:
    """The static part of the report for ``model`` (an ``onnx.ModelProto`` without data).

    Args:
        model: As :func:`sharedml.model._graph.load_graph` returns it. It is modified (prepare's
            plan converts large Constant nodes in place): pass a model you no longer need.
        model_path: The model's file, to resolve external data.

    Raises:
        ExternalDataError: external data that prepare would refuse (missing, short, unsafe).
    """
    from onnx import AttributeProto as onnx_attr

    from sharedml.prepared._format import read_manifest
    from sharedml.prepared._plan import DEFAULT_SIZE_THRESHOLD_BYTES, plan_weights

    tensors: list[TensorInfo] = []
    for ref in iter_tensors(model.graph):
        info = ExternalData.of(ref.tensor)
        if info is not None:
            placement = "external files"
        elif ref.depth > 0 and ref.placement is not Placement.SPARSE:
            placement = "subgraphs"
        else:
            placement = _PLACEMENT_NAMES[ref.placement]
        tensors.append(
            TensorInfo(
                name=ref.name or "<unnamed>",
                dtype=_dtype_name(ref.tensor.data_type),
                shape=tuple(int(d) for d in ref.tensor.dims),
                nbytes=_tensor_bytes(ref.tensor),
                placement=placement,
                file=info.location if info is not None else None,
            )
        )
    for node, attr, nbytes in iter_attribute_weights(model.graph):
        kind = {onnx_attr.FLOATS: "float", onnx_attr.INTS: "int64"}.get(attr.type, "string")
        count = len(attr.floats) or len(attr.ints) or len(attr.strings)
        tensors.append(
            TensorInfo(
                name=f"{node.name or node.op_type}.{attr.name}",
                dtype=kind,
                shape=(count,),
                nbytes=nbytes,
                placement="node attributes",
            )
        )
    placements = []
    for placement in PLACEMENTS:
        chosen = [t for t in tensors if t.placement == placement]
        if chosen:
            placements.append(
                PlacementSummary(placement, len(chosen), sum(t.nbytes for t in chosen))
            )
    files: dict[str, int] = {}
    for t in tensors:
        if t.file is not None:
            files[t.file] = files.get(t.file, 0) + t.nbytes
    largest = sorted(tensors, key=lambda t: t.nbytes, reverse=True)[:_LARGEST_SHOWN]

    already = read_manifest(model) is not None
    # prepare's own plan, so that "what prepare would move" cannot drift from prepare.
    plan = plan_weights(model, Path(model_path), DEFAULT_SIZE_THRESHOLD_BYTES)
    return WeightsSummary(
        total_bytes=sum(t.nbytes for t in tensors),
        tensors=len(tensors),
        placements=tuple(placements),
        external_files=tuple(sorted(files.items())),
        largest=tuple(largest),
        already_prepared=already,
        prepare_moves_tensors=len(plan.moving),
        prepare_moves_bytes=plan.moving_bytes,
        prepare_leaves_tensors=plan.inline_tensors,
        prepare_leaves_bytes=plan.inline_bytes,
        prepare_converts_constants=plan.constants_converted,
    )


# --------------------------------------------------------------------------------------------
# The report


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
        return _use_traffic(self.strategies)

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
        return {n: _projected(m, n, traffic) for n in self.projection_sessions}

    @property
    def runtime_weights(self) -> dict[str, dict[str, Any]]:
        """What each strategy's sessions hold as weights at run time, beside the file's.

        Per strategy: the measured growth per extra session, the weights ORT derives from the
        file's (``derived_bytes``: fused, folded, dequantized) and packs (``prepacked_bytes``),
        read from ORT's saved optimized model where a pooled strategy built it, and how the
        strategy holds each: ``"once"`` (mapped once for every session), ``"per session"``,
        ``"none"`` (not made: prepacking off) or ``"-"`` (ORT makes none for this model).
        """
        stats: Mapping[str, Any] = {}
        for m in self.measurements:
            found = m.details.get("runtime_weights")
            if isinstance(found, Mapping):
                stats = found
                break
        out: dict[str, dict[str, Any]] = {}
        for m in self.measurements:
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
            out[m.strategy] = {
                "file_bytes": self.weights_bytes,
                "per_session_bytes": m.per_session_bytes,
                "derived_bytes": stats.get("derived_bytes"),
                "prepacked_bytes": stats.get("prepacked_bytes"),
                "file_weights": raw,
                "derived": derived,
                "packed": packed,
            }
        return out

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


# --------------------------------------------------------------------------------------------
# Recommendation: every sentence from the measured figures

SAME_WITHIN = 0.10
"""Two figures within this fraction of each other are "about the same": wider than what repeat
measurements of one configuration differ by (docs/inspect.md has the figures)."""
_NOTABLE_DERIVED = 1.5  # a plain session holding this many times the file's weights: say why
_NOTABLE_UNSHARED = 0.01  # unshared weights this share of the file's are worth a finding


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def _compare(a: float, b: float) -> str:
    """``"less"``, ``"same"`` (within :data:`SAME_WITHIN` of ``b``) or ``"more"``."""
    if a < (1 - SAME_WITHIN) * b:
        return "less"
    if a > (1 + SAME_WITHIN) * b:
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
    out: list[Finding] = []
    sizes = _input_sizes(inputs, trial)
    if sizes is not None:
        out.append(sizes)
    if serialized is not None:
        out.append(_serialized_runs(serialized, sessions))
    read = _tables_read(tables, measurements, sessions)
    if read is not None:
        out.append(read)
    stats = _runtime_stats(measurements)
    naive = measurements.get(NAIVE)
    shared = measurements.get(SHARED)
    packs = measurements.get(SHARED_PRIVATE_PACKS)
    raw = measurements.get(SHARED_RAW)
    single = measurements.get(SINGLE)
    big = max(DEFAULT_PROJECTION_SESSIONS[-1], sessions * 2)
    metric = next(iter(measurements.values())).metric.upper() if measurements else "PSS"
    hb = human_bytes

    traffic = _use_traffic(measurements)
    fixed = fixed_bytes or 0
    naive_total = _total(naive, traffic)
    shared_total = _total(shared, traffic)
    pool_cost = shared_total + fixed if shared_total is not None else None
    if naive is not None and shared is not None and naive_total and pool_cost is not None:
        if sessions == 1:
            itself = f" and sharedml's own {hb(fixed)} once per process" if fixed else ""
            out.append(
                Finding(
                    "one-session",
                    f"With one session there is nothing to share: the pool takes "
                    f"{hb(shared_total)} ({metric}){itself}, a plain session {hb(naive_total)}. "
                    "Measure with --sessions 2 or more (sessions=2) to see what each extra "
                    "session costs.",
                    {"pool_bytes": shared_total, "plain_bytes": naive_total, "fixed_bytes": fixed},
                )
            )
        else:
            out.append(_pool_vs_plain(naive, shared, sessions, big, metric, traffic, fixed))
    single_total = _total(single, traffic)
    if single_total is not None and pool_cost and sessions > 1:
        verdict = _compare(single_total, pool_cost)
        pool_what = f"the pool's {hb(pool_cost)}" + (
            f" (sharedml's own {hb(fixed)} included)" if fixed else ""
        )
        text = (
            f"One plain session shared by all {sessions} threads takes {hb(single_total)}, "
            + _than(single_total, pool_cost, pool_what)
        )
        text += (
            ": ORT lets several threads run one CPU session at once, so on the CPU that is "
            "the smaller choice; the pool is for threads that each need a session of their "
            "own (DirectML, CUDA graphs, per-thread state)."
            if verdict == "less"
            else "; its threads share that one session's intra-op thread pool, where the "
            "pool gives each thread a session of its own."
        )
        out.append(
            Finding(
                "single-vs-pool",
                text,
                {
                    "single_bytes": single_total,
                    "pool_bytes": pool_cost,
                    "fixed_bytes": fixed,
                    "verdict": verdict,
                },
            )
        )
    known = {
        name: cost
        for name, cost in ((SHARED, pool_cost), (SINGLE, single_total), (NAIVE, naive_total))
        if cost is not None
    }
    advice = _advice(known, sessions)
    if advice is not None:
        out.append(advice)
        held = _held_vs_trimmed(measurements, known, advice, sessions, traffic, fixed)
        if held is not None:
            out.append(held)
    if raw is not None and shared is not None and shared_total and raw.total_bytes is not None:
        out.append(_prepacking_off(raw, shared))
    for m in (raw, packs):
        own = m.details.get("runtime_weights") if m is not None else None
        if m is None or not isinstance(own, Mapping) or not own.get("derived_bytes"):
            continue
        derived = int(own["derived_bytes"])
        setting = "prepacking='off'" if m is raw else "prepacking='per-session'"
        out.append(
            Finding(
                "derived-not-shared",
                f"{setting} ({m.strategy}) shares only the file's weights: ORT's optimizers "
                f"derive {hb(derived)} of weights from them (fused, folded or dequantized), "
                "which every session derives and keeps for itself.",
                {"strategy": m.strategy, "derived_bytes": derived},
            )
        )
    if shared is not None and packs is not None:
        a, b = shared.per_session_bytes, packs.per_session_bytes
        if a is not None and b is not None:
            basis = max(naive.per_session_bytes or 0 if naive else 0, weights_bytes, 1)
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
                    f"all at {sessions})"
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
            out.append(
                Finding(
                    "per-session-packing",
                    text,
                    {"per_session_bytes": b, "default_per_session_bytes": a, "extra_bytes": extra},
                )
            )
    runtime = _runtime_weights(naive, stats, weights_bytes)
    if runtime is not None:
        out.append(runtime)
    if unshared[1] and unshared[1] >= _NOTABLE_UNSHARED * max(weights_bytes, 1):
        out.append(
            Finding(
                "unshared-weights",
                f"{hb(unshared[1])} of weights in {unshared[0]} node attributes or sparse "
                "initializers (ai.onnx.ml parameters, tensor attributes) stay in the graph: "
                "prepare cannot move them, so every session keeps its own copy and no route "
                "shares them.",
                {"tensors": unshared[0], "bytes": unshared[1]},
            )
        )
    nonfinite = _nonfinite_outputs(trial, inputs)
    if nonfinite is not None:
        out.append(nonfinite)
    numerics = _numerics(measurements, sessions)
    if numerics is not None:
        out.append(numerics)
    for m in measurements.values():
        if m.stopped_reason:
            out.append(Finding("stopped", f"{m.strategy}: {m.stopped_reason}.", {}))
    if not out:
        out.append(Finding("none", "Measure at least 'naive' and 'shared' for a recommendation."))
    return tuple(out)


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


def _serialized_runs(serialized: SerializedRuns, sessions: int) -> Finding:
    provider, version = serialized.provider, serialized.onnxruntime_version
    rule = serialized.rule or "ORT issue #20713"
    text = (
        f"{provider} on onnxruntime {version} runs one Run at a time across the process "
        f"({rule}): {sessions} sessions run no more at once than one, and each uploads "
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
    return Finding(
        "serialized-runs",
        text,
        {
            "provider": provider,
            "onnxruntime_version": version,
            "batchable": serialized.not_batchable is None,
        },
    )


def _use_traffic(measurements: Mapping[str, Measurement]) -> bool:
    """Compare figures after the table-covering runs: only where every compared one has them."""
    compared = [measurements[n] for n in (NAIVE, SHARED, SINGLE) if n in measurements]
    return bool(compared) and all(m.traffic_bytes is not None for m in compared)


def _total(m: Measurement | None, traffic: bool) -> int | None:
    if m is None:
        return None
    return m.traffic_bytes if traffic else m.total_bytes


def _per_session(m: Measurement, traffic: bool) -> int | None:
    return m.traffic_per_session_bytes if traffic else m.per_session_bytes


def _projected(m: Measurement, sessions: int, traffic: bool) -> int | None:
    return m.traffic_projected_bytes(sessions) if traffic else m.projected_bytes(sessions)


def _pool_vs_plain(
    naive: Measurement,
    shared: Measurement,
    sessions: int,
    big: int,
    metric: str,
    traffic: bool = False,
    fixed: int = 0,
) -> Finding:
    hb = human_bytes
    naive_total, shared_total = _total(naive, traffic) or 0, _total(shared, traffic) or 0
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
        "plain_per_session_bytes": _per_session(naive, traffic),
        "pool_per_session_bytes": _per_session(shared, traffic),
    }
    when = (
        "After runs over every row of the tables the inputs index (as traffic reads them over "
        "time), with"
        if traffic
        else "With"
    )
    takes = (
        f"sharedml's pool takes {hb(shared_total)} ({metric}) and sharedml itself {hb(fixed)} "
        f"once per process (its imports and threads), {hb(pool)} in all"
        if fixed
        else f"sharedml's pool takes {hb(shared_total)} ({metric})"
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
    per_naive, per_shared = _per_session(naive, traffic), _per_session(shared, traffic)
    if per_naive is not None and per_shared is not None:
        text += (
            f" Each extra plain session adds {hb(per_naive)}, each extra pooled "
            f"session {hb(per_shared)}"
        )
        far_naive, far_shared = _projected(naive, big, traffic), _projected(shared, big, traffic)
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
    return Finding("pool-vs-plain", text, figures)


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


def _advice(known: Mapping[str, int], sessions: int) -> Finding | None:
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


def _held_vs_trimmed(
    measurements: Mapping[str, Measurement],
    held: Mapping[str, int],
    advice: Finding,
    sessions: int,
    traffic: bool,
    fixed: int,
) -> Finding | None:
    """What the compared strategies hold once glibc gave its freed heap back, against held.

    The advice is on the held figures (a server never trims). This says how much of each is
    heap the C library kept, and whether the trimmed figures would have named another
    strategy, so that a reader who trims (or measures after a trim) sees why the two differ.
    """
    trimmed: dict[str, int] = {}
    for name in held:
        m = measurements.get(name)
        served = m is not None and m.trimmed and bool(m.held_growth)
        value = m.trimmed_bytes if m is not None and served else None
        if value is None:  # not served, or no malloc_trim here: nothing to set beside held
            return None
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
        + (" over the tables' rows" if traffic else "")
        + ", untrimmed, as a server that never calls malloc_trim holds it; against the same "
        f"processes after malloc_trim: {listed}."
    )
    alternative = _advice(trimmed, sessions)
    other = alternative.figures["chosen"] if alternative is not None else None
    if other is not None and other != advice.figures["chosen"]:
        text += (
            f" Trimmed, the advice would name {_called(other, sessions)} instead: the freed heap "
            f"that glibc keeps decides it here (up to {hb(max(kept.values()))})."
        )
    return Finding(
        "held-vs-trimmed",
        text,
        {
            "held": dict(held),
            "trimmed": trimmed,
            "kept_bytes": kept,
            "trimmed_choice": other,
            "after_traffic": traffic,
        },
    )


def _prepacking_off(raw: Measurement, shared: Measurement) -> Finding:
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
    return Finding(
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


def _runtime_stats(measurements: Mapping[str, Measurement]) -> Mapping[str, Any] | None:
    """What ORT's saved optimized model of this model holds, from any pooled strategy."""
    for m in measurements.values():
        stats = m.details.get("runtime_weights")
        if isinstance(stats, Mapping):
            return stats
    return None


def _runtime_weights(
    naive: Measurement | None, stats: Mapping[str, Any] | None, weights_bytes: int
) -> Finding | None:
    """Say what plain sessions hold beyond the file's weights, where ORT's saved model shows it.

    Only with the saved model's figures: a session's own growth (thread pools, arena, kernel
    state) is no evidence of derived weights by itself.
    """
    per = naive.per_session_bytes if naive is not None else None
    derived = int(stats.get("derived_bytes") or 0) if stats is not None else 0
    packed = int(stats.get("prepacked_bytes") or 0) if stats is not None else 0
    if per is None or not weights_bytes or not derived + packed:
        return None
    if per < _NOTABLE_DERIVED * weights_bytes:
        return None
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
    return Finding("runtime-weights", text, figures)


def _tables_read(
    tables: Sequence[IndexedTable], measurements: Mapping[str, Measurement], sessions: int
) -> Finding | None:
    """Say which tables inputs index, what running over their rows added, and what is compared."""
    if not tables:
        return None
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
    traffic = _use_traffic(measurements)
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
            + f", and memory grew ({sessions} sessions): {changes}. The comparisons and the "
            "advice below use these figures after traffic."
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
    return Finding("indexed-tables", text, figures)


def _input_sizes(inputs: Sequence[InputSpec], trial: Mapping[str, Any] | None) -> Finding | None:
    """Name the sizes inspect chose for symbolic heights, widths and lengths, and how to set them.

    A model's memory depends on them; a size of 1 is degenerate (a detector at 1x1 holds a
    fraction of what it holds at 320x320) and is said so loudly, never passed silently.
    """
    chosen = [c for c in chosen_sizes(inputs) if c.role != "batch"]
    if not chosen:
        return None
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
                " because a plain session refused the sizes tried first ("
                + "; ".join(
                    f"{', '.join(r['inputs'])}: {str(r['error']).rstrip('.')}" for r in rejected
                )
                + ")"
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
            text += (
                "; a plain session refused the sizes tried first ("
                + "; ".join(
                    f"{', '.join(r['inputs'])}: {str(r['error']).rstrip('.')}" for r in rejected
                )
                + ")"
            )
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
    return Finding("degenerate-inputs" if degenerate else "input-sizes", text, figures)


def _nonfinite_outputs(
    trial: Mapping[str, Any] | None, inputs: Sequence[InputSpec]
) -> Finding | None:
    """Say that the trial run's outputs hold NaN or infinite values, and what may cause it."""
    outputs = list(trial.get("outputs") or ()) if trial is not None else []
    bad = [o for o in outputs if o.get("nonfinite")]
    if not bad:
        return None

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
    masks = [i.name for i in inputs if i.dtype == "bool" and i.source != "file"]
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
    return Finding("nonfinite-outputs", text, figures)


def _numerics(measurements: Mapping[str, Measurement], sessions: int) -> Finding | None:
    """Compare every strategy's outputs with a default plain session's (the trial run)."""
    compared = {n: m for n, m in measurements.items() if m.matches_plain is not None}
    if not compared:
        return None
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
        return Finding("numerics", text, figures)
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
            f" The pool gives each CPU session cores // {sessions} intra-op threads, and "
            "dynamically quantizing kernels (DynamicQuantizeLSTM, MatMulInteger) round "
            "differently with another thread count; a plain session given the same "
            "intra_op_num_threads matches the pool (README, SessionPool)."
        )
    return Finding("numerics", text, figures)


def recommend(measurements: Mapping[str, Measurement], *, sessions: int, weights_bytes: int) -> str:
    """The recommendation as one paragraph: the sentences of :func:`findings`."""
    return " ".join(
        f.text for f in findings(measurements, sessions=sessions, weights_bytes=weights_bytes)
    )


# --------------------------------------------------------------------------------------------
# inspect()


def inspect(
    model: str | os.PathLike[str] | None = None,
    *,
    sessions: int = 4,
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    dims: Mapping[str, int] | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None,
    feeds: str | os.PathLike[str] | None = None,
    strategies: Sequence[str] | None = None,
    projection_sessions: Sequence[int] = DEFAULT_PROJECTION_SESSIONS,
    timeout_s: float | None = None,
    progress: InspectProgress | None = None,
    compress: str | None = None,
    ep_libraries: Mapping[str, str | os.PathLike[str]] | None = None,
    ep_devices: Mapping[str, Any] | None = None,
) -> InspectReport:
    """Report what ``model`` holds and what ``sessions`` sessions of it cost per strategy.

    First, one plain session with ORT's defaults is created and run once on the inputs, in a
    fresh process (the trial run): a model that the generated inputs do not fit fails there in
    seconds, with a message naming the dimensions that were set to 1, and its outputs are what
    every strategy's outputs are checked against (:attr:`Measurement.plain_max_abs_diff`). Then
    each strategy is measured in a fresh subprocess, one after another: ``sessions`` sessions
    created one at a time, and after each, all of them run concurrently, round after round
    until a round adds no memory, memory recorded (see :mod:`sharedml.inspection._child`).

    Args:
        model: An ONNX model file; ``None`` inspects sharedml's built-in demo model (built into
            the cache folder on first use).
        sessions: N, the number of sessions (and threads) to measure.
        providers: As for ``onnxruntime.InferenceSession``; default CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        dims: Sizes of the inputs' symbolic dimensions by name (default 1 each; at least 1).
        shapes: Whole shapes of inputs by name (``{"images": (1, 3, 320, 320)}``); their
            symbolic dimensions hold for the other inputs too.
        feeds: An ``.npz`` file of input values by input name (``numpy.savez``); inputs it
            does not hold are generated.
        strategies: Names of registered strategies to measure (default: every strategy
            registered as a default; see :func:`sharedml.registered_strategies`).
        projection_sessions: Session counts to project memory to (N is added).
        timeout_s: Stop any one measurement after this long.
        progress: Called as ``progress(description, steps_done, steps_total)``.
        compress: ``"int8"`` or ``"int4"``: also measure a pool over the model's compressed
            weights (strategy ``shared-<format>``: memory and run time, as every strategy), and
            compare its outputs with the float model's on the same inputs
            (:attr:`InspectReport.compressed`: largest absolute and relative difference, top-1
            agreement of classifier-like outputs). See ``docs/compress.md``.
        ep_libraries: A plugin execution provider's library per EP name, as for
            ``SessionPool``; every measuring process registers it.
        ep_devices: A plugin EP's device per EP name, as for ``SessionPool``; every measuring
            process picks that device (:attr:`InspectReport.device` says which).

    Returns:
        The :class:`InspectReport`.

    Raises:
        ModelNotFoundError: ``model`` does not exist.
        InvalidModelError: ``model`` is not an ONNX model.
        ExternalDataError: its external data is missing or unsafe.
        ProviderError: a provider this onnxruntime build does not have.
        ValueError: ``sessions`` below 1, an unknown strategy, dimension or input, a shape or
            feeds file that does not fit the model.
        FileNotFoundError: ``feeds`` does not exist.
        CompressError: ``compress`` was given for a model with nothing to compress, or an
            onnxruntime that cannot make the format.
        MeasurementError: the trial run failed (its ``report`` attribute holds the partial
            report: the static part, the inputs and the error), or a measuring subprocess
            failed (the message names the strategy).

    Thread safety: safe to call from any thread; concurrent calls disturb each other's figures.
    """
    import onnxruntime as ort

    from sharedml._errors import MeasurementError
    from sharedml.inspection._measure import trial_run
    from sharedml.model._graph import load_graph
    from sharedml.model._inputs import defaulted_dims, described, load_feeds
    from sharedml.runtime._providers import plan_providers

    if sessions < 1:
        raise ValueError(f"sessions must be at least 1, not {sessions}.")
    if any(n < 1 for n in projection_sessions):
        raise ValueError("projection_sessions must all be at least 1.")
    names = (
        tuple(strategies)
        if strategies is not None
        else tuple(s.name for s in registered_strategies() if s.default)
    )
    if not names:
        raise ValueError("Name at least one strategy to measure.")
    compressed_format = None
    if compress is not None:
        from sharedml.prepared._compress import WeightsFormat

        compressed_format = WeightsFormat.parse(compress)
        if compressed_format is WeightsFormat.FLOAT:
            raise ValueError("compress must be 'int8' or 'int4' (the float model is measured).")
        names = (*names, f"{SHARED}-{compressed_format.value}")
    chosen = [get_strategy(n) for n in dict.fromkeys(names)]
    # Fails early on a missing provider; a plugin EP's library is registered and its device
    # chosen here, and every measuring child is given the same (plan.to_spec()).
    plan = plan_providers(
        providers, provider_options, ep_libraries=ep_libraries, ep_devices=ep_devices
    )
    plugin_args = {
        key: value for key, value in plan.to_spec().items() if key in ("ep_libraries", "ep_devices")
    }

    demo = model is None
    if model is None:
        from sharedml.inspection._demo import demo_model_path

        if progress is not None:
            progress("building the demo model", 0, 0)
        path = demo_model_path()
    else:
        path = Path(model)
    proto = load_graph(path)
    label = "the demo model" if demo else f"'{path}'"
    given = None
    if feeds is not None:
        given = described(load_feeds(feeds))
    # Sizes for the symbolic dimensions nobody gave, most plausible first: the trial run tries
    # them in turn until a plain session runs (a recognizer refuses a height of 224).
    candidates: list[tuple[InputSpec, ...]] = []
    for guess in SIZE_CHOICES:
        specs = input_specs(proto, dims, shapes=shapes, given=given, model_name=label, guess=guess)
        if specs not in candidates:
            candidates.append(specs)
    inputs = candidates[0]
    tables = indexed_tables(proto)
    weights = summarize_weights(proto, path)
    serialized = _serialized_for(plan, proto, label)
    del proto  # a model with inline weights is as large as they are: not kept while measuring
    gc.collect()

    total_steps = sessions * len(chosen)

    accuracy: CompressedAccuracy | None = None

    def report(
        measured: Sequence[Measurement],
        found: tuple[Finding, ...],
        trial: Mapping[str, Any],
        error: str | None = None,
        fixed: FixedCost | None = None,
    ) -> InspectReport:
        return InspectReport(
            model_path=path,
            demo=demo,
            sessions=sessions,
            providers=plan.providers,
            device=trial.get("device") or plan.device,
            inputs=inputs,
            weights=weights,
            measurements=tuple(measured),
            projection_sessions=tuple(sorted({*projection_sessions, sessions})),
            recommendation=" ".join(f.text for f in found),
            onnxruntime_version=(measured[0].onnxruntime_version if measured else "")
            or ort.__version__,
            platform=platform.platform(),
            findings=found,
            trial=trial,
            error=error,
            fixed_cost=fixed,
            tables=tables,
            compressed=accuracy,
        )

    compressed_path = None
    if compressed_format is not None:  # refused here, before any process is started
        from sharedml.prepared._compress import compressed_model_for

        if progress is not None:
            progress(f"compressing the weights to {compressed_format.value} (cached)", 0, 0)
        compressed_path = compressed_model_for(path, weights=compressed_format)

    measurements: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="sharedml-inspect-") as scratch:
        if progress is not None:
            progress("trial run: one plain session, ORT defaults", 0, total_steps)
        rejected: list[dict[str, Any]] = []
        for inputs in candidates:
            trial = trial_run(
                path,
                inputs=inputs,
                reference=Path(scratch) / "plain-outputs.npz",
                providers=plan.providers,
                provider_options=plan.provider_options,
                **plugin_args,
                feeds=feeds,
                timeout_s=timeout_s,
            )
            if trial.error is None:
                break
            rejected.append({"inputs": [i.describe() for i in inputs], "error": trial.error})
        trial_dict = trial.to_dict() | {"rejected_sizes": rejected}
        if trial.error is not None:
            inputs = candidates[0]
            message = _trial_failed(label, rejected, defaulted_dims(inputs, dims))
            exc = MeasurementError(message)
            exc.report = report((), (), trial_dict, message)
            raise exc
        if compressed_format and compressed_path and trial.reference is not None:
            from sharedml.inspection._compressed import compressed_accuracy

            if progress is not None:
                what = f"{compressed_format.value}: one run on the same inputs, for accuracy"
                progress(what, 0, total_steps)
            accuracy = compressed_accuracy(
                compressed_path,
                compressed_format,
                reference=trial.reference,
                inputs=inputs,
                scratch=Path(scratch),
                providers=plan.providers,
                provider_options=plan.provider_options,
                **plugin_args,
                feeds=feeds,
                timeout_s=timeout_s,
            )
        for index, strategy in enumerate(chosen):
            done_before = index * sessions

            def step(
                done: int, _total: int, name: str = strategy.name, base: int = done_before
            ) -> None:
                if progress is not None:
                    progress(f"{name}: {done}/{sessions} sessions", base + done, total_steps)

            if progress is not None:
                what = (
                    "preparing the model (cached) and opening the pool"
                    if strategy.warm_cache
                    else "starting a fresh process"
                )
                progress(f"{strategy.name}: {what}", done_before, total_steps)
            measurements.append(
                measure(
                    path,
                    strategy.name,
                    sessions=sessions,
                    providers=plan.providers,
                    provider_options=plan.provider_options,
                    **plugin_args,
                    inputs=inputs,
                    timeout_s=timeout_s,
                    progress=step,
                    feeds=feeds,
                    reference=trial.reference,
                    tables=tables,
                )
            )
        fixed: FixedCost | None = None
        shared = next((m for m in measurements if m.strategy == SHARED), None)
        if shared is not None:
            from sharedml.inspection._measure import fixed_cost

            if progress is not None:
                progress(
                    "sharedml's own cost: a fresh process imports it, opens and closes a pool",
                    total_steps,
                    total_steps,
                )
            fixed = fixed_cost(
                path,
                inputs=inputs,
                sessions=sessions,
                providers=plan.providers,
                provider_options=plan.provider_options,
                **plugin_args,
                feeds=feeds,
                timeout_s=timeout_s,
                rounds=shared.points[-1].rounds,
            )
    by_name = {m.strategy: m for m in measurements}
    metric = measurements[0].metric if measurements else "pss"
    fixed_bytes = (
        fixed.bytes(metric, by_name[SHARED].trimmed_bytes)
        if fixed is not None and fixed.error is None and SHARED in by_name
        else None
    )
    # Compressed weights change the outputs on purpose: their own section reports them
    # (InspectReport.compressed); the findings compare the float model's strategies.
    float_only = {n: m for n, m in by_name.items() if get_strategy(n).weights == "float"}
    found = findings(
        float_only,
        sessions=sessions,
        weights_bytes=weights.total_bytes,
        unshared=weights.unshared,
        serialized=serialized,
        trial=trial_dict,
        inputs=inputs,
        fixed_bytes=fixed_bytes,
        tables=tables,
    )
    return report(measurements, found, trial_dict, fixed=fixed)


def _serialized_for(plan: Any, proto: Any, label: str) -> SerializedRuns | None:
    """What a recommendation says of a provider that runs one ``Run`` at a time, or None."""
    import onnxruntime as ort

    from sharedml._errors import NotBatchableError
    from sharedml.pool._batching import signature_of
    from sharedml.runtime._providers import runs_rule

    rule = runs_rule(plan)
    if not rule.serialized:
        return None
    try:
        signature_of(proto, name=label)
        why = None
    except NotBatchableError as exc:
        why = str(exc)
    return SerializedRuns(plan.primary, ort.__version__, why, rule.reason)


# What Windows says where ORT turns a wide file name into the ANSI code page and cannot: the
# message of ERROR_NO_UNICODE_TRANSLATION, as Wine and as Windows word it.
_ANSI_PATH_ERRORS = ("No Unicode translation", "No mapping for the Unicode character")


def _trial_failed(
    label: str, rejected: Sequence[Mapping[str, Any]], defaulted: Mapping[str, Sequence[str]]
) -> str:
    """The message for a trial run that failed at every size tried: ORT's errors, the dims."""
    first = rejected[0]
    if any(sign in str(first["error"]) for sign in _ANSI_PATH_ERRORS):
        return (
            f"onnxruntime could not open {label}: on Windows, onnxruntime before 1.25 (every "
            "onnxruntime-directml) fails to create a session from a file whose name has a "
            "character outside the system's ANSI code page (onnxruntime pull request 27724). "
            "Rename or copy the model to a file name without such characters (the folders may "
            f"keep theirs), or use onnxruntime 1.25 or newer. ORT said: {first['error']}"
        )
    text = (
        f"One plain onnxruntime session of {label} could not run on the inputs inspect made "
        f"(nothing was measured): {str(first['error']).rstrip('.')}."
    )
    if len(rejected) > 1:
        others = "; ".join(
            f"{', '.join(r['inputs'])}: {str(r['error']).rstrip('.')}" for r in rejected[1:]
        )
        text += f" Also tried {others}."
    if defaulted:
        chose = "; ".join(f"{name}: {', '.join(d)}" for name, d in defaulted.items())
        every = [d.split("=")[0] for dims in defaulted.values() for d in dims]
        # Batch sizes of 1 rarely break a model; heights, widths and lengths do.
        named = next((d for d in every if "batch" not in d.lower() and d != "?"), None)
        text += (
            f" inspect chose the sizes of these symbolic dimensions ({chose}): give real sizes "
            + (f"with --dim {named}=SIZE (dims= in Python), " if named else "")
            + "a whole input with --shape NAME=AxBxC, or real inputs with --inputs feeds.npz."
        )
    else:
        text += " Give real inputs with --inputs feeds.npz (feeds= in Python)."
    return text
