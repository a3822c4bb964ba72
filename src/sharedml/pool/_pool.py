"""SessionPool: N ONNX Runtime sessions over one copy of the weights, safe to use from any thread.

The pool is the client side of the split: it owns the queue of callers and the lifecycle of its
sessions; how a session gets its weights is the route planner's (:mod:`sharedml.route._planner`),
which
hands the pool a :class:`~sharedml.SessionRecipe`, and whether requests may merge is the
batching module's (:mod:`sharedml.pool._batching`).

One queue of tickets serves every caller (``run``, ``run_async``, ``session()``), oldest first.
The oldest ticket gets the next free session and becomes its *leader*: with batching on it takes
the compatible requests queued behind it, oldest first, up to ``max_batch_size`` rows, runs them
as one ``Run`` and hands each follower its rows. So:

- A request that finds a free session becomes its leader at once (no thread hop to any
  request). It runs alone unless the pool expects more rows: by default a leader waits, for at
  most half a batch's run time, for as many rows as the latest batch had (the callers of that
  batch on their way back), so an idle pool adds no latency and looping callers meet in one
  batch (``Batching.max_delay_ms``).
- First come, first served across batches: a request that cannot merge with the head of the
  queue is served when it becomes the head; nothing starves.
- The session released last is handed out first: on a lightly used pool one session does the
  work, with its intra-op threads still spinning and its buffers in cache, while the others'
  threads sleep (handing them out in turn keeps all of them awake, competing for the cores).
- A session is used by one caller at a time: never two ``Run()``s on one session at once
  (DirectML crashes otherwise; CUDA graphs and stateful kernels need it too).
- Every checked-out session comes back: a run that raises returns its session; a session whose
  provider failed (``EPFail``/``EngineError``) is dropped and a fresh one takes its place.
- Where the provider runs one ``Run`` at a time across the process (DirectML on
  onnxruntime-directml >= 1.18), each ``Run`` takes a process-wide first-come-first-served lock
  for its device; checkouts do not hold it.
- The constructor returns once the first session exists; the others are created in the
  background, one at a time process-wide (concurrent creation crashes DirectML on some
  versions, and costs memory on the CPU). A failed background creation is retried with
  back-off and reported to the caller that was waiting for that session, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import functools
import logging
import math
import operator
import os
import threading
import time
import types
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

from sharedml._errors import (
    InvalidInputError,
    NotBatchableError,
    PoolClosedError,
    PoolError,
    PoolTimeout,
    RunError,
    SessionCreationError,
    SharedMLError,
)
from sharedml._host import release_freed_heap, usable_cores
from sharedml.cache._cache import CacheDir
from sharedml.model._graph import load_graph
from sharedml.pool._batching import (
    ADAPTIVE_DELAY_SHARE,
    Batching,
    Request,
    Signature,
    bucket_for,
    merge,
    owned,
    same_results,
    signature_of,
    split,
)
from sharedml.pool._graphs import (
    DEFAULT_MAX_GRAPHS,
    GRAPH_DEVICES,
    GraphSession,
    ShapeSessions,
    cuda_graphs_enabled,
)
from sharedml.route._planner import Mechanism, SessionRecipe, plan_route
from sharedml.runtime._providers import (
    DML,
    ProviderPlan,
    ProviderSpec,
    plan_providers,
    serialize_runs_by_default,
)

__all__ = ["PoolStats", "SessionPool"]

_CREATION_LOCK = threading.Lock()  # process-wide: DirectML crashes on concurrent creation
_CREATION_RETRIES = 5  # background attempts per session before the pool stops growing
_RETRY_BASE_S = 0.1  # seconds before the first retry; doubles each time
_DEFAULT_SESSIONS = 4
_SERIALIZED_SESSIONS = 1  # where Runs cannot overlap, more sessions buy no concurrency
# Merged runs whose outputs did not split back into the requests' rows before the pool stops
# merging: one odd request (rows that ORT broadcasts, a shape the model special-cases) must
# not turn batching off for everyone; a model that never splits shows it again at once.
_SPLIT_FAILURES_TO_STOP = 3
_CHECK_RTOL_CPU = 1e-3  # merged vs solo, relative to an output's largest magnitude
_CHECK_RTOL_DEVICE = 2e-2  # GPUs may use TF32 and pick other kernels per batch size

_log = logging.getLogger("sharedml")


class _FairLock:
    """A lock handed over in arrival order (``threading.Lock`` lets one thread take it again)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: deque[threading.Event] = deque()
        self._held = False

    def acquire(self) -> None:
        with self._lock:
            if not self._held:
                self._held = True
                return
            turn = threading.Event()
            self._waiters.append(turn)
        try:
            turn.wait()  # release() hands the lock over by setting it: it stays held
        except BaseException:
            with self._lock:
                if turn in self._waiters:
                    self._waiters.remove(turn)
                    raise
            self.release()  # handed over as we were interrupted: pass it on
            raise

    def release(self) -> None:
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._held = False

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


_CREATOR: ThreadPoolExecutor | None = None
_CREATOR_GUARD = threading.Lock()


def _background_creator() -> ThreadPoolExecutor:
    """The one thread that creates every pool's background sessions, in this process.

    One thread for all pools: creation is serialized anyway, and a thread that allocates gets a
    malloc arena of its own, a cost paid once per process rather than once per pool.
    """
    global _CREATOR
    with _CREATOR_GUARD:
        if _CREATOR is None:
            _CREATOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sharedml-create")
        return _CREATOR


def _forget_creator_in_child() -> None:
    global _CREATOR
    _CREATOR = None  # its thread did not survive fork(): a child's pools start their own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_creator_in_child)


_RUN_LOCKS: dict[tuple[str, int], _FairLock] = {}
_RUN_LOCKS_GUARD = threading.Lock()
_WARNED_SESSIONS: set[str] = set()  # providers warned about extra serialized sessions


