"""The scheduler on its own: fake sessions, no ONNX Runtime, properties that hold under load.

A fake session computes ``2 * x + 1`` row by row and records the rows of every feed it runs,
so a caller that got another caller's rows, or a batch over the limit, shows at once. Batches
that must form are made deterministic by holding the only session with a checkout while
callers queue (polling ``waiting``), as tests/pool/test_batching.py does with a real pool.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from _waiting import DEADLINE_S, wait_until

from sharedml import Batching, InvalidInputError, PoolClosedError, SessionCreationError
from sharedml.pool._batching import Request
from sharedml.pool._creation import create_with_retries
from sharedml.pool._scheduler import Scheduler

POISON = -1.0  # a row holding this fails any run it is in, as a bad input would


class FakeSessions:
    """A session source whose sessions compute ``2 * x + 1`` (no ORT)."""

    def __init__(self, *, fail_merged: bool = False, interrupt_merged: bool = False) -> None:
        self.fail_merged = fail_merged
        self.interrupt_merged = interrupt_merged
        self.lock = threading.Lock()
        self.feeds: list[tuple[int, bool]] = []  # (rows, merged) of every run
        self.created = 0
        self.running: set[int] = set()
        self.overlapped = False  # two runs on one session at once

    def create(self) -> Any:
        with self.lock:
            self.created += 1
            return self.created

    def run(self, session: Any, request: Request, feed: Mapping[str, Any] | None) -> list[Any]:
        x = (feed if feed is not None else request.feed)["x"]
        with self.lock:
            self.overlapped |= session in self.running
            self.running.add(session)
            self.feeds.append((len(x), feed is not None))
        try:
            if feed is not None and self.interrupt_merged:
                raise KeyboardInterrupt
            if feed is not None and self.fail_merged:
                raise RuntimeError("the merged run failed")
            if (x == POISON).any():
                raise ValueError("a row holds the poison value")
            return [x * 2.0 + 1.0]
        finally:
            with self.lock:
                self.running.discard(session)

    def discard(self, session: Any) -> None:
        pass


def request(x: np.ndarray) -> Request:
    return Request(None, {"x": x}, None, len(x), key=("x", x.shape[1:]))


def rows(n: int, first: float) -> np.ndarray:
    """``n`` rows of 3 values, unique to ``first``."""
    return (first + np.arange(n * 3, dtype=np.float64) / 1000).reshape(n, 3)


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[Scheduler, FakeSessions]]]:
    made: list[Scheduler] = []

    def factory(
        sessions: int = 1, *, batching: Batching | None = None, **fake: bool
    ) -> tuple[Scheduler, FakeSessions]:
        source = FakeSessions(**fake)
        scheduler = Scheduler(source, max_sessions=sessions, batching=batching)
        scheduler.add_sessions([source.create() for _ in range(sessions)])
        made.append(scheduler)
        return scheduler, source

    yield factory
    for scheduler in made:
        scheduler.close(None, deadline=None)
        scheduler.drain()


def start(calls: list[Callable[[], Any]]) -> tuple[list[threading.Thread], dict[int, Any]]:
    """Run ``calls`` on daemon threads that start together; their results or errors by index."""
    outcomes: dict[int, Any] = {}
    barrier = threading.Barrier(len(calls))

    def body(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = calls[i]()
        except BaseException as exc:
            outcomes[i] = exc

    # Daemon threads: broken code leaves them waiting for ever, and the test fails instead.
    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    return threads, outcomes


def queue_behind_a_checkout(scheduler: Scheduler, calls: list[Callable[[], Any]]) -> dict[int, Any]:
    """Hold the only session, let ``calls`` queue, give it back; their outcomes by index."""
    session = scheduler.checkout(None)
    _, outcomes = start(calls)
    wait_until(lambda: scheduler.stats().waiting == len(calls), what="every call to queue")
    scheduler.checkin(session)
    wait_until(lambda: len(outcomes) == len(calls), what="every call to finish")
    return outcomes


def test_every_caller_gets_exactly_its_own_rows_and_no_batch_exceeds_the_limit(
    make: Callable[..., tuple[Scheduler, FakeSessions]], fast_switching: None
) -> None:
    scheduler, source = make(2, batching=Batching(max_batch_size=5))
    inputs = {(i, j): rows(1 + (i + j) % 3, 100 * i + j) for i in range(12) for j in range(20)}

    def caller(i: int) -> list[bool]:
        return [
            np.array_equal(scheduler.run(request(inputs[i, j]))[0], inputs[i, j] * 2.0 + 1.0)
            for j in range(20)
        ]

    threads, outcomes = start([lambda i=i: caller(i) for i in range(12)])
    for thread in threads:
        thread.join(DEADLINE_S)
    assert outcomes == {i: [True] * 20 for i in range(12)}
    assert max(n for n, _ in source.feeds) <= 5
    assert not source.overlapped
    stats = scheduler.stats()
    assert (stats.runs, stats.failed_runs, stats.busy, stats.waiting) == (240, 0, 0, 0)


def test_queued_requests_merge_oldest_first_up_to_the_limit(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    scheduler, source = make(1, batching=Batching(max_batch_size=4, max_delay_ms=0))
    inputs = [rows(n, 10 * i) for i, n in enumerate([1, 2, 1, 3, 1])]
    outcomes = queue_behind_a_checkout(
        scheduler, [lambda x=x: scheduler.run(request(x)) for x in inputs]
    )
    for i, x in enumerate(inputs):
        np.testing.assert_array_equal(outcomes[i][0], x * 2.0 + 1.0)
    merged = [n for n, was_merged in source.feeds if was_merged]
    assert merged and max(merged) <= 4


def test_a_failing_merged_run_falls_back_to_solo_runs_for_its_callers(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    scheduler, source = make(1, batching=Batching(max_batch_size=8, max_delay_ms=0))
    inputs = [rows(1, 1), rows(1, POISON), rows(2, 3)]
    outcomes = queue_behind_a_checkout(
        scheduler, [lambda x=x: scheduler.run(request(x)) for x in inputs]
    )
    np.testing.assert_array_equal(outcomes[0][0], inputs[0] * 2.0 + 1.0)
    np.testing.assert_array_equal(outcomes[2][0], inputs[2] * 2.0 + 1.0)
    assert isinstance(outcomes[1], InvalidInputError)  # only the culprit fails
    assert source.feeds[0] == (4, True)  # merged first, then each alone in queue order
    assert sorted(source.feeds[1:]) == [(1, False), (1, False), (2, False)]
    assert scheduler.stats().failed_runs == 1


def test_close_wakes_every_waiter_with_pool_closed_error(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    scheduler, _ = make(1, batching=Batching(max_delay_ms=0))
    session = scheduler.checkout(None)
    futures = [scheduler.submit(request(rows(1, i))) for i in range(2)]
    _, outcomes = start(
        [lambda i=i: scheduler.run(request(rows(1, 10 + i))) for i in range(3)]
        + [lambda: scheduler.checkout(None)]
    )
    wait_until(lambda: scheduler.stats().waiting == 6, what="every call to queue")
    closing = threading.Thread(target=scheduler.close, args=(None,), kwargs={"deadline": None})
    closing.start()
    wait_until(lambda: len(outcomes) == 4, what="the waiters to be woken")
    assert all(isinstance(outcome, PoolClosedError) for outcome in outcomes.values())
    assert all(isinstance(f.exception(DEADLINE_S), PoolClosedError) for f in futures)
    assert closing.is_alive()  # it waits for the checkout in flight
    scheduler.checkin(session)
    closing.join(DEADLINE_S)
    assert not closing.is_alive()
    with pytest.raises(PoolClosedError):
        scheduler.run(request(rows(1, 0)))


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_ctrl_c_in_a_leader_filling_its_batch_hands_the_rows_it_took_back(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
    sigint_raises: None,
) -> None:
    # The main thread leads a batch still filling (a long delay) and has taken two callers'
    # rows when Ctrl-C arrives: they go back to the queue, first, and the session with them;
    # the next request then fills a batch with them.
    batching = Batching(max_batch_size=4, max_delay_ms=DEADLINE_S * 1000)
    scheduler, source = make(1, batching=batching)
    inputs = [rows(1, 1), rows(1, 2), rows(2, 3)]
    started: list[dict[int, Any]] = []

    def interrupt_the_leader() -> None:
        wait_until(lambda: scheduler.stats().busy == 1, what="the main thread to lead")
        started.append(start([lambda x=x: scheduler.run(request(x)) for x in inputs[:2]])[1])
        wait_until(
            lambda: (scheduler.stats().waits, scheduler.stats().waiting) == (2, 0),
            what="the leader to take both requests",
        )
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    interrupter = threading.Thread(target=interrupt_the_leader)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        scheduler.run(request(rows(1, 0)))
    interrupter.join(DEADLINE_S)
    last = scheduler.run(request(inputs[2]))
    outcomes = started[0]
    wait_until(lambda: len(outcomes) == 2, what="the rows taken to run")
    for i, x in enumerate(inputs[:2]):
        np.testing.assert_array_equal(outcomes[i][0], x * 2.0 + 1.0)
    np.testing.assert_array_equal(last[0], inputs[2] * 2.0 + 1.0)
    assert source.feeds[0] == (4, True)  # the rows handed back merged with the next request
    stats = scheduler.stats()
    assert (stats.busy, stats.waiting, stats.runs, stats.failed_runs) == (0, 0, 4, 1)
    assert (stats.batches, stats.batch_checks) == (1, 1)  # then checked against solo runs


def test_a_leader_interrupted_in_its_run_fails_its_followers_and_returns_the_session(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    scheduler, source = make(
        1, batching=Batching(max_batch_size=8, max_delay_ms=0), interrupt_merged=True
    )
    outcomes = queue_behind_a_checkout(
        scheduler, [lambda i=i: scheduler.run(request(rows(1, i))) for i in range(3)]
    )
    assert all(isinstance(outcome, KeyboardInterrupt) for outcome in outcomes.values())
    stats = scheduler.stats()
    assert (stats.busy, stats.sessions, stats.failed_runs) == (0, 1, 3)
    source.interrupt_merged = False
    np.testing.assert_array_equal(scheduler.run(request(rows(1, 5)))[0], rows(1, 5) * 2.0 + 1.0)


class FlakySessions(FakeSessions):
    """Sessions whose creation fails ``failures`` times first."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def create(self) -> Any:
        with self.lock:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("injected creation failure")
        return super().create()


