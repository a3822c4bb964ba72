"""SessionPool: N ONNX Runtime sessions over one copy of the weights, safe to use from any thread.

Data flow: model file -> (prepare, cached) prepared graph + weights file -> ``WeightStore``
(mapped once per process) -> N ``InferenceSession``s that borrow the mapped bytes -> ``run()``.

Invariants the pool keeps, whatever its callers do:

- A session is used by one caller at a time: never two ``Run()``s on one session at once
  (DirectML crashes otherwise; CUDA graphs and stateful kernels need it too).
- Every checked-out session comes back: a run that raises returns its session; a session whose
  provider failed (``EPFail``/``EngineError``) is dropped and a fresh one takes its place.
- Session creation happens outside the pool's lock, so that runs go on meanwhile. It is
  serialized process-wide by default (concurrent creation crashes DirectML on some versions,
  and on the CPU it costs memory: see ``serialize_creation``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sharedml._cache import cache_dir as cache_root
from sharedml._cache import prepared_model_for
from sharedml._errors import (
    PoolClosedError,
    PoolTimeout,
    ProviderError,
    SessionCreationError,
    SharedMLError,
)
from sharedml._prepack import release_freed_heap as _release_freed_heap
from sharedml._prepare import DEFAULT_SIZE_THRESHOLD_BYTES
from sharedml._providers import (
    CPU,
    CUDA,
    DML,
    ProviderPlan,
    ProviderSpec,
    plan_providers,
    serialize_runs_by_default,
)
from sharedml._weights import MECHANISMS, WeightStore, zero_copy_mechanisms

__all__ = ["PoolStats", "SessionPool", "clone_session_options"]

_CREATION_LOCK = threading.Lock()  # process-wide: DirectML crashes on concurrent creation

# Config keys copied from a caller's SessionOptions onto each session's own options. ORT's
# Python SessionOptions can be neither copied nor enumerated, so the pool copies the public
# attributes and these keys; anything else (free-dimension overrides, custom op libraries) goes
# through the pool's ``configure`` callback.
_KNOWN_CONFIG_KEYS = (
    "session.disable_prepacking",
    "session.use_env_allocators",
    "session.set_denormal_as_zero",
    "session.enable_quant_qdq",
    "session.disable_quant_qdq",
    "session.disable_double_qdq_remover",
    "session.enable_quant_qdq_cleanup",
    "optimization.enable_gelu_approximation",
    "optimization.disable_specified_optimizers",
    "session.inter_op.allow_spinning",
    "session.intra_op.allow_spinning",
    "session.intra_op_thread_affinities",
    "session.dynamic_block_base",
    "session.force_spinning_stop",
    "session.strict_shape_type_inference",
    "session.allow_released_opsets_only",
    "session.use_device_allocator_for_initializers",
    "session.disable_cpu_ep_fallback",
    "session.disable_aot_function_inlining",
    "session.qdqisint8allowed",
    "session.x64quantprecision",
    "ep.dml.disable_graph_fusion",
    "ep.dml.enable_graph_capture",
    "ep.dml.disable_memory_arena",
    "mlas.enable_gemm_fastmath_arm64_bfloat16",
)
_COPIED_ATTRIBUTES = (
    "enable_cpu_mem_arena",
    "enable_mem_pattern",
    "enable_mem_reuse",
    "enable_profiling",
    "execution_mode",
    "execution_order",
    "graph_optimization_level",
    "inter_op_num_threads",
    "intra_op_num_threads",
    "log_severity_level",
    "log_verbosity_level",
    "logid",
    "profile_file_prefix",
    "use_deterministic_compute",
)


def clone_session_options(template: Any | None) -> Any:
    """A new ``SessionOptions`` with ``template``'s public attributes and known config keys."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if template is None:
        return so
    for attr in _COPIED_ATTRIBUTES:
        setattr(so, attr, getattr(template, attr))
    for key in _KNOWN_CONFIG_KEYS:
        try:
            value = template.get_session_config_entry(key)
        except RuntimeError:  # ORT raises when the key is not set
            continue
        so.add_session_config_entry(key, value)
    return so


