"""Creating a pool's sessions: up front, on helper threads, or in the background with retries.

The constructor of a pool returns once its first session exists; the others are created in the
background, one at a time process-wide (concurrent creation crashes DirectML on some versions,
and costs memory on the CPU). A failed background creation is retried with back-off and
reported to the caller that was waiting for that session, never dropped.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sharedml._errors import SessionCreationError, SharedMLError
from sharedml._host._platform import release_freed_heap, usable_cores

__all__ = [
    "CREATION_LOCK",
    "background_creator",
    "create_initial",
    "create_with_retries",
    "creation_error",
]

# Process-wide: DirectML crashes on concurrent creation. Reentrant: a pool measuring its first
# session's rows holds it, and a session per batch bucket creates its sessions as it runs.
CREATION_LOCK = threading.RLock()
_CREATION_RETRIES = 5  # background attempts per session before the pool stops growing
_RETRY_BASE_S = 0.1  # seconds before the first retry; doubles each time

_CREATOR: ThreadPoolExecutor | None = None
_CREATOR_GUARD = threading.Lock()


def background_creator() -> ThreadPoolExecutor:
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


def create_initial(
    create: Callable[[], Any], n: int, *, serialized: bool, trim: bool = False
) -> list[Any]:
    """Create ``n`` sessions, on up to one thread per core unless creation is ``serialized``.

    The calling thread creates its share too: its heap is glibc's main arena, the one arena
    whose freed top ``malloc_trim`` gives back. On the first failure the sessions already
    made are dropped and the error is raised. ``trim``: give freed heap back once all exist
    (each creation of a prepacked model trimmed as it finished, but another was still freeing
    meanwhile).
    """
    workers = 1 if serialized else min(n, usable_cores())
    if workers <= 1:
        return [create() for _ in range(n)]
    with ThreadPoolExecutor(workers - 1, thread_name_prefix="sharedml-create") as executor:
        share = n * (workers - 1) // workers
        futures = [executor.submit(create) for _ in range(share)]
        try:
            mine = [create() for _ in range(n - share)]
            created = mine + [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    if trim:
        release_freed_heap()
    return created


def creation_error(exc: Exception) -> SharedMLError:
    """A background creation's failure as the error its waiting caller gets.

    Kept for another thread: the traceback's frames (the creating thread's, still running)
    would hold the sessions they created for as long as the error is kept, so it is dropped.
    """
    error: SharedMLError = (
        exc
        if isinstance(exc, SharedMLError)
        else SessionCreationError(f"Creating a session in the background failed: {exc}")
    )
    if error is not exc:
        error.__cause__ = exc
    exc.__traceback__ = error.__traceback__ = None
    return error


def create_with_retries(
    n: int,
    *,
    create: Callable[[], Any],
    created: Callable[[Any], object],
    failed: Callable[[SharedMLError, bool], None],
    finished: Callable[[int], None],
    stopping: threading.Event,
) -> None:
    """Create ``n`` sessions one at a time, retrying each failure with back-off.

    Args:
        n: Sessions to create.
        create: Creates one session.
        created: Takes each session made.
        failed: Told of each failure (the error, and whether the retries are spent).
        finished: Told at the end, however it ends, how many sessions were not created (the
            retries were spent, or the pool closed).
        stopping: Set when the pool closes: creation stops before the next attempt.
    """
    pending = n
    try:
        while pending:
            sess = None
            for attempt in range(1, _CREATION_RETRIES + 1):
                if stopping.is_set():
                    return
                try:
                    sess = create()
                    break
                except Exception as exc:
                    final = attempt == _CREATION_RETRIES
                    failed(creation_error(exc), final)
                    if final or stopping.wait(_RETRY_BASE_S * 2 ** (attempt - 1)):
                        return
            pending -= 1
            created(sess)
    finally:
        finished(pending)
