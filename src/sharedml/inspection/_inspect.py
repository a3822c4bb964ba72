"""``sharedml.inspect``: what a model's weights are, and what N sessions of it cost per strategy.

The report (:class:`~sharedml.inspection._report.InspectReport`) has a static part, read from
the model's protobuf without loading external data (:mod:`sharedml.inspection._weights_summary`),
and a measured part: each strategy (:mod:`sharedml.inspection._measure`) measured in a fresh
subprocess, one after another, with a least-squares fit of memory against the session count that
projects other counts, and a recommendation computed from those figures
(:mod:`sharedml.inspection._findings`). The CLI (``sharedml inspect``) only renders this report.

:func:`inspect` goes in steps: plan (the strategies, the providers, the inputs to try and the
static part, before any process starts), the trial run, the measurements, the findings, the
report.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharedml.inspection._compressed import CompressedAccuracy
from sharedml.inspection._findings import SAME_WITHIN, Finding, SerializedRuns, findings, recommend
from sharedml.inspection._measure import FixedCost, measure
from sharedml.inspection._report import InspectReport
from sharedml.inspection._results import DEFAULT_PROJECTION_SESSIONS, Measurement
from sharedml.inspection._strategies import (
    SHARED,
    Strategy,
    get_strategy,
    registered_strategies,
)
from sharedml.inspection._weights_summary import (
    PlacementSummary,
    TensorInfo,
    WeightsSummary,
    summarize_weights,
)
from sharedml.model._inputs import SIZE_CHOICES, InputSpec, input_specs
from sharedml.model._tables import IndexedTable, indexed_tables
from sharedml.runtime._errors import is_model_refused

if TYPE_CHECKING:
    from sharedml.inspection._measure import TrialRun
    from sharedml.prepared._compress import WeightsFormat
    from sharedml.runtime._providers import ProviderPlan

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

InspectProgress = Callable[[str, int, int], None]
"""Called as ``progress(description, steps_done, steps_total)``; a step is one session measured."""


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
    plan = _plan(
        model,
        sessions=sessions,
        providers=providers,
        provider_options=provider_options,
        dims=dims,
        shapes=shapes,
        feeds=feeds,
        strategies=strategies,
        projection_sessions=projection_sessions,
        timeout_s=timeout_s,
        progress=progress,
        compress=compress,
        ep_libraries=ep_libraries,
        ep_devices=ep_devices,
    )
    with tempfile.TemporaryDirectory(prefix="sharedml-inspect-") as folder:
        scratch = Path(folder)
        trial = _trial(plan, scratch)
        accuracy = _compressed_accuracy(plan, trial, scratch)
        measurements = _measure_strategies(plan, trial)
        fixed = _fixed_cost(plan, trial, measurements)
    report = _assemble(plan, trial.inputs, trial.record, measurements, fixed, accuracy)
    return _with_findings(report, plan.serialized)


# --------------------------------------------------------------------------------------------
# Plan: everything decided before a process starts


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What :func:`inspect` measures, and with what; settled before any process starts.

    Attributes:
        path: The model file (the demo's, built in the cache, for ``model=None``).
        demo: Whether it is the demo model.
        label: How messages name it.
        sessions: N.
        strategies: The strategies to measure, in order, each once.
        providers: The providers every measuring process plans the same way.
        child_options: The keyword arguments every measuring process is given: providers and
            their options, a plugin EP's library and device, the feeds, the time limit.
        dims: The dimensions the caller gave, for the trial run's message.
        candidates: The inputs to try, most plausible sizes first (a recognizer refuses a
            height of 224): the trial run takes the first that a plain session runs.
        tables: Weights that inputs index.
        weights: The static part of the report.
        serialized: Where the provider runs one ``Run`` at a time, for the findings.
        projection_sessions: The session counts the report projects (N included).
        compressed: With ``compress``: the format and the compressed model (built already).
        progress: Told of each step.
    """

    path: Path
    demo: bool
    label: str
    sessions: int
    strategies: tuple[Strategy, ...]
    providers: ProviderPlan
    child_options: Mapping[str, Any]
    dims: Mapping[str, int] | None
    candidates: tuple[tuple[InputSpec, ...], ...]
    tables: tuple[IndexedTable, ...]
    weights: WeightsSummary
    serialized: SerializedRuns | None
    projection_sessions: tuple[int, ...]
    compressed: tuple[WeightsFormat, Path] | None
    progress: InspectProgress | None

    @property
    def steps(self) -> int:
        """Progress steps in all: one per session measured."""
        return self.sessions * len(self.strategies)

    def tell(self, description: str, done: int) -> None:
        """Report progress: ``done`` of :attr:`steps`."""
        if self.progress is not None:
            self.progress(description, done, self.steps)


