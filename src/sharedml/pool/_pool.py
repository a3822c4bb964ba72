"""SessionPool: N ONNX Runtime sessions over one copy of the weights, safe to use from any thread.

The pool is the client side of the split: it owns the lifecycle of its sessions. Its arguments
become one checked :class:`~sharedml.pool._options.PoolOptions` and a plan
(:mod:`sharedml.pool._options`) before anything is read; how a session gets its weights is the
route planner's (:mod:`sharedml.route._planner`), which hands the pool a
:class:`~sharedml.route.SessionRecipe`; whether requests may merge is the batching module's
(:mod:`sharedml.pool._batching`); who runs when, and which requests merge into one ``Run``, is
the scheduler's (:mod:`sharedml.pool._scheduler`); creation and its retries are
:mod:`sharedml.pool._creation`'s, the device's fair run lock :mod:`sharedml.pool._runlock`'s.

- A session is used by one caller at a time: never two ``Run()``s on one session at once
  (DirectML crashes otherwise; CUDA graphs and stateful kernels need it too). One exception,
  on the CPU only: a pool left to its default count whose requests could merge runs requests
  side by side on its session where merging does not pay (ORT's CPU ``Run`` is thread-safe);
  a checkout (``session()``) still has its session alone.
- Every checked-out session comes back: a run that raises returns its session; a session whose
  provider failed (``EPFail``/``EngineError``) is dropped and a fresh one takes its place.
- Where the provider runs one ``Run`` at a time across the process (DirectML on
  onnxruntime-directml >= 1.18, WebGPU, any provider the provider table does not know:
  :data:`sharedml.runtime.PROVIDER_FACTS`), each ``Run`` takes a process-wide
  first-come-first-served lock for its device; checkouts do not hold it.
- The constructor returns once the first session exists; the others are created in the
  background, one at a time process-wide, retried with back-off on failure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import logging
import math
import os
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any, Literal

from sharedml._errors import (
    InvalidInputError,
    NotBatchableError,
    PoolError,
    PoolTimeout,
    SharedMLError,
)
from sharedml._host._platform import release_freed_heap, usable_cores
from sharedml.cache._root import CacheDir
from sharedml.model._proto import ModelProto
from sharedml.pool._arena import MEMORY_PATTERNS_ON_REASON, MEMORY_PATTERNS_REASON, ArenaPeaks
from sharedml.pool._batching import (
    Batching,
    BatchingDefault,
    BatchingSetting,
    Request,
    Signature,
    signature_of,
)
from sharedml.pool._calibrate import Calibration, calibrate, rows_for_memory
from sharedml.pool._creation import (
    CREATION_LOCK,
    background_creator,
    create_initial,
    create_with_retries,
)
from sharedml.pool._graphs import (
    DEFAULT_MAX_GRAPHS,
    GRAPH_DEVICES,
    GraphSession,
    ShapeSessions,
)
from sharedml.pool._options import DEFAULT_SESSIONS, PoolOptions, PoolPlan, plan_pool
from sharedml.pool._relax import relax, relaxed_model
from sharedml.pool._runlock import FairLock, SerializedSession, run_lock_for
from sharedml.pool._scheduler import Scheduler, closed_error
from sharedml.pool._stats import PoolStats
from sharedml.route._options import Mechanism
from sharedml.route._planner import SessionRecipe, open_model, plan_route
from sharedml.runtime._errors import is_session_lost, mapped_run_errors, run_error
from sharedml.runtime._providers import (
    CPU,
    ProviderPlan,
    ProviderSpec,
)
from sharedml.weights._store import WeightStore

__all__ = ["PoolStats", "SessionPool", "open_pool"]

_CHECK_RTOL_CPU = 1e-3  # merged vs solo, relative to an output's largest magnitude
_CHECK_RTOL_DEVICE = 2e-2  # GPUs may use TF32 and pick other kernels per batch size

_log = logging.getLogger("sharedml")

_WARNED_SESSIONS: set[str] = set()  # providers warned about extra serialized sessions


class _State(enum.Enum):
    """A pool's lifecycle: opening -> open -> closing -> closed; never reopened."""

    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


