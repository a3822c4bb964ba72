"""Measure what N sessions of a model cost, each configuration in a fresh subprocess.

One measurement = one *strategy* (how the N sessions get their weights) at one session count,
run by ``python -c "from sharedml._measure import _child_main; ..." SPEC`` in a process of its
own, so that what one strategy allocated (heap kept by the allocator, mapped files, thread
pools) can neither hide nor inflate another's figures. The child:

1. imports onnxruntime and the strategy, builds the inputs, and creates and drops one tiny
   session with the same providers, so that loading the providers' libraries and ORT's
   environment (one-time costs of any process) are not counted;
2. records the baseline: psutil ``memory_full_info()`` (PSS, USS, RSS), and device memory where
   it can be read;
3. for k = 1 .. N: creates session k, then runs sessions 1..k once each, *concurrently* (k
   threads released together by a ``threading.Barrier``), and records memory again. Point k is
   therefore "k sessions, each having run once, concurrently": point N is the total, and the
   per-extra-session cost is the least-squares slope over all points, not a guess;
4. prints one ``RESULT`` line of JSON on stdout (progress lines before it), or an error as its
   last stderr line and a non-zero exit status.

Memory figures are growth over the baseline. The headline metric is PSS where the platform has
it (Linux): a page mapped by several processes counts a share in each, and a file mapped once
by this process counts once, which is what "how much RAM does this cost" means. Elsewhere it is
USS (private pages), and the result says which (:attr:`Measurement.metric`). With glibc, each
reading follows ``malloc_trim(0)``: session creation frees large transient buffers, and how much
of that free heap glibc keeps varies from run to run (by 30% of the total on the demo model),
so the trimmed figure, what the sessions hold, is the repeatable one. The reading before the
trim is kept as well (:attr:`MemoryPoint.untrimmed_bytes`).

Device memory: with the CUDA provider, the child's own usage read through NVML (``pynvml``) or
``nvidia-smi --query-compute-apps``; with DirectML it is reported as not measurable (Windows
exposes no per-process figure sharedml can read); never estimated.

Strategies live in a registry (:func:`register_strategy`). A strategy names its factory as
``"module:function"`` because the factory runs in the child process, which imports it; the
factory takes a :class:`StrategyContext` and returns a :class:`SessionSet`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import importlib
import json
import math
import operator
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from sharedml._errors import MeasurementError

__all__ = [
    "DEFAULT_MEMORY_RESERVE_BYTES",
    "InputSpec",
    "Measurement",
    "MemoryPoint",
    "SessionSet",
    "Strategy",
    "StrategyContext",
    "get_strategy",
    "input_specs",
    "measure",
    "register_strategy",
    "registered_strategies",
]

_SPEC_VERSION = 1
_RESULT_PREFIX = "RESULT "
_PROGRESS_PREFIX = "PROGRESS "
DEFAULT_MEMORY_RESERVE_BYTES = 512 * 1024 * 1024  # bytes a measurement leaves free for the box
_STDERR_LINES_KEPT = 50  # of the child's stderr, for error messages
_MODULE = "sharedml._measure"  # not __name__, which is "__main__" when run as a script
_CHILD_CODE = f"import sys; from {_MODULE} import _child_main; sys.exit(_child_main(sys.argv[1:]))"

Runner = Callable[[Mapping[str, Any]], object]
"""Runs one session once on the given feeds (a callable made by :meth:`SessionSet.add`)."""

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(sessions_done, sessions_total)`` while a child measures."""


# --------------------------------------------------------------------------------------------
# Strategies


@dataclasses.dataclass(frozen=True)
class StrategyContext:
    """What a strategy's factory gets, in the measuring child.

    Attributes:
        model_path: The user's model, as given.
        sessions: How many sessions the child will ask for.
        providers: Provider names in priority order (CPU last), as planned by sharedml.
        provider_options: One options dict per provider.
    """

    model_path: Path
    sessions: int
    providers: tuple[str, ...]
    provider_options: tuple[dict[str, str], ...]