_PREPACKING_ALIASES: dict[object, str] = {None: "auto", False: "off", True: "per-session"}


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _config_entry(so: Any, key: str) -> str | None:
    try:
        return str(so.get_session_config_entry(key))
    except RuntimeError:
        return None


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's counters (``pool.stats()``).

    Attributes:
        sessions: Sessions that exist now.
        busy: Sessions checked out now.
        max_sessions: The most sessions the pool will create.
        runs: ``run()`` calls and checkouts completed.
        failed_runs: Those that raised.
        waits: Acquisitions that had to wait for a free session.
        wait_seconds: Total time callers spent waiting.
        created: Sessions created over the pool's life (replacements included).
        replaced: Sessions dropped after a provider failure.
        create_seconds: Total time spent creating sessions.
    """

    sessions: int
    busy: int
    max_sessions: int
    runs: int
    failed_runs: int
    waits: int
    wait_seconds: float
    created: int
    replaced: int
    create_seconds: float

    @property
    def idle(self) -> int:
        """Sessions free now."""
        return self.sessions - self.busy


def _is_session_fatal(exc: BaseException) -> bool:
    """Errors after which ORT does not promise a usable session (device and engine faults)."""
    name = type(exc).__name__
    return name in ("EPFail", "EngineError")


class _Ticket:
    """A caller waiting for a session: granted a session, or a slot to create one."""

    __slots__ = ("granted", "session")

    def __init__(self) -> None:
        self.granted = False
        self.session: Any = None


class SessionPool:
    """N ONNX Runtime sessions over one shared copy of a model's weights.

    Example::

        with sharedml.SessionPool("model.onnx", sessions=8) as pool:
            outputs = pool.run(None, {"input": batch})        # from any thread
            with pool.session(timeout_s=1.0) as sess:           # exclusive checkout
                sess.run(None, {"input": batch})

    Args:
        model: Path of any ONNX model. A model not written by :func:`sharedml.prepare` is
            prepared into the cache first (keyed by content, reused across processes).
        sessions: How many sessions the pool holds (created up front unless ``min_sessions``).
        min_sessions: Create only this many up front and grow on demand up to ``max_sessions``.
        max_sessions: The most sessions the pool grows to (default ``sessions``).
        providers: As for ``onnxruntime.InferenceSession``. Default: CPU.
        provider_options: As for ``onnxruntime.InferenceSession``.
        sess_options: A template ``onnxruntime.SessionOptions``; its public attributes and
            known config entries are applied to every session (the object is not modified).
        configure: Called with each session's ``SessionOptions`` before creation, for settings
            that cannot be read back from a template (free-dimension overrides, custom ops).
        mechanism: How sessions get the shared weights: ``"auto"`` (the best one measured to be
            zero-copy on the installed ORT) or one of ``"in-memory-file"``,
            ``"add-initializer"``, ``"ort-mmap"``.
        prepacking: What to do with ORT's CPU weight prepacking (packed MatMul/Conv/Gemm
            kernels are faster, up to 2.2x at batch 8):
            ``"auto"`` (default, also ``None``): on CPU, share the *packed* weights too, through
            an optimized model whose data file carries ORT's prepacked blobs (built once, cached
            per ORT build and CPU), wherever ORT packs or derives any weight of the model;
            otherwise share the raw weights. See :mod:`sharedml._prepack`.
            ``"shared"``: the prepacked-file route, or an error if it cannot be built.
            ``"off"`` (also ``False``): share raw weights, prepacking off (least memory, slowest
            batched kernels, fastest session creation).
            ``"per-session"`` (also ``True``): ORT's own behaviour: each session packs a private
            copy of every packed weight.
        cache_dir: Where unprepared models are prepared (default: see :func:`sharedml.cache_dir`).
        verify_weights: Check the weights file's SHA-256 when it is first mapped in the process.
        serialize_creation: Create one session at a time, process-wide (default). ``False``:
            the first ``min_sessions`` sessions are created on up to one thread per core (ORT
            releases the GIL while it loads), and sessions grown later are not serialized
            either. Faster start-up, more memory: a pool of 8 over a 100 MiB MLP starts in
            0.29 s instead of 0.55 s on 2 cores, but glibc keeps 4-11 MiB of the freed
            load-time heap per process in the helper threads' arenas, which ``malloc_trim``
            cannot return (``benchmarks/parallel_start_memory.py``).
            Refused (``ValueError``) with DirectML.
        serialize_runs: Allow only one ``Run`` at a time across the pool. ``None``: on for
            DirectML on ORT versions where concurrent DML sessions crash.
        size_threshold_bytes: Passed to prepare for models it prepares.

    Raises:
        SharedMLError: see :mod:`sharedml._errors`; the model, provider or first session failed.

    Thread safety: every method may be called from any thread; ``run_async`` from event loops.
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        sessions: int = 4,
        min_sessions: int | None = None,
        max_sessions: int | None = None,
        providers: Sequence[ProviderSpec] | None = None,
        provider_options: Sequence[dict[str, Any]] | None = None,
        sess_options: Any | None = None,
        configure: Callable[[Any], None] | None = None,
        mechanism: str = "auto",
        prepacking: str | bool | None = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        verify_weights: bool = True,
        serialize_creation: bool = True,
        serialize_runs: bool | None = None,
        size_threshold_bytes: int = DEFAULT_SIZE_THRESHOLD_BYTES,
    ) -> None:
        self._max = max_sessions if max_sessions is not None else sessions
        self._min = min_sessions if min_sessions is not None else self._max
        if self._max < 1 or not 0 <= self._min <= self._max:
            raise ValueError(
                f"Need 0 <= min_sessions <= max_sessions and max_sessions >= 1; got "
                f"min_sessions={self._min}, max_sessions={self._max}."
            )
        if not serialize_creation and any(
            (p if isinstance(p, str) else p[0]) == DML for p in providers or ()
        ):
            raise ValueError(
                "serialize_creation=False with DmlExecutionProvider: creating DirectML sessions "
                "concurrently crashes some onnxruntime-directml versions; leave it True."
            )
        prepacking = _PREPACKING_ALIASES.get(prepacking, prepacking)
        if prepacking not in ("auto", "shared", "off", "per-session"):
            raise ValueError(
                "prepacking must be 'auto', 'shared', 'off' or 'per-session' (or None, False, "
                f"True), not {prepacking!r}."
            )
        if prepacking == "shared" and mechanism != "auto":
            raise ValueError(
                "prepacking='shared' chooses the weight mechanism itself; leave mechanism='auto'."
            )
        if mechanism not in ("auto", "device", *MECHANISMS):
            raise ValueError(
                f"mechanism must be 'auto', 'device' or one of {MECHANISMS}, not {mechanism!r}."
            )
        self._state = "opening"
        self._cond = threading.Condition()
        self._idle: deque[Any] = deque()
        self._queue: deque[_Ticket] = deque()  # callers waiting for a session, oldest first
        self._count = 0  # sessions that exist or are being created
        self._busy = 0
        self._runs = self._failed = self._waits = self._created = self._replaced = 0
        self._wait_s = self._create_s = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._io_meta: tuple[list[Any], list[Any]] | None = None

        self.source_path = Path(model)
        self.plan: ProviderPlan = plan_providers(providers, provider_options)
        self.model_path = prepared_model_for(
            model, cache=cache_dir, size_threshold_bytes=size_threshold_bytes
        )
        self.weights = WeightStore.open(self.model_path, verify=verify_weights, cache=cache_dir)
        self._device_store: Any = None
        self._template = sess_options
        self._configure = configure
        self._prepacking: str = str(prepacking)
        self._prepacked: Any = None  # a _prepack.PrepackedModel on the prepacked-file route
        self.mechanism_reason = ""
        self.mechanism = self._choose_mechanism(mechanism)
        if self.plan.primary == CPU and mechanism == "auto" and prepacking in ("auto", "shared"):
            self._prepacked = self._plan_prepacked(cache_dir, forced=prepacking == "shared")
            if self._prepacked is not None:
                self.mechanism = "prepacked-file"
        self._serialize_creation = serialize_creation
        self._run_lock: threading.Lock | None = (
            threading.Lock()
            if (
                serialize_runs
                if serialize_runs is not None
                else serialize_runs_by_default(self.plan)
            )
            else None
        )
        try:
            self._idle.extend(self._create_initial_sessions(self._min))
        except BaseException:
            self._idle.clear()
            raise
        self._count = len(self._idle)
        self._state = "open"

    # ----------------------------------------------------------------------------------------
    # Sessions

    def _choose_mechanism(self, requested: str) -> str:
        """Resolve ``mechanism``.

        ``auto`` means device buffers on a GPU provider when that route works, else the best
        zero-copy CPU mechanism measured on this ORT.
        """
        on_device = self.plan.primary in (CUDA, DML)
        if requested == "device" or (requested == "auto" and on_device):
            from sharedml import _device

            if on_device and _device.device_mechanism_available(
                self.plan.primary, self.plan.device_id
            ):
                self._device_store = _device.DeviceWeightStore.for_store(
                    self.weights, self.plan.primary, self.plan.device_id
                )
                return "device"
            if requested == "device":
                raise ProviderError(
                    f"No device weight route works for {self.plan.primary} on this onnxruntime "
                    "build; use mechanism='auto' to fall back to host-mapped weights."
                )
            warnings.warn(
                f"Device weight sharing is unavailable for {self.plan.primary} here: every "
                "session will upload its own copy of the weights to the device.",
                RuntimeWarning,
                stacklevel=3,
            )
        return zero_copy_mechanisms()[0] if requested in ("auto", "device") else requested

    def _plan_prepacked(self, cache: str | os.PathLike[str] | None, *, forced: bool) -> Any:
        """Build (or find in the cache) the prepacked model; None where it does not pay."""
        from sharedml import _prepack

        try:
            prepacked = _prepack.build_prepacked_model(
                self.model_path,
                self.weights.path,
                cache_root(cache) / "prepacked",
                sess_options=self._template,
                weights_digest="sha256:" + self.weights.manifest.sha256,
            )
        except SharedMLError as exc:
            if forced:
                raise
            self.mechanism_reason = f"prepacked model could not be built ({exc}); raw weights"
            warnings.warn(
                f"sharedml: sharing prepacked weights failed for '{self.source_path}', the pool "
                f"shares raw weights with prepacking off instead: {exc}",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        decision = _prepack.choose_cpu_route(prepacked.stats, sessions=self._max)
        self.mechanism_reason = decision.reason
        if forced or decision.route is _prepack.CpuRoute.PREPACKED_FILE:
            return prepacked
        return None

    def _session_options(self) -> Any:
        import onnxruntime as ort

        so = clone_session_options(self._template)
        if self.plan.primary == CPU and so.intra_op_num_threads == 0:
            # N sessions run at once: ORT's default (one thread per core in every session)
            # oversubscribes the cores N-fold. Measured (4 sessions, 2 cores): about 2x slower.
            so.intra_op_num_threads = max(1, _usable_cores() // self._max)
        if self._prepacked is not None:
            self._prepacked.apply(so)
        elif self._prepacking != "auto" or _config_entry(so, "session.disable_prepacking") is None:
            # Raw weights shared: prepacking off unless asked for, since with it on every
            # session packs a private copy of each MatMul/Conv weight, exactly the memory the
            # pool exists to save.
            so.add_session_config_entry(
                "session.disable_prepacking", "0" if self._prepacking == "per-session" else "1"
            )
        for key, value in self.plan.config_entries:
            if _config_entry(so, key) is None:
                so.add_session_config_entry(key, value)
        if self.plan.disable_mem_pattern:
            so.enable_mem_pattern = False
        if self.plan.sequential_execution:
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if self._device_store is not None:
            self._device_store.register(so)
        elif self._prepacked is None:
            # (The prepacked model is loaded by path: ORT must map its data file itself, or it
            # ignores the prepacked blobs; see PrepackedModel.apply.)
            self.weights.register(so, self.mechanism)
        if self._configure is not None:
            self._configure(so)
        return so

    def _create_initial_sessions(self, n: int) -> list[Any]:
        """Create ``n`` sessions, on up to one thread per core unless creation is serialized.

        The calling thread creates its share too: its heap is glibc's main arena, the one arena
        whose freed top ``malloc_trim`` gives back. On the first failure the sessions already
        made are dropped and the error is raised.
        """
        workers = 1 if self._serialize_creation else min(n, _usable_cores())
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
        if self._prepacked is not None:
            # Each creation trimmed as it finished, but another was still freeing meanwhile.
            _release_freed_heap()
        return created

    def _create_session(self) -> Any:
        import onnxruntime as ort

        so = self._session_options()
        lock = _CREATION_LOCK if self._serialize_creation else contextlib.nullcontext()
        path = self._prepacked.model_path if self._prepacked is not None else self.model_path
        start = time.perf_counter()
        try:
            with lock:
                sess = ort.InferenceSession(
                    str(path),
                    so,
                    providers=list(self.plan.providers),
                    provider_options=[dict(o) for o in self.plan.provider_options],
                )
        except SharedMLError:
            raise
        except Exception as exc:
            raise SessionCreationError(
                f"onnxruntime could not create a session for '{self.source_path}' "
                f"(prepared as '{self.model_path}') with {list(self.plan.providers)}: {exc}"
            ) from exc
        if self._prepacked is not None:
            # ORT packs every weight again at load to validate the mapped blobs, then frees
            # that work; glibc keeps the freed pages (up to ~65 MiB a session) unless trimmed.
            _release_freed_heap()
        elapsed = time.perf_counter() - start
        with self._cond:
            self._created += 1
            self._create_s += elapsed
        return sess

    def _dispatch(self) -> None:
        """Hand free sessions (or creation slots) to waiting callers, oldest first.

        Called with ``self._cond`` held. A handed-over session counts as busy from here on, so
        ``stats()`` never misses it while its new owner wakes up.
        """
        while self._state == "open" and self._queue and (self._idle or self._count < self._max):
            ticket = self._queue.popleft()
            if self._idle:
                ticket.session = self._idle.popleft()
            else:
                self._count += 1  # the waiter creates it
            ticket.granted = True
            self._busy += 1
        self._cond.notify_all()  # granted waiters, and close() waiting for busy to reach 0

    def _acquire(self, timeout_s: float | None) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waited_since: float | None = None
        ticket: _Ticket | None = None
        with self._cond:
            try:
                while True:
                    if self._state in ("closing", "closed"):
                        raise PoolClosedError(
                            "This SessionPool is closed; create a new pool to run more work."
                        )
                    if ticket is not None and ticket.granted:
                        sess = ticket.session
                        break
                    # First come, first served: nobody may take a session while others wait,
                    # or a caller that loops on the pool starves the ones already waiting.
                    if ticket is None and not self._queue:
                        if self._idle:
                            sess = self._idle.popleft()
                            self._busy += 1
                            break
                        if self._count < self._max:
                            self._count += 1
                            self._busy += 1
                            sess = None
                            break
                    if ticket is None:
                        ticket = _Ticket()
                        self._queue.append(ticket)
                        waited_since = time.monotonic()
                        self._waits += 1
                        self._dispatch()
                        continue
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise PoolTimeout(
                            f"No session of the pool became free within {timeout_s} s "
                            f"({self._busy} of {self._max} busy). Raise max_sessions or the "
                            "timeout."
                        )
                    self._cond.wait(remaining)
            except BaseException:
                # Timeout, close, or KeyboardInterrupt while waiting: leave the queue, and pass
                # on a session (or creation slot) handed over in the meantime.
                if ticket is not None:
                    if ticket.granted:
                        self._busy -= 1
                        if ticket.session is not None:
                            self._idle.append(ticket.session)
                        else:
                            self._count -= 1
                        self._dispatch()
                    else:
                        self._queue.remove(ticket)
                raise
            finally:
                if waited_since is not None:
                    self._wait_s += time.monotonic() - waited_since
        if sess is None:
            try:
                sess = self._create_session()
            except BaseException:
                with self._cond:
                    self._count -= 1
                    self._busy -= 1
                    self._dispatch()
                raise
        return sess

    def _release(self, sess: Any, *, failed: bool, broken: bool) -> None:
        with self._cond:
            self._busy -= 1
            self._runs += 1
            self._failed += failed
            if broken:
                self._count -= 1  # the next acquire creates a fresh session in its place
                self._replaced += 1
            else:
                self._idle.append(sess)
            self._dispatch()

    @contextlib.contextmanager
    def session(self, timeout_s: float | None = None) -> Iterator[Any]:
        """Check out one session for exclusive use.

        Args:
            timeout_s: Wait at most this long for a free session (``None``: wait forever).

        Yields:
            An ``onnxruntime.InferenceSession`` no other caller uses until the block ends.

        Raises:
            PoolTimeout: no session became free in time (also a ``TimeoutError``).
            PoolClosedError: the pool is closing or closed.
        """
        sess = self._acquire(timeout_s)
        failed = broken = False
        try:
            if self._run_lock is not None:
                with self._run_lock:
                    yield sess
            else:
                yield sess
        except BaseException as exc:
            failed, broken = True, _is_session_fatal(exc)
            raise
        finally:
            self._release(sess, failed=failed, broken=broken)

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any | None = None,
    ) -> list[Any]:
        """Run the model on a free session; same arguments and result as ``InferenceSession.run``.

        Blocks until a session is free. Thread-safe.
        """
        with self.session() as sess:
            return list(sess.run(output_names, dict(input_feed), run_options))

    async def run_async(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any | None = None,
    ) -> list[Any]:
        """``run`` for asyncio code: the run happens on a worker thread, the loop stays free."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._state != "open":
                raise PoolClosedError("This SessionPool is closed; create a new pool.")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self._max, thread_name_prefix="sharedml"
                )
            executor = self._executor
        call = functools.partial(self.run, output_names, input_feed, run_options)
        return await loop.run_in_executor(executor, call)

    # ----------------------------------------------------------------------------------------
    # Metadata and lifecycle

    def _meta(self) -> tuple[list[Any], list[Any]]:
        if self._io_meta is None:
            with self.session() as sess:
                self._io_meta = (list(sess.get_inputs()), list(sess.get_outputs()))
        return self._io_meta

    def get_inputs(self) -> list[Any]:
        """The model's inputs, as ``InferenceSession.get_inputs`` gives them."""
        return self._meta()[0]

    def get_outputs(self) -> list[Any]:
        """The model's outputs, as ``InferenceSession.get_outputs`` gives them."""
        return self._meta()[1]

    @property
    def max_sessions(self) -> int:
        """The most sessions this pool holds at once."""
        return self._max

    @property
    def closed(self) -> bool:
        """Whether ``close`` has been called."""
        return self._state in ("closing", "closed")

    def stats(self) -> PoolStats:
        """Counters of this pool's sessions and runs."""
        with self._cond:
            return PoolStats(
                sessions=len(self._idle) + self._busy,
                busy=self._busy,
                max_sessions=self._max,
                runs=self._runs,
                failed_runs=self._failed,
                waits=self._waits,
                wait_seconds=self._wait_s,
                created=self._created,
                replaced=self._replaced,
                create_seconds=self._create_s,
            )

    def close(self, timeout_s: float | None = None) -> None:
        """Refuse new work, wait for runs in flight, then release every session.

        Callers waiting for a session get ``PoolClosedError``. Idempotent.

        Raises:
            PoolTimeout: runs in flight did not finish within ``timeout_s`` (the pool stays
                closing; call ``close`` again to wait more).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if self._state == "closed":
                return
            self._state = "closing"
            self._cond.notify_all()
            while self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PoolTimeout(
                        f"{self._busy} run(s) still in flight after {timeout_s} s; the pool is "
                        "closing and accepts no new work."
                    )
                self._cond.wait(remaining)
            self._idle.clear()
            self._count = 0
            self._state = "closed"
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<SessionPool {self.source_path.name!r} sessions={len(self._idle) + self._busy}/"
            f"{self._max} providers={list(self.plan.providers)} mechanism={self.mechanism!r} "
            f"{self._state}>"
        )
