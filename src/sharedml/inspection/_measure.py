"""Measure what N sessions of a model cost, each strategy in a fresh subprocess.

This is the parent side: :func:`measure` runs the measuring child through the child-process
runner (:func:`sharedml.runtime._child.run_child`) with the strategy, the providers and the
inputs as one JSON spec, passes its progress lines on, and turns its result into a
:class:`~sharedml.Measurement`. The child
(:mod:`sharedml.inspection._child`) says what a point is and how memory is read. One process per
measurement, so that what one strategy allocated (heap kept by the allocator, mapped files,
thread pools) can neither hide nor inflate another's figures.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sharedml._errors import MeasurementError
from sharedml.inspection._child import MIN_ROUNDS, PROGRESS_PREFIX, SPEC_VERSION
from sharedml.inspection._results import Measurement
from sharedml.inspection._strategies import get_strategy
from sharedml.model._inputs import InputSpec, input_specs
from sharedml.model._tables import IndexedTable
from sharedml.runtime._child import ChildFailed, entry_code, run_child

__all__ = [
    "DEFAULT_MEMORY_RESERVE_BYTES",
    "FixedCost",
    "ProgressCallback",
    "TrialRun",
    "fixed_cost",
    "measure",
    "trial_run",
]

DEFAULT_MEMORY_RESERVE_BYTES = 512 * 1024 * 1024  # bytes a measurement leaves free for the box
_CHILD_CODE = entry_code("sharedml.inspection._child:measuring_child")

# sharedml's own cost in a process: this child reads its memory with
# sharedml.inspection._memory run as a file (runpy), so that nothing of sharedml is imported
# before its first reading; then it imports sharedml, opens a pool as README shows (sessions
# created in the background), runs its N sessions at once, as many rounds as the measuring
# child's last point ran, and reads again (trimmed: a pool gives freed heap back as it creates
# sessions, so its held and trimmed figures agree, and trimmed readings of imports move less):
# the pool as a process that used plain onnxruntime before sees it. Less the pooled strategy's
# own figure, that is sharedml's fixed cost. (A pool closed and read after would count twice
# what ORT sets up for the first session of a model, which the strategy's figure holds too.)
_FIXED_COST_CODE = r"""
import gc, json, runpy, sys
spec = json.loads(sys.argv[1])
memory = runpy.run_path(spec["memory_module"])
import numpy as np, onnxruntime as ort

def reading():
    gc.collect()
    memory["trim_heap"]()
    return memory["read_memory"]()

providers = list(spec["providers"])
options = [dict(o) for o in spec["provider_options"]]
libraries, devices = spec.get("ep_libraries") or {}, spec.get("ep_devices") or {}
warm_so = ort.SessionOptions()
if devices:  # a plugin EP, registered and chosen as its user would (sharedml not imported yet)
    (name, chosen), = devices.items()
    if name in libraries:
        ort.register_execution_provider_library(name, libraries[name])
    def fits(d):
        hw = d.device
        return (str(hw.type).rsplit(".", 1)[-1].lower() == chosen["type"]
                and hw.vendor_id == chosen["vendor_id"] and hw.device_id == chosen["device_id"])
    found = [d for d in ort.get_ep_devices() if d.ep_name == name and fits(d)]
    warm_so.add_provider_for_devices([found[chosen["index"]]], options[0])
    warm = ort.InferenceSession(bytes.fromhex(spec["warmup"]), warm_so)
else:
    warm = ort.InferenceSession(bytes.fromhex(spec["warmup"]), providers=providers,
                                provider_options=options)
warm.run(None, {"a": np.zeros(1, np.float32)})
del warm
before = reading()
import sharedml
sharedml.SessionPool  # what a pool's user imports; the rest loads as the pool needs it
imported = reading()
from sharedml.model._inputs import generate, load_feeds
given = load_feeds(spec["feeds_file"]) if spec.get("feeds_file") else {}
feeds = {i["name"]: given[i["name"]] if i.get("source") == "file" else generate(i)
         for i in spec["inputs"]}
import threading
n = spec["sessions"]
pool = sharedml.SessionPool(spec["model"], sessions=n, providers=providers,
                            provider_options=options, ep_libraries=libraries,
                            ep_devices=devices, per_session_state=True)
pool.wait_ready()
held = [pool.session() for _ in range(n)]
sessions = [h.__enter__() for h in held]
barrier = threading.Barrier(n)
def work(sess):
    barrier.wait()
    sess.run(None, feeds)