def _plan(
    model: str | os.PathLike[str] | None,
    *,
    sessions: int,
    providers: Sequence[Any] | None,
    provider_options: Sequence[dict[str, Any]] | None,
    dims: Mapping[str, int] | None,
    shapes: Mapping[str, Sequence[int]] | None,
    feeds: str | os.PathLike[str] | None,
    strategies: Sequence[str] | None,
    projection_sessions: Sequence[int],
    timeout_s: float | None,
    progress: InspectProgress | None,
    compress: str | None,
    ep_libraries: Mapping[str, str | os.PathLike[str]] | None,
    ep_devices: Mapping[str, Any] | None,
) -> _Plan:
    """Check the arguments, choose the strategies and providers, read the model's static part.

    The model's protobuf is read once here and let go before anything is measured: a model
    with inline weights is as large as they are.
    """
    from sharedml.model._graph import load_graph
    from sharedml.runtime._providers import plan_providers

    if sessions < 1:
        raise ValueError(f"sessions must be at least 1, not {sessions}.")
    if any(n < 1 for n in projection_sessions):
        raise ValueError("projection_sessions must all be at least 1.")
    chosen, compressed_format = _strategies_to_measure(strategies, compress)
    # Fails early on a missing provider; a plugin EP's library is registered and its device
    # chosen here, and every measuring child is given the same (plan.to_spec()).
    provider_plan = plan_providers(
        providers, provider_options, ep_libraries=ep_libraries, ep_devices=ep_devices
    )
    plugin_args = {
        key: value
        for key, value in provider_plan.to_spec().items()
        if key in ("ep_libraries", "ep_devices")
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
    candidates = _inputs_to_try(proto, label, dims=dims, shapes=shapes, feeds=feeds)
    tables = indexed_tables(proto)
    weights = summarize_weights(proto, path)
    serialized = _serialized_for(provider_plan, proto, label)
    del proto  # a model with inline weights is as large as they are: not kept while measuring
    gc.collect()

    compressed = None
    if compressed_format is not None:  # refused here, before any process is started
        from sharedml.prepared._compress import compressed_model_for

        if progress is not None:
            progress(f"compressing the weights to {compressed_format.value} (cached)", 0, 0)
        compressed = (compressed_format, compressed_model_for(path, weights=compressed_format))

    return _Plan(
        path=path,
        demo=demo,
        label=label,
        sessions=sessions,
        strategies=chosen,
        providers=provider_plan,
        child_options={
            "providers": provider_plan.providers,
            "provider_options": provider_plan.provider_options,
            **plugin_args,
            "feeds": feeds,
            "timeout_s": timeout_s,
        },
        dims=dims,
        candidates=candidates,
        tables=tables,
        weights=weights,
        serialized=serialized,
        projection_sessions=tuple(sorted({*projection_sessions, sessions})),
        compressed=compressed,
        progress=progress,
    )


def _strategies_to_measure(
    strategies: Sequence[str] | None, compress: str | None
) -> tuple[tuple[Strategy, ...], WeightsFormat | None]:
    """The strategies named (or the default ones), and a compressed pool's after them.

    Raises:
        ValueError: no strategy, an unknown one, or a ``compress`` format that is not one.
    """
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
    return tuple(get_strategy(n) for n in dict.fromkeys(names)), compressed_format


def _inputs_to_try(
    proto: Any,
    label: str,
    *,
    dims: Mapping[str, int] | None,
    shapes: Mapping[str, Sequence[int]] | None,
    feeds: str | os.PathLike[str] | None,
) -> tuple[tuple[InputSpec, ...], ...]:
    """The inputs to run on, one set per size guess for the dimensions nobody gave, distinct."""
    from sharedml.model._inputs import described, load_feeds

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
    return tuple(candidates)


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


# --------------------------------------------------------------------------------------------
# Measure: the trial run, the compressed model's accuracy, each strategy, sharedml's own cost


@dataclasses.dataclass(frozen=True)
class _Trial:
    """The trial run that succeeded.

    Attributes:
        run: Its result; its outputs are every strategy's reference.
        inputs: The inputs it ran on, which every strategy then runs on.
        record: What the report keeps of it (:attr:`InspectReport.trial`), the sizes that
            failed before it included.
    """

    run: TrialRun
    inputs: tuple[InputSpec, ...]
    record: Mapping[str, Any]


def _trial(plan: _Plan, scratch: Path) -> _Trial:
    """One plain session with ORT's defaults, in a fresh process, on each candidate until one runs.

    Raises:
        MeasurementError: it ran on none; ``report`` holds the partial report (the static part,
            the inputs, the error).
    """
    from sharedml._errors import MeasurementError
    from sharedml.inspection._measure import trial_run
    from sharedml.model._inputs import defaulted_dims

    plan.tell("trial run: one plain session, ORT defaults", 0)
    rejected: list[dict[str, Any]] = []
    for inputs in plan.candidates:
        trial = trial_run(
            plan.path,
            inputs=inputs,
            reference=scratch / "plain-outputs.npz",
            **plan.child_options,
        )
        if trial.error is None:
            break
        rejected.append({"inputs": [i.describe() for i in inputs], "error": trial.error})
        if is_model_refused(trial.error):
            break  # ORT refuses the model: no other size would load it
    record = trial.to_dict() | {"rejected_sizes": rejected}
    if trial.error is not None:
        inputs = plan.candidates[0]
        message = _trial_failed(plan.label, rejected, defaulted_dims(inputs, plan.dims))
        exc = MeasurementError(message)
        exc.report = _assemble(plan, inputs, record, error=message)
        raise exc
    return _Trial(trial, inputs, record)


def _compressed_accuracy(plan: _Plan, trial: _Trial, scratch: Path) -> CompressedAccuracy | None:
    """The compressed model's outputs on the trial's inputs against the trial's; None: no model."""
    if plan.compressed is None or trial.run.reference is None:
        return None
    from sharedml.inspection._compressed import compressed_accuracy

    compressed_format, compressed_path = plan.compressed
    plan.tell(f"{compressed_format.value}: one run on the same inputs, for accuracy", 0)
    return compressed_accuracy(
        compressed_path,
        compressed_format,
        reference=trial.run.reference,
        inputs=trial.inputs,
        scratch=scratch,
        **plan.child_options,
    )


def _measure_strategies(plan: _Plan, trial: _Trial) -> list[Measurement]:
    """Each strategy in a fresh process, one after another, on the trial's inputs."""
    measurements: list[Measurement] = []
    for index, strategy in enumerate(plan.strategies):
        done_before = index * plan.sessions

        def step(
            done: int, _total: int, name: str = strategy.name, base: int = done_before
        ) -> None:
            plan.tell(f"{name}: {done}/{plan.sessions} sessions", base + done)

        what = (
            "preparing the model (cached) and opening the pool"
            if strategy.warm_cache
            else "starting a fresh process"
        )
        plan.tell(f"{strategy.name}: {what}", done_before)
        measurements.append(
            measure(
                plan.path,
                strategy.name,
                sessions=plan.sessions,
                inputs=trial.inputs,
                progress=step,
                reference=trial.run.reference,
                tables=plan.tables,
                **plan.child_options,
            )
        )
    return measurements


def _fixed_cost(
    plan: _Plan, trial: _Trial, measurements: Sequence[Measurement]
) -> FixedCost | None:
    """What sharedml itself costs a process, where the pool was measured; else None."""
    shared = next((m for m in measurements if m.strategy == SHARED), None)
    if shared is None:
        return None
    from sharedml.inspection._measure import fixed_cost

    plan.tell(
        "sharedml's own cost: a fresh process imports it, opens and closes a pool", plan.steps
    )
    return fixed_cost(
        plan.path,
        inputs=trial.inputs,
        sessions=plan.sessions,
        rounds=shared.points[-1].rounds,
        **plan.child_options,
    )


# --------------------------------------------------------------------------------------------
# Report: what was measured, then the findings computed from it


def _assemble(
    plan: _Plan,
    inputs: tuple[InputSpec, ...],
    trial: Mapping[str, Any],
    measurements: Sequence[Measurement] = (),
    fixed: FixedCost | None = None,
    accuracy: CompressedAccuracy | None = None,
    error: str | None = None,
) -> InspectReport:
    """The report of what was measured, without findings (:func:`_with_findings` adds them)."""
    import onnxruntime as ort

    return InspectReport(
        model_path=plan.path,
        demo=plan.demo,
        sessions=plan.sessions,
        providers=plan.providers.providers,
        device=trial.get("device") or plan.providers.device,
        inputs=inputs,
        weights=plan.weights,
        measurements=tuple(measurements),
        projection_sessions=plan.projection_sessions,
        recommendation="",
        onnxruntime_version=(measurements[0].onnxruntime_version if measurements else "")
        or ort.__version__,
        platform=platform.platform(),
        trial=trial,
        error=error,
        fixed_cost=fixed,
        tables=plan.tables,
        compressed=accuracy,
    )


def _with_findings(report: InspectReport, serialized: SerializedRuns | None) -> InspectReport:
    """``report`` with its findings and recommendation, computed from its own figures."""
    # Compressed weights change the outputs on purpose: their own section reports them
    # (InspectReport.compressed); the findings compare the float model's strategies.
    float_only = {n: m for n, m in report.strategies.items() if get_strategy(n).weights == "float"}
    found = findings(
        float_only,
        sessions=report.sessions,
        weights_bytes=report.weights.total_bytes,
        unshared=report.weights.unshared,
        serialized=serialized,
        trial=report.trial,
        inputs=report.inputs,
        fixed_bytes=report.fixed_bytes,
        tables=report.tables,
    )
    return dataclasses.replace(
        report, findings=found, recommendation=" ".join(f.text for f in found)
    )


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
    if is_model_refused(str(first["error"])):
        return (
            f"This onnxruntime refuses {label}, as any session would (nothing was measured): "
            f"{str(first['error']).rstrip('.')}."
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