class SessionSet(Protocol):
    """The sessions of one strategy, created one at a time by the measuring child."""

    def add(self) -> Runner:
        """Create one more session (or reuse one) and return a callable that runs it once."""

    def close(self) -> None:
        """Release every session."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way of giving N threads sessions over a model.

    Attributes:
        name: Short name, as in ``strategies.<name>`` of the JSON report.
        summary: One line for tables: what the N sessions are.
        factory: ``"module:function"``, importable in a fresh process; the function takes a
            :class:`StrategyContext` and returns a :class:`SessionSet`.
        warm_cache: The strategy uses sharedml's prepared-model cache: the parent prepares the
            model first, so that the one-time prepare is not counted as the sessions' memory.
        default: Measured by ``inspect`` when no strategies are named.
    """

    name: str
    summary: str
    factory: str
    warm_cache: bool = False
    default: bool = True


_REGISTRY: dict[str, Strategy] = {}
_REGISTRY_LOCK = threading.Lock()


def register_strategy(strategy: Strategy, *, replace: bool = False) -> None:
    """Add a strategy to the registry that ``inspect`` and :func:`measure` draw on.

    Args:
        strategy: The strategy. Its factory is only imported in the measuring child.
        replace: Replace a registered strategy of the same name instead of refusing.

    Raises:
        ValueError: the name is taken (and ``replace`` is false) or the factory is not of the
            form ``"module:function"``.

    Thread safety: safe to call from any thread.
    """
    module, _, func = strategy.factory.partition(":")
    if not module or not func:
        raise ValueError(
            f"Strategy {strategy.name!r}: factory must be 'module:function', not "
            f"{strategy.factory!r}."
        )
    with _REGISTRY_LOCK:
        if strategy.name in _REGISTRY and not replace:
            raise ValueError(f"A strategy named {strategy.name!r} is already registered.")
        _REGISTRY[strategy.name] = strategy


def registered_strategies() -> tuple[Strategy, ...]:
    """Every registered strategy, in registration order."""
    with _REGISTRY_LOCK:
        return tuple(_REGISTRY.values())


def get_strategy(name: str) -> Strategy:
    """The registered strategy called ``name``.

    Raises:
        ValueError: no such strategy (the message lists the known ones).
    """
    with _REGISTRY_LOCK:
        strategy = _REGISTRY.get(name)
        known = ", ".join(_REGISTRY)
    if strategy is None:
        raise ValueError(f"Unknown strategy {name!r}; known strategies: {known}.")
    return strategy


class _PlainSessions:
    """Plain ``InferenceSession``s over the user's model, ONNX Runtime defaults."""

    def __init__(self, ctx: StrategyContext, *, share_one: bool) -> None:
        self._ctx = ctx
        self._share_one = share_one
        self._sessions: list[Any] = []

    def add(self) -> Runner:
        import onnxruntime as ort

        if not self._sessions or not self._share_one:
            self._sessions.append(
                ort.InferenceSession(
                    str(self._ctx.model_path),
                    providers=list(self._ctx.providers),
                    provider_options=[dict(o) for o in self._ctx.provider_options],
                )
            )
        sess = self._sessions[-1]
        return lambda feeds: sess.run(None, dict(feeds))

    def close(self) -> None:
        self._sessions.clear()


class _PoolSessions:
    """A :class:`sharedml.SessionPool` grown one session at a time by holding checkouts."""

    def __init__(self, ctx: StrategyContext, *, prepacking: str) -> None:
        from sharedml._pool import SessionPool

        self._stack = contextlib.ExitStack()
        # min_sessions=0: the pool creates a session whenever all existing ones are checked
        # out, so holding k checkouts gives exactly k sessions. serialize_runs=False because a
        # serialized pool holds its run lock for a whole checkout; the child itself runs the
        # sessions one at a time where the provider needs that (see _child_measure).
        self._pool = SessionPool(
            ctx.model_path,
            sessions=ctx.sessions,
            min_sessions=0,
            providers=list(ctx.providers),
            provider_options=[dict(o) for o in ctx.provider_options],
            prepacking=prepacking,
            serialize_runs=False,
        )

    def add(self) -> Runner:
        sess = self._stack.enter_context(self._pool.session())
        return lambda feeds: sess.run(None, dict(feeds))

    def close(self) -> None:
        self._stack.close()
        self._pool.close()