for _ in range(spec["rounds"]):  # as many rounds as the pooled strategy's last point ran
    threads = [threading.Thread(target=work, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
opened = reading()
keys = ("pss", "uss", "rss", "private")
def growth(a, b):
    return {k: None if a[k] is None or b[k] is None else a[k] - b[k] for k in keys}
print("RESULT " + json.dumps({"imports": growth(imported, before), "pool": growth(opened, before)}),
      flush=True)
"""

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(sessions_done, sessions_total)`` while a child measures."""


def measure(
    model: str | os.PathLike[str],
    strategy: str = "naive",
    *,
    sessions: int = 4,
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    ep_libraries: Mapping[str, Any] | None = None,
    ep_devices: Mapping[str, Any] | None = None,
    dims: Mapping[str, int] | None = None,
    inputs: Sequence[InputSpec] | None = None,
    timeout_s: float | None = None,
    memory_reserve_bytes: int = DEFAULT_MEMORY_RESERVE_BYTES,
    progress: ProgressCallback | None = None,
    feeds: str | os.PathLike[str] | None = None,
    reference: str | os.PathLike[str] | None = None,
    tables: Sequence[IndexedTable] = (),
    traffic_seconds: float | None = None,
) -> Measurement:
    """Measure one strategy at ``sessions`` sessions in a fresh subprocess.

    Args:
        model: The ONNX model.
        strategy: A registered strategy's name (see :func:`registered_strategies`).
        sessions: How many sessions to create (all of them run concurrently, round after
            round until their memory settles: :attr:`MemoryPoint.rounds`).
        providers: As for ``onnxruntime.InferenceSession``; default CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        ep_libraries: Plugin EP libraries by EP name, as for ``SessionPool``.
        ep_devices: Plugin EP devices by EP name, as for ``SessionPool``.
        dims: Sizes of the inputs' symbolic dimensions (default 1); ignored with ``inputs``.
        inputs: The inputs to generate (default: from the model's signature and ``dims``).
        timeout_s: Stop the child after this long (``None``: no limit).
        memory_reserve_bytes: Memory to leave free: the child creates no further session when
            less than this plus 1.5 times the largest per-session growth seen is available (the
            machine's available memory, or the cgroup's room), and the rest is projected
            (:attr:`Measurement.stopped_reason`). Measuring N plain sessions of a large model
            must not push the machine into swapping or the OOM killer.
        progress: Called as ``progress(sessions_done, sessions)`` while the child works.
        feeds: An ``.npz`` file with the values of the ``inputs`` whose ``source`` is
            ``"file"`` (``sharedml inspect --inputs``).
        reference: Outputs of a default plain session to compare the first run with
            (:func:`trial_run` writes them); see :attr:`Measurement.plain_max_abs_diff`.
        tables: Tables the inputs index (:func:`sharedml.model._tables.indexed_tables`): after
            the points, each session runs over inputs whose ids cover their rows, and memory
            is read after each (:attr:`Measurement.traffic_points`).
        traffic_seconds: Time those runs may take in all (default 60 s); where it runs out,
            fewer rows are covered and :attr:`Measurement.traffic` says so.

    Returns:
        The :class:`Measurement`.

    Raises:
        ValueError: ``sessions`` below 1, an unknown strategy or dimension.
        ProviderError: a provider this onnxruntime build does not have.
        ModelError: the model cannot be read (see :mod:`sharedml._errors`).
        MeasurementError: the child failed; the message names the strategy and the child's
            last line of stderr.

    Thread safety: safe to call from several threads, but concurrent measurements disturb each
    other's figures (memory pressure, CPU time); ``inspect`` runs them one after another.
    """
    from sharedml.model._graph import load_graph
    from sharedml.runtime._providers import plan_providers

    if sessions < 1:
        raise ValueError(f"sessions must be at least 1, not {sessions}.")
    chosen = get_strategy(strategy)
    plan = plan_providers(
        providers, provider_options, ep_libraries=ep_libraries, ep_devices=ep_devices
    )
    path = Path(model)
    if inputs is None:
        inputs = input_specs(load_graph(path), dims, model_name=f"'{path}'")
    if chosen.warm_cache:
        from sharedml.prepared._prepare import prepared_model_for

        prepared_model_for(path)
    if chosen.weights != "float":  # the one-off compression is not the sessions' memory either
        from sharedml.prepared._compress import compressed_model_for

        compressed_model_for(path, weights=chosen.weights)
    spec = _spec(path, plan, inputs, feeds) | {
        "strategy": chosen.name,
        "factory": chosen.factory,
        "sessions": sessions,
        "memory_reserve_bytes": int(memory_reserve_bytes),
        "reference_file": str(reference) if reference is not None else None,
        "tables": [t.to_dict() for t in tables],
        "traffic_seconds": traffic_seconds,
    }
    try:
        raw = _run_child(
            spec, what=f"Measuring strategy '{chosen.name}'", timeout_s=timeout_s, progress=progress
        )
        served = None
        points: list[Any] = list(raw.get("points") or [])
        if len(points) == sessions:  # not where memory ran short: that is projected
            # What a server holds: the N sessions created, then served together, untrimmed.
            served = _run_child(
                spec | {"mode": "serve", "rounds": points[-1]["rounds"]},
                what=f"Serving strategy '{chosen.name}'",
                timeout_s=timeout_s,
                progress=None,
            )
    except ChildFailed as exc:
        raise MeasurementError(str(exc)) from None
    return Measurement._from_child(chosen, sessions, raw, served)


def _spec(
    path: Path, plan: Any, inputs: Sequence[InputSpec], feeds: str | os.PathLike[str] | None
) -> dict[str, Any]:
    """What every child needs: the model, the providers and how to make the inputs.

    The providers as :meth:`~sharedml.runtime.ProviderPlan.to_spec` gives them: a child
    registers the same plugin library and picks the same device.
    """
    return {
        "version": SPEC_VERSION,
        "model": str(path.resolve()),
        **plan.to_spec(),
        "inputs": [i.to_dict() for i in inputs],
        "feeds_file": str(Path(feeds).resolve()) if feeds is not None else None,
    }


@dataclasses.dataclass(frozen=True)
class TrialRun:
    """One plain session with ORT's defaults, run once in a fresh process before measuring.

    Attributes:
        error: ORT's message where creating or running the session failed, else None.
        outputs: ``{name, dtype, shape}`` of each output (shape None for non-tensor outputs).
        run_seconds: The run's wall time.
        reference: The file holding its numeric outputs (for :func:`measure`'s ``reference``).
        device: The device the session ran on, in words (``ProviderPlan.device``).
    """

    error: str | None
    outputs: tuple[Mapping[str, Any], ...] = ()
    run_seconds: float | None = None
    reference: Path | None = None
    device: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "error": self.error,
            "outputs": [dict(o) for o in self.outputs],
            "run_seconds": self.run_seconds,
            "device": self.device,
        }


def trial_run(
    model: str | os.PathLike[str],
    *,
    inputs: Sequence[InputSpec],
    reference: str | os.PathLike[str],
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    ep_libraries: Mapping[str, Any] | None = None,
    ep_devices: Mapping[str, Any] | None = None,
    feeds: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
) -> TrialRun:
    """Create one plain session of ``model`` in a fresh process and run it once on ``inputs``.

    A model that fails on the generated inputs (a detector whose symbolic height and width
    were set to 1) fails here in seconds, before any strategy is measured; its outputs are the
    reference that every measurement's numerics are checked against.

    Args:
        model: The ONNX model.
        inputs: From :func:`sharedml.model._inputs.input_specs`.
        reference: Where to write the outputs (``.npz``).
        providers: As for ``onnxruntime.InferenceSession``; default CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        ep_libraries: Plugin EP libraries by EP name, as for ``SessionPool``.
        ep_devices: Plugin EP devices by EP name, as for ``SessionPool``.
        feeds: As for :func:`measure`.
        timeout_s: Stop the child after this long.

    Returns:
        The trial; ``error`` says why it failed (ORT's own message).
    """
    from sharedml.runtime._providers import plan_providers

    plan = plan_providers(
        providers, provider_options, ep_libraries=ep_libraries, ep_devices=ep_devices
    )
    spec = _spec(Path(model), plan, inputs, feeds) | {
        "mode": "trial",
        "strategy": "trial",
        "reference_file": str(reference),
    }
    try:
        raw = _run_child(spec, what="The trial run", timeout_s=timeout_s, progress=None)
    except ChildFailed as exc:
        error = f"stopped after {timeout_s} s: {exc.last}" if exc.timed_out else exc.last
        return TrialRun(error=error)
    return TrialRun(
        error=None,
        outputs=tuple(raw["outputs"]),
        run_seconds=float(raw["run_seconds"]),
        reference=Path(reference),
        device=raw.get("device"),
    )


@dataclasses.dataclass(frozen=True)
class FixedCost:
    """What sharedml itself costs a process, once, whatever its pools hold.

    A fresh process that has onnxruntime loaded and has run a session reads its memory, imports
    sharedml, opens a pool of N of the model as README shows (its other sessions created on
    sharedml's background thread) and runs all N at once: ``pool`` is that growth, what a pool
    costs a process that used plain onnxruntime before. Less the pooled strategy's own figure
    (measured over a baseline that had sharedml imported and its once-per-process probes of
    onnxruntime run), what remains is sharedml's: its imports, those probes, its creation
    thread and what that thread's heap keeps. Growth per metric (``pss``,
    ``uss``, ``rss``, ``private``), None where the platform does not give it.

    Attributes:
        imports: Growth after ``import sharedml`` and loading ``sharedml.SessionPool``.
        pool: Growth with the pool open and its sessions run together ``rounds`` times.
        error: Why it could not be measured (the child's last line), else None.
    """

    imports: Mapping[str, int | None]
    pool: Mapping[str, int | None]
    error: str | None = None

    def bytes(self, metric: str, pooled: int | None) -> int | None:
        """Sharedml's own cost in ``metric``: :attr:`pool` less ``pooled``, at least 0.

        Args:
            metric: The metric.
            pooled: The pooled strategy's total at the same session count, over a baseline
                that had sharedml imported, trimmed as this is (:attr:`Measurement.trimmed_bytes`).
        """
        value = self.pool.get(metric)
        if value is None or pooled is None:
            return None
        return max(0, int(value) - int(pooled))

    def imports_bytes(self, metric: str) -> int | None:
        """What importing sharedml added, in ``metric``."""
        value = self.imports.get(metric)
        return None if value is None else max(0, int(value))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"imports": dict(self.imports), "pool": dict(self.pool), "error": self.error}