def _run_lock_for(plan: ProviderPlan) -> _FairLock:
    """The process-wide run lock of ``plan``'s device: every pool on it shares it."""
    key = (plan.primary, plan.device_id)
    with _RUN_LOCKS_GUARD:
        return _RUN_LOCKS.setdefault(key, _FairLock())


class _State(enum.Enum):
    """A pool's lifecycle: opening -> open -> closing -> closed; never reopened."""

    OPENING = "opening"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's counters (``pool.stats()``).

    Attributes:
        sessions: Sessions that exist now.
        busy: Sessions in use now (checked out, or running a request or batch).
        waiting: Requests and checkouts queued for a session now.
        max_sessions: The most sessions the pool will create.
        runs: Requests and checkouts completed.
        failed_runs: Those that raised.
        waits: Requests and checkouts that had to queue.
        wait_seconds: Total time they spent queued.
        created: Sessions created over the pool's life (replacements included).
        replaced: Sessions dropped after a provider failure.
        create_seconds: Total time spent creating sessions.
        creation_failures: Background creations that failed (each was retried or reported).
        batches: ``Run`` calls made for requests while batching (merged or alone).
        batched_rows: Rows those runs processed.
        max_batch_rows: The most rows in one of them.
        padded_rows: Rows of padding those runs added (``Batching.pad_to_buckets``).
        fill_wait_seconds: Total time sessions waited for more rows before a batch ran
            (``Batching.max_delay_ms``).
        run_seconds: Total time sessions spent running the requests of ``run`` and
            ``run_async`` (their ``Run`` calls, with a merged batch's merge of its feeds and
            split of its outputs; checkouts through ``session()`` are the caller's own). Over
            a window, divided by the window and the sessions, it is how busy they were: the
            rest went to waiting for rows, handing results back, and idling.
        batching: Whether the pool merges requests now (see ``SessionPool.batching_reason``).
        batch_checks: Merged batches checked against solo runs of their requests (the pool
            checks its first merged batches, until one of requests with different rows passed).
        batch_mismatches: Checks whose merged rows differed from the solo runs: the pool then
            gave every caller its solo result and stopped merging.
    """

    sessions: int
    busy: int
    waiting: int
    max_sessions: int
    runs: int
    failed_runs: int
    waits: int
    wait_seconds: float
    created: int
    replaced: int
    create_seconds: float
    creation_failures: int = 0
    batches: int = 0
    batched_rows: int = 0
    max_batch_rows: int = 0
    padded_rows: int = 0
    fill_wait_seconds: float = 0.0
    run_seconds: float = 0.0
    batching: bool = False
    batch_checks: int = 0
    batch_mismatches: int = 0

    @property
    def idle(self) -> int:
        """Sessions free now."""
        return self.sessions - self.busy

    @property
    def mean_batch_rows(self) -> float:
        """Rows per batch, on average (0 without batching)."""
        return self.batched_rows / self.batches if self.batches else 0.0


def _is_session_fatal(exc: BaseException) -> bool:
    """Errors after which ORT does not promise a usable session (device and engine faults)."""
    return type(exc).__name__ in ("EPFail", "EngineError")


def _run_error(exc: BaseException) -> SharedMLError:
    """ORT's run failure as a sharedml error that keeps ORT's message and type name."""
    if isinstance(exc, SharedMLError):
        return exc  # sharedml's own refusal (a graph session's), already clear
    kind = type(exc).__name__
    message = " ".join(str(exc).split()) or kind
    # InvalidArgument: shapes or dtypes; ValueError: ORT's Python layer (missing inputs).
    cls = InvalidInputError if kind in ("InvalidArgument", "ValueError") else RunError
    error = cls(f"onnxruntime raised {kind}: {message}", ort_type=kind)
    error.__cause__ = exc
    return error


def _closed() -> PoolClosedError:
    return PoolClosedError("This SessionPool is closed; create a new pool to run more work.")


class _Signal:
    """``threading.Event``'s ``set``/``wait``/``clear`` for a single waiter, on one raw lock.

    An Event waits through a Condition: a lock allocated per wait, the Condition's own lock
    taken and given back around it, each a hand-off of the GIL between the threads of a
    batch. A pool wakes every caller of a batch, so it pays that per request; here a wait is
    one acquire of a lock that ``set`` releases. Unlocked means set, as an Event stays set.
    """

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # already set
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        with contextlib.suppress(RuntimeError):  # set again meanwhile: it is set either way
            self._lock.release()
        return True

    def clear(self) -> None:
        self._lock.acquire(blocking=False)


class _Ticket:
    """A caller in the queue: a checkout, or a request to run (with batching: to merge)."""

    __slots__ = (
        "done",
        "error",
        "event",
        "future",
        "granted",
        "queued_at",
        "request",
        "result",
        "session",
        "to_copy",
    )

    def __init__(self, request: Request | None = None, future: Future[Any] | None = None) -> None:
        self.request = request  # None: a checkout, which never merges
        self.future = future  # run_async: the result goes here, no thread waits
        self.event = _Signal()  # set when granted, done, or told to give up
        self.granted = False  # a session (or a slot to create one) is this ticket's
        self.session: Any = None
        self.done = False  # a leader ran this request in its batch
        self.result: Any = None
        self.to_copy = False  # result is views of a batch's outputs, to copy: see owned_result
        self.error: BaseException | None = None
        self.queued_at = 0.0

    def owned_result(self) -> Any:
        """The result, copied out of the batch's outputs first where it is views of them to copy.

        Called in the thread that hands the result over (the caller's own for ``run``), after
        the session went back: the copies of a batch's rows are made in parallel and never
        while the session is held.
        """
        if self.to_copy:
            self.result, self.to_copy = owned(self.result), False
        return self.result


class _SerializedSession:
    """A checked-out session whose runs take the device's process-wide run lock."""

    def __init__(self, session: Any, lock: _FairLock) -> None:
        self._session = session
        self._lock = lock

    def run(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._session.run(*args, **kwargs)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._session.run_with_iobinding(*args, **kwargs)

    def run_with_ort_values(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return self._session.run_with_ort_values(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def _rows_of(value: Any, rows: int, have: int) -> Any:
    """``value`` with ``rows`` rows, its own repeated (for warm-up feeds of other batch sizes)."""
    import numpy as np

    reps = -(-rows // have)
    return np.concatenate([value] * reps)[:rows]


def _discard(sess: Any) -> None:
    """Let a session go; a CUDA-graph session's thread stops first."""
    if isinstance(sess, (GraphSession, ShapeSessions)):
        sess.close()


def _same_feed(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two requests' feeds hold the same values (a check of them proves nothing)."""
    import numpy as np

    return all(np.array_equal(a[k], b[k]) for k in a)


# The most sessions a pool takes: far beyond what any host holds (each session keeps its own
# activations and threads), and far below what overflows a C size (2**63 raised OverflowError
# deep inside the pool, not a message about the argument).
_MAX_SESSIONS = 1 << 16


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


def _count_argument(name: str, value: object, *, minimum: int) -> int:
    try:
        count = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be an integer, not {value!r}.") from None
    if isinstance(value, bool) or not minimum <= count <= _MAX_SESSIONS:
        raise ValueError(
            f"{name} must be an integer from {minimum} to {_MAX_SESSIONS}, not {value!r}."
        )
    return count


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
        sessions: How many sessions the pool holds. Default: 4; 1 where the provider runs one
            ``Run`` at a time across the process (DirectML), where more sessions only multiply
            the weights on the device (asking for more warns, unless ``per_session_state``).
        min_sessions: Create only this many and grow on demand up to ``max_sessions``.
        max_sessions: The most sessions the pool grows to (default ``sessions``).
        providers: As for ``onnxruntime.InferenceSession``. Default: CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        sess_options: A template ``onnxruntime.SessionOptions``; its public attributes and
            known config entries are applied to every session (the object is not modified).
        configure: Called with each session's ``SessionOptions`` before creation, for settings
            that cannot be read back from a template (free-dimension overrides, custom ops).
        mechanism: How sessions get the shared weights: ``"auto"`` (the route planner picks:
            device buffers on a GPU provider where a route works, else the best zero-copy host
            mechanism measured on the installed ORT) or a :class:`~sharedml.Mechanism` value:
            ``"device"``, ``"in-memory-file"``, ``"add-initializer"``, ``"ort-mmap"``.
        prepacking: What to do with ORT's CPU weight prepacking (see
            :class:`~sharedml.Prepacking` and ``docs/cpu-prepacking.md``):
            ``"auto"`` (default, also ``None``): on CPU, share the *packed* weights too, through
            ORT's saved prepacked model (built once, cached per ORT build and CPU), wherever ORT
            packs or derives any weight of the model; otherwise share the raw weights.
            ``"shared"``: the prepacked-file route, or an error if it cannot be built.
            ``"off"`` (also ``False``): share raw weights, prepacking off (unpacked kernels).
            ``"per-session"`` (also ``True``): ORT's own behaviour: each session packs a private
            copy of every packed weight.
        batching: Merge the requests that queue while every session is busy into one ``Run``
            (see :class:`~sharedml.Batching` and ``docs/batching.md``): ``True`` (defaults), a
            ``Batching``, or ``False``. Only models whose rows the row-independence analysis
            proves apart are merged (or with ``Batching(rows_independent=True)``, the caller's
            word). ``"auto"``: on wherever the analysis proves the model batchable, else off.
            ``None`` (default): as ``"auto"`` where the provider runs one ``Run`` at a time,
            else off. :attr:`batching_reason` says which and why.
        per_session_state: Say that each caller needs a session of its own (state kept in the
            session, CUDA or DML graph capture): no warning for extra sessions where runs are
            serialized.
        create_in_background: Return once the first session exists and create the rest on one
            background thread per process (default): callers are served meanwhile. That thread
            costs a few MiB once per process (its own malloc arena: figures in README).
            ``False``: the constructor returns with every up-front session created.
        cache_dir: The cache folder (default: :func:`sharedml.cache_dir`).
        verify_weights: Check the weights' SHA-256 when they are first mapped in the process.
        serialize_creation: Create one session at a time, process-wide (default). ``False``:
            the first ``min_sessions`` sessions are created on up to one thread per core (ORT
            releases the GIL while it loads), before the constructor returns: faster start-up
            of a full pool, but glibc keeps a few MiB of freed load-time heap per process in
            the helper threads' arenas (figures: README, Benchmarks). Refused (``ValueError``)
            with DirectML.
        serialize_runs: Allow only one ``Run`` at a time on the provider's device, across the
            process, first come first served. ``None``: on for DirectML on ORT versions where
            concurrent DML sessions crash.
        size_threshold_bytes: Passed to :func:`sharedml.prepare` for models it prepares.
        weights: ``"float"`` (default: the model's own weights), or ``"int8"`` / ``"int4"``:
            its MatMul and Gemm weights quantized to 8- or 4-bit blocks (onnxruntime's
            ``MatMulNBits``), built once into the cache and shared like any prepared model
            (``docs/compress.md``). Raises ``CompressError`` where nothing can be compressed.

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
        sessions: int | None = None,
        min_sessions: int | None = None,
        max_sessions: int | None = None,
        providers: Sequence[ProviderSpec] | None = None,
        provider_options: Sequence[dict[str, Any]] | None = None,
        sess_options: Any | None = None,
        configure: Callable[[Any], None] | None = None,
        mechanism: str = "auto",
        prepacking: str | bool | None = "auto",
        batching: bool | Batching | str | None = None,
        per_session_state: bool = False,
        create_in_background: bool = True,
        cache_dir: CacheDir = None,
        verify_weights: bool = True,
        serialize_creation: bool = True,
        serialize_runs: bool | None = None,
        size_threshold_bytes: int | None = None,
        weights: str = "float",
    ) -> None:
        self._state = _State.OPENING
        self._pid = os.getpid()
        # Arguments first: nothing is prepared, mapped or created for a call that cannot work.
        counts = {
            name: _count_argument(name, value, minimum=minimum)
            for name, value, minimum in (
                ("sessions", sessions, 1),
                ("max_sessions", max_sessions, 1),
                ("min_sessions", min_sessions, 0),
            )
            if value is not None
        }
        self.plan: ProviderPlan = plan_providers(providers, provider_options)
        serialized = (
            serialize_runs if serialize_runs is not None else serialize_runs_by_default(self.plan)
        )
        if not serialize_creation and DML in self.plan.providers:
            raise ValueError(
                "serialize_creation=False with DmlExecutionProvider: creating DirectML sessions "
                "concurrently crashes some onnxruntime-directml versions; leave it True."
            )
        default = _SERIALIZED_SESSIONS if serialized else _DEFAULT_SESSIONS
        self._max = counts.get("max_sessions", counts.get("sessions", default))
        self._min = counts.get("min_sessions", self._max)
        if self._min > self._max:
            raise ValueError(f"min_sessions ({self._min}) is more than max_sessions ({self._max}).")
        if serialized and self._max > 1 and not per_session_state:
            self._warn_serialized_sessions()
        auto = batching == "auto"
        wanted = None if auto else Batching.parse(batching)

        self._cond = threading.Condition()
        self._idle: deque[Any] = deque()
        self._queue: deque[_Ticket] = deque()  # waiting tickets, oldest first
        self._count = 0  # sessions that exist or are being created
        self._busy = 0
        self._runs = self._failed = self._waits = self._created = self._replaced = 0
        self._creation_failures = self._batches = self._batched_rows = self._max_rows = 0
        self._padded_rows = 0
        self._wait_s = self._create_s = self._fill_s = self._run_s = 0.0
        self._filling = 0  # leaders waiting for more rows (Batching.max_delay_ms)
        # Adaptive delay: rows and run seconds of the latest batches (newest last); with
        # Batching.share_rows, the leaders forming or running a batch and the rows they hold.
        self._recent: deque[tuple[int, float]] = deque([(0, 0.0)], maxlen=max(1, self._max))
        self._leading = 0
        self._held_rows = 0
        self._executor: ThreadPoolExecutor | None = None
        self._meta: dict[str, Any] | None = None  # inputs, outputs, providers, modelmeta
        self._serialize_creation = serialize_creation
        self._run_lock: _FairLock | None = _run_lock_for(self.plan) if serialized else None
        self._graphs = cuda_graphs_enabled(self.plan.primary, self.plan.provider_options[0])
        self._template: Any = None  # with graphs: see _graph_template
        self._template_lock = threading.Lock()
        self._creator: Future[None] | None = None
        self._creation_error: BaseException | None = None  # undelivered background failure
        self._gave_up: BaseException | None = None  # background creation stopped for good
        self._ready = threading.Event()  # every up-front session exists (or never will)
        self._stopping = threading.Event()  # close(): background creation stops

        self.recipe: SessionRecipe = plan_route(
            model,
            plan=self.plan,
            max_sessions=self._max,
            sess_options=sess_options,
            configure=configure,
            mechanism=mechanism,
            prepacking=prepacking,
            cache_dir=cache_dir,
            verify_weights=verify_weights,
            size_threshold_bytes=size_threshold_bytes,
            weights=weights,
        )
        self.batching: Batching | None = None
        self._signature: Signature | None = None
        self._batching_reason = "batching was not asked for (batching=False)"
        if batching is None and not serialized:
            self._batching_reason = (
                "batching is on by default only where the provider runs one Run at a time; "
                "pass batching=True to merge requests"
            )
        if wanted is not None or auto or (batching is None and serialized):
            chosen = wanted or Batching()
            try:
                self._signature = signature_of(
                    load_graph(self.recipe.model_path),
                    name=f"model '{self.source_path}'",
                    rows_independent=chosen.rows_independent,
                    max_rows=chosen.max_batch_size,
                )
                self.batching = chosen
                self._batching_reason = (
                    "merging requests: the caller said each output row depends only on its own "
                    "input row (Batching(rows_independent=True))"
                    if chosen.rows_independent
                    else "merging requests: the row-independence analysis proved that every "
                    "output row depends only on its own input row"
                )
            except NotBatchableError as exc:
                if wanted is not None:
                    raise  # asked for: say why not; by default: run unbatched, and say why
                self._batching_reason = f"not merging requests: {exc}"
                _log.info("sharedml: %s", self._batching_reason)
        # Defence in depth behind the analysis: merged batches are checked against solo runs of
        # their requests until one with requests of different rows has passed.
        self._checked = False
        self._checks = self._mismatches = self._split_failures = 0
        self._pads = self.batching is not None and self.batching.pads(
            self.plan.primary, cuda_graphs=self._graphs
        )
        self._per_bucket = self.batching is not None and self.batching.sessions_per_bucket(
            self.plan.primary,
            cuda_graphs=self._graphs,
            convolutions=self._signature is None or self._signature.convolutions,
        )
        self._shares = self.batching is not None and self.batching.shares_rows(
            self.plan.primary, serialized=serialized
        )
        self._copies = self.batching is None or self.batching.copy_outputs

        initial = (
            self._min if not (serialize_creation and create_in_background) else min(self._min, 1)
        )
        try:
            self._idle.extend(self._create_initial_sessions(initial))
        except BaseException:
            self._idle.clear()
            raise
        self._count = len(self._idle)
        self._state = _State.OPEN
        background = self._min - initial
        if background:
            self._count += background  # reserved: on-demand growth must not overshoot
            self._creator = _background_creator().submit(self._create_in_background, background)
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
            stacklevel=3,
        )

    # ----------------------------------------------------------------------------------------
    # What the route planner decided

    @property
    def source_path(self) -> Path:
        """The model as given (``<bytes>`` for a model given as bytes)."""
        return self.recipe.source_path

    @property
    def model_path(self) -> Path:
        """The prepared model the sessions' weights come from."""
        return self.recipe.model_path

    @property
    def weights(self) -> Any:
        """The :class:`~sharedml.WeightStore` mapping the weights once for the process."""
        return self.recipe.weights

    @property
    def mechanism(self) -> Mechanism:
        """How the sessions get the weights (see :class:`~sharedml.Mechanism`)."""
        return self.recipe.mechanism

    @property
    def mechanism_reason(self) -> str:
        """Why the route planner chose :attr:`mechanism`."""
        return self.recipe.reason

    @property
    def batching_reason(self) -> str:
        """Whether the pool merges requests, and why (or why not)."""
        return self._batching_reason

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
            raise _closed()

    def _create_initial_sessions(self, n: int) -> list[Any]:
        """Create ``n`` sessions, on up to one thread per core unless creation is serialized.

        The calling thread creates its share too: its heap is glibc's main arena, the one arena
        whose freed top ``malloc_trim`` gives back. On the first failure the sessions already
        made are dropped and the error is raised.
        """
        workers = 1 if self._serialize_creation else min(n, usable_cores())
        if workers <= 1:
            return [self._create_session() for _ in range(n)]
        with ThreadPoolExecutor(workers - 1, thread_name_prefix="sharedml-create") as executor:
            share = n * (workers - 1) // workers
            futures = [executor.submit(self._create_session) for _ in range(share)]
            try:
                mine = [self._create_session() for _ in range(n - share)]
                created = mine + [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        if self.recipe.prepacked is not None:
            # Each creation trimmed as it finished, but another was still freeing meanwhile.
            release_freed_heap()
        return created

    def _create_session(self) -> Any:
        lock = _CREATION_LOCK if self._serialize_creation else contextlib.nullcontext()
        start = time.perf_counter()
        sess: Any
        if self._graphs:
            # Driven by a thread of its own: ORT keeps a CUDA graph per thread; its sessions,
            # one per set of dim values, are created as shapes arrive (see _graphs).
            buckets = len(self.batching.buckets()) if self.batching else 0
            sess = GraphSession(
                self._graph_template(),
                functools.partial(self._create_session_with_dims, lock),
                device=GRAPH_DEVICES[self.plan.primary],
                device_id=self.plan.device_id,
                max_graphs=DEFAULT_MAX_GRAPHS + buckets,  # room for every batch bucket
            )
        else:
            with lock:
                sess = self.recipe.create_session()
            if self._per_bucket:
                # One session per batch bucket, dims fixed, created as buckets arrive (see
                # Batching.session_per_bucket); this one runs every other shape.
                assert self.batching is not None
                sess = ShapeSessions(
                    sess,
                    functools.partial(self._create_session_with_dims, lock),
                    max_shapes=len(self.batching.buckets()),
                )
        elapsed = time.perf_counter() - start
        with self._cond:
            self._created += 1
            self._create_s += elapsed
            if self._meta is None:
                self._meta = _metadata_of(sess)
        return sess

    def _graph_template(self) -> Any:
        """The pool's one session with graphs off, never run: what its graph sessions report."""
        with self._template_lock:
            if self._template is None:
                self._template = self.recipe.create_session(cuda_graph=False)
            return self._template

    def _create_session_with_dims(self, lock: Any, dims: Mapping[str, int]) -> Any:
        with lock:
            return self.recipe.create_session(dims=dims)

    def _create_in_background(self, n: int) -> None:
        """Create ``n`` more sessions (reserved in ``_count``), one at a time.

        A failure is retried with back-off; each one is reported (:meth:`_creation_failed`).
        Runs until the sessions exist, the retries are spent, or the pool closes.
        """
        pending = n
        try:
            while pending:
                sess = None
                for attempt in range(1, _CREATION_RETRIES + 1):
                    if self._stopping.is_set():
                        return
                    try:
                        sess = self._create_session()
                        break
                    except Exception as exc:
                        final = attempt == _CREATION_RETRIES
                        self._creation_failed(exc, final=final)
                        if final or self._stopping.wait(_RETRY_BASE_S * 2 ** (attempt - 1)):
                            return
                with self._cond:
                    pending -= 1
                    if self._state is _State.OPEN:
                        self._idle.append(sess)
                        self._dispatch()
                    else:
                        self._count -= 1  # closing: the session goes with this reference
        finally:
            with self._cond:
                self._count -= pending  # reservations that will not become sessions
            self._ready.set()

    def _creation_failed(self, exc: Exception, *, final: bool) -> None:
        """Report a background failure to the caller that waits for capacity, or keep it."""
        error: SharedMLError = (
            exc
            if isinstance(exc, SharedMLError)
            else SessionCreationError(f"Creating a session in the background failed: {exc}")
        )
        if error is not exc:
            error.__cause__ = exc
        # Kept for another thread: its traceback's frames (this thread's, still running) would
        # hold the sessions they created for as long as the error is kept.
        exc.__traceback__ = error.__traceback__ = None
        with self._cond:
            self._creation_failures += 1
            if final:
                self._gave_up = error
            if self._queue and not self._idle:
                # The caller at the head of the queue would have had this session.
                self._finish(self._queue.popleft(), error=error)
            else:
                self._creation_error = error  # for the next caller that has to wait

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

    def _dispatch(self) -> None:
        """Hand free sessions (or creation slots) to waiting tickets, oldest first.

        Called with ``self._cond`` held. A handed-over session counts as busy from here on, so
        ``stats()`` never misses it while its new owner wakes up.
        """
        while (
            self._state is _State.OPEN and self._queue and (self._idle or self._count < self._max)
        ):
            ticket = self._queue.popleft()
            if self._idle:
                ticket.session = self._idle.pop()
            else:
                self._count += 1  # the ticket's owner creates it
            ticket.granted = True
            self._busy += 1
            self._wait_s += time.monotonic() - ticket.queued_at
            if ticket.future is not None:
                self._lead_async(ticket)
            else:
                ticket.event.set()
        self._cond.notify_all()  # close() waits for busy to reach 0, leaders for more rows

    def _take(self, ticket: _Ticket) -> bool:
        """Give ``ticket`` a session (or a slot) at once if that is fair; else queue it.

        Called with ``self._cond`` held. Returns whether it was granted now.
        """
        if not self._queue:
            # First come, first served: nobody may take a session while others wait, or a
            # caller that loops on the pool starves the ones already waiting.
            if self._idle:
                ticket.session = self._idle.pop()
                ticket.granted = True
                self._busy += 1
                return True
            if self._count < self._max:
                self._count += 1
                ticket.granted = True
                self._busy += 1
                return True
        if self._creation_error is not None:
            error, self._creation_error = self._creation_error, None
            raise error  # this caller would have had the session that failed
        ticket.queued_at = time.monotonic()
        self._queue.append(ticket)
        self._waits += 1
        if self._filling:
            self._cond.notify_all()  # a leader filling its batch may want this one
        return False

    def _wait(self, ticket: _Ticket, timeout_s: float | None) -> None:
        """Wait for ``ticket`` to be granted or done; leave the queue on timeout or close."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                if remaining is not None and remaining <= 0:
                    raise PoolTimeout(
                        f"No session of the pool became free within {timeout_s} s "
                        f"({self._busy} of {self._max} busy). Raise max_sessions or the timeout."
                    )
                ticket.event.wait(remaining)
                with self._cond:
                    if ticket.granted:
                        return
                    if ticket.error is not None:
                        raise ticket.error  # closed, a failed creation, or a failed batch
                    if ticket.done:
                        return  # a leader ran this request in its batch
                    if self._state is not _State.OPEN:
                        raise _closed()
                    ticket.event.clear()
            except BaseException:
                # Timeout, close, or KeyboardInterrupt while waiting: leave the queue, and pass
                # on a session (or creation slot) handed over in the meantime.
                with self._cond:
                    if ticket.granted:
                        self._give_back(ticket.session)
                    elif ticket in self._queue:
                        self._queue.remove(ticket)
                        self._wait_s += time.monotonic() - ticket.queued_at
                raise

    def _give_back(self, sess: Any) -> None:
        """Return an unused grant (``None``: a creation slot). Called with ``self._cond`` held."""
        self._busy -= 1
        if sess is not None:
            self._idle.append(sess)
        else:
            self._count -= 1
        self._dispatch()

    def _acquire(self, ticket: _Ticket, timeout_s: float | None) -> Any:
        """A session for ``ticket``; ``None`` if a leader ran its request meanwhile."""
        with self._cond:
            self._check_usable()
            granted = self._take(ticket)
        if not granted:
            self._wait(ticket, timeout_s)
            if ticket.done:
                return None
        if ticket.session is None:
            try:
                ticket.session = self._create_session()
            except BaseException:
                with self._cond:
                    self._give_back(None)
                raise
        return ticket.session

    def _release(
        self,
        sess: Any,
        *,
        requests: int,
        failed: int,
        broken: bool,
        held: int | None = None,
        run_s: float = 0.0,
    ) -> None:
        with self._cond:
            self._run_s += run_s
            if held is not None:
                self._leading -= 1
                self._held_rows -= held
            self._busy -= 1
            self._runs += requests
            self._failed += failed
            if broken:
                self._count -= 1  # the next acquire creates a fresh session in its place
                self._replaced += 1
            else:
                self._idle.append(sess)
            self._dispatch()
        if broken:
            _discard(sess)

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
        sess = self._acquire(_Ticket(), timeout)
        broken = False
        failed = 0
        try:
            yield sess if self._run_lock is None else _SerializedSession(sess, self._run_lock)
        except BaseException as exc:
            failed, broken = 1, _is_session_fatal(exc)
            raise
        finally:
            self._release(sess, requests=1, failed=failed, broken=broken)

    # ----------------------------------------------------------------------------------------
    # Runs

    def _request(
        self, output_names: Sequence[str] | None, feed: Mapping[str, Any], run_options: Any
    ) -> Request:
        if self._signature is not None:
            return self._signature.request(output_names, feed, run_options)
        outputs = tuple(output_names) if output_names is not None else None
        return Request(outputs, dict(feed), run_options, 0, None)

    def _ort_run(self, sess: Any, request: Request, feed: Mapping[str, Any] | None = None) -> Any:
        """One ``sess.run``, under the device's run lock where runs are serialized."""
        names = list(request.output_names) if request.output_names is not None else None
        lock = self._run_lock if self._run_lock is not None else contextlib.nullcontext()
        with lock:
            if isinstance(sess, GraphSession):
                if request.run_options is not None:
                    raise InvalidInputError(
                        "run_options cannot be given to a pool with CUDA graphs: each graph is "
                        "replayed with the run options it was captured with. Pass None."
                    )
                return sess.run(names, dict(feed or request.feed))
            return list(sess.run(names, dict(feed or request.feed), request.run_options))

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
        ticket = _Ticket(self._request(output_names, input_feed, run_options))
        sess = self._acquire(ticket, None)
        if sess is not None:
            self._lead(sess, ticket)
        if ticket.error is not None:
            raise ticket.error
        result: list[Any] = ticket.owned_result()
        return result

    async def run_async(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any | None = None,
    ) -> list[Any]:
        """``run`` for asyncio code: the request queues without holding a thread.

        Raises:
            The same as :meth:`run`.
        """
        self._check_usable()
        request = self._request(output_names, input_feed, run_options)
        future: Future[Any] = Future()
        ticket = _Ticket(request, future)
        with self._cond:
            self._check_usable()
            if self._take(ticket):
                self._lead_async(ticket)
        return await asyncio.wrap_future(future)

    def _lead_async(self, ticket: _Ticket) -> None:
        """Run a granted async ticket on the pool's executor. Called with ``self._cond`` held."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self._max, thread_name_prefix="sharedml-run"
            )
        self._executor.submit(self._lead_and_settle, ticket)

    def _lead_and_settle(self, ticket: _Ticket) -> None:
        future = ticket.future
        assert future is not None
        try:
            if ticket.session is None:
                try:
                    ticket.session = self._create_session()
                except BaseException:
                    with self._cond:
                        self._give_back(None)
                    raise
            self._lead(ticket.session, ticket)
        except BaseException as exc:
            ticket.error = exc
        if ticket.error is not None:
            future.set_exception(ticket.error)
        else:
            future.set_result(ticket.owned_result())

    def _lead(self, sess: Any, ticket: _Ticket) -> None:
        """Run ``ticket``'s request (and, batching, compatible queued ones) on ``sess``."""
        batch = [ticket]
        held: int | None = None
        broken = False
        run_s = 0.0
        try:
            if self.batching is not None and ticket.request is not None:
                followers, held = self._followers(ticket)
                batch += followers
            start = time.perf_counter()
            broken = self._run_batch(sess, batch)
            run_s = time.perf_counter() - start
        except BaseException as exc:  # KeyboardInterrupt in the leader: nobody is left hanging
            for t in batch:
                if t.result is None and t.error is None:
                    t.error = exc
            raise
        finally:
            failed = sum(t.error is not None for t in batch)
            self._release(
                sess, requests=len(batch), failed=failed, broken=broken, held=held, run_s=run_s
            )
            for follower in batch[1:]:
                self._finish(follower)

    def _followers(self, leader: _Ticket) -> tuple[list[_Ticket], int | None]:
        """Take the queued requests that merge with ``leader``'s, oldest first.

        Returns:
            The requests taken, and the rows the batch holds in ``share_rows``'s count (None
            where rows are not shared), which ``_release`` gives back.

        Raises:
            BaseException: whatever interrupts the wait for more rows (a ``KeyboardInterrupt``
                in the leader's thread). The requests taken so far go back to the front of the
                queue, in their order, for the session the leader gives back (or, where the
                pool is closing, get ``PoolClosedError``); the count is given back too.
        """
        assert self.batching is not None and leader.request is not None
        key = leader.request.key
        if key is None:
            return [], None
        adaptive = self.batching.max_delay_ms is None
        limit = cap = target = self.batching.max_batch_size
        rows = leader.request.rows
        taken: list[_Ticket] = []
        with self._cond:
            counted = self._shares  # adaptive only (Batching.shares_rows)
            if adaptive:
                # The callers of the latest batches are likely on their way back: wait for
                # this session's share of them, for a bounded share of a batch's run time.
                wait_s = self._recent[-1][1] * ADAPTIVE_DELAY_SHARE
            else:
                wait_s = self.batching.max_delay_ms / 1000  # type: ignore[operator]
            if counted:
                self._leading += 1
                self._held_rows += rows
            deadline = time.monotonic() + wait_s
            try:
                while True:
                    if counted:
                        cap = target = self._share(key, limit)
                    elif adaptive:
                        target = min(limit, self._recent[-1][0])  # the latest batch's rows
                    full = False
                    for other in list(self._queue):
                        request = other.request
                        if request is None or request.key != key:
                            continue
                        if rows + request.rows > cap:
                            full = True  # the oldest that does not fit goes first next time
                            break
                        self._queue.remove(other)
                        self._wait_s += time.monotonic() - other.queued_at
                        taken.append(other)
                        rows += request.rows
                        if counted:
                            self._held_rows += request.rows
                    now = time.monotonic()
                    remaining = deadline - now
                    if full or rows >= target or remaining <= 0 or self._state is not _State.OPEN:
                        return taken, rows if counted else None
                    self._filling += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        self._filling -= 1
                        self._fill_s += time.monotonic() - now
            except BaseException:
                if counted:
                    self._leading -= 1
                    self._held_rows -= rows
                if self._state is _State.OPEN:
                    requeued_at = time.monotonic()
                    for t in taken:
                        t.queued_at = requeued_at  # queued again from now: see _dispatch
                    self._queue.extendleft(reversed(taken))
                else:  # close() already failed the queue; these were out of it
                    for t in taken:
                        self._finish(t, error=_closed())
                raise

    def _share(self, key: Any, limit: int) -> int:
        """The rows a leader runs under the adaptive delay (``self._cond`` held).

        The sessions that batch (idle ones and those whose leaders form or run a batch) share
        the rows in play evenly: the rows their latest batches had (the callers on their way
        back) or, where more, the rows held and queued now. One session: its latest batch's
        rows. Several: each its part, so that their batches run side by side (on a GPU, in
        streams of their own) instead of one session taking every row while the others idle.
        """
        sessions = max(1, len(self._idle) + self._leading)
        expected = sum(rows for rows, _ in list(self._recent)[-sessions:])
        queued = sum(
            t.request.rows for t in self._queue if t.request is not None and t.request.key == key
        )
        return min(limit, -(-max(expected, self._held_rows + queued) // sessions))

    def _run_batch(self, sess: Any, batch: list[_Ticket]) -> bool:
        """Run ``batch`` on ``sess`` and fill in every ticket's result or error.

        Returns:
            Whether the session is broken (a provider failure): it is then replaced.
        """
        requests = [t.request for t in batch]
        assert all(r is not None for r in requests)
        merged_rows = sum(r.rows for r in requests if r is not None)
        rows = merged_rows
        if self._pads and self.batching is not None and batch[0].request.key is not None:  # type: ignore[union-attr]
            rows = bucket_for(merged_rows, self.batching.max_batch_size)
        if len(batch) > 1 or rows != merged_rows:
            start = time.perf_counter()
            try:
                feed = merge(requests, rows=rows)  # type: ignore[arg-type]
                outputs = self._ort_run(sess, batch[0].request, feed)  # type: ignore[arg-type]
            except Exception as exc:
                if _is_session_fatal(exc):
                    for t in batch:
                        t.error = _run_error(exc)
                    return True
                outputs = None  # rerun each member alone: only the culprit fails
            self._count_batch(merged_rows, time.perf_counter() - start, padded=rows - merged_rows)
            parts = (
                split(outputs, requests, rows=rows, copy=False)  # type: ignore[arg-type]
                if outputs is not None
                else None
            )
            if parts is not None and len(batch) > 1 and not self._checked:
                parts = self._check_merged(sess, batch, parts)
                if parts is None:
                    return False  # each request got its solo outcome
            if parts is not None:
                for t, part in zip(batch, parts, strict=True):
                    t.result, t.to_copy = part, self._copies
                return False
            if outputs is not None:
                self._split_failed()  # an output's axis 0 did not add up: rerun one by one
        for t in batch:
            start = time.perf_counter()
            try:
                t.result = self._ort_run(sess, t.request)  # type: ignore[arg-type]
            except Exception as exc:
                t.error = _run_error(exc)
                if _is_session_fatal(exc):
                    for rest in batch:
                        if rest.result is None and rest.error is None:
                            rest.error = t.error
                    return True
            finally:
                if self.batching is not None:
                    self._count_batch(t.request.rows, time.perf_counter() - start)  # type: ignore[union-attr]
        return False

    def _count_batch(self, rows: int, seconds: float, *, padded: int = 0) -> None:
        with self._cond:
            self._recent.append((rows, seconds))
            self._batches += 1
            self._batched_rows += rows
            self._padded_rows += padded
            self._max_rows = max(self._max_rows, rows)

    def _check_merged(
        self, sess: Any, batch: list[_Ticket], parts: list[list[Any]]
    ) -> list[list[Any]] | None:
        """Compare a merged batch's rows with each request run alone (until one check passed).

        Only batches whose requests hold different values are checked (equal rows would hide a
        model that mixes them). Returns ``parts`` where every request's rows match its solo
        run; else None, after giving every request its solo outcome (a result, or the error
        its run alone raised): the pool then stops merging.
        """
        requests = [t.request for t in batch]
        first = requests[0].feed  # type: ignore[union-attr]
        if all(_same_feed(first, r.feed) for r in requests[1:]):  # type: ignore[union-attr]
            return parts
        outcomes: list[Any] = []
        for t in batch:
            try:
                outcomes.append(self._ort_run(sess, t.request))  # type: ignore[arg-type]
            except Exception as exc:
                outcomes.append(_run_error(exc))
        rtol = (
            _CHECK_RTOL_CPU if self.plan.primary == "CPUExecutionProvider" else _CHECK_RTOL_DEVICE
        )
        same = all(
            not isinstance(solo, BaseException) and same_results(part, solo, rtol=rtol)
            for part, solo in zip(parts, outcomes, strict=True)
        )
        with self._cond:
            self._checks += 1
            self._checked = self._checked or same
            if not same:
                self._mismatches += 1
        if same:
            return parts
        for t, solo in zip(batch, outcomes, strict=True):
            if isinstance(solo, BaseException):
                t.error = solo
            else:
                t.result, t.to_copy = solo, False
        self._stop_merging(
            "a merged batch gave a caller other values than running its request alone (its "
            "outputs depend on other callers' rows)"
        )
        return None

    def _split_failed(self) -> None:
        with self._cond:
            self._split_failures += 1
            stop = self._split_failures >= _SPLIT_FAILURES_TO_STOP
        if stop:
            self._stop_merging(
                f"{self._split_failures} merged runs returned outputs whose axis 0 is not the "
                "merged row count, so their rows cannot be told apart"
            )

    def _stop_merging(self, why: str) -> None:
        if self.batching is None:
            return
        self.batching = None
        self._batching_reason = f"stopped merging requests: {why}"
        warnings.warn(
            f"sharedml: model '{self.source_path}': {why}. The pool stops merging requests "
            "(each runs alone).",
            RuntimeWarning,
            stacklevel=3,
        )

    def _finish(self, ticket: _Ticket, *, error: BaseException | None = None) -> None:
        """Settle a follower (or a waiter given up on): its result or error is final."""
        if error is not None:
            ticket.error = error
        ticket.done = True
        if ticket.future is not None:
            if ticket.error is not None:
                ticket.future.set_exception(ticket.error)
            else:
                ticket.future.set_result(ticket.owned_result())
        else:
            ticket.event.set()

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
                        error = _run_error(exc)
                        if error is exc:
                            raise
                        raise error from exc

    # ----------------------------------------------------------------------------------------
    # Metadata and lifecycle

    def _metadata(self, key: str) -> Any:
        if self._meta is None:
            with self.session():  # a pool created with min_sessions=0 has none yet
                pass
        assert self._meta is not None
        return self._meta[key]

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
        """Counters of this pool's sessions and runs."""
        with self._cond:
            return PoolStats(
                sessions=len(self._idle) + self._busy,
                busy=self._busy,
                waiting=len(self._queue),
                max_sessions=self._max,
                runs=self._runs,
                failed_runs=self._failed,
                waits=self._waits,
                wait_seconds=self._wait_s,
                created=self._created,
                replaced=self._replaced,
                create_seconds=self._create_s,
                creation_failures=self._creation_failures,
                batches=self._batches,
                batched_rows=self._batched_rows,
                max_batch_rows=self._max_rows,
                padded_rows=self._padded_rows,
                fill_wait_seconds=self._fill_s,
                run_seconds=self._run_s,
                batching=self.batching is not None,
                batch_checks=self._checks,
                batch_mismatches=self._mismatches,
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
        with self._cond:
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSING
            self._stopping.set()
            waiting, self._queue = list(self._queue), deque()
            for ticket in waiting:
                self._finish(ticket, error=_closed())
            self._cond.notify_all()
            while self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PoolTimeout(
                        f"{self._busy} run(s) still in flight after {timeout_s} s; the pool is "
                        "closing and accepts no new work."
                    )
                self._cond.wait(remaining)
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
        with self._cond:
            dropped, self._idle = list(self._idle), deque()
            self._count = 0
            self._creation_error = None
            self._state = _State.CLOSED
            executor, self._executor = self._executor, None
        for sess in dropped:
            _discard(sess)
        with self._template_lock:
            self._template = None
        if executor is not None:
            executor.shutdown(wait=True)

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
            f"<SessionPool {self.source_path.name!r} sessions={len(self._idle) + self._busy}/"
            f"{self._max} providers={list(self.plan.providers)} mechanism={self.mechanism.value!r}"
            f"{' batching' if self.batching is not None else ''} {self._state.value}>"
        )