def _naive(ctx: StrategyContext) -> SessionSet:
    return _PlainSessions(ctx, share_one=False)


def _single(ctx: StrategyContext) -> SessionSet:
    return _PlainSessions(ctx, share_one=True)


def _shared(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="auto")


def _shared_raw(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="off")


def _shared_private_packs(ctx: StrategyContext) -> SessionSet:
    return _PoolSessions(ctx, prepacking="per-session")


for _strategy in (
    Strategy("naive", "N plain onnxruntime.InferenceSession, ORT defaults", f"{_MODULE}:_naive"),
    Strategy(
        "shared",
        "sharedml.SessionPool(model, sessions=N): defaults (packed weights shared too)",
        f"{_MODULE}:_shared",
        warm_cache=True,
    ),
    Strategy(
        "shared-raw",
        "SessionPool(..., prepacking='off'): raw weights shared, no packed kernels",
        f"{_MODULE}:_shared_raw",
        warm_cache=True,
    ),
    Strategy(
        "shared-private-packs",
        "SessionPool(..., prepacking='per-session'): each session packs its own copy",
        f"{_MODULE}:_shared_private_packs",
        warm_cache=True,
    ),
    Strategy("single", "one plain session shared by all N threads", f"{_MODULE}:_single"),
):
    register_strategy(_strategy)
del _strategy


# --------------------------------------------------------------------------------------------
# Inputs


_GENERATED_DTYPES = frozenset(
    (
        "bool",
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "str",
    )
)


@dataclasses.dataclass(frozen=True)
class InputSpec:
    """One model input as the measuring child generates it.

    Attributes:
        name: The input's name.
        dtype: numpy dtype name (``"float32"``, ``"int64"``, ``"bool"``, ``"str"``, ...).
        shape: The concrete shape the child generates.
        dim_names: For each axis, the symbolic name it had in the model (``None`` for a fixed
            size; ``"?"`` for an unnamed dynamic axis, generated as 1).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    dim_names: tuple[str | None, ...]

    def describe(self) -> str:
        """``x float32[batch=1, 1024]``: the input as generated, symbolic axes named."""
        axes = [
            str(size) if dim is None else f"{dim}={size}"
            for size, dim in zip(self.shape, self.dim_names, strict=True)
        ]
        return f"{self.name} {self.dtype}[{', '.join(axes)}]"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def input_specs(
    model: Any, dims: Mapping[str, int] | None = None, *, model_name: str = "the model"
) -> tuple[InputSpec, ...]:
    """The inputs to generate for ``model`` (an ``onnx.ModelProto``).

    Symbolic dimensions are 1 unless ``dims`` names them.

    Args:
        model: The model's protobuf (``sharedml._prepare.load_graph`` gives it without data).
        dims: Sizes of symbolic dimensions, by name.
        model_name: How error messages name the model.

    Returns:
        One spec per graph input that is not an initializer, in graph order.

    Raises:
        ValueError: ``dims`` names a dimension the model does not have, or a size below 0.
        MeasurementError: an input whose type inspect cannot generate (sequences, maps,
            bfloat16, ...).
    """
    import onnx

    checked: dict[str, int] = {}
    for name, size in (dims or {}).items():
        try:
            checked[name] = operator.index(size)  # ints only: no 2.5, no "2"
        except TypeError:
            checked[name] = -1
        if checked[name] < 0 or isinstance(size, bool):
            raise ValueError(f"Dimension {name!r} must be a non-negative integer, not {size!r}.")
    dims = checked
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    specs: list[InputSpec] = []
    seen_dims: set[str] = set()
    for value in graph.input:
        if value.name in initializers:
            continue  # IR < 4: initializers are listed as inputs with defaults
        kind = value.type.WhichOneof("value")
        if kind != "tensor_type":
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} is a {kind or 'value of unknown type'}; "
                "inspect can generate only tensor inputs."
            )
        tensor_type = value.type.tensor_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
            dtype_name = "str" if dtype.kind in "OSU" else dtype.name
        except Exception:
            dtype_name = onnx.TensorProto.DataType.Name(tensor_type.elem_type).lower()
        if dtype_name not in _GENERATED_DTYPES:
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} has type {dtype_name}; inspect can "
                f"generate inputs of types {', '.join(sorted(_GENERATED_DTYPES))}."
            )
        if not tensor_type.HasField("shape"):
            raise MeasurementError(
                f"Input '{value.name}' of {model_name} has no shape (not even a rank), so inspect "
                "cannot generate it. Give the input a shape in the model (onnx.shape_inference "
                "or the exporter's dynamic_axes)."
            )
        shape: list[int] = []
        names: list[str | None] = []
        for dim in tensor_type.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
                names.append(None)
            elif dim.dim_param:
                seen_dims.add(dim.dim_param)
                shape.append(dims.get(dim.dim_param, 1))
                names.append(dim.dim_param)
            else:
                shape.append(1)
                names.append("?")
        specs.append(InputSpec(value.name, dtype_name, tuple(shape), tuple(names)))
    unknown = sorted(set(dims) - seen_dims)
    if unknown:
        known = ", ".join(sorted(seen_dims)) or "none"
        raise ValueError(
            f"{model_name[:1].upper() + model_name[1:]} has no symbolic dimension "
            f"{', '.join(repr(u) for u in unknown)} (its symbolic dimensions: {known})."
        )
    return tuple(specs)


def _generate(spec: Mapping[str, Any]) -> Any:
    """An input that keeps every common op valid: floats in [0, 1), integers 1, bools False.

    Integers are 1 rather than random: a valid row of any embedding table of at least 2 rows
    (Gather), a non-zero divisor, and an attention mask that keeps every position.
    """
    import numpy as np

    shape = tuple(spec["shape"])
    dtype = spec["dtype"]
    if dtype == "str":
        return np.full(shape, "", dtype=object)
    if dtype == "bool":
        return np.zeros(shape, dtype=np.bool_)
    if np.dtype(dtype).kind == "f":
        rng = np.random.default_rng(0)
        return rng.random(shape, dtype=np.float64).astype(dtype)
    return np.ones(shape, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Results


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
    """

    sessions: int
    pss_bytes: int | None
    uss_bytes: int | None
    rss_bytes: int
    untrimmed_bytes: int | None
    device_bytes: int | None
    create_seconds: float
    run_seconds: float

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
        )


