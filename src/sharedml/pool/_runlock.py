"""The fair run locks: one ``Run`` at a time on a device, first come first served.

Where the provider runs one ``Run`` at a time across the process (DirectML on
onnxruntime-directml >= 1.18, WebGPU, a provider the provider table does not know), each ``Run``
takes a process-wide lock for its device that every pool on it shares, whatever its model;
checkouts do not hold it, only each ``Run`` inside them.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from sharedml.runtime._providers import ProviderPlan

__all__ = ["FairLock", "SerializedSession", "run_lock_for"]


class FairLock:
    """A lock handed over in arrival order (``threading.Lock`` lets one thread take it again).

    Thread safety: made to be shared by threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: deque[threading.Event] = deque()
        self._held = False

    def acquire(self) -> None:
        """Wait for the lock, behind every thread that asked for it first."""
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
        """Hand the lock to the thread that has waited longest, or free it."""
        with self._lock:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._held = False

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


_RUN_LOCKS: dict[str, FairLock] = {}
_RUN_LOCKS_GUARD = threading.Lock()


def run_lock_for(plan: ProviderPlan) -> FairLock:
    """The process-wide run lock of ``plan``'s device: every pool on it shares it."""
    with _RUN_LOCKS_GUARD:
        return _RUN_LOCKS.setdefault(plan.device_key, FairLock())


class SerializedSession:
    """A checked-out session whose runs take the device's process-wide run lock."""

    def __init__(self, session: Any, lock: FairLock) -> None:
        self._session = session
        self._lock = lock

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """``InferenceSession.run`` under the run lock."""
        with self._lock:
            return self._session.run(*args, **kwargs)

    def run_with_iobinding(self, *args: Any, **kwargs: Any) -> Any:
        """``InferenceSession.run_with_iobinding`` under the run lock."""
        with self._lock:
            return self._session.run_with_iobinding(*args, **kwargs)

    def run_with_ort_values(self, *args: Any, **kwargs: Any) -> Any:
        """``InferenceSession.run_with_ort_values`` under the run lock."""
        with self._lock:
            return self._session.run_with_ort_values(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)
