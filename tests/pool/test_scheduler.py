"""The scheduler on its own: fake sessions, no ONNX Runtime, properties that hold under load.

A fake session computes ``2 * x + 1`` row by row and records the rows of every feed it runs,
so a caller that got another caller's rows, or a batch over the limit, shows at once. Its runs
take no real time but advance a fake clock that the scheduler times runs with (its
``run_clock``): by ``cost(rows)`` each, a constant by default (merging pays, as on a GPU). Batches
that must form are made deterministic by holding the only session with a checkout while
callers queue (polling ``waiting``), as tests/pool/test_batching.py does with a real pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pytest
from _waiting import DEADLINE_S, wait_until

from sharedml import Batching, InvalidInputError, PoolClosedError, RunError, SessionCreationError
from sharedml.pool import _payoff
from sharedml.pool._batching import UNTOLD_GAP, Request
from sharedml.pool._creation import create_with_retries
from sharedml.pool._scheduler import Scheduler

POISON = -1.0  # a row holding this fails any run it is in, as a bad input would


class FakeSessions:
    """A session source whose sessions compute ``2 * x + 1`` (no ORT).

    ``leak_above``: a run whose feed holds a value above it adds the feed's column sums to
    every row (a batch statistic): a model that mixes rows only for some inputs. ``gate``:
    merged runs wait for it (``merged_started`` is set once one does); ``solo_gate``: runs of
    one request wait for it. ``seen`` holds the rows of every run: what ran, and what never
    did; ``most`` the most runs one session had at once.
    """

    def __init__(
        self,
        *,
        fail_merged: bool = False,
        interrupt_merged: bool = False,
        leak_above: float | None = None,
        gate: threading.Event | None = None,
        solo_gate: threading.Event | None = None,
        lose_session_on: float | None = None,
        cost: Callable[[int], float] = lambda rows: 1e-4,
        sleep: bool = False,
        contended: bool = False,
    ) -> None:
        self.cost = cost  # fake seconds a run of that many rows takes
        self.sleep = sleep  # ... and real ones, sleeping
        # ... one run at a time per session, as a session whose threads one run keeps busy
        self.contended = threading.Lock() if contended else None
        self.now = 0.0  # the fake clock: advanced by the runs only
        self.fail_merged = fail_merged
        self.lose_session_on = lose_session_on  # a run holding this value loses its session
        self.discarded: list[Any] = []
        self.interrupt_merged = interrupt_merged
        self.leak_above = leak_above
        self.gate = gate  # merged runs wait for it to be set
        self.solo_gate = solo_gate  # runs of one request wait for it to be set
        self.merged_started = threading.Event()
        self.lock = threading.Lock()
        self.feeds: list[tuple[int, bool]] = []  # (rows, merged) of every run
        self.seen: list[np.ndarray] = []  # the rows of every run
        self.created = 0
        self.running: dict[int, int] = {}  # runs in flight, by session
        self.most = 0  # the most runs one session had at once
        self.overlapped = False  # two runs on one session at once

    def create(self) -> Any:
        with self.lock:
            self.created += 1
            return self.created

    def run(self, session: Any, request: Request, feed: Mapping[str, Any] | None) -> list[Any]:
        x = (feed if feed is not None else request.feed)["x"]
        with self.lock:
            self.overlapped |= session in self.running
            self.running[session] = self.running.get(session, 0) + 1
            self.most = max(self.most, self.running[session])
            self.feeds.append((len(x), feed is not None))
            self.seen.append(x.copy())
            self.now += self.cost(len(x))
        try:
            if self.sleep:
                with self.contended or contextlib.nullcontext():
                    time.sleep(self.cost(len(x)))
            if feed is not None and self.gate is not None:
                self.merged_started.set()
                assert self.gate.wait(DEADLINE_S)
            if feed is not None and self.interrupt_merged:
                raise KeyboardInterrupt
            if feed is not None and self.fail_merged:
                raise RuntimeError("the merged run failed")
            if (x == POISON).any():
                raise InvalidInputError("a row holds the poison value")
            if self.lose_session_on is not None and (x == self.lose_session_on).any():
                raise RunError("the device went away", session_lost=True)
            if feed is None and self.solo_gate is not None:
                assert self.solo_gate.wait(DEADLINE_S)
            if self.leak_above is not None and (x > self.leak_above).any():
                return [x * 2.0 + 1.0 + x.sum(axis=0)]
            return [x * 2.0 + 1.0]
        finally:
            with self.lock:
                self.running[session] -= 1
                if not self.running[session]:
                    del self.running[session]

    def discard(self, session: Any) -> None:
        with self.lock:
            self.discarded.append(session)

    def clock(self) -> float:
        with self.lock:
            return self.now


def request(x: np.ndarray) -> Request:
    return Request(None, {"x": x}, None, len(x), key=("x", x.shape[1:]))


def rows(n: int, first: float) -> np.ndarray:
    """``n`` rows of 3 values, unique to ``first``."""
    return (first + np.arange(n * 3, dtype=np.float64) / 1000).reshape(n, 3)


@pytest.fixture
def make() -> Iterator[Callable[..., tuple[Scheduler, FakeSessions]]]:
    made: list[Scheduler] = []

    def factory(
        sessions: int = 1,
        *,
        batching: Batching | None = None,
        check_seed: int | None = None,
        share_runs: int = 1,
        **fake: Any,
    ) -> tuple[Scheduler, FakeSessions]:
        source = FakeSessions(**fake)
        scheduler = Scheduler(
            source,
            max_sessions=sessions,
            batching=batching,
            check_seed=check_seed,
            run_clock=source.clock,
            share_runs=share_runs,
        )
        scheduler.add_sessions([source.create() for _ in range(sessions)])
        made.append(scheduler)
        return scheduler, source

    yield factory
    for scheduler in made:
        # A deadline: a test that failed holding a session fails here too, instead of hanging.
        scheduler.close(DEADLINE_S, deadline=time.monotonic() + DEADLINE_S)
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


class LoopWakes:
    """Counts the calls that other threads make into an event loop (``call_soon_threadsafe``).

    Each such call writes to the loop's self-pipe and wakes its thread: the hand-over that
    delivering a batch's results costs. Installed on the loop object itself.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.calls = 0
        real = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]