# --------------------------------------------------------------------------------------------
# The parent side


def _child_env() -> dict[str, str]:
    """The child imports this very sharedml, installed or not."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def measure(
    model: str | os.PathLike[str],
    strategy: str = "naive",
    *,
    sessions: int = 4,
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[dict[str, Any]] | None = None,
    dims: Mapping[str, int] | None = None,
    inputs: Sequence[InputSpec] | None = None,
    timeout_s: float | None = None,
    memory_reserve_bytes: int = DEFAULT_MEMORY_RESERVE_BYTES,
    progress: ProgressCallback | None = None,
) -> Measurement:
    """Measure one strategy at ``sessions`` sessions in a fresh subprocess.

    Args:
        model: The ONNX model.
        strategy: A registered strategy's name (see :func:`registered_strategies`).
        sessions: How many sessions to create (all of them run once, concurrently).
        providers: As for ``onnxruntime.InferenceSession``; default CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        dims: Sizes of the inputs' symbolic dimensions (default 1); ignored with ``inputs``.
        inputs: The inputs to generate (default: from the model's signature and ``dims``).
        timeout_s: Stop the child after this long (``None``: no limit).
        memory_reserve_bytes: Memory to leave free: the child creates no further session when
            less than this plus 1.5 times the largest per-session growth seen is available (the
            machine's available memory, or the cgroup's room), and the rest is projected
            (:attr:`Measurement.stopped_reason`). Measuring N plain sessions of a large model
            must not push the machine into swapping or the OOM killer.
        progress: Called as ``progress(sessions_done, sessions)`` while the child works.

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
    from sharedml._prepare import load_graph
    from sharedml._providers import plan_providers

    if sessions < 1:
        raise ValueError(f"sessions must be at least 1, not {sessions}.")
    chosen = get_strategy(strategy)
    plan = plan_providers(providers, provider_options)
    path = Path(model)
    if inputs is None:
        inputs = input_specs(load_graph(path), dims, model_name=f"'{path}'")
    if chosen.warm_cache:
        from sharedml._cache import prepared_model_for

        prepared_model_for(path)
    spec = {
        "version": _SPEC_VERSION,
        "model": str(path.resolve()),
        "strategy": chosen.name,
        "factory": chosen.factory,
        "sessions": sessions,
        "providers": list(plan.providers),
        "provider_options": [dict(o) for o in plan.provider_options],
        "inputs": [{"name": i.name, "dtype": i.dtype, "shape": list(i.shape)} for i in inputs],
        "memory_reserve_bytes": int(memory_reserve_bytes),
    }
    raw = _run_child(spec, timeout_s=timeout_s, progress=progress)
    return Measurement._from_child(chosen, sessions, raw)


def _run_child(
    spec: Mapping[str, Any], *, timeout_s: float | None, progress: ProgressCallback | None
) -> dict[str, Any]:
    name = spec["strategy"]
    # -c rather than -m: runpy would import this module a second time as __main__.
    cmd = [sys.executable, "-c", _CHILD_CODE, json.dumps(spec)]
    stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES_KEPT)
    result: dict[str, Any] | None = None
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        errors="replace",
        env=_child_env(),
    )
    assert proc.stdout is not None and proc.stderr is not None
    stderr = proc.stderr

    def drain_stderr() -> None:  # a full pipe would block the child
        for line in stderr:
            if line.strip():
                stderr_tail.append(line.strip())

    drainer = threading.Thread(target=drain_stderr, name="sharedml-measure-stderr", daemon=True)
    drainer.start()
    timer: threading.Timer | None = None
    timed_out = threading.Event()
    if timeout_s is not None:

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.daemon = True
        timer.start()
    try:
        for line in proc.stdout:
            if line.startswith(_PROGRESS_PREFIX):
                if progress is not None:
                    done, total = (int(v) for v in line[len(_PROGRESS_PREFIX) :].split())
                    progress(done, total)
            elif line.startswith(_RESULT_PREFIX):
                result = json.loads(line[len(_RESULT_PREFIX) :])
        returncode = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:  # interrupted (Ctrl-C) or a callback raised: leave no child
            proc.kill()
            proc.wait()
        drainer.join(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
    last = stderr_tail[-1] if stderr_tail else "(no output on stderr)"
    if timed_out.is_set():
        raise MeasurementError(
            f"Measuring strategy '{name}' took longer than {timeout_s} s and was stopped. "
            f"Last stderr line: {last}"
        )
    if returncode != 0 or result is None:
        if returncode < 0:
            how = f"was killed by signal {-returncode}"
            if -returncode == 9:
                how += " (out of memory?)"
        else:
            how = f"exited with status {returncode}"
        raise MeasurementError(
            f"Measuring strategy '{name}' failed: the measuring process {how}: {last}"
        )
    return result


# --------------------------------------------------------------------------------------------
# The child side


def _memory() -> dict[str, int | None]:
    import psutil

    proc = psutil.Process()
    try:
        info = proc.memory_full_info()
    except (psutil.AccessDenied, NotImplementedError):  # pragma: no cover - not on Linux
        basic = proc.memory_info()
        return {"pss": None, "uss": None, "rss": int(basic.rss)}
    pss = getattr(info, "pss", None)
    uss = getattr(info, "uss", None)
    return {
        "pss": int(pss) if pss is not None else None,
        "uss": int(uss) if uss is not None else None,
        "rss": int(info.rss),
    }


def _malloc_trim() -> bool:
    """Give the heap pages that the allocator keeps after ``free`` back to the OS (glibc).

    Creating a session allocates and frees large transient buffers (the parsed model, copies
    of initializers before prepacking). glibc keeps much of that freed heap, by amounts that
    vary from run to run by a model's size or more; it is reusable, not held by the sessions.
    Trimming before each reading makes the figures what the sessions hold, and repeatable; the
    reading before the trim is kept too (``untrimmed_bytes``).

    Returns:
        Whether a trim happened (only with glibc).
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and other libcs: no malloc_trim
        return False
    trim(0)
    return True


def _available_bytes() -> int:
    """Memory the child may still use: the machine's available memory, or the cgroup's room."""
    import psutil

    available = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return available


class _DeviceMemory:
    """This process's device memory, where the provider and platform let it be read."""

    def __init__(self, providers: Sequence[str]) -> None:
        self.metric: str | None = None
        self.note: str | None = None
        self._nvml: Any = None
        primary = providers[0] if providers else "CPUExecutionProvider"
        if primary in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
            try:
                pynvml = importlib.import_module("pynvml")  # optional: nvidia-ml-py
                pynvml.nvmlInit()
                self._nvml = pynvml
                self.metric = "nvml"
            except Exception:
                if shutil.which("nvidia-smi"):
                    self.metric = "nvidia-smi"
                else:
                    self.note = (
                        "not measurable: neither pynvml (pip install nvidia-ml-py) nor nvidia-smi "
                        "is available"
                    )
        elif primary == "DmlExecutionProvider":
            self.note = (
                "not measurable: DirectML reports no per-process device memory that sharedml can "
                "read; use Task Manager's 'Dedicated GPU memory' column for this process"
            )
        elif primary != "CPUExecutionProvider":
            self.note = f"not measured: sharedml reads device memory only for CUDA, not {primary}"
        self._seen = False

    def read(self) -> int | None:
        """Bytes of device memory this process uses now, or None where it cannot be read."""
        if self.metric is None:
            return None
        pid = os.getpid()
        total = 0
        found = False
        try:
            if self.metric == "nvml":
                nvml = self._nvml
                for index in range(nvml.nvmlDeviceGetCount()):
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        if proc.pid == pid and proc.usedGpuMemory is not None:
                            total += int(proc.usedGpuMemory)
                            found = True
            else:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "--query-compute-apps=pid,used_memory",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=True,
                ).stdout
                for line in out.splitlines():
                    fields = [f.strip() for f in line.split(",")]
                    if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
                        total += int(fields[1]) * 1024 * 1024  # nvidia-smi reports MiB
                        found = True
        except Exception as exc:
            self.note = f"not measurable: reading device memory failed ({exc})"
            self.metric = None
            return None
        self._seen = self._seen or found
        return total

    def finish(self) -> None:
        if self.metric is not None and not self._seen:
            # The driver never listed this process: in a container with its own PID namespace
            # the driver reports host PIDs. Zeros would be invented figures.
            self.note = (
                f"not measurable: {self.metric} does not list this process (a container with its "
                "own PID namespace?)"
            )
            self.metric = None


