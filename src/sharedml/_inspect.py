"""``sharedml.inspect``: what a model's weights are, and what N sessions of it cost per strategy.

The report has a static part, read from the model's protobuf without loading external data
(how many bytes of weights, where they sit, the largest tensors, what ``prepare`` would move),
and a measured part: each strategy (:mod:`sharedml._measure`) measured in a fresh subprocess,
one after another, with a least-squares fit of memory against the session count that projects
other counts, and a recommendation computed from those figures. The CLI (``sharedml inspect``)
only renders this report.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._format import human_bytes
from sharedml._inputs import InputSpec, input_specs
from sharedml._measure import measure
from sharedml._onnx import ExternalData, Placement, iter_tensors, tensor_nbytes
from sharedml._results import Measurement
from sharedml._strategies import (
    NAIVE,
    SHARED,
    SHARED_PRIVATE_PACKS,
    SHARED_RAW,
    SINGLE,
    get_strategy,
    registered_strategies,
)

__all__ = [
    "DEFAULT_PROJECTION_SESSIONS",
    "InspectProgress",
    "InspectReport",
    "PlacementSummary",
    "TensorInfo",
    "WeightsSummary",
    "inspect",
    "recommend",
    "summarize_weights",
]

DEFAULT_PROJECTION_SESSIONS = (1, 2, 4, 8, 16, 32)
_LARGEST_SHOWN = 5
_MiB = 1024 * 1024

InspectProgress = Callable[[str, int, int], None]
"""Called as ``progress(description, steps_done, steps_total)``; a step is one session measured."""

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
        total_bytes: Bytes of every weight (initializers, Constant nodes, subgraphs, external).
        tensors: How many tensors that is.
        placements: Tensors and bytes per placement (only placements that occur).
        external_files: ``(file, bytes)`` of each external data file the model refers to.
        largest: The largest tensors, largest first.
        already_prepared: The model was written by ``sharedml.prepare``.
        prepare_moves_tensors: Tensors ``prepare`` would put in the weights file.
        prepare_moves_bytes: Their bytes.
        prepare_leaves_tensors: Tensors it would leave in the graph (small ones).
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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "total_bytes": self.total_bytes,
            "tensors": self.tensors,
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
    import onnx

    try:
        return str(onnx.TensorProto.DataType.Name(data_type)).lower()
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
        model: As :func:`sharedml._onnx.load_graph` returns it. It is modified (prepare's
            plan converts large Constant nodes in place): pass a model you no longer need.
        model_path: The model's file, to resolve external data.

    Raises:
        ExternalDataError: external data that prepare would refuse (missing, short, unsafe).
    """
    from sharedml._prepare import DEFAULT_SIZE_THRESHOLD_BYTES, plan_weights, read_manifest

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
class InspectReport:
    """What ``sharedml inspect`` reports; every figure the CLI prints comes from here.

    Attributes:
        model_path: The model inspected.
        demo: Whether it is sharedml's built-in demo model.
        sessions: The session count measured (N).
        providers: The execution providers every strategy used, CPU last.
        inputs: The inputs generated for the runs.
        weights: The static part.
        measurements: One :class:`~sharedml._measure.Measurement` per strategy, in the order
            measured.
        projection_sessions: The session counts :meth:`projection` covers.
        recommendation: A paragraph computed from the figures.
        onnxruntime_version: The onnxruntime that measured.
        platform: ``platform.platform()`` of the machine.
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
        """Projected memory of ``strategy`` at each of :attr:`projection_sessions` (fit)."""
        m = self.strategies[strategy]
        return {n: m.projected_bytes(n) for n in self.projection_sessions}

    def to_dict(self) -> dict[str, Any]:
        """The JSON object that ``sharedml inspect --json`` prints."""
        return {
            "model": str(self.model_path),
            "demo": self.demo,
            "sessions": self.sessions,
            "providers": list(self.providers),
            "onnxruntime": self.onnxruntime_version,
            "platform": self.platform,
            "inputs": [i.to_dict() for i in self.inputs],
            "weights_bytes": self.weights_bytes,
            "tensors": self.weights.tensors,
            "weights": self.weights.to_dict(),
            "memory_metric": self.metric,
            "strategies": {
                m.strategy: m.to_dict()
                | {"projection": {str(n): v for n, v in self.projection(m.strategy).items()}}
                for m in self.measurements
            },
            "recommendation": self.recommendation,
        }


# --------------------------------------------------------------------------------------------
# Recommendation


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "n/a"


def recommend(measurements: Mapping[str, Measurement], *, sessions: int, weights_bytes: int) -> str:
    """A paragraph of advice computed from the measurements (no figure is made up)."""
    parts: list[str] = []
    naive = measurements.get(NAIVE)
    shared = measurements.get(SHARED)
    prepacked = measurements.get(SHARED_PRIVATE_PACKS)
    raw = measurements.get(SHARED_RAW)
    single = measurements.get(SINGLE)
    big = max(DEFAULT_PROJECTION_SESSIONS[-1], sessions * 2)
    metric = next(iter(measurements.values())).metric.upper() if measurements else "PSS"

    def total(m: Measurement | None) -> int | None:
        return None if m is None else m.total_bytes

    naive_total, shared_total = total(naive), total(shared)
    if naive is not None and shared is not None and naive_total and shared_total is not None:
        saving = naive_total - shared_total
        material = max(0.1 * naive_total, 8 * _MiB)
        slopes = ""
        if naive.per_session_bytes is not None and shared.per_session_bytes is not None:
            slopes = (
                f" Each extra plain session adds {human_bytes(naive.per_session_bytes)}, each "
                f"extra pooled session {human_bytes(shared.per_session_bytes)}"
            )
            far_naive, far_shared = naive.projected_bytes(big), shared.projected_bytes(big)
            if far_naive is not None and far_shared is not None:
                slopes += (
                    f"; at {big} sessions that would be about {human_bytes(far_naive)} against "
                    f"{human_bytes(far_shared)} (projected)."
                )
            else:
                slopes += "."
        if sessions == 1:
            parts.append(
                f"With one session there is nothing to share: the pool takes "
                f"{human_bytes(shared_total)} ({metric}), a plain session "
                f"{human_bytes(naive_total)}. Measure with --sessions 2 or more (sessions=2) "
                "to see what each extra session costs."
            )
        elif saving > material:
            parts.append(
                f"With {sessions} sessions, sharedml's pool takes {human_bytes(shared_total)} "
                f"({metric}) where {sessions} plain sessions take {human_bytes(naive_total)}: "
                f"{human_bytes(saving)} ({_pct(saving, naive_total)}) less.{slopes} "
                f"Use sharedml.SessionPool(model, sessions={sessions})."
            )
        elif saving >= -material:
            parts.append(
                f"Sharing saves little here: {human_bytes(shared_total)} with the pool against "
                f"{human_bytes(naive_total)} for {sessions} plain sessions. The weights "
                f"({human_bytes(weights_bytes)}) are small next to what each session needs for "
                f"itself, so plain sessions are as good.{slopes}"
            )
        else:
            parts.append(
                f"The pool takes more than plain sessions here ({human_bytes(shared_total)} "
                f"against {human_bytes(naive_total)}): sharing does not pay for this model.{slopes}"
            )
    if shared is not None and prepacked is not None:
        a, b = shared.per_session_bytes, prepacked.per_session_bytes
        if a is not None and b is not None:
            extra = b - a
            if extra <= max(0.02 * weights_bytes, 1 * _MiB):
                parts.append(
                    f"ORT's own per-session prepacking (prepacking='per-session') costs next "
                    f"to nothing more per session for this model ({human_bytes(extra)})."
                )
            else:
                parts.append(
                    f"ORT's own per-session prepacking (prepacking='per-session') would add "
                    f"{human_bytes(extra)} per session ({human_bytes(total(prepacked))} in all "
                    f"at {sessions}): each session keeps a packed copy of each MatMul/Conv "
                    "weight. The pool's default shares the packed weights instead, where ORT "
                    "packs any."
                )
    if shared is not None and raw is not None:
        raw_total = total(raw)
        if shared_total is not None and raw_total is not None:
            parts.append(
                f"With prepacking off (prepacking='off') the pool takes "
                f"{human_bytes(raw_total)} against {human_bytes(shared_total)} for its default: "
                "the least memory and the fastest session creation, but unpacked MatMul/Gemm "
                "kernels (slower for batched inputs on CPU: see docs/cpu-prepacking.md)."
            )
    if single is not None and shared is not None and sessions > 1:
        single_total = total(single)
        if single_total is not None and shared_total is not None:
            gap = shared_total - single_total
            if gap > max(0.05 * shared_total, 8 * _MiB):
                parts.append(
                    f"One plain session shared by all threads is smaller still "
                    f"({human_bytes(single_total)}): ORT allows concurrent Run calls on one "
                    "session, but the threads then share its one intra-op thread pool; the pool "
                    "gives each thread a session of its own (which DirectML requires)."
                )
            elif gap >= -max(0.05 * shared_total, 8 * _MiB):
                parts.append(
                    f"One plain session shared by all threads takes about as much "
                    f"({human_bytes(single_total)}), but its threads share one session's "
                    "intra-op thread pool, where the pool gives each thread a session of its "
                    "own (which DirectML requires)."
                )
            else:
                parts.append(
                    f"One plain session shared by all threads takes {human_bytes(single_total)}, "
                    "more than the pool: a plain session keeps its own copies of the weights."
                )
    for m in measurements.values():
        if m.stopped_reason:
            parts.append(f"{m.strategy}: {m.stopped_reason}.")
    if not parts:
        parts.append("Measure at least 'naive' and 'shared' for a recommendation.")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# inspect()


def inspect(
    model: str | os.PathLike[str] | None = None,
    *,
    sessions: int = 4,
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    dims: Mapping[str, int] | None = None,
    strategies: Sequence[str] | None = None,
    projection_sessions: Sequence[int] = DEFAULT_PROJECTION_SESSIONS,
    timeout_s: float | None = None,
    progress: InspectProgress | None = None,
) -> InspectReport:
    """Report what ``model`` holds and what ``sessions`` sessions of it cost per strategy.

    Each strategy is measured in a fresh subprocess, one after another: ``sessions`` sessions
    created one at a time, and after each, all of them run once concurrently on generated
    inputs, memory recorded (see :mod:`sharedml._measure`).

    Args:
        model: An ONNX model file; ``None`` inspects sharedml's built-in demo model (built into
            the cache folder on first use).
        sessions: N, the number of sessions (and threads) to measure.
        providers: As for ``onnxruntime.InferenceSession``; default CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        dims: Sizes of the inputs' symbolic dimensions by name (default 1 each).
        strategies: Names of registered strategies to measure (default: every strategy
            registered as a default; see :func:`sharedml.registered_strategies`).
        projection_sessions: Session counts to project memory to (N is added).
        timeout_s: Stop any one measurement after this long.
        progress: Called as ``progress(description, steps_done, steps_total)``.

    Returns:
        The :class:`InspectReport`.

    Raises:
        ModelNotFoundError: ``model`` does not exist.
        InvalidModelError: ``model`` is not an ONNX model.
        ExternalDataError: its external data is missing or unsafe.
        ProviderError: a provider this onnxruntime build does not have.
        ValueError: ``sessions`` below 1, an unknown strategy or dimension name.
        MeasurementError: a measuring subprocess failed (the message names the strategy).

    Thread safety: safe to call from any thread; concurrent calls disturb each other's figures.
    """
    import onnxruntime as ort

    from sharedml._onnx import load_graph
    from sharedml._providers import plan_providers

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
    chosen = [get_strategy(n) for n in dict.fromkeys(names)]
    plan = plan_providers(providers, provider_options)  # fails early on a missing provider

    demo = model is None
    if model is None:
        from sharedml._demo import demo_model_path

        if progress is not None:
            progress("building the demo model", 0, 0)
        path = demo_model_path()
    else:
        path = Path(model)
    proto = load_graph(path)
    label = "the demo model" if demo else f"'{path}'"
    inputs = input_specs(proto, dims, model_name=label)
    weights = summarize_weights(proto, path)
    del proto  # a model with inline weights is as large as they are: not kept while measuring
    gc.collect()

    total_steps = sessions * len(chosen)
    measurements: list[Measurement] = []
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
                inputs=inputs,
                timeout_s=timeout_s,
                progress=step,
            )
        )
    by_name = {m.strategy: m for m in measurements}
    return InspectReport(
        model_path=path,
        demo=demo,
        sessions=sessions,
        providers=plan.providers,
        inputs=inputs,
        weights=weights,
        measurements=tuple(measurements),
        projection_sessions=tuple(sorted({*projection_sessions, sessions})),
        recommendation=recommend(by_name, sessions=sessions, weights_bytes=weights.total_bytes),
        onnxruntime_version=measurements[0].onnxruntime_version or ort.__version__,
        platform=platform.platform(),
    )
