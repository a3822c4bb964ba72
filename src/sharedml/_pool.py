"""SessionPool: N ONNX Runtime sessions over one copy of the weights, safe to use from any thread.

The pool is the client side of the split: it owns the queue of callers and the lifecycle of its
sessions; how a session gets its weights is the route planner's (:mod:`sharedml._route`), which
hands the pool a :class:`~sharedml.SessionRecipe`.

Invariants the pool keeps, whatever its callers do:

- A session is used by one caller at a time: never two ``Run()``s on one session at once
  (DirectML crashes otherwise; CUDA graphs and stateful kernels need it too).
- Waiting callers are served first come, first served.
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
import enum
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

from sharedml._cache import CacheDir
from sharedml._errors import PoolClosedError, PoolTimeout
from sharedml._host import release_freed_heap, usable_cores
from sharedml._providers import (
    DML,
    ProviderPlan,
    ProviderSpec,
    plan_providers,
    serialize_runs_by_default,
)
from sharedml._route import Mechanism, SessionRecipe, plan_route

__all__ = ["PoolStats", "SessionPool"]

_CREATION_LOCK = threading.Lock()  # process-wide: DirectML crashes on concurrent creation


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
        busy: Sessions checked out now.
        waiting: Callers waiting for a session now.
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
    waiting: int
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
        cache_dir: The cache folder (default: :func:`sharedml.cache_dir`).
        verify_weights: Check the weights' SHA-256 when they are first mapped in the process.
        serialize_creation: Create one session at a time, process-wide (default). ``False``:
            the first ``min_sessions`` sessions are created on up to one thread per core (ORT
            releases the GIL while it loads), and sessions grown later are not serialized
            either: faster start-up, but glibc keeps a few MiB of freed load-time heap per
            process in the helper threads' arenas (figures: README, Benchmarks). Refused
            (``ValueError``) with DirectML.
        serialize_runs: Allow only one ``Run`` at a time across the pool. ``None``: on for
            DirectML on ORT versions where concurrent DML sessions crash.
        size_threshold_bytes: Passed to :func:`sharedml.prepare` for models it prepares.

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
        cache_dir: CacheDir = None,
        verify_weights: bool = True,
        serialize_creation: bool = True,
        serialize_runs: bool | None = None,
        size_threshold_bytes: int | None = None,
    ) -> None:
        self._state = _State.OPENING
        self._max = max_sessions if max_sessions is not None else sessions
        self._min = min_sessions if min_sessions is not None else self._max
        if self._max < 1 or not 0 <= self._min <= self._max:
            raise ValueError(
                f"Need 0 <= min_sessions <= max_sessions and max_sessions >= 1; got "
                f"min_sessions={self._min}, max_sessions={self._max}."
            )
        self.plan: ProviderPlan = plan_providers(providers, provider_options)
        if not serialize_creation and DML in self.plan.providers:
            raise ValueError(
                "serialize_creation=False with DmlExecutionProvider: creating DirectML sessions "
                "concurrently crashes some onnxruntime-directml versions; leave it True."
            )
        self._cond = threading.Condition()
        self._idle: deque[Any] = deque()
        self._queue: deque[_Ticket] = deque()  # callers waiting for a session, oldest first
        self._count = 0  # sessions that exist or are being created
        self._busy = 0
        self._runs = self._failed = self._waits = self._created = self._replaced = 0
        self._wait_s = self._create_s = 0.0
        self._executor: ThreadPoolExecutor | None = None
        self._io_meta: tuple[list[Any], list[Any]] | None = None
        self._serialize_creation = serialize_creation

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
        )
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
        self._state = _State.OPEN

    # ----------------------------------------------------------------------------------------
    # What the route planner decided

    @property
    def source_path(self) -> Path:
        """The model as given."""
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

    # ----------------------------------------------------------------------------------------
    # Sessions

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
        with lock:
            sess = self.recipe.create_session()
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
        while (
            self._state is _State.OPEN and self._queue and (self._idle or self._count < self._max)
        ):
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
                    if self._state in (_State.CLOSING, _State.CLOSED):
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
            if self._state is not _State.OPEN:
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
            if self._state is _State.CLOSED:
                return
            self._state = _State.CLOSING
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
            self._state = _State.CLOSED
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __del__(self) -> None:
        # Like an unclosed file: the sessions go with the object, but silently dropping a pool
        # that may hold runs or waiters is worth a word (shown with -W default or in tests).
        if getattr(self, "_state", None) is _State.OPEN:
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
            f"{self._max} providers={list(self.plan.providers)} mechanism={self.mechanism.value!r} "
            f"{self._state.value}>"
        )