def _tiny_model_bytes() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "a"], ["b"])],
        "warmup",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    data: bytes = model.SerializeToString()
    return data


def _run_concurrently(
    runners: Sequence[Runner], feeds: Mapping[str, Any], concurrent: bool
) -> float:
    """Run every runner once; all together on a barrier, or one by one. Returns wall seconds."""
    if not concurrent:
        start = time.perf_counter()
        for run in runners:
            run(feeds)
        return time.perf_counter() - start
    barrier = threading.Barrier(len(runners) + 1)
    errors: list[BaseException] = []

    def work(run: Runner) -> None:
        try:
            barrier.wait()
            run(feeds)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in runners]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


def _growth(now: Mapping[str, int | None], base: Mapping[str, int | None], key: str) -> int | None:
    a, b = now.get(key), base.get(key)
    return None if a is None or b is None else a - b


def _child_measure(spec: Mapping[str, Any]) -> dict[str, Any]:
    import onnxruntime as ort

    if spec.get("version") != _SPEC_VERSION:
        raise ValueError(f"spec version {spec.get('version')} is not {_SPEC_VERSION}")
    module_name, _, func_name = spec["factory"].partition(":")
    factory = getattr(importlib.import_module(module_name), func_name)
    providers = tuple(spec["providers"])
    provider_options = tuple(dict(o) for o in spec["provider_options"])
    ctx = StrategyContext(
        model_path=Path(spec["model"]),
        sessions=int(spec["sessions"]),
        providers=providers,
        provider_options=provider_options,
    )
    feeds = {i["name"]: _generate(i) for i in spec["inputs"]}
    reserve = int(spec["memory_reserve_bytes"])
    # DirectML can run neither one session from two threads nor several sessions at once.
    concurrent = providers[0] != "DmlExecutionProvider"
    device = _DeviceMemory(providers)

    # One-time costs of any process that uses these providers: their libraries, ORT's
    # environment and thread pools. Paid (and released) here, so that they are not counted.
    warmup = ort.InferenceSession(
        _tiny_model_bytes(), providers=list(providers), provider_options=list(provider_options)
    )
    warmup.run(None, {"a": _generate({"shape": [1], "dtype": "float32"})})
    del warmup
    gc.collect()
    base_untrimmed = _memory()
    trimmed = _malloc_trim()
    base = _memory()
    base_device = device.read()
    metric = "pss" if base["pss"] is not None else "uss" if base["uss"] is not None else "rss"
    start = time.perf_counter()
    sessions = factory(ctx)
    setup_seconds = time.perf_counter() - start
    runners: list[Runner] = []
    points: list[dict[str, Any]] = []
    stopped: str | None = None
    largest_step = 0
    previous = 0
    try:
        for k in range(1, ctx.sessions + 1):
            if k > 1:
                room = _available_bytes() - reserve
                if room < 1.5 * largest_step:
                    stopped = (
                        f"stopped after {k - 1} of {ctx.sessions} sessions to leave "
                        f"{reserve / 2**20:.0f} MiB free: each session needs up to "
                        f"{largest_step / 2**20:.0f} MiB, {max(room, 0) / 2**20:.0f} MiB was "
                        "left; larger counts are projected"
                    )
                    break
            start = time.perf_counter()
            runners.append(sessions.add())
            create_seconds = time.perf_counter() - start
            run_seconds = _run_concurrently(runners, feeds, concurrent)
            gc.collect()
            untrimmed = _memory()
            _malloc_trim()
            now = _memory()
            dev = device.read()
            growth = _growth(now, base, metric) or 0
            largest_step = max(largest_step, growth - previous)
            previous = growth
            points.append(
                {
                    "sessions": k,
                    "pss_bytes": _growth(now, base, "pss"),
                    "uss_bytes": _growth(now, base, "uss"),
                    "rss_bytes": _growth(now, base, "rss"),
                    "untrimmed_bytes": _growth(untrimmed, base_untrimmed, metric),
                    "device_bytes": (
                        dev - base_device if dev is not None and base_device is not None else None
                    ),
                    "create_seconds": create_seconds,
                    "run_seconds": run_seconds,
                }
            )
            print(f"{_PROGRESS_PREFIX}{k} {ctx.sessions}", flush=True)
    finally:
        runners.clear()
        sessions.close()
    device.finish()
    if device.metric is None:
        for point in points:
            point["device_bytes"] = None
    return {
        "metric": metric,
        "baseline_bytes": base[metric],
        "trimmed": trimmed,
        "setup_seconds": setup_seconds,
        "concurrent": concurrent,
        "points": points,
        "device_metric": device.metric,
        "device_note": device.note,
        "stopped_reason": stopped,
        "onnxruntime": ort.__version__,
    }


def _child_main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print(
            "usage: python -m sharedml._measure SPEC_JSON (run by sharedml inspect)",
            file=sys.stderr,
        )
        return 2
    try:
        spec = json.loads(argv[0])
        result = _child_measure(spec)
    except BaseException as exc:  # one line, last on stderr: the parent quotes it
        text = " ".join((str(exc).strip() or type(exc).__name__).split())
        print(f"{type(exc).__name__}: {text}", file=sys.stderr, flush=True)
        return 1
    if not all(math.isfinite(p["run_seconds"]) for p in result["points"]):
        print("ValueError: a run time is not finite", file=sys.stderr)
        return 1
    print(_RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
