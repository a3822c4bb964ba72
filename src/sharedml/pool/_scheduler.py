"""The scheduler: one queue of tickets, the sessions it hands out, and the batches leaders form.

A :class:`Scheduler` knows nothing of ONNX Runtime. It hands out sessions that a
:class:`SessionSource` creates, runs requests (merged or alone) through that source, and lets
them go through it, so tests drive it with fake sessions. Batch forming is an object's job here
as in Ray Serve's ``serve/batching.py`` (``_BatchQueue``): callers put requests in, the leader
of a batch takes the compatible ones out; the pool only opens and closes it.

One queue of tickets serves every caller (``run``, ``run_async``, checkouts), oldest first.
The oldest ticket gets the next free session and becomes its *leader*: with batching on it takes
the compatible requests queued behind it, oldest first, up to ``max_batch_size`` rows, runs them
as one ``Run`` and hands each follower its rows (``docs/batching.md`` has the policy: the
adaptive delay, rows shared over sessions, the checks of merged batches against solo runs, the
fallback to solo runs where merged outputs do not split).

The session released last is handed out first: on a lightly used pool one session does the
work, with its intra-op threads still spinning and its buffers in cache, while the others'
threads sleep (handing them out in turn keeps all of them awake, competing for the cores).

Where batches will later form on every free session at once, :meth:`Scheduler._share` is the one
place that decides how many rows a leader takes; tickets, the queue and the release of rows held
stay as they are.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from sharedml._errors import (
    PoolClosedError,
    PoolTimeout,
    RunError,
    SharedMLError,
)
from sharedml.pool._batching import (
    ADAPTIVE_DELAY_SHARE,
    Batching,
    CheckKind,
    CheckSchedule,
    Request,
    bucket_for,
    isolated,
    merge,
    owned,
    same_feed,
    same_results,
    split,
    tells,
)
from sharedml.pool._payoff import Comparison, MergeGain, MergeState
from sharedml.pool._stats import Counters, PoolStats

__all__ = [
    "Scheduler",
    "SessionSource",
    "Ticket",
    "closed_error",
]

# Merged runs whose outputs did not split back into the requests' rows before the pool stops
# merging: one odd request (rows that ORT broadcasts, a shape the model special-cases) must
# not turn batching off for everyone; a model that never splits shows it again at once.
_SPLIT_FAILURES_TO_STOP = 3

_log = logging.getLogger("sharedml")

if TYPE_CHECKING:
    import asyncio  # at run time only where a caller runs one: its import is start-up time


class SessionSource(Protocol):
    """The sessions a scheduler hands out: how they are made, run and let go.

    The scheduler calls these without its lock held, from the threads of its callers (and of
    its executor for ``run_async``).
    """

    def create(self) -> Any:
        """A new session, for a slot the scheduler granted (the pool grows on demand)."""

    def run(self, session: Any, request: Request, feed: Mapping[str, Any] | None) -> list[Any]:
        """Run ``request`` on ``session``: with ``feed`` (a merged batch's), that feed instead."""

    def discard(self, session: Any) -> None:
        """Let a session go that a provider failure broke."""


def _failure(exc: BaseException) -> SharedMLError:
    """What a source's run raised, as the callers get it (the source maps ORT's own errors)."""
    if isinstance(exc, SharedMLError):
        return exc
    error = RunError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def _lost(error: SharedMLError) -> bool:
    return isinstance(error, RunError) and error.session_lost


def closed_error() -> PoolClosedError:
    """The error of a call on a closed pool (or a waiter that a closing pool turned away)."""
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


class Ticket:
    """A caller in the queue: a checkout, or a request to run (with batching: to merge)."""

    __slots__ = (
        "arrived",
        "done",
        "error",
        "event",
        "future",
        "granted",
        "left",
        "loop",
        "queued_at",
        "request",
        "result",
        "session",
        "to_copy",
        "views",
    )

    def __init__(
        self,
        request: Request | None = None,
        future: Future[Any] | asyncio.Future[Any] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.request = request  # None: a checkout, which never merges
        self.future = future  # submit, run_async: the result goes here, no thread waits
        self.loop = loop  # run_async: the loop that owns ``future`` and must set it
        self.event = _Signal()  # set when granted, done, or told to give up
        self.granted = False  # a session (or a slot to create one) is this ticket's
        self.session: Any = None
        self.done = False  # a leader ran this request in its batch
        self.result: Any = None
        self.to_copy = False  # result is views of a batch's outputs, to copy: see owned_result
        self.views = False  # ... to hand over as views of the caller's rows only
        self.error: BaseException | None = None
        self.queued_at = 0.0
        self.arrived = time.monotonic()
        self.left = False  # its caller is gone (cancelled, interrupted) before it ran

    def gone(self) -> bool:
        """Whether the caller left before its request started (it must not run)."""
        return self.left or (self.future is not None and self.future.cancelled())

    def start(self) -> bool:
        """Mark the request as running, unless its caller left: then False (it must not run).

        An async caller's future is set running here, so that a cancel from now on (the
        caller gone while its batch runs) leaves the result to be dropped instead. An asyncio
        future has no running state: one cancelled from here on drops its result in
        :func:`_set_results`.
        """
        if self.left:
            return False
        if self.future is None:
            return True
        if self.loop is not None:
            return not self.future.cancelled()
        assert isinstance(self.future, Future)
        return self.future.set_running_or_notify_cancel()

    def settle(self, into: list[Ticket] | None = None) -> None:
        """Hand an async caller its result or error; nothing where it was cancelled.

        A ``run_async`` caller's future belongs to its event loop: the result is made ready
        here (copied out of the batch where it must be) and set there, through ``into``
        where the leader hands over a whole batch at once (see :func:`deliver`).
        """
        future = self.future
        assert future is not None
        if future.cancelled():
            return  # nobody waits for it: no copy, no error
        if self.loop is not None:
            if self.error is None:
                self.owned_result()
            if into is None:
                deliver([self])
            else:
                into.append(self)
            return
        assert isinstance(future, Future)
        try:
            if self.error is not None:
                future.set_exception(self.error)
            else:
                future.set_result(self.owned_result())
        except InvalidStateError:
            pass  # cancelled meanwhile

    def owned_result(self) -> Any:
        """The result, copied out of the batch's outputs first where it is views of them to copy.

        Called in the thread that hands the result over (the caller's own for ``run``), after
        the session went back: the copies of a batch's rows are made in parallel and never
        while the session is held. With ``Batching(copy_outputs=False)`` the views become
        arrays whose ``.base`` holds the caller's rows only (:func:`isolated`).
        """
        if self.to_copy:
            self.result = isolated(self.result) if self.views else owned(self.result)
            self.to_copy = False
        return self.result


def deliver(tickets: list[Ticket]) -> None:
    """Set ``run_async`` callers' futures on their loops: one wake-up per loop, not per caller.

    asyncio's ``wrap_future`` wakes the loop once per settled future, through its self-pipe:
    for a merged batch of N async callers, N writes from the leader's thread, each releasing
    the GIL to a loop thread that then runs one caller and waits for the next, while the
    session idles (docs/gpu.md has the figures). Handing the loop the whole batch lets it
    resume every caller in one pass.
    """
    by_loop: dict[asyncio.AbstractEventLoop, list[Ticket]] = {}
    for ticket in tickets:
        assert ticket.loop is not None
        by_loop.setdefault(ticket.loop, []).append(ticket)
    for loop, ready in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits there
            loop.call_soon_threadsafe(_set_results, ready)


def _set_results(tickets: list[Ticket]) -> None:
    """On the callers' loop: each future takes its result or error, unless cancelled."""
    for ticket in tickets:
        future = ticket.future
        assert future is not None
        if future.done():
            continue  # cancelled after its batch started: the result is dropped
        if ticket.error is not None:
            future.set_exception(ticket.error)
        else:
            future.set_result(ticket.result)


class _Shared:
    """A session running requests side by side: how many now, and whether one found it broken."""

    __slots__ = ("broken", "runs", "session")

    def __init__(self, session: Any) -> None:
        self.session = session
        self.runs = 1
        self.broken = False  # let go once its last run ends; it takes no more meanwhile


class Scheduler:
    """The queue of a pool's callers, its sessions, and the batches their leaders form.

    Args:
        source: Creates, runs and lets go of the sessions.
        max_sessions: The most sessions that exist at once (created on demand up to it).
        batching: How requests merge; None: never.
        batching_reason: Why batching is on or off (``SessionPool.batching_reason``).
        pads: Pad merged batches to buckets (``Batching.pads``).
        shares_rows: Share the rows in play over the sessions (``Batching.shares_rows``).
        check_rtol: The tolerance of the check of merged batches against solo runs, relative
            to an output's largest magnitude.
        check_seed: Seeds when those checks come and which request a spot check reruns
            (:class:`~sharedml.pool._batching.CheckSchedule`; tests). None: from the OS.
        run_clock: What times the runs of requests (merged, alone, and the solo runs that
            check merged batches or time them against solo runs: whether merging pays, and
            the adaptive delay). Default ``time.perf_counter``; tests give a fake clock.
        name: The model, as warnings name it.
        share_runs: The most requests one session runs side by side (each its own ``Run``)
            while requests do not merge: merging measured not to pay, or stopped. 1 (the
            default): a session runs one ``Run`` at a time. Only for sessions whose ``Run``
            is thread-safe (ORT's CPU provider).
        cores: The cores the sessions' runs share (``MergeGain``'s, for the trial of merging
            against requests side by side); None: not known.

    Thread safety: every method may be called from any thread.
    """

    def __init__(
        self,
        source: SessionSource,
        *,
        max_sessions: int,
        batching: Batching | None = None,
        batching_reason: str = "",
        pads: bool = False,
        shares_rows: bool = False,
        check_rtol: float = 1e-3,
        check_seed: int | None = None,
        run_clock: Callable[[], float] | None = None,
        name: str = "model",
        share_runs: int = 1,
        cores: int | None = None,
    ) -> None:
        self._source = source
        self._clock = run_clock if run_clock is not None else time.perf_counter
        self._max = max_sessions
        self.batching = batching
        self.batching_reason = batching_reason
        self._pads = pads
        self._shares = shares_rows
        self._copies = batching is None or batching.copy_outputs
        self._rtol = check_rtol
        self._name = name
        self.counters = Counters()
        self.cond = threading.Condition()
        self._open = True
        self._idle: deque[Any] = deque()
        self._queue: deque[Ticket] = deque()  # waiting tickets, oldest first
        self._count = 0  # sessions that exist or are being created
        self._busy = 0  # grants in flight: sessions handed out, and runs side by side on them
        # Side by side (share_runs > 1, requests not merging): a session handed to a request
        # takes more requests until it runs share_runs; it goes back to the idle ones when
        # the last leaves. A checkout or a merging leader gets an idle session only.
        self._share_limit = max(1, share_runs)
        self._side: dict[int, _Shared] = {}  # by id(session)
        self._filling = 0  # leaders waiting for more rows (Batching.max_delay_ms)
        # Adaptive delay: rows and run seconds of the latest batches (newest last); with
        # Batching.share_rows, the leaders forming or running a batch and the rows they hold.
        self._recent: deque[tuple[int, float]] = deque([(0, 0.0)], maxlen=max(1, max_sessions))
        self._leading = 0
        self._held_rows = 0
        # Defence in depth behind the analysis: merged batches are checked against solo runs of
        # their requests, the first of every class and then at random (CheckSchedule).
        self._checks = CheckSchedule(
            batching.check_within if batching is not None else None,
            limit=batching.max_batch_size if batching is not None else 1,
            seed=check_seed,
        )
        self._leaked = False  # a check failed: batches still in flight are checked in full
        # Whether merging pays, measured on the traffic (merged Runs against solo reruns of
        # their requests): merging pauses where it does not (pool/_payoff).
        self._gain = MergeGain(
            enabled=batching is not None and batching.measure_gain,
            side_by_side=self._share_limit if self._share_limit > 1 else None,
            cores=cores,
        )
        self._base_reason = batching_reason
        self._executor: ThreadPoolExecutor | None = None
        self._creation_error: BaseException | None = None  # undelivered background failure

    # ----------------------------------------------------------------------------------------
    # Sessions: created, added, handed out, given back

    @property
    def sessions(self) -> int:
        """Sessions that exist now (idle or busy)."""
        return len(self._idle) + self._busy - self._extra()

    def _extra(self) -> int:
        """Grants beyond each shared session's first: runs side by side, not sessions."""
        return sum(shared.runs - 1 for shared in self._side.values())

    def create_session(self) -> Any:
        """A new session from the source, counted in ``created`` and ``create_seconds``."""
        start = time.perf_counter()
        sess = self._source.create()
        elapsed = time.perf_counter() - start
        with self.cond:
            self.counters.created += 1
            self.counters.create_seconds += elapsed
        return sess

    def add_sessions(self, sessions: list[Any], *, reserved: int = 0) -> None:
        """Start with ``sessions``, and ``reserved`` more on their way (:meth:`add_session`)."""
        with self.cond:
            self._idle.extend(sessions)
            self._count = len(self._idle) + reserved

    def add_session(self, sess: Any) -> bool:
        """Add a reserved session once created; False (and it is dropped) once closed."""
        with self.cond:
            if not self._open:
                self._count -= 1  # closing: the session goes with the caller's reference
                return False
            self._idle.append(sess)
            self._dispatch()
            return True

    def unreserve(self, n: int) -> None:
        """``n`` reserved sessions will never be added (creation gave up or the pool closed)."""
        with self.cond:
            self._count -= n

    def creation_failed(self, error: SharedMLError) -> None:
        """Report a background failure to the caller that waits for capacity, or keep it."""
        with self.cond:
            self.counters.creation_failures += 1
            while self._queue and self._queue[0].gone():
                self._left(self._queue.popleft())
            if self._queue and not self._idle:
                # The caller at the head of the queue would have had this session.
                self._finish(self._queue.popleft(), error=error)
            else:
                self._creation_error = error  # for the next caller that has to wait

    def checkout(self, timeout_s: float | None) -> Any:
        """Take a session for exclusive use (give it back with :meth:`checkin`).

        Raises:
            PoolTimeout: none became free within ``timeout_s``.
            PoolClosedError: the scheduler is closing or closed.
        """
        sess = self._acquire(Ticket(), timeout_s)
        assert sess is not None  # a checkout never merges, so no leader runs it
        return sess

    def checkin(self, sess: Any, *, failed: bool = False, broken: bool = False) -> None:
        """Give back a checked-out session; ``broken``: it is let go and replaced on demand."""
        self._release(sess, requests=1, failed=int(failed), broken=broken)

    def _dispatch(self) -> None:
        """Hand free sessions (or creation slots) to waiting tickets, oldest first.

        Called with ``self.cond`` held. A handed-over session counts as busy from here on, so
        ``stats()`` never misses it while its new owner wakes up.
        """
        while self._open and self._queue:
            ticket = self._queue[0]
            if ticket.gone():
                self._left(self._queue.popleft())
                continue
            if not self._grant(ticket):
                break  # first come, first served: the oldest waits, and those behind it
            self._queue.popleft()
            self.counters.wait_seconds += time.monotonic() - ticket.queued_at
            if ticket.future is not None:
                self._lead_async(ticket)
            else:
                ticket.event.set()
        self.cond.notify_all()  # close() waits for busy to reach 0, leaders for more rows

    def _grant(self, ticket: Ticket) -> bool:
        """Give ``ticket`` an idle session, a slot to create one, or a place beside other runs.

        Called with ``self.cond`` held; False where none is free for it now.
        """
        side = ticket.request is not None and self._side_by_side()
        if self._idle:
            ticket.session = self._idle.pop()
            if side:
                self._side[id(ticket.session)] = _Shared(ticket.session)
        elif self._count < self._max:
            self._count += 1  # the ticket's owner creates it
        elif side and (shared := self._roomiest()) is not None:
            shared.runs += 1
            ticket.session = shared.session
        else:
            return False
        ticket.granted = True
        self._busy += 1
        return True

    def _side_by_side(self) -> bool:
        """Whether requests run side by side on sessions now (``self.cond`` held)."""
        return self._share_limit > 1 and (self.batching is None or self._gain.runs_side_by_side)

    def _roomiest(self) -> _Shared | None:
        """The shared session with the fewest runs, where it takes one more; else None."""
        room = [s for s in self._side.values() if not s.broken and s.runs < self._share_limit]
        return min(room, key=lambda shared: shared.runs, default=None)

    def _take(self, ticket: Ticket) -> bool:
        """Give ``ticket`` a session (or a slot) at once if that is fair; else queue it.

        Called with ``self.cond`` held. Returns whether it was granted now.
        """
        if not self._open:
            raise closed_error()
        # First come, first served: nobody may take a session while others wait, or a caller
        # that loops on the pool starves the ones already waiting.
        if not self._queue and self._grant(ticket):
            return True
        if self._creation_error is not None:
            error, self._creation_error = self._creation_error, None
            raise error  # this caller would have had the session that failed
        ticket.queued_at = time.monotonic()
        self._queue.append(ticket)
        self.counters.waits += 1
        if self._filling:
            self.cond.notify_all()  # a leader filling its batch may want this one
        return False

    def _wait(self, ticket: Ticket, timeout_s: float | None) -> None:
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
                with self.cond:
                    if ticket.granted:
                        return
                    if ticket.error is not None:
                        raise ticket.error  # closed, a failed creation, or a failed batch
                    if ticket.done:
                        return  # a leader ran this request in its batch
                    if not self._open:
                        raise closed_error()
                    ticket.event.clear()
            except BaseException:
                # Timeout, close, or KeyboardInterrupt while waiting: leave the queue, and pass
                # on a session (or creation slot) handed over in the meantime.
                with self.cond:
                    if ticket.granted:
                        self._give_back(ticket.session)
                    elif ticket in self._queue:
                        self._queue.remove(ticket)
                        self.counters.wait_seconds += time.monotonic() - ticket.queued_at
                    elif not ticket.done:
                        ticket.left = True  # a leader took it: it must not run now
                raise

    def _give_back(self, sess: Any) -> None:
        """Return an unused grant (``None``: a creation slot). Called with ``self.cond`` held."""
        if sess is None:
            self._busy -= 1
            self._count -= 1
            self._dispatch()
        else:
            self._put_back(sess, broken=False)

    def _put_back(self, sess: Any, *, broken: bool) -> bool:
        """A grant of ``sess`` ends (``self.cond`` held); whether the session is to be let go.

        A session that runs requests side by side goes back to the idle ones when its last
        run ends; one found broken meanwhile takes no more runs and is let go then.
        """
        self._busy -= 1
        shared = self._side.get(id(sess))
        if shared is not None:
            shared.broken = shared.broken or broken
            if shared.runs > 1:
                shared.runs -= 1
                self._dispatch()
                return False
            del self._side[id(sess)]
            broken = shared.broken
        if broken:
            self._count -= 1  # the next acquire creates a fresh session in its place
            self.counters.replaced += 1
        else:
            self._idle.append(sess)
        self._dispatch()
        return broken

    def _acquire(self, ticket: Ticket, timeout_s: float | None) -> Any:
        """A session for ``ticket``; ``None`` if a leader ran its request meanwhile."""
        with self.cond:
            granted = self._take(ticket)
        if not granted:
            self._wait(ticket, timeout_s)
            if ticket.done:
                return None
        if ticket.session is None:
            self._create_for(ticket)
        return ticket.session

    def _create_for(self, ticket: Ticket) -> None:
        """Create the session of a granted slot; on failure the slot goes back."""
        try:
            ticket.session = self.create_session()
        except BaseException:
            with self.cond:
                self._give_back(None)
            raise

    def _release(
        self,
        sess: Any,
        *,
        requests: int,
        failed: int,
        broken: bool,
        held: int | None = None,
        run_s: float = 0.0,
        ran: list[Ticket] | None = None,
    ) -> None:
        with self.cond:
            self.counters.run_seconds += run_s
            if ran is not None and self._gain.trial is not None:
                for t in ran:
                    if t.error is None and t.request is not None:
                        self._changed(self._gain.observe(t.arrived, t.request.rows))
            if held is not None:
                self._leading -= 1
                self._held_rows -= held
            self.counters.runs += requests
            self.counters.failed_runs += failed
            broken = self._put_back(sess, broken=broken)
        if broken:
            self._source.discard(sess)

    # ----------------------------------------------------------------------------------------
    # Runs

    def run(self, request: Request) -> Any:
        """Run ``request``, alone or merged with others; its result (ORT's list of outputs).

        Raises:
            PoolClosedError: the scheduler is closing or closed.
            BaseException: whatever the run raised (the source's errors, as it maps them).
        """
        ticket = Ticket(request)
        sess = self._acquire(ticket, None)
        if sess is not None:
            self._lead(sess, ticket)
        if ticket.error is not None:
            raise ticket.error
        return ticket.owned_result()

    def submit(self, request: Request) -> Future[Any]:
        """Queue ``request`` without a thread waiting for it; its result comes in the future.

        Raises:
            PoolClosedError: the scheduler is closing or closed.
        """
        future: Future[Any] = Future()
        ticket = Ticket(request, future)
        self._queue_async(ticket)
        future.add_done_callback(lambda f: self._cancelled(ticket) if f.cancelled() else None)
        return future

    async def run_async(self, request: Request) -> Any:
        """:meth:`run` for a coroutine: the request queues without holding a thread.

        The future lives on the running loop and is set there by :func:`deliver`, a batch
        at a time. A caller cancelled while queued takes its request out of the queue.

        Raises:
            The same as :meth:`run`.
        """
        import asyncio

        loop = asyncio.get_running_loop()
        ticket = Ticket(request, loop.create_future(), loop)
        self._queue_async(ticket)
        try:
            return await ticket.future  # type: ignore[misc]
        except asyncio.CancelledError:
            self._cancelled(ticket)
            raise

    def _cancelled(self, ticket: Ticket) -> None:
        """An async caller cancelled (or disconnected): a queued request leaves the queue.

        One that a leader took into a batch still forming is dropped when the batch starts;
        one already running finishes, and its result is dropped.
        """
        with self.cond:
            if ticket in self._queue:
                self._queue.remove(ticket)
                self.counters.wait_seconds += time.monotonic() - ticket.queued_at
                self._left(ticket)

    def _left(self, ticket: Ticket) -> None:
        """Count a request whose caller left before it ran (``self.cond`` held), once."""
        if not ticket.done:
            ticket.done = True
            self.counters.cancelled += 1

    def _queue_async(self, ticket: Ticket) -> None:
        """Queue an async caller's ticket; one granted at once runs on the executor."""
        with self.cond:
            if self._take(ticket):
                self._lead_async(ticket)

    def _lead_async(self, ticket: Ticket) -> None:
        """Run a granted async ticket on the executor. Called with ``self.cond`` held."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self._max * self._share_limit, thread_name_prefix="sharedml-run"
            )
        self._executor.submit(self._lead_and_settle, ticket)

    def _lead_and_settle(self, ticket: Ticket) -> None:
        ready: list[Ticket] = []  # the batch's run_async callers, handed over together
        try:
            if ticket.session is None:
                self._create_for(ticket)
            self._lead(ticket.session, ticket, ready)
        except BaseException as exc:
            ticket.error = exc
        ticket.settle(ready)
        if ready:
            deliver(ready)

    def _lead(self, sess: Any, ticket: Ticket, ready: list[Ticket] | None = None) -> None:
        """Run ``ticket``'s request (and, batching, compatible queued ones) on ``sess``.

        Followers that are ``run_async`` callers go into ``ready`` for the caller to
        :func:`deliver` with its own; without ``ready``, they are delivered here.
        """
        batch = [ticket]
        taken: list[Ticket] = []
        held: int | None = None
        broken = False
        run_s = 0.0
        try:
            if self.batching is not None and ticket.request is not None:
                followers, held = self._followers(ticket)
                taken = followers
                batch += followers
            with self.cond:
                # Callers that left (a cancelled run_async) before the run starts: their
                # requests do not run; the rest of the batch does.
                running = [t for t in batch if t.start()]
                for t in batch:
                    if t not in running:
                        self._left(t)
            batch = running
            if batch:
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
                sess,
                requests=len(batch),
                failed=failed,
                broken=broken,
                held=held,
                run_s=run_s,
                ran=batch,
            )
            ready_here: list[Ticket] = [] if ready is None else ready
            ran = {id(t) for t in batch}  # not `in batch`: n comparisons per follower
            for follower in taken:
                if id(follower) in ran:
                    self._finish(follower, into=ready_here)
            if ready is None and ready_here:
                deliver(ready_here)

    def _followers(self, leader: Ticket) -> tuple[list[Ticket], int | None]:
        """Take the queued requests that merge with ``leader``'s, oldest first.

        Returns:
            The requests taken, and the rows the batch holds in ``share_rows``'s count (None
            where rows are not shared), which ``_release`` gives back.

        Raises:
            BaseException: whatever interrupts the wait for more rows (a ``KeyboardInterrupt``
                in the leader's thread). The requests taken so far go back to the front of the
                queue, in their order, for the session the leader gives back (or, where the
                scheduler is closing, get ``PoolClosedError``); the count is given back too.
        """
        assert self.batching is not None and leader.request is not None
        key = leader.request.key
        if key is None:
            return [], None
        adaptive = self.batching.max_delay_ms is None
        limit = cap = target = self.batching.max_batch_size
        rows = leader.request.rows
        taken: list[Ticket] = []
        with self.cond:
            if not self._gain.merges():
                return [], None  # merging measured not to pay: this request runs alone
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
                        if other.gone():
                            self._queue.remove(other)
                            self._left(other)
                            continue
                        if request is None or request.key != key:
                            continue
                        if rows + request.rows > cap:
                            full = True  # the oldest that does not fit goes first next time
                            break
                        self._queue.remove(other)
                        self.counters.wait_seconds += time.monotonic() - other.queued_at
                        taken.append(other)
                        rows += request.rows
                        if counted:
                            self._held_rows += request.rows
                    now = time.monotonic()
                    remaining = deadline - now
                    if full or rows >= target or remaining <= 0 or not self._open:
                        return taken, rows if counted else None
                    self._filling += 1
                    try:
                        self.cond.wait(remaining)
                    finally:
                        self._filling -= 1
                        self.counters.fill_wait_seconds += time.monotonic() - now
            except BaseException:
                if counted:
                    self._leading -= 1
                    self._held_rows -= rows
                if self._open:
                    requeued_at = time.monotonic()
                    for t in taken:
                        t.queued_at = requeued_at  # queued again from now: see _dispatch
                    self._queue.extendleft(reversed(taken))
                else:  # close() already failed the queue; these were out of it
                    for t in taken:
                        self._finish(t, error=closed_error())
                raise

    def _share(self, key: Any, limit: int) -> int:
        """The rows a leader runs under the adaptive delay (``self.cond`` held).

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

    def _run_batch(self, sess: Any, batch: list[Ticket]) -> bool:
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
            start = self._clock()
            try:
                feed = merge(requests, rows=rows)  # type: ignore[arg-type]
                outputs = self._source.run(sess, batch[0].request, feed)  # type: ignore[arg-type]
            except Exception as exc:
                error = _failure(exc)
                if _lost(error):
                    for t in batch:
                        t.error = error
                    return True
                outputs = None  # rerun each member alone: only the culprit fails
            merged_s = self._clock() - start
            self._count_batch(merged_rows, merged_s, padded=rows - merged_rows)
            parts = (
                split(outputs, requests, rows=rows, copy=False)  # type: ignore[arg-type]
                if outputs is not None
                else None
            )
            if parts is not None and len(batch) > 1:
                parts = self._check_merged(sess, batch, parts, merged_rows, merged_s)
                if parts is None:
                    return False  # each request got its solo outcome
            if parts is not None:
                for t, part in zip(batch, parts, strict=True):
                    t.result, t.to_copy, t.views = part, True, not self._copies
                return False
            if outputs is not None:
                self._split_failed()  # an output's axis 0 did not add up: rerun one by one
        for t in batch:
            start = self._clock()
            try:
                t.result = self._source.run(sess, t.request, None)  # type: ignore[arg-type]
            except Exception as exc:
                t.error = _failure(exc)
                if _lost(t.error):
                    for rest in batch:
                        if rest.result is None and rest.error is None:
                            rest.error = t.error
                    return True
            finally:
                if self.batching is not None:
                    self._count_batch(t.request.rows, self._clock() - start)  # type: ignore[union-attr]
        return False

    def _count_batch(self, rows: int, seconds: float, *, padded: int = 0) -> None:
        with self.cond:
            self._recent.append((rows, seconds))
            counters = self.counters
            counters.batches += 1
            counters.batched_rows += rows
            counters.padded_rows += padded
            counters.max_batch_rows = max(counters.max_batch_rows, rows)

    def _check_merged(
        self, sess: Any, batch: list[Ticket], parts: list[Any], rows: int, merged_s: float
    ) -> list[Any] | None:
        """Check a merged batch against solo runs of its requests where the schedule says so.

        The solo runs are made here, on the batch's session, right after the merged run: the
        batch's callers wait for them (one run for a spot check), and the callers of other
        batches only where they wait for this session. Returns ``parts`` where no check was
        due or every request checked matched its solo run; else None, after giving every
        request its solo outcome (a result, or the error its run alone raised): the
        scheduler then stops merging. Once a check failed, every merged batch still in
        flight is checked in full, so that none of them hands out merged rows.

        The solo runs' times, against the merged run's (``merged_s``), tell whether merging
        pays (:class:`~sharedml.pool._payoff.MergeGain`); while it wants a comparison and no
        check is due, one request picked at random is rerun alone for its time only.
        """
        requests = [t.request for t in batch]
        key = requests[0].key  # type: ignore[union-attr]
        with self.cond:
            leaked = self._leaked
            kind: CheckKind | None = "full" if leaked else self._checks.due(key, rows)
            timing = kind is None and self._gain.wants_comparison(rows)
            spot = self._checks.pick(len(batch)) if kind == "spot" else None
        if kind is None:
            if timing:  # any request times as well: the leader's own
                self._time_alone(sess, batch[0], rows, merged_s)
            return parts
        feeds = [r.feed for r in requests]  # type: ignore[union-attr]
        if not leaked and all(same_feed(feeds[0], f) for f in feeds[1:]):
            with self.cond:
                self._checks.skipped(key, rows)  # proves nothing: the next batch gets it
                timing = self._gain.wants_comparison(rows)
            if timing:
                self._time_alone(sess, batch[0], rows, merged_s)
            return parts
        checked = list(range(len(batch))) if spot is None else [spot]
        start = self._clock()
        outcomes: dict[int, Any] = {}
        solo_s = 0.0
        for i in checked:
            began = self._clock()
            outcomes[i] = self._solo(sess, batch[i])
            solo_s += self._clock() - began
        same = all(
            not isinstance(solo, BaseException) and same_results(parts[i], solo, rtol=self._rtol)
            for i, solo in outcomes.items()
        )
        if not same:  # every caller of this batch gets its solo outcome
            for i, t in enumerate(batch):
                if i not in outcomes:
                    outcomes[i] = self._solo(sess, t)
        elapsed = self._clock() - start
        telling = same and not leaked and tells(feeds, checked)
        with self.cond:
            counters = self.counters
            counters.batch_checks += 1
            counters.check_runs += len(outcomes)
            counters.check_seconds += elapsed
            if not same:
                counters.batch_mismatches += 1
                self._leaked = True
            elif not leaked:
                self._checks.passed(key, rows, telling=telling)
                solo_rows = sum(r.rows for i in checked if (r := requests[i]) is not None)
                self._compared(Comparison(merged_s, rows, solo_s, solo_rows))
        if same:
            return parts
        for i, t in enumerate(batch):
            solo = outcomes[i]
            if isinstance(solo, BaseException):
                t.error = solo
            else:
                t.result, t.to_copy = solo, False
        self._stop_merging(
            "a merged batch gave a caller other values than running its request alone (its "
            "outputs depend on other callers' rows)"
        )
        return None

    def _time_alone(self, sess: Any, ticket: Ticket, rows: int, merged_s: float) -> None:
        """Rerun one request of a merged batch alone, for its time only.

        Its result stays the merged one; the time is a comparison for
        :class:`~sharedml.pool._payoff.MergeGain`.
        """
        start = self._clock()
        outcome = self._solo(sess, ticket)
        elapsed = self._clock() - start
        with self.cond:
            self.counters.gain_runs += 1
            self.counters.gain_seconds += elapsed
            if not isinstance(outcome, BaseException):
                solo_rows = ticket.request.rows  # type: ignore[union-attr]
                self._compared(Comparison(merged_s, rows, elapsed, solo_rows))

    def _compared(self, comparison: Comparison) -> None:
        """Record a comparison (``self.cond`` held); say so where merging paused or resumed."""
        self._changed(self._gain.add(comparison))

    def _changed(self, change: str | None) -> None:
        """Say why merging paused or resumed, where it did (``self.cond`` held)."""
        if change is not None:
            base = self._base_reason.rstrip(".")
            self.batching_reason = f"{base}; {change}" if base else change
            _log.info("sharedml: model '%s': %s", self._name, change)

    def _solo(self, sess: Any, ticket: Ticket) -> Any:
        """``ticket``'s request run alone on ``sess``: its outputs, or the error it raised."""
        try:
            return self._source.run(sess, ticket.request, None)  # type: ignore[arg-type]
        except Exception as exc:
            return _failure(exc)

    def _split_failed(self) -> None:
        with self.cond:
            self.counters.split_failures += 1
            failures = self.counters.split_failures
        if failures >= _SPLIT_FAILURES_TO_STOP:
            self._stop_merging(
                f"{failures} merged runs returned outputs whose axis 0 is not the "
                "merged row count, so their rows cannot be told apart"
            )

    def _stop_merging(self, why: str) -> None:
        if self.batching is None:
            return
        self.batching = None
        self.batching_reason = f"stopped merging requests: {why}"
        warnings.warn(
            f"sharedml: model '{self._name}': {why}. The pool stops merging requests "
            "(each runs alone).",
            RuntimeWarning,
            stacklevel=3,
        )

    def _finish(
        self,
        ticket: Ticket,
        *,
        error: BaseException | None = None,
        into: list[Ticket] | None = None,
    ) -> None:
        """Settle a follower (or a waiter given up on): its result or error is final.

        A ``run_async`` caller goes into ``into`` where given (see :meth:`Ticket.settle`).
        """
        if error is not None:
            ticket.error = error
        ticket.done = True
        if ticket.future is not None:
            ticket.settle(into)
        else:
            ticket.event.set()

    # ----------------------------------------------------------------------------------------
    # Counters and lifecycle

    def stats(self) -> PoolStats:
        """A snapshot of the counters (``SessionPool.stats``)."""
        with self.cond:
            return PoolStats(
                sessions=self.sessions,
                busy=self._busy - self._extra(),
                waiting=len(self._queue),
                max_sessions=self._max,
                batching=self.batching is not None and self._gain.state is not MergeState.PAUSED,
                merge_gain=self._gain.gain,
                merge_comparisons=self._gain.comparisons,
                merge_pauses=self._gain.pauses,
                merge_trials=self._gain.trials,
                **self.counters.published(),
            )

    def close(self, timeout_s: float | None, *, deadline: float | None) -> None:
        """Refuse new work, fail the waiters with ``PoolClosedError``, wait for runs in flight.

        Args:
            timeout_s: As the caller gave it (for the message).
            deadline: ``time.monotonic()`` by which runs must have finished; None: no limit.

        Raises:
            PoolTimeout: runs still in flight at ``deadline`` (closed to new work all the
                same; call again to wait more).
        """
        with self.cond:
            self._open = False
            waiting, self._queue = list(self._queue), deque()
            for ticket in waiting:
                self._finish(ticket, error=closed_error())
            self.cond.notify_all()
            while self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise PoolTimeout(
                        f"{self._busy} run(s) still in flight after {timeout_s} s; the pool is "
                        "closing and accepts no new work."
                    )
                self.cond.wait(remaining)

    def drain(self) -> None:
        """After :meth:`close`: let every idle session go, and stop the executor."""
        with self.cond:
            dropped, self._idle = list(self._idle), deque()
            self._count = 0
            self._creation_error = None
            executor, self._executor = self._executor, None
        for sess in dropped:
            self._source.discard(sess)
        if executor is not None:
            executor.shutdown(wait=True)