def test_a_batch_of_run_async_callers_wakes_their_loop_once(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    scheduler, source = make(1, batching=Batching(max_batch_size=8, max_delay_ms=0))
    inputs = [rows(1, 10 * i) for i in range(8)]

    async def main() -> None:
        wakes = LoopWakes(asyncio.get_running_loop())
        session = scheduler.checkout(None)
        tasks = callers(scheduler, inputs)
        await until(lambda: scheduler.stats().waiting == 8, "every caller to queue")
        scheduler.checkin(session)
        outs = await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
        for x, out in zip(inputs, outs, strict=True):
            np.testing.assert_array_equal(out[0], x * 2.0 + 1.0)
        assert wakes.calls == 1  # the leader's thread handed the loop the whole batch

    asyncio.run(main())
    assert source.feeds[0] == (8, True) and scheduler.stats().batches == 1  # then its checks


def test_callers_on_two_loops_in_one_batch_each_get_their_rows_one_wake_per_loop(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    scheduler, source = make(1, batching=Batching(max_batch_size=8, max_delay_ms=0))
    inputs = [rows(1, 10 * i) for i in range(8)]
    session = scheduler.checkout(None)
    wakes: list[LoopWakes] = []

    def loop_thread(mine: list[np.ndarray]) -> Any:
        async def main() -> Any:
            wakes.append(LoopWakes(asyncio.get_running_loop()))
            return await asyncio.gather(*(call_async(scheduler, x) for x in mine))

        return asyncio.run(main())

    # Interleaved: the batch alternates between the two loops' callers.
    _, outcomes = start([lambda: loop_thread(inputs[0::2]), lambda: loop_thread(inputs[1::2])])
    wait_until(lambda: scheduler.stats().waiting == 8, what="both loops' callers to queue")
    scheduler.checkin(session)
    wait_until(lambda: len(outcomes) == 2, what="both loops to finish")
    for mine, outs in ((inputs[0::2], outcomes[0]), (inputs[1::2], outcomes[1])):
        assert not isinstance(outs, BaseException), outs
        for x, out in zip(mine, outs, strict=True):
            np.testing.assert_array_equal(out[0], x * 2.0 + 1.0)
    assert source.feeds[0] == (8, True) and scheduler.stats().batches == 1
    assert [w.calls for w in wakes] == [1, 1]


def test_a_loop_closed_while_its_callers_batch_runs_leaves_the_others_their_results(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    # A loop closed without cancelling its caller (a thread whose loop was torn down): the
    # result has nowhere to go and is dropped; the batch's leader, a thread, gets its own.
    gate = threading.Event()
    scheduler, source = make(1, batching=Batching(max_batch_size=8, max_delay_ms=0), gate=gate)
    mine, theirs = rows(1, 10), rows(1, 20)
    session = scheduler.checkout(None)
    _, outcomes = start([lambda: scheduler.run(request(mine))])  # first: it leads the batch
    wait_until(lambda: scheduler.stats().waiting == 1, what="the thread's caller to queue")
    loop = asyncio.new_event_loop()
    task = loop.create_task(scheduler.run_async(request(theirs)))
    loop.run_until_complete(asyncio.sleep(0))  # the task runs up to its wait: queued
    wait_until(lambda: scheduler.stats().waiting == 2, what="the loop's caller to queue")
    scheduler.checkin(session)
    assert source.merged_started.wait(DEADLINE_S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        loop.close()  # the task still waits: it is never resumed
    gate.set()
    wait_until(lambda: 0 in outcomes, what="the thread's run to finish")
    assert not isinstance(outcomes[0], BaseException), outcomes[0]
    np.testing.assert_array_equal(outcomes[0][0], mine * 2.0 + 1.0)
    assert source.feeds[0] == (2, True) and scheduler.stats().batches == 1
    wait_until(lambda: scheduler.stats().busy == 0, what="the session to come back")
    assert not task.done()


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


# --------------------------------------------------------------------------------------------
# Checks of merged batches against solo runs: found within a bound, whatever came first

LEAK = 100.0  # FakeSessions(leak_above=LEAK): rows above it mix with the batch's other rows


def merged_batch(scheduler: Scheduler, inputs: list[np.ndarray]) -> list[Any]:
    """Run ``inputs`` as one merged batch (queued behind a checkout, no threads); results."""
    session = scheduler.checkout(None)
    futures = [scheduler.submit(request(x)) for x in inputs]
    scheduler.checkin(session)
    return [f.result(DEADLINE_S) for f in futures]


def distinct(batch: int, members: int = 2) -> list[np.ndarray]:
    """``members`` requests of one row each, unlike any other batch's and not blank."""
    return [rows(1, 1 + batch + i / 10) for i in range(members)]


# Requests (POISON-free) whose rows add nothing to a batch sum: a leak cannot show through them.
HARMLESS: list[Callable[[int], list[np.ndarray]]] = [
    lambda b: [np.zeros((1, 3)), np.zeros((1, 3)) + 1e-9 * (b + 1)],  # zeros, near-zeros
    lambda b: [np.full((1, 3), b + 1.0), np.full((1, 3), b + 2.0)],  # one value throughout
    lambda b: [np.array([[b + 2.0, -(b + 2.0), 0]]), np.array([[1.0, 2.0, -3.0]])],  # zero sums
    lambda b: [
        np.array([[1.0, 2, 5], [-1, -2, -5]]) * (2 + b / 8),
        np.array([[3.0, 2, 4], [-3, -2, -4]]),
    ],
    lambda b: [  # every position of the sequence the same vector
        np.tile([[[1.0, 2, 3 + b]]], (1, 4, 1)),
        np.tile([[[5.0, b, 6]]], (1, 4, 1)),
    ],
]


@pytest.mark.parametrize("seed", range(12))
def test_a_leak_after_settled_traffic_is_found_within_check_within_batches(
    make: Callable[..., tuple[Scheduler, FakeSessions]], seed: int
) -> None:
    # 40 batches that cannot leak settle the class (checks spread out to gaps of up to 8);
    # then every batch leaks, and a check must come within 8 of them.
    batching = Batching(max_batch_size=2, max_delay_ms=0, check_within=8)
    scheduler, _ = make(1, batching=batching, check_seed=seed, leak_above=LEAK)
    for b in range(40):
        merged_batch(scheduler, distinct(b))
    settled = scheduler.stats()
    assert settled.batch_mismatches == 0 and 5 <= settled.batch_checks < 40  # sampled
    for n in range(1, 9):
        inputs = distinct(LEAK + 10 * n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = merged_batch(scheduler, inputs)
        if scheduler.stats().batch_mismatches:
            break
    else:
        pytest.fail("8 leaking batches in a row went unchecked")
    assert any("stops merging" in str(w.message) for w in caught)
    for x, out in zip(inputs, outs, strict=True):  # the batch caught: each caller's solo result
        np.testing.assert_array_equal(out[0], x * 2.0 + 1.0 + x.sum(axis=0))
    assert scheduler.batching is None and not scheduler.stats().batching


@pytest.mark.parametrize("harmless", range(len(HARMLESS)))
@pytest.mark.parametrize("seed", range(6))
def test_priming_with_harmless_rows_buys_no_gaps_between_checks(
    make: Callable[..., tuple[Scheduler, FakeSessions]], harmless: int, seed: int
) -> None:
    # Batches whose rows could not show a leak (zeros, one value, zero sums, one vector at every
    # position) are checked but prove nothing: however many passed, the class is checked at
    # least every UNTOLD_GAP batches, so the leak that follows is found within that many.
    shapes = [x.shape for x in HARMLESS[harmless](0)]
    batching = Batching(max_batch_size=2 * shapes[0][0], max_delay_ms=0)  # check_within: 64
    scheduler, _ = make(1, batching=batching, check_seed=seed, leak_above=LEAK)
    for b in range(30):
        merged_batch(scheduler, HARMLESS[harmless](b))
    assert scheduler.stats().batch_checks >= 30 // UNTOLD_GAP
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the leaders' threads warn: recorded, not raised
        for n in range(1, UNTOLD_GAP + 1):
            leaking = [  # the same class: the same shapes
                np.arange(np.prod(shape)).reshape(shape) / 10 + (LEAK if i == 0 else 7) + n
                for i, shape in enumerate(shapes)
            ]
            merged_batch(scheduler, leaking)
            if scheduler.stats().batch_mismatches:
                break
        else:
            pytest.fail(f"{UNTOLD_GAP} leaking batches after harmless ones went unchecked")
    assert any("stops merging" in str(w.message) for w in caught)


def test_the_first_batch_of_every_class_is_checked_in_full(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    batching = Batching(max_batch_size=8, max_delay_ms=0, check_within=None)
    scheduler, source = make(1, batching=batching, check_seed=0)
    merged_batch(scheduler, distinct(0))
    for b in range(1, 10):  # settled: check_within=None checks no more
        merged_batch(scheduler, distinct(b))
    assert (scheduler.stats().batch_checks, scheduler.stats().check_runs) == (1, 2)
    # A new row bucket (4 rows), a new non-batch shape, new output names: each checked at once.
    merged_batch(scheduler, distinct(20, members=4))
    merged_batch(scheduler, [rows(1, 30)[:, :2], rows(1, 31)[:, :2]])
    session = scheduler.checkout(None)
    futures = [
        scheduler.submit(Request(("y",), {"x": x}, None, 1, key=(("x", (3,)), ("y",))))
        for x in distinct(40)
    ]
    scheduler.checkin(session)
    [f.result(DEADLINE_S) for f in futures]
    stats = scheduler.stats()
    assert (stats.batch_checks, stats.check_runs) == (4, 2 + 4 + 2 + 2)  # full: every request
    # Every other run: the 13 merged ones, and those that timed merging against solo runs.
    assert stats.batch_mismatches == 0
    assert len(source.feeds) == 13 + stats.check_runs + stats.gain_runs


def test_equal_requests_are_not_checked_and_the_next_different_batch_is(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    scheduler, _ = make(1, batching=Batching(max_batch_size=2, max_delay_ms=0), check_seed=0)
    x = rows(1, 5)
    for _ in range(5):
        merged_batch(scheduler, [x, x.copy()])
    assert scheduler.stats().batch_checks == 0
    merged_batch(scheduler, distinct(1))
    assert scheduler.stats().batch_checks == 1


def test_a_spot_check_reruns_one_request_and_a_failed_one_gives_every_caller_its_solo_result(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    batching = Batching(max_batch_size=4, max_delay_ms=0, check_within=1)  # every batch
    scheduler, _ = make(1, batching=batching, check_seed=3, leak_above=LEAK)
    for b in range(4):
        merged_batch(scheduler, distinct(b, members=4))
    stats = scheduler.stats()
    assert (stats.batch_checks, stats.check_runs) == (4, 4 + 3)  # one full, then spot checks
    inputs = [rows(1, 1), rows(1, LEAK + 1), rows(1, 2), rows(1, 3)]
    with pytest.warns(RuntimeWarning, match="other values than running its request alone"):
        outs = merged_batch(scheduler, inputs)
    for x, out in zip(inputs, outs, strict=True):
        solo = x * 2.0 + 1.0 + (x.sum(axis=0) if (x > LEAK).any() else 0)
        np.testing.assert_array_equal(out[0], solo)
    stats = scheduler.stats()
    assert (stats.batch_checks, stats.batch_mismatches, stats.check_runs) == (5, 1, 7 + 4)
    assert stats.check_seconds > 0 and scheduler.batching is None
    assert stats.busy == 0 and stats.waiting == 0


# --------------------------------------------------------------------------------------------
# Callers that leave: a cancelled run_async leaves its batch, and never runs unless it started


async def until(predicate: Callable[[], bool], what: str) -> None:
    """``wait_until`` for a coroutine: polls without blocking the event loop."""
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {DEADLINE_S} s waiting for {what}")
        await asyncio.sleep(0.001)


# How an async caller queues: ``run_async`` (a future of the caller's loop, as
# ``SessionPool.run_async`` uses) or ``submit`` (a thread-safe future, awaited wrapped).
FLAVOURS = ["run_async", "submit"]


def call_async(scheduler: Scheduler, x: np.ndarray, flavour: str = "run_async") -> Any:
    """An awaitable of ``x``'s run, queued the ``flavour`` way (see ``FLAVOURS``)."""
    if flavour == "submit":
        return asyncio.wrap_future(scheduler.submit(request(x)))
    return scheduler.run_async(request(x))


def callers(
    scheduler: Scheduler, inputs: list[np.ndarray], flavour: str = "run_async"
) -> list[asyncio.Task[Any]]:
    """An asyncio task per input that meets the others on a barrier, then runs it."""
    barrier = asyncio.Barrier(len(inputs))

    async def call(x: np.ndarray) -> Any:
        await barrier.wait()
        return await call_async(scheduler, x, flavour)

    return [asyncio.ensure_future(call(x)) for x in inputs]


def ran(source: FakeSessions, x: np.ndarray) -> bool:
    """Whether any run saw a row of ``x``."""
    return any(np.isin(x[:, 0], seen[:, 0]).any() for seen in source.seen)


async def settled_and_free(
    scheduler: Scheduler, tasks: list[asyncio.Task[Any]], inputs: list[np.ndarray], gone: set[int]
) -> None:
    """Every task left in ``tasks`` got its own rows; the gone ones were cancelled; no slot is
    held, nobody waits; and the scheduler still merges a batch afterwards."""
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), DEADLINE_S)
    for i, (x, outcome) in enumerate(zip(inputs, outcomes, strict=True)):
        if i in gone:
            assert isinstance(outcome, asyncio.CancelledError), (i, outcome)
        else:
            assert not isinstance(outcome, BaseException), (i, outcome)
            np.testing.assert_array_equal(outcome[0], x * 2.0 + 1.0)
    await until(lambda: scheduler.stats().busy == 0, "the session to come back")
    stats = scheduler.stats()
    assert (stats.busy, stats.waiting, stats.failed_runs) == (0, 0, 0)
    later = [rows(1, 900 + i) for i in range(4)]  # fills a batch: no delay waits for more
    session = scheduler.checkout(None)
    futures = [asyncio.ensure_future(call_async(scheduler, x)) for x in later]
    await until(lambda: scheduler.stats().waiting == 4, "the later requests to queue")
    scheduler.checkin(session)
    batches = scheduler.stats().batches
    for x, out in zip(later, await asyncio.gather(*futures), strict=True):
        np.testing.assert_array_equal(out[0], x * 2.0 + 1.0)
    assert scheduler.stats().batches == batches + 1  # one merged batch


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_callers_cancelled_while_queued_leave_the_queue_and_never_run(
    make: Callable[..., tuple[Scheduler, FakeSessions]], flavour: str
) -> None:
    scheduler, source = make(1, batching=Batching(max_batch_size=8, max_delay_ms=0))
    inputs = [rows(1, 10 * i) for i in range(6)]
    gone = {1, 4}

    async def main() -> None:
        session = scheduler.checkout(None)
        tasks = callers(scheduler, inputs, flavour)
        await until(lambda: scheduler.stats().waiting == 6, "every caller to queue")
        for i in gone:
            tasks[i].cancel()
        await until(lambda: scheduler.stats().waiting == 4, "the cancelled to leave the queue")
        scheduler.checkin(session)
        await settled_and_free(scheduler, tasks, inputs, gone)

    asyncio.run(main())
    assert not any(ran(source, inputs[i]) for i in gone)
    assert all(ran(source, inputs[i]) for i in range(6) if i not in gone)
    assert scheduler.stats().cancelled == 2


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("who", ["leader", "follower"])
def test_a_caller_cancelled_while_its_batch_forms_leaves_it_and_never_runs(
    make: Callable[..., tuple[Scheduler, FakeSessions]], who: str, flavour: str
) -> None:
    # The leader waits (a long delay) for 4 rows; it took the second caller's already. One of
    # the two is cancelled; then two more arrive, the batch starts, and runs without it.
    batching = Batching(max_batch_size=4, max_delay_ms=DEADLINE_S * 1000)
    scheduler, source = make(1, batching=batching)
    inputs = [rows(1, 10 * i) for i in range(4)]
    gone = {0 if who == "leader" else 1}

    async def main() -> None:
        session = scheduler.checkout(None)
        tasks = callers(scheduler, inputs[:2], flavour)
        await until(lambda: scheduler.stats().waiting == 2, "two callers to queue")
        scheduler.checkin(session)
        await until(
            lambda: (scheduler.stats().waiting, scheduler.stats().busy) == (0, 1),
            "the leader to take the second caller into its batch",
        )
        for i in gone:
            tasks[i].cancel()
        await until(lambda: all(tasks[i].done() for i in gone), "the cancel to land")
        tasks += callers(scheduler, inputs[2:], flavour)
        await settled_and_free(scheduler, tasks, inputs, gone)

    asyncio.run(main())
    assert not any(ran(source, inputs[i]) for i in gone)
    assert source.feeds[0] == (3, True)  # the batch ran the three callers left
    assert scheduler.stats().cancelled == 1


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_caller_cancelled_while_its_batch_runs_leaves_the_others_their_results(
    make: Callable[..., tuple[Scheduler, FakeSessions]], flavour: str
) -> None:
    gate = threading.Event()
    scheduler, source = make(1, batching=Batching(max_batch_size=8, max_delay_ms=0), gate=gate)
    inputs = [rows(1, 10 * i) for i in range(4)]
    gone = {0, 2}  # the leader and a follower

    async def main() -> None:
        session = scheduler.checkout(None)
        tasks = callers(scheduler, inputs, flavour)
        await until(lambda: scheduler.stats().waiting == 4, "every caller to queue")
        scheduler.checkin(session)
        await until(source.merged_started.is_set, "the merged run to start")
        for i in gone:
            tasks[i].cancel()
        await until(lambda: all(tasks[i].done() for i in gone), "the cancel to land")
        gate.set()
        await settled_and_free(scheduler, tasks, inputs, gone)

    asyncio.run(main())
    assert source.feeds[0] == (4, True)  # it had started: it ran, the results were dropped
    assert scheduler.stats().cancelled == 0


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs pthread_kill")
def test_a_caller_interrupted_while_a_forming_batch_holds_its_request_leaves_it(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
    sigint_raises: None,
) -> None:
    # An async leader waits (a long delay) for 3 rows and takes the main thread's request;
    # Ctrl-C reaches the main thread while it waits: its request must not run. The next
    # request fills the batch (3 rows counted), which runs the two requests left.
    batching = Batching(max_batch_size=3, max_delay_ms=DEADLINE_S * 1000)
    scheduler, source = make(1, batching=batching)
    mine, others = rows(1, 5), [rows(1, 10), rows(1, 20)]
    session = scheduler.checkout(None)
    first = scheduler.submit(request(others[0]))
    scheduler.checkin(session)
    wait_until(lambda: scheduler.stats().busy == 1, what="the async leader to fill")

    def interrupt_when_taken() -> None:
        wait_until(
            lambda: (scheduler.stats().waits, scheduler.stats().waiting) == (2, 0),
            what="the leader to take the main thread's request",
        )
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]

    interrupter = threading.Thread(target=interrupt_when_taken)
    interrupter.start()
    with pytest.raises(KeyboardInterrupt):
        scheduler.run(request(mine))
    interrupter.join(DEADLINE_S)
    rest = [scheduler.submit(request(x)) for x in others[1:]]
    for x, future in zip(others, [first, *rest], strict=True):
        np.testing.assert_array_equal(future.result(DEADLINE_S)[0], x * 2.0 + 1.0)
    assert not ran(source, mine)
    assert source.feeds == [(2, True), (1, False), (1, False)]  # without it; checked in full
    wait_until(lambda: scheduler.stats().busy == 0, what="the session to come back")
    stats = scheduler.stats()
    assert (stats.cancelled, stats.waiting, stats.failed_runs) == (1, 0, 0)


def test_a_run_that_loses_its_session_fails_and_the_session_is_replaced(make: Any) -> None:
    scheduler, source = make(sessions=1, lose_session_on=13.0)
    with pytest.raises(RunError, match="device went away"):
        scheduler.run(request(np.full((1, 3), 13.0)))
    assert source.discarded == [1]  # the source let the session go
    out = scheduler.run(request(rows(1, 5.0)))  # a new session serves the next caller
    np.testing.assert_array_equal(out[0], rows(1, 5.0) * 2.0 + 1.0)
    assert source.created == 2


# ---------------------------------------------------------------------------------------------
# Whether merging pays: merged Runs timed against solo runs, on the fake clock


def merged_runs(source: FakeSessions) -> int:
    with source.lock:
        return sum(merged for _rows, merged in source.feeds)


def test_merging_pauses_where_a_batch_costs_what_its_rows_cost_alone(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    # Convolutions on a few cores: n rows in one Run take n single rows' time. Merging then
    # only adds its own costs, so the pool measures it and stops waiting for rows.
    batching = Batching(max_batch_size=8, max_delay_ms=0)
    scheduler, source = make(1, batching=batching, cost=lambda rows: 1e-3 * rows)
    for b in range(_payoff.WARM_RUNS + _payoff.SAMPLES):  # a shape's first Runs do not count
        merged_batch(scheduler, distinct(b, members=4))
    stats = scheduler.stats()
    assert stats.merge_pauses == 1 and not stats.batching
    assert stats.merge_gain == pytest.approx(1.0)
    assert stats.merge_comparisons == _payoff.SAMPLES
    assert "merging paused: merged batches of 4.0 rows" in scheduler.batching_reason
    assert "1.00x the rows/s" in scheduler.batching_reason
    # From now on queued requests run one by one, each alone, and still get their own rows.
    before = merged_runs(source)
    inputs = distinct(100, members=4)
    outs = merged_batch(scheduler, inputs)
    assert merged_runs(source) == before
    for x, out in zip(inputs, outs, strict=True):
        np.testing.assert_array_equal(out[0], x * 2.0 + 1.0)


def test_merging_goes_on_where_a_batch_costs_little_more_than_a_row(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    # A MatMul-bound model: the weights are read once for all the rows of a batch.
    batching = Batching(max_batch_size=8, max_delay_ms=0)
    scheduler, source = make(1, batching=batching, cost=lambda rows: 1e-3 + 1e-5 * rows)
    for b in range(3 * _payoff.SAMPLES):
        merged_batch(scheduler, distinct(b, members=4))
    assert merged_runs(source) == 3 * _payoff.SAMPLES
    stats = scheduler.stats()
    assert stats.merge_pauses == 0 and stats.batching
    assert stats.merge_gain is not None and stats.merge_gain > 3
    # Once decided, no more solo runs for timing: only the checks' (spread out) give samples.
    assert stats.gain_runs < _payoff.SAMPLES
    assert "paused" not in scheduler.batching_reason


def test_a_paused_pool_measures_again_later_and_resumes_only_past_the_hysteresis(
    make: Callable[..., tuple[Scheduler, FakeSessions]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_payoff, "FIRST_RETRY_RUNS", 8)
    per_row = [1e-3]  # the traffic changes: rows get cheaper once the pool has paused

    def cost(rows: int) -> float:
        return 1e-3 + per_row[0] * (rows - 1)

    batching = Batching(max_batch_size=8, max_delay_ms=0, check_within=None)
    scheduler, source = make(1, batching=batching, cost=cost)
    for b in range(_payoff.WARM_RUNS + _payoff.SAMPLES):
        merged_batch(scheduler, distinct(b, members=4))
    assert scheduler.stats().merge_pauses == 1
    # A gain between the thresholds (1.23x: above PAUSE_BELOW, under RESUME_AT) found by the
    # retry does not resume merging: the pool pauses again, and waits twice as long.
    per_row[0] = 0.75e-3
    assert _payoff.PAUSE_BELOW < 4 / (1 + 3 * 0.75) < _payoff.RESUME_AT
    b = 100
    while scheduler.stats().merge_pauses < 2:
        merged_batch(scheduler, distinct(b, members=4))
        b += 1
        assert b < 100 + 8 * (8 + _payoff.SAMPLES), "the paused pool never measured again"
    assert not scheduler.stats().batching
    # Rows as cheap as on a GPU: the next retry resumes merging, and says why.
    per_row[0] = 1e-5
    assert "short of the 1.3x that resumes it" in scheduler.batching_reason
    while scheduler.batching_reason.startswith("merging paused"):
        merged_batch(scheduler, distinct(b, members=4))
        b += 1
        assert b < 200 + 16 * (16 + _payoff.SAMPLES), "merging never resumed"
    assert scheduler.batching_reason.startswith("merging again: merged batches of 4.0 rows")
    assert scheduler.stats().batching and scheduler.stats().merge_pauses == 2
    before = merged_runs(source)
    merged_batch(scheduler, distinct(1000, members=4))
    assert merged_runs(source) == before + 1


def test_runs_too_short_to_time_keep_merging_and_stop_the_timing_runs(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    # A Run of microseconds times the threads around it more than the model; merging then saves
    # the pool's own per-request work. Such comparisons do not pause, and after SAMPLES of them
    # no more solo runs are made to time merging.
    batching = Batching(max_batch_size=8, max_delay_ms=0, check_within=None)
    short = _payoff.MIN_RUN_S / 10
    scheduler, source = make(1, batching=batching, cost=lambda rows: short * rows)
    for b in range(_payoff.WARM_RUNS + 3 * _payoff.SAMPLES):
        merged_batch(scheduler, distinct(b, members=4))
    stats = scheduler.stats()
    assert stats.batching and stats.merge_pauses == 0 and stats.merge_gain is None
    assert stats.gain_runs <= _payoff.WARM_RUNS + _payoff.SAMPLES
    assert merged_runs(source) == _payoff.WARM_RUNS + 3 * _payoff.SAMPLES


def test_measure_gain_false_keeps_merging_whatever_the_gain(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    batching = Batching(max_batch_size=8, max_delay_ms=0, measure_gain=False)
    scheduler, source = make(1, batching=batching, cost=lambda rows: 1e-3 * rows)
    for b in range(2 * _payoff.SAMPLES):
        merged_batch(scheduler, distinct(b, members=4))
    stats = scheduler.stats()
    assert stats.batching and stats.merge_pauses == 0 and stats.gain_runs == 0
    assert merged_runs(source) == 2 * _payoff.SAMPLES


# ---------------------------------------------------------------------------------------------
# Side by side: where merging does not pay, a session whose Run is thread-safe runs requests
# at once (each its own Run), up to share_runs


def paused(
    make: Callable[..., tuple[Scheduler, FakeSessions]], gate: threading.Event, **kwargs: Any
) -> Any:
    """A scheduler of one session whose merging measured not to pay (n rows cost n rows);
    from now on its runs of one request wait for ``gate``."""
    batching = Batching(max_batch_size=8, max_delay_ms=0)
    scheduler, source = make(
        1, batching=batching, cost=lambda rows: 1e-3 * rows, solo_gate=gate, **kwargs
    )
    gate.set()  # open while the checks' solo runs measure
    for b in range(_payoff.WARM_RUNS + _payoff.SAMPLES):
        merged_batch(scheduler, distinct(b, members=4))
    assert not scheduler.stats().batching
    gate.clear()
    return scheduler, source


def in_flight(source: FakeSessions) -> int:
    with source.lock:
        return sum(source.running.values())


@pytest.mark.parametrize("share_runs", [2, 3])
def test_a_paused_pool_runs_requests_side_by_side_up_to_its_share(
    make: Callable[..., tuple[Scheduler, FakeSessions]], share_runs: int
) -> None:
    gate = threading.Event()
    scheduler, source = paused(make, gate, share_runs=share_runs)
    assert f"side by side, each its own Run, up to {share_runs}" in scheduler.batching_reason
    inputs = distinct(50, members=5)
    threads, outcomes = start([lambda x=x: scheduler.run(request(x)) for x in inputs])
    wait_until(lambda: in_flight(source) == share_runs, what="runs side by side")
    wait_until(lambda: scheduler.stats().waiting == 5 - share_runs, what="the rest to queue")
    stats = scheduler.stats()
    assert (stats.sessions, stats.busy) == (1, 1)  # one session, busy: not one per run
    gate.set()
    for thread in threads:
        thread.join(DEADLINE_S)
    for i, x in enumerate(inputs):
        np.testing.assert_array_equal(outcomes[i][0], x * 2.0 + 1.0)
    assert source.most == share_runs  # never more at once than the share
    assert source.created == 1 and scheduler.stats().busy == 0


def test_a_pool_that_merges_runs_one_request_or_batch_at_a_time(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    # Merging pays here: leaders hold their session alone, whatever the share.
    batching = Batching(max_batch_size=8, max_delay_ms=0)
    scheduler, source = make(
        1, batching=batching, cost=lambda rows: 1e-3 + 1e-5 * rows, share_runs=4
    )
    for b in range(3 * _payoff.SAMPLES):
        merged_batch(scheduler, distinct(b, members=4))
    threads, outcomes = start(
        [lambda b=b: merged_batch(scheduler, distinct(100 + b)) for b in range(4)]
    )
    for thread in threads:
        thread.join(DEADLINE_S)
    assert len(outcomes) == 4 and scheduler.stats().batching
    assert not source.overlapped


def test_a_checkout_waits_for_the_runs_side_by_side_and_then_has_the_session_alone(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    gate = threading.Event()
    scheduler, source = paused(make, gate, share_runs=4)
    first = [scheduler.submit(request(x)) for x in distinct(60, members=2)]
    wait_until(lambda: in_flight(source) == 2, what="two runs side by side")
    checked_out: list[Any] = []
    holder = threading.Thread(target=lambda: checked_out.append(scheduler.checkout(DEADLINE_S)))
    holder.start()
    wait_until(lambda: scheduler.stats().waiting == 1, what="the checkout to queue")
    later = scheduler.submit(request(rows(1, 70.0)))  # behind the checkout: no place beside
    assert scheduler.stats().waiting == 2 and in_flight(source) == 2
    gate.set()
    holder.join(DEADLINE_S)
    assert checked_out == [1]
    for future in first:
        future.result(DEADLINE_S)
    # The session is the checkout's alone: the run queued behind it waits for the checkin.
    assert scheduler.stats().waiting == 1 and not later.done()
    scheduler.checkin(checked_out[0])
    np.testing.assert_array_equal(later.result(DEADLINE_S)[0], rows(1, 70.0) * 2.0 + 1.0)


def test_a_session_lost_beside_other_runs_takes_no_more_and_is_let_go_once_they_end(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    gate = threading.Event()  # holds the run that keeps going; the lost one fails at once
    scheduler, source = paused(make, gate, share_runs=4, lose_session_on=13.0)
    kept = scheduler.submit(request(rows(1, 80.0)))
    wait_until(lambda: in_flight(source) == 1, what="a run on the session")
    with pytest.raises(RunError, match="device went away"):
        scheduler.submit(request(np.full((1, 3), 13.0))).result(DEADLINE_S)
    later = scheduler.submit(request(rows(1, 90.0)))
    assert scheduler.stats().waiting == 1  # not beside the run still on the lost session
    assert source.discarded == []  # that run still uses it
    gate.set()
    np.testing.assert_array_equal(kept.result(DEADLINE_S)[0], rows(1, 80.0) * 2.0 + 1.0)
    np.testing.assert_array_equal(later.result(DEADLINE_S)[0], rows(1, 90.0) * 2.0 + 1.0)
    assert source.discarded == [1]  # once, after the last run on it ended
    assert source.created == 2 and scheduler.stats().sessions == 1


def callers_until(scheduler: Scheduler, done: Callable[[], bool], n: int = 4) -> int:
    """``n`` callers of one row each run in a loop until ``done()``; the requests they made."""
    made = [0] * n
    stop = threading.Event()

    def caller(i: int) -> None:
        while not stop.is_set():
            x = rows(1, 1000 * i + made[i])
            np.testing.assert_array_equal(scheduler.run(request(x))[0], x * 2.0 + 1.0)
            made[i] += 1

    threads, outcomes = start([lambda i=i: caller(i) for i in range(n)])
    try:
        wait_until(done, what="the pool to decide")
    finally:
        stop.set()
        for thread in threads:
            thread.join(DEADLINE_S)
    assert not any(isinstance(o, BaseException) for o in outcomes.values()), outcomes
    return sum(made)


def sleeping(make: Callable[..., tuple[Scheduler, FakeSessions]], **fake: Any) -> Any:
    """One session whose runs sleep: a merged Run of n rows costs less than n solo Runs."""
    return make(
        1,
        batching=Batching(max_batch_size=8),
        cost=lambda rows: 4e-3 + 1e-3 * (rows - 1),
        sleep=True,
        share_runs=4,
        **fake,
    )


def test_merging_that_beats_solo_runs_pauses_where_requests_side_by_side_serve_faster(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    # A merged Run of n rows costs less than n solo Runs (merging "pays" against them), but
    # requests run at once on the session overlap: the trial finds that and pauses merging.
    scheduler, source = sleeping(make)
    callers_until(scheduler, lambda: scheduler.stats().merge_pauses == 1)
    reason = scheduler.batching_reason
    assert "merging paused: requests run side by side got their results in" in reason
    stats = scheduler.stats()
    assert stats.merge_gain is not None and stats.merge_gain > _payoff.PAUSE_BELOW
    assert source.most > 1 and not stats.batching


def test_merging_goes_on_where_requests_side_by_side_serve_no_faster(
    make: Callable[..., tuple[Scheduler, FakeSessions]],
) -> None:
    # The same costs, but runs on one session do not overlap (its threads are all busy).
    scheduler, source = sleeping(make, contended=True)
    after_trial: list[int] = []

    def merging_again() -> bool:
        # The trial's side phase ran (runs overlapped); then merged batches again, and more.
        if source.most > 1 and not after_trial:
            after_trial.append(merged_runs(source))
        return bool(after_trial) and merged_runs(source) >= after_trial[0] + 2 * _payoff.SAMPLES

    callers_until(scheduler, merging_again)
    stats = scheduler.stats()
    assert stats.batching and stats.merge_pauses == 0, scheduler.batching_reason