def fixed_cost(
    model: str | os.PathLike[str],
    *,
    inputs: Sequence[InputSpec],
    sessions: int = 4,
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    ep_libraries: Mapping[str, Any] | None = None,
    ep_devices: Mapping[str, Any] | None = None,
    feeds: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    rounds: int = MIN_ROUNDS,
) -> FixedCost:
    """Measure sharedml's own per-process cost (:class:`FixedCost`) in a fresh process.

    The model must be prepared already (the pool's first use prepares it; ``inspect`` measures
    this after the pooled strategies). A failure is returned in ``error``, not raised: the
    report then says the figure is missing rather than stopping. ``rounds``: how many times
    the N sessions run together, as the pooled strategy's measurement ran them (its last
    point's :attr:`MemoryPoint.rounds`), so that the two hold the same activation memory.
    """
    from sharedml.inspection import _memory
    from sharedml.inspection._child import warmup_model_bytes
    from sharedml.runtime._providers import plan_providers

    plan = plan_providers(
        providers, provider_options, ep_libraries=ep_libraries, ep_devices=ep_devices
    )
    spec = _spec(Path(model), plan, inputs, feeds) | {
        "sessions": sessions,
        "rounds": rounds,
        "warmup": warmup_model_bytes().hex(),
        "memory_module": str(Path(_memory.__file__).resolve()),
    }
    try:
        raw = _run_child(
            spec,
            what="Measuring sharedml's own cost",
            timeout_s=timeout_s,
            progress=None,
            code=_FIXED_COST_CODE,
        )
    except ChildFailed as exc:
        error = f"stopped after {timeout_s} s: {exc.last}" if exc.timed_out else exc.last
        return FixedCost({}, {}, error=error)
    return FixedCost(dict(raw["imports"]), dict(raw["pool"]))


def _run_child(
    spec: Mapping[str, Any],
    *,
    what: str,
    timeout_s: float | None,
    progress: ProgressCallback | None,
    code: str = _CHILD_CODE,
) -> Any:
    """Run a measuring child on ``spec``; its result (raises :class:`ChildFailed`)."""

    def on_line(line: str) -> None:
        if progress is not None and line.startswith(PROGRESS_PREFIX):
            done, total = (int(v) for v in line[len(PROGRESS_PREFIX) :].split())
            progress(done, total)

    return run_child([json.dumps(spec)], code=code, what=what, timeout_s=timeout_s, on_line=on_line)