def _rows_of(value: Any, rows: int, have: int) -> Any:
    """``value`` with ``rows`` rows, its own repeated (for warm-up feeds of other batch sizes)."""
    import numpy as np

    reps = -(-rows // have)
    return np.concatenate([value] * reps)[:rows]


def _discard(sess: Any) -> None:
    """Let a session go; a CUDA-graph session's thread stops first."""
    if isinstance(sess, (GraphSession, ShapeSessions)):
        sess.close()


@dataclasses.dataclass(frozen=True)
class _NodeArg:
    """An input or output as ``onnxruntime.NodeArg`` describes it: name, type, shape."""

    name: str
    type: str
    shape: list[Any]


_MODEL_METADATA = (
    "custom_metadata_map",
    "description",
    "domain",
    "graph_description",
    "graph_name",
    "producer_name",
    "version",
)


def _metadata_of(sess: Any) -> dict[str, Any]:
    """A session's inputs, outputs, providers and model metadata, as copies.

    ORT's ``NodeArg`` and ``ModelMetadata`` objects keep their session alive: a closed pool
    holding them kept a session, its memory and its maps of the weights (on Windows, a file
    that can then be neither deleted nor rewritten).
    """

    def args(found: Any) -> list[_NodeArg]:
        return [_NodeArg(a.name, a.type, list(a.shape)) for a in found]

    meta = sess.get_modelmeta()
    return {
        "inputs": args(sess.get_inputs()),
        "outputs": args(sess.get_outputs()),
        "providers": list(sess.get_providers()),
        "modelmeta": types.SimpleNamespace(**{a: getattr(meta, a) for a in _MODEL_METADATA}),
    }


def _timeout_argument(timeout_s: object) -> float | None:
    """``None``, ``inf`` or longer than a lock can wait: wait forever; else seconds (>= 0)."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"timeout_s must be a number of seconds or None, not {timeout_s!r}.")
    if (isinstance(timeout_s, float) and math.isnan(timeout_s)) or timeout_s < 0:
        raise ValueError(f"timeout_s must be >= 0 seconds (or None), not {timeout_s!r}.")
    # threading.TIMEOUT_MAX (about 292 years) is the longest wait a lock takes: 1e300 or 2**64
    # raised OverflowError there. Anything that long is "wait forever".
    if timeout_s >= threading.TIMEOUT_MAX:
        return None
    return float(timeout_s)


def _decide_batching(
    wanted: Batching | None,
    *,
    auto: bool,
    by_default: bool,
    serialized: bool,
    graph: ModelProto,
    name: str,
) -> tuple[Batching | None, Signature | None, str]:
    """Whether a pool merges requests: its settings, the model's signature, and why.

    A model that fixes axis 0 at 1 batches where the analysis proves that axis can be relaxed
    (``signature.relaxed``). The caller serves every proven model from the graph the analysis
    proved (``pool/_relax``).

    Args:
        wanted: The settings asked for (``True`` or a ``Batching``); None: not asked for.
        auto: ``"auto"`` (or ``Batching(required=False)``): merge if the analysis proves the
            model batchable, else say why not.
        by_default: ``batching`` was left out.
        serialized: The pool holds one session by default (the provider runs one ``Run`` at a
            time, or each session holds its own copy of the weights).
        graph: The prepared model's graph, which the analysis reads.
        name: How messages name the model.

    Raises:
        NotBatchableError: settings were asked for, required, and the model cannot be proven
            batchable.
    """
    reason = "batching was not asked for (batching=False)"
    if by_default and not serialized:
        reason = (
            "batching is on by default only where the provider runs one Run at a time, or "
            "each of its sessions holds its own copy of the weights (the provider table); "
            "pass batching=True to merge requests"
        )
    if wanted is None and not auto:
        return None, None, reason
    asked = wanted or Batching()
    try:
        signature = signature_of(
            graph,
            name=name,
            rows_independent=asked.rows_independent,
            max_rows=asked.max_batch_size,
            relax=True,
        )
    except NotBatchableError as exc:
        if not auto:
            raise  # required: say why not; "auto" (or not required): run unbatched, say why
        reason = f"not merging requests: {exc}"
        _log.info("sharedml: %s", reason)
        return None, None, reason
    reason = (
        "merging requests: the caller said each output row depends only on its own input row "
        "(Batching(rows_independent=True))"
        if signature.proof is None
        else "merging requests: the row-independence analysis proved that every output row "
        "depends only on its own input row"
    )
    return asked, signature, reason


class _Sessions:
    """How the pool's sessions are made, run and let go: the scheduler's session source.

    Args:
        recipe: The route planner's recipe for a session.
        plan: The providers.
        graphs: Whether sessions capture CUDA graphs (each driven by a thread of its own).
        buckets: Batch buckets a session may run (room for a graph, or a session, each).
        per_bucket: Give each bucket a session of its own (``Batching.session_per_bucket``).
        serialized_creation: Create one session at a time, process-wide.
        run_lock: The device's run lock where its Runs are serialized, else None.
    """

    def __init__(
        self,
        recipe: SessionRecipe,
        plan: ProviderPlan,
        *,
        graphs: bool,
        buckets: int,
        per_bucket: bool,
        serialized_creation: bool,
        run_lock: FairLock | None,
    ) -> None:
        self.recipe = recipe  # the pool's: replaced where its first session changed its settings
        self._plan = plan
        self._graphs = graphs
        self._buckets = buckets
        self._per_bucket = per_bucket
        self._lock: Any = CREATION_LOCK if serialized_creation else contextlib.nullcontext()
        self._run_lock = run_lock
        self._template: Any = None  # with graphs: see _graph_template
        self._guard = threading.Lock()
        self.meta: dict[str, Any] | None = None  # inputs, outputs, providers, modelmeta
        # CPU arenas keep their largest run's memory: given back once a peak has passed.
        self.peaks = ArenaPeaks() if plan.primary == CPU and not graphs else None

    def create(self) -> Any:
        """A new session (with graphs: a graph session; with buckets: a session per bucket)."""
        sess: Any
        if self._graphs:
            # Driven by a thread of its own: ORT keeps a CUDA graph per thread; its sessions,
            # one per set of dim values, are created as shapes arrive (see _graphs).
            sess = GraphSession(
                self._graph_template(),
                self._create_with_dims,
                device=GRAPH_DEVICES[self._plan.primary],
                device_id=self._plan.device_id,
                max_graphs=DEFAULT_MAX_GRAPHS + self._buckets,  # room for every batch bucket
            )
        else:
            with self._lock:
                sess = self.recipe.create_session()
            if self._per_bucket:
                # One session per batch bucket, dims fixed, created as buckets arrive (see
                # Batching.session_per_bucket); this one runs every other shape.
                sess = ShapeSessions(sess, self._create_with_dims, max_shapes=self._buckets)
        with self._guard:
            if self.meta is None:
                self.meta = _metadata_of(sess)
        # Planning the route (model files parsed and hashed, the prepacked form read) and
        # creating a session free transient heap that glibc keeps, and a server never trims: a
        # pool of four sessions of a 0.1 MiB GRU held 1.4 MiB more than four plain sessions
        # until it was given back. Milliseconds, against a session's creation.
        release_freed_heap()
        return sess

    def _graph_template(self) -> Any:
        """The pool's one session with graphs off, never run: what its graph sessions report."""
        with self._guard:
            if self._template is None:
                self._template = self.recipe.create_session(cuda_graph=False)
            return self._template

    def _create_with_dims(self, dims: Mapping[str, int]) -> Any:
        with self._lock:
            return self.recipe.create_session(dims=dims)

    def run(self, sess: Any, request: Request, feed: Mapping[str, Any] | None) -> list[Any]:
        """One ``sess.run``, under the device's run lock where runs are serialized."""
        names = list(request.output_names) if request.output_names is not None else None
        lock = self._run_lock if self._run_lock is not None else contextlib.nullcontext()
        with lock, mapped_run_errors():
            if isinstance(sess, GraphSession):
                if request.run_options is not None:
                    raise InvalidInputError(
                        "run_options cannot be given to a pool with CUDA graphs: each graph is "
                        "replayed with the run options it was captured with. Pass None."
                    )
                result: list[Any] = sess.run(names, dict(feed or request.feed))
                return result
            inputs = dict(feed or request.feed)
            options = request.run_options
            if self.peaks is not None:
                options = self.peaks.run_options(sess, inputs, options)
            return list(sess.run(names, inputs, options))

    def discard(self, sess: Any) -> None:
        """Let a session go; a CUDA-graph session's thread stops first."""
        _discard(sess)

    def forget_template(self) -> None:
        """Drop the graph template (the pool is closed)."""
        with self._guard:
            self._template = None


_DEFAULT_ROWS = Batching().max_batch_size  # a caller who set another sized batches


class SessionPool:
    """N ONNX Runtime sessions over one shared copy of a model's weights.

    Example::

        with sharedml.SessionPool("model.onnx", sessions=8) as pool:
            outputs = pool.run(None, {"input": batch})        # from any thread
            with pool.session(timeout_s=1.0) as sess:           # exclusive checkout
                sess.run(None, {"input": batch})

    Args:
        model: Path of any ONNX model, or its bytes. A model not written by
            :func:`sharedml.prepare` is prepared into the cache first (keyed by content,
            reused across processes).
        sessions: How many sessions the pool holds. Default: the provider table's (4; 1 where
            the provider runs one ``Run`` at a time across the process, DirectML and WebGPU,
            where more sessions only multiply the weights on the device: asking for more warns,
            unless ``per_session_state``; 1 on OpenVINO, whose sessions each compile their own
            copy of the weights). On the CPU, a pool whose requests merge (and whose
            ``sess_options`` set no thread count) takes one session of every core instead
            (sessions of 16 intra-op threads from 32 cores on, at most 4)
            (``docs/batching.md``, the default split).
            ``"auto"``: on the CPU with batching on, split the usable cores into sessions x
            intra-op threads by measuring a few probe sessions before the pool's own are
            created (within a time budget of 10 s and a memory budget for the probes'
            batches; ``docs/batching.md``, choosing the split). Elsewhere, or where the model
            cannot be measured, a stated default applies. An ``intra_op_num_threads`` set by
            ``sess_options`` or ``configure`` fixes the threads, and the sessions are then
            ``cores // threads``.
            ``pool.stats().calibration`` says what was measured and chosen, and why.
        min_sessions: Create only this many and grow on demand up to ``max_sessions``. Not
            with ``sessions="auto"`` (``ValueError``), which chooses the count itself.
        max_sessions: The most sessions the pool grows to (default ``sessions``). Not with
            ``sessions="auto"`` (``ValueError``).
        providers: As for ``onnxruntime.InferenceSession``. Default: CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        sess_options: A template ``onnxruntime.SessionOptions``; its public attributes and
            known config entries are applied to every session (the object is not modified).
        configure: Called with each session's ``SessionOptions`` before creation, for settings
            that cannot be read back from a template (free-dimension overrides, custom ops).
            On the CPU it is called after the pool turned memory patterns off
            (``enable_mem_pattern=False``: with them each session keeps its activations twice,
            ``docs/memory.md``), so it may turn them back on; the default merging pool, whose
            requests may run side by side, keeps them on (``pool/_arena.py``).
        mechanism: How sessions get the shared weights: ``"auto"`` (the route planner picks:
            device buffers on a GPU provider where a route works, else the best zero-copy host
            mechanism measured on the installed ORT) or a :class:`~sharedml.route.Mechanism` value:
            ``"device"``, ``"in-memory-file"``, ``"add-initializer"``, ``"ort-mmap"``.
        prepacking: What to do with ORT's CPU weight prepacking (see
            :class:`~sharedml.route.Prepacking` and ``docs/cpu-prepacking.md``):
            ``"auto"`` (default): on CPU, share the *packed* weights too, through
            ORT's saved prepacked model (built once, cached per ORT build and CPU), wherever ORT
            packs or derives any weight of the model; otherwise share the raw weights.
            ``"shared"``: the prepacked-file route, or an error if it cannot be built.
            ``"off"``: share raw weights, prepacking off (unpacked kernels).
            ``"per-session"``: ORT's own behaviour: each session packs a private copy of every
            packed weight.
        batching: Merge the requests that queue while every session is busy into one ``Run``
            (see :class:`~sharedml.Batching` and ``docs/batching.md``), one meaning per
            spelling: ``"auto"``: wherever the row-independence analysis proves the model
            batchable, else off; ``True``: the defaults, or ``NotBatchableError``; a
            ``Batching``: its settings, or ``NotBatchableError`` (unless
            ``Batching(required=False)``: then as ``"auto"``); ``False``: never. Left out:
            ``"auto"`` where the pool holds one session by default (the provider runs one
            ``Run`` at a time, or each session holds its own copy of the weights: the provider
            table), else ``False``.
            :attr:`batching_reason` says which and why. Only models whose rows the analysis
            proves apart are merged (or with ``Batching(rows_independent=True)``, the caller's
            word).
        per_session_state: Say that each caller needs a session of its own (state kept in the
            session, CUDA or DML graph capture): no warning for extra sessions where runs are
            serialized, and a merging CPU pool never runs requests side by side on a session.
        create_in_background: Return once the first session exists and create the rest on one
            background thread per process (default): callers are served meanwhile. That thread
            costs a few MiB once per process (its own malloc arena: figures in README).
            ``False``: the constructor returns with every up-front session created.
        cache_dir: The cache: a path, a :class:`sharedml.cache.Cache`, or None for
            :func:`sharedml.cache_dir`; resolved once, carried by the pool's route recipe.
        verify_weights: Check the weights' SHA-256 when they are first mapped in the process.
        serialize_creation: Create one session at a time, process-wide (default). ``False``:
            the first ``min_sessions`` sessions are created on up to one thread per core (ORT
            releases the GIL while it loads), before the constructor returns: faster start-up
            of a full pool, but glibc keeps a few MiB of freed load-time heap per process in
            the helper threads' arenas (figures: README, Benchmarks). Refused (``ValueError``)
            with DirectML.
        serialize_runs: Allow only one ``Run`` at a time on the provider's device, across the
            process, first come first served. ``None``: as sharedml's provider table says
            (:data:`sharedml.runtime.PROVIDER_FACTS`): on for DirectML on ORT versions where
            concurrent DML sessions crash, for WebGPU, and for every provider the table does
            not know; ``False`` is the opt-in for such a provider whose runs may overlap.
            ``stats().runs_rule`` says which rule applied.
        size_threshold_bytes: Passed to :func:`sharedml.prepare` for models it prepares.
        weights: ``"float"`` (default: the model's own weights), or ``"int8"`` / ``"int4"``:
            its MatMul and Gemm weights quantized to 8- or 4-bit blocks (onnxruntime's
            ``MatMulNBits``), built once into the cache and shared like any prepared model
            (``docs/compress.md``). Raises ``CompressError`` where nothing can be compressed.
        cores: The CPU cores the pool's sessions share (default: this process's affinity
            mask): what ``sessions="auto"`` splits, and what a CPU pool given a count divides
            into intra-op threads (``cores // sessions`` each). A Ray replica passes its
            ``num_cpus``; a process sharing its cores with other work passes its own share.
        ep_libraries: A plugin execution provider's library per EP name
            (``{"FooExecutionProvider": "/opt/foo/libfoo_ep.so"}``), for one sharedml does not
            find itself: it finds those of the packages it knows (``onnxruntime-ep-webgpu``,
            ``onnxruntime-ep-openvino``, ``onnxruntime-ep-nv-tensorrt-rtx``) and any library
            already registered in the process. Each is registered once per process.
        ep_devices: A plugin EP's device per EP name: a
            :class:`~sharedml.runtime.DeviceSelector` (hardware type, vendor, device id,
            index) or ``OrtEpDevice`` objects (as Windows ML hands them out); default: the
            first device the EP lists. :attr:`plan` says which (``pool.plan.device``).

    Raises:
        SharedMLError: see :mod:`sharedml._errors`; the model, provider or first session failed.
        NotBatchableError: ``batching`` was asked for a model whose requests cannot merge
            (or whose rows the analysis cannot prove apart).

    Thread safety: every method may be called from any thread; ``run_async`` from event loops.
    A pool cannot be used in a child process made by ``fork()``: create it in the child.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | bytes,
        *,
        sessions: int | Literal["auto"] | None = None,
        min_sessions: int | None = None,
        max_sessions: int | None = None,
        providers: Sequence[ProviderSpec] | None = None,
        provider_options: Sequence[dict[str, Any]] | None = None,
        sess_options: Any | None = None,
        configure: Callable[[Any], None] | None = None,
        mechanism: str = "auto",
        prepacking: str = "auto",
        batching: BatchingSetting | BatchingDefault = BatchingDefault.BY_PROVIDER,
        per_session_state: bool = False,
        create_in_background: bool = True,
        cache_dir: CacheDir = None,
        verify_weights: bool = True,
        serialize_creation: bool = True,
        serialize_runs: bool | None = None,
        size_threshold_bytes: int | None = None,
        weights: str = "float",
        cores: int | None = None,
        ep_libraries: Mapping[str, str | os.PathLike[str]] | None = None,
        ep_devices: Mapping[str, Any] | None = None,
    ) -> None:
        # Arguments first: nothing is prepared, mapped or created for a call that cannot work.
        options = PoolOptions.from_arguments(
            sessions=sessions,
            min_sessions=min_sessions,
            max_sessions=max_sessions,
            providers=providers,
            provider_options=provider_options,
            sess_options=sess_options,
            configure=configure,
            mechanism=mechanism,
            prepacking=prepacking,
            batching=batching,
            per_session_state=per_session_state,
            create_in_background=create_in_background,
            cache_dir=cache_dir,
            verify_weights=verify_weights,
            serialize_creation=serialize_creation,
            serialize_runs=serialize_runs,
            size_threshold_bytes=size_threshold_bytes,
            weights=weights,
            cores=cores,
            ep_libraries=ep_libraries,
            ep_devices=ep_devices,
        )
        self._open(model, options)

    def _open(self, model: str | os.PathLike[str] | bytes, options: PoolOptions) -> None:
        """Plan the pool from its checked options, then route the model and start the sessions."""
        self._state = _State.OPENING
        self._pid = os.getpid()
        self.plan: ProviderPlan = options.providers.plan()
        self._cores = options.session.cores or usable_cores()
        planned = plan_pool(options, self.plan, cores=self._cores)
        self._runs_rule = planned.runs
        self._max, self._min = planned.route.max_sessions, planned.min_sessions
        if planned.warn_sessions:
            self._warn_serialized_sessions()
        serialized = planned.runs.serialized
        self._run_lock: FairLock | None = run_lock_for(self.plan) if serialized else None
        self._creator: Future[None] | None = None
        self._gave_up: BaseException | None = None  # background creation stopped for good
        self._ready = threading.Event()  # every up-front session exists (or never will)
        self._stopping = threading.Event()  # close(): background creation stops
        chosen, reason, recipe = self._route(model, planned)
        self._calibration: Calibration | None = None
        bound_rows = side_by_side = False
        if planned.calibrate:  # probes come and go before any session of the pool exists
            chosen, reason, recipe = self._calibrate(planned, recipe, chosen, reason)
        elif chosen is not None and planned.batching_split is not None:
            # Where merging does not pay, requests run side by side on a session, unless the
            # caller said each needs a session of its own.
            side_by_side = not options.per_session_state
            reason, recipe = self._split_for_batching(
                planned.batching_split, reason, recipe, side_by_side=side_by_side
            )
            # The caller left the batch size to the pool: bound it by memory (_start measures).
            bound_rows = planned.batching is None or (
                planned.batching.max_batch_size == _DEFAULT_ROWS
            )
        # plan_pool turned memory patterns off on the CPU; a pool whose requests may run side by
        # side tries them on (pool/_arena.py), where measuring bounds its rows.
        patterns_off = recipe.configure
        if side_by_side and bound_rows:
            recipe = dataclasses.replace(recipe, configure=options.session.configure)
        self._start(
            planned,
            recipe,
            chosen,
            reason,
            bound_rows=bound_rows,
            side_by_side=side_by_side,
            patterns_off=patterns_off,
        )

    def _route(
        self, model: str | os.PathLike[str] | bytes, planned: PoolPlan
    ) -> tuple[Batching | None, str, SessionRecipe]:
        """Open the model, decide batching on its graph, and plan the route of the graph loaded.

        Sets the model's batching signature; returns the batching settings (None: requests do
        not merge), why, and the route's recipe for a session.
        """
        # The model is prepared, parsed and mapped once; every step below reads that graph.
        opened = open_model(model, planned.route.weights)
        chosen, self._signature, reason = _decide_batching(
            planned.batching,
            auto=planned.auto_batching,
            by_default=planned.batching_by_default,
            serialized=planned.one_session,
            graph=opened.graph,
            name=f"model '{opened.source_path}'",
        )
        if self._signature is not None and self._signature.proof:
            # The sessions load the graph the analysis proved: no declared shape it did not
            # prove, which ORT would fold into constants (pool/_relax). It is routed instead
            # of the prepared graph, so the pool plans one route, for the graph it loads.
            relaxed = relax(opened.graph, self._signature.proof)
            try:
                if relaxed.graph is not opened.graph:
                    verify = planned.route.weights.verify_weights
                    opened = relaxed_model(opened, relaxed, verify=verify)
                reason += relaxed.reason
            except NotBatchableError as exc:
                if not planned.auto_batching:
                    raise
                chosen, self._signature, reason = None, None, f"not merging requests: {exc}"
                _log.info("sharedml: %s", reason)
            del relaxed
        return chosen, reason, plan_route(opened, planned.route)

    def _calibrate(
        self, planned: PoolPlan, recipe: SessionRecipe, chosen: Batching | None, reason: str
    ) -> tuple[Batching | None, str, SessionRecipe]:
        """``sessions="auto"``: measure the split; set the counts, and the threads it chose."""
        self._calibration = calibrate(
            recipe,
            batching=chosen,
            serialized=planned.runs.serialized,
            default_sessions=planned.default_sessions,
            creation_lock=CREATION_LOCK if planned.serialize_creation else None,
            cores=planned.route.session.cores,
        )
        release_freed_heap()  # what the probe sessions freed: a server never trims
        _log.info("sharedml: sessions='auto': %s", self._calibration.reason)
        self._max = self._min = self._calibration.sessions
        if self._calibration.threads is not None:
            recipe = dataclasses.replace(recipe, intra_op_threads=self._calibration.threads)
        if chosen is not None and self._calibration.max_batch_size is not None:
            # Merged rows measured not worth their activation memory: fewer per Run.
            chosen = dataclasses.replace(chosen, max_batch_size=self._calibration.max_batch_size)
            reason = reason.rstrip(".") + (
                f". sessions='auto' found merged batches not worth their memory: at most "
                f"{chosen.max_batch_size} row(s) per Run (stats().calibration says why)."
            )
        return chosen, reason, recipe

    def _split_for_batching(
        self, split: tuple[int, int], reason: str, recipe: SessionRecipe, *, side_by_side: bool
    ) -> tuple[str, SessionRecipe]:
        """A merging CPU pool given no count: its sessions and their threads; the reason."""
        sessions, threads = split
        self._max = self._min = sessions
        side = ", or run side by side on it where that serves more" if side_by_side else ""
        reason = reason.rstrip(".") + (
            f". Sessions: {sessions} of {threads} intra-op thread(s) each, the default of a "
            "merging CPU pool: a lone request runs on those threads, waiting ones merge into a "
            f"session's batch{side} (sessions= or intra_op_num_threads sets another)."
        )
        return reason, dataclasses.replace(recipe, intra_op_threads=threads)

    def _start(
        self,
        planned: PoolPlan,
        recipe: SessionRecipe,
        chosen: Batching | None,
        reason: str,
        *,
        bound_rows: bool = False,
        side_by_side: bool = False,
        patterns_off: Callable[[Any], None] | None = None,
    ) -> None:
        """The scheduler and its sessions: the first ones now, the others in the background.

        ``bound_rows``: measure one row's activations on the first session before the scheduler
        exists, and merge no more rows than keep the pool within the sessions it replaces.
        ``side_by_side``: where merging does not pay, a session runs up to a batch's rows of
        requests at once, each its own ``Run`` (ORT's CPU ``Run`` is thread-safe): the
        activations of as many rows as a batch holds, so within the same memory bound.
        ``patterns_off``: the recipe's ``configure`` with memory patterns off, where the recipe
        has them on; used instead where one row's activations, measured with them, bound the
        rows (they would hold every batch's activations twice).
        """
        graphs, serialized = planned.cuda_graphs, planned.runs.serialized
        self._pads = chosen is not None and chosen.pads(self.plan.primary, cuda_graphs=graphs)
        self._sessions = _Sessions(
            recipe,
            self.plan,
            graphs=graphs,
            buckets=len(chosen.buckets()) if chosen is not None else 0,
            per_bucket=chosen is not None
            and chosen.sessions_per_bucket(
                self.plan.primary,
                cuda_graphs=graphs,
                convolutions=self._signature is None or self._signature.convolutions,
            ),
            serialized_creation=planned.serialize_creation,
            run_lock=self._run_lock,
        )
        first: list[Any] = []  # measured before the scheduler exists: counted below
        first_s = 0.0
        if bound_rows and chosen is not None:
            measure = functools.partial(
                rows_for_memory,
                recipe=self.recipe,
                limit=chosen.max_batch_size,
                replaces=DEFAULT_SESSIONS,
                # this process's other creations would read as this model's activations
                lock=CREATION_LOCK if planned.serialize_creation else None,
            )
            began = time.perf_counter()
            first.append(self._sessions.create())
            first_s = time.perf_counter() - began
            bound = measure(first[0])
            if self.recipe.configure is not patterns_off and (
                not bound.measured or bound.rows < chosen.max_batch_size
            ):
                # Activations matter here, or nobody knows: without patterns the pool keeps them
                # once, as before.
                self._sessions.discard(first.pop())
                self._sessions.recipe = dataclasses.replace(self.recipe, configure=patterns_off)
                began = time.perf_counter()
                first.append(self._sessions.create())
                first_s += time.perf_counter() - began
                bound = measure(first[0], recheck=False)  # read as heavy already
            chosen = dataclasses.replace(chosen, max_batch_size=bound.rows)
            reason = f"{reason} {bound.reason}"
        if self.plan.primary == CPU:
            on = self.recipe.configure is not patterns_off
            patterns = MEMORY_PATTERNS_ON_REASON if on else MEMORY_PATTERNS_REASON
            self._sessions.recipe = dataclasses.replace(
                self.recipe, reason=f"{self.recipe.reason} {patterns}".strip()
            )
        self._scheduler = Scheduler(
            self._sessions,
            max_sessions=self._max,
            batching=chosen,
            batching_reason=reason,
            pads=self._pads,
            shares_rows=chosen is not None
            and chosen.shares_rows(self.plan.primary, serialized=serialized),
            check_rtol=(
                _CHECK_RTOL_CPU
                if self.plan.primary == "CPUExecutionProvider"
                else _CHECK_RTOL_DEVICE
            ),
            name=str(self.source_path),
            share_runs=chosen.max_batch_size if side_by_side and chosen is not None else 1,
            cores=self._cores,
        )

        serialize_creation = planned.serialize_creation
        initial = (
            self._min
            if not (serialize_creation and planned.create_in_background)
            else min(self._min, 1)
        )
        if first:
            counters = self._scheduler.counters
            counters.created, counters.create_seconds = len(first), first_s
        created = first + create_initial(
            self._scheduler.create_session,
            initial - len(first),
            serialized=serialize_creation,
            trim=self.recipe.prepacked is not None,
        )
        background = self._min - initial
        self._scheduler.add_sessions(created, reserved=background)
        self._state = _State.OPEN
        if background:
            self._creator = background_creator().submit(
                create_with_retries,
                background,
                create=self._scheduler.create_session,
                created=self._scheduler.add_session,
                failed=self._background_failed,
                finished=self._background_finished,
                stopping=self._stopping,
            )
        else:
            self._ready.set()

    def _warn_serialized_sessions(self) -> None:
        provider = self.plan.primary
        if provider in _WARNED_SESSIONS:
            return
        _WARNED_SESSIONS.add(provider)
        warnings.warn(
            f"{self._max} sessions on {provider}: its Runs are serialized across the process, "
            "so extra sessions run no more at once and each holds its own device copy of the "
            "weights. One session with batching serves the same requests; pass "
            "per_session_state=True if each caller needs a session of its own.",
            RuntimeWarning,
            stacklevel=4,  # the caller of SessionPool(...) (or of open_pool)
        )

    # ----------------------------------------------------------------------------------------
    # What the route planner decided

    @property
    def recipe(self) -> SessionRecipe:
        """How each session is made: the route planner's recipe, with the pool's settings."""
        return self._sessions.recipe

    @property
    def source_path(self) -> Path:
        """The model as given (``<bytes>`` for a model given as bytes)."""
        return self.recipe.source_path

    @property
    def model_path(self) -> Path:
        """The prepared model the sessions' weights come from."""
        return self.recipe.model_path

    @property
    def weights(self) -> WeightStore:
        """The :class:`~sharedml.weights.WeightStore` mapping the weights once for the process."""
        return self.recipe.weights

    @property
    def mechanism(self) -> Mechanism:
        """How the sessions get the weights (see :class:`~sharedml.route.Mechanism`)."""
        return self.recipe.mechanism

    @property
    def mechanism_reason(self) -> str:
        """Why the route planner chose :attr:`mechanism`."""
        return self.recipe.reason

    @property
    def batching(self) -> Batching | None:
        """How the pool merges requests now; None: it does not (see :attr:`batching_reason`)."""
        return self._scheduler.batching

    @property
    def batching_reason(self) -> str:
        """Whether the pool merges requests, and why (or why not)."""
        return self._scheduler.batching_reason

    # ----------------------------------------------------------------------------------------
    # Sessions

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise PoolError(
                f"This SessionPool was created in process {self._pid}; this is process "
                f"{os.getpid()}, a child made by fork(). ONNX Runtime's sessions and threads do "
                "not survive fork(): create the pool in the child (after the fork)."
            )
        if self._state is not _State.OPEN:
            raise closed_error()

    def _background_failed(self, error: SharedMLError, final: bool) -> None:
        """A background creation failed: its waiting caller hears of it (see Scheduler)."""
        if final:
            self._gave_up = error
        self._scheduler.creation_failed(error)

    def _background_finished(self, pending: int) -> None:
        self._scheduler.unreserve(pending)  # reservations that will not become sessions
        self._ready.set()

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every session the pool creates up front exists.

        Raises:
            PoolTimeout: not all of them within ``timeout_s``.
            SessionCreationError: background creation failed for good (after its retries);
                the pool keeps serving with the sessions it has.
        """
        timeout = _timeout_argument(timeout_s)
        if not self._ready.wait(timeout):
            raise PoolTimeout(
                f"The pool's sessions were not all created within {timeout_s} s "
                f"({self.stats().sessions} of {self._min} so far)."
            )
        if self._gave_up is not None:
            raise self._gave_up

    @contextlib.contextmanager
    def session(self, timeout_s: float | None = None) -> Iterator[Any]:
        """Check out one session for exclusive use.

        Args:
            timeout_s: Wait at most this long for a free session (``None`` or ``inf``: wait
                forever).

        Yields:
            An ``onnxruntime.InferenceSession`` no other caller uses until the block ends
            (where runs are serialized, a thin wrapper whose ``run`` takes the device's lock).
            Its errors are onnxruntime's own.

        Raises:
            PoolTimeout: no session became free in time (also a ``TimeoutError``).
            PoolClosedError: the pool is closing or closed.
        """
        timeout = _timeout_argument(timeout_s)
        self._check_usable()
        sess = self._scheduler.checkout(timeout)
        broken = failed = False
        try:
            yield sess if self._run_lock is None else SerializedSession(sess, self._run_lock)
        except BaseException as exc:
            failed, broken = True, is_session_lost(exc)
            raise
        finally:
            self._scheduler.checkin(sess, failed=failed, broken=broken)

    # ----------------------------------------------------------------------------------------
    # Runs

    def _request(
        self, output_names: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any
    ) -> Request:
        if self._signature is not None:
            return self._signature.request(output_names, feed, run_options)
        outputs = tuple(output_names) if output_names is not None else None
        return Request(outputs, dict(feed), run_options, 0, None)

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any | None = None,
    ) -> list[Any]:
        """Run the model; same arguments and result as ``InferenceSession.run``.

        Blocks until a session is free (with batching: or until a batch that took this request
        has run). Thread-safe.

        Raises:
            InvalidInputError: the feed does not fit the model's inputs.
            RunError: onnxruntime failed the run (its message and type name are kept).
            PoolClosedError: the pool is closing or closed.
        """
        self._check_usable()
        result: list[Any] = self._scheduler.run(
            self._request(output_names, input_feed, run_options)
        )
        return result

    async def run_async(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any | None = None,
    ) -> list[Any]:
        """``run`` for asyncio code: the request queues without holding a thread.

        Cancelling the awaiting task (a client that disconnected) takes the request out of
        the queue, or out of the batch that took it if that batch has not started: it never
        runs, and the batch runs for the others. A request whose batch already runs finishes;
        its result is dropped. Either way no session or queue slot stays held.

        Raises:
            The same as :meth:`run`.
        """
        self._check_usable()
        result: list[Any] = await self._scheduler.run_async(
            self._request(output_names, input_feed, run_options)
        )
        return result

    def warm_up(self, input_feed: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
        """Run ``input_feed`` once on every session, before serving.

        With CUDA graphs this captures every session's graph for the feed's shape (with
        batching: for every padded batch size up to ``max_batch_size``), so that no capture
        happens while other CUDA work runs; without, it settles each session's first-run
        allocations. Waits for the sessions still being created first.

        Raises:
            PoolTimeout: the sessions were not all free (or created) within ``timeout_s``.
            InvalidInputError, RunError: as :meth:`run`.
        """
        self.wait_ready(timeout_s)
        feeds: list[dict[str, Any]] = [dict(input_feed)]
        if self.batching is not None and self._pads:
            rows = {len(v) for v in input_feed.values() if hasattr(v, "__len__")}
            if len(rows) == 1 and (n := rows.pop()):
                sizes = self.batching.buckets()
                feeds = [{k: _rows_of(v, size, n) for k, v in input_feed.items()} for size in sizes]
        with contextlib.ExitStack() as held:
            sessions = [
                held.enter_context(self.session(timeout_s=timeout_s)) for _ in range(self._min)
            ]
            for sess in sessions:
                for feed in feeds:
                    try:
                        sess.run(None, feed)
                    except Exception as exc:  # as run() reports it: InvalidInputError, RunError
                        error = run_error(exc)
                        if error is exc:
                            raise
                        raise error from exc

    # ----------------------------------------------------------------------------------------
    # Metadata and lifecycle

    def _metadata(self, key: str) -> Any:
        if self._sessions.meta is None:
            with self.session():  # a pool created with min_sessions=0 has none yet
                pass
        assert self._sessions.meta is not None
        return self._sessions.meta[key]

    def get_inputs(self) -> list[Any]:
        """The model's inputs, as ``InferenceSession.get_inputs`` gives them."""
        return list(self._metadata("inputs"))

    def get_outputs(self) -> list[Any]:
        """The model's outputs, as ``InferenceSession.get_outputs`` gives them."""
        return list(self._metadata("outputs"))

    def get_providers(self) -> list[str]:
        """The providers ORT registered for the sessions, as ``get_providers`` gives them."""
        return list(self._metadata("providers"))

    def get_modelmeta(self) -> Any:
        """The model's metadata, as ``InferenceSession.get_modelmeta`` gives it."""
        return self._metadata("modelmeta")

    @property
    def max_sessions(self) -> int:
        """The most sessions this pool holds at once."""
        return self._max

    @property
    def closed(self) -> bool:
        """Whether ``close`` has been called."""
        return self._state in (_State.CLOSING, _State.CLOSED)

    def stats(self) -> PoolStats:
        """Counters of this pool's sessions and runs (and, for ``sessions="auto"``, its split)."""
        stats = self._scheduler.stats()
        peaks = self._sessions.peaks
        return dataclasses.replace(
            stats,
            calibration=self._calibration,
            arena_shrinks=peaks.shrinks if peaks is not None else 0,
            serialized_runs=self._runs_rule.serialized,
            runs_rule=self._runs_rule.reason,
            device=self.plan.device,
        )

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new work, wait for runs in flight, then release every session.

        Callers waiting for a session get ``PoolClosedError``; a background creation under way
        finishes and its session is dropped. Idempotent.

        Raises:
            PoolTimeout: runs in flight did not finish within ``timeout_s`` (the pool stays
                closing; call ``close`` again to wait more).
        """
        timeout = _timeout_argument(timeout_s)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._scheduler.cond:
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSING
        self._stopping.set()
        self._scheduler.close(timeout_s, deadline=deadline)
        creator = self._creator
        if creator is not None and creator.cancel():  # queued behind another pool: dropped
            self._ready.set()
        elif creator is not None:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                creator.result(remaining)
            except FuturesTimeout:
                raise PoolTimeout(
                    f"A session still being created after {timeout_s} s; the pool is closing "
                    "and accepts no new work."
                ) from None
        self._state = _State.CLOSED
        self._scheduler.drain()
        self._sessions.forget_template()

    def __del__(self) -> None:
        # Like an unclosed file: the sessions go with the object, but silently dropping a pool
        # that may hold runs or waiters is worth a word (shown with -W default or in tests).
        if getattr(self, "_state", None) is _State.OPEN and os.getpid() == self._pid:
            warnings.warn(
                f"unclosed {self!r}; use 'with SessionPool(...)' or call close()",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<SessionPool {self.source_path.name!r} sessions={self._scheduler.sessions}/"
            f"{self._max} providers={list(self.plan.providers)} mechanism={self.mechanism.value!r}"
            f"{' batching' if self.batching is not None else ''} {self._state.value}>"
        )


def open_pool(model: str | os.PathLike[str] | bytes, options: PoolOptions) -> SessionPool:
    """A :class:`SessionPool` from options checked already, as ``SessionPool(model, ...)`` opens it.

    For code that builds one :class:`~sharedml.pool._options.PoolOptions` and passes it on
    whole (``sharedml serve`` opens every model's pool with one; a Ray replica adjusts the
    one it was given): the keyword arguments are not spelled out, and checked, again.

    Raises:
        SharedMLError, NotBatchableError: as ``SessionPool``.
    """
    pool = SessionPool.__new__(SessionPool)
    pool._open(model, options)
    return pool