def test_a_failed_creation_gives_its_slot_back() -> None:
    source = FlakySessions(failures=1)
    scheduler = Scheduler(source, max_sessions=1)
    with pytest.raises(RuntimeError, match="injected"):
        scheduler.run(request(rows(1, 0)))
    stats = scheduler.stats()
    assert (stats.sessions, stats.busy, stats.failed_runs) == (0, 0, 0)
    session = scheduler.checkout(timeout_s=DEADLINE_S)  # the slot came back: created now
    scheduler.checkin(session)
    assert scheduler.stats().created == 1
    scheduler.close(None, deadline=None)


def test_background_creation_retries_and_tells_the_waiting_caller_of_a_failure() -> None:
    source = FlakySessions(failures=2)
    scheduler = Scheduler(source, max_sessions=1)
    scheduler.add_sessions([], reserved=1)  # the one session is on its way
    _, outcomes = start([lambda: scheduler.checkout(None)])
    wait_until(lambda: scheduler.stats().waiting == 1, what="the caller to queue")
    create_with_retries(
        1,
        create=scheduler.create_session,
        created=scheduler.add_session,
        failed=lambda error, final: scheduler.creation_failed(error),
        finished=scheduler.unreserve,
        stopping=threading.Event(),
    )
    wait_until(lambda: 0 in outcomes, what="the caller to hear")
    assert isinstance(outcomes[0], SessionCreationError)
    assert "injected creation failure" in str(outcomes[0])
    stats = scheduler.stats()
    assert (stats.creation_failures, stats.created, stats.sessions) == (2, 1, 1)
    scheduler.checkin(scheduler.checkout(timeout_s=DEADLINE_S))  # the retry's session serves
    scheduler.close(None, deadline=None)
