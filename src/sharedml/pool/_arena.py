"""A CPU session's activation memory: no memory patterns, and the arena given back after a peak.

**Memory patterns off.** With ``enable_mem_pattern`` (ORT's default), a session's first ``Run``
at a shape allocates every activation from its arena, one by one, and plans their offsets; from
the second on it allocates that plan as one block, beside the arena's chunks from the first,
which the arena keeps. So a session holds about twice its activations: four sessions of a
320x320 U-Net-like segmenter (2 MiB of weights) held 834 MiB with patterns and 427 MiB without,
a real detector at 640x640 (PP-OCRv4 det) 423 against 256, with no measurable change in CPU
time per run here; on weight-heavy models (an MLP, BERT-like) nothing changed either way
(``docs/memory.md`` has every figure and the other levers measured). Plain sessions keep the
pattern; the pool's CPU sessions run without it, which is why a pool of N holds at most what N
plain sessions do on models whose activations dominate. ``configure`` runs after this and may
turn it back on.

**Except where requests run side by side.** The default merging CPU pool runs requests side by
side on its session (each its own ``Run``) where merging does not pay. Without patterns every
activation of every concurrent ``Run`` is taken from, and given back to, the session's one arena
under its lock: on 16 cores, 16 callers of a MiniLM-like session served 0.81-0.89x the requests
of the same session with patterns (which takes one block a ``Run``), and a plain session's
1.02-1.13x with them (three runs, ``docs/batching.md``). That pool keeps patterns on; its rows
per ``Run`` are bounded by one row's activations measured with them on (two runs: the chunks
and the block), so its batches and its side-by-side runs stay within the plain sessions it
stands for. Where that row bounds the rows, or could not be measured, the pool creates its
session again without patterns.

**Giving a peak back.**
ORT's CPU arena keeps what the largest ``Run`` of a session needed, for the session's life: a
ResNet-50-like session that once ran 16 rows held 393 MiB afterwards against 189 before, while
it ran one row at a time again (two cores here, after ``malloc_trim``). ORT frees the arena's
unused regions at the end of a ``Run`` given the run option
``memory.enable_memory_arena_shrinkage`` (the same session then held 176 MiB); shrinking on every
``Run`` would pay the peak's page faults again at each batch, so it is done once a peak has
passed: when :data:`QUIET_RUNS` runs in a row on that session held at most ``1 / FALL`` of the
rows of its largest run since it last shrank. A batching pool under steady load never shrinks;
one whose load fell from 16 rows to a few gives the difference back. Only on the CPU provider,
and never for a run given the caller's own run options.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "FALL",
    "MEMORY_PATTERNS_ON_REASON",
    "MEMORY_PATTERNS_REASON",
    "QUIET_RUNS",
    "ArenaPeaks",
    "rows_of",
    "without_memory_patterns",
]

# A run "below the peak" holds at most a quarter of its rows, and it takes 8 in a row: a pool
# of two batching sessions under 16 callers runs batches of 1-16 rows (7.5 on average), and
# shrinking there would pay a regrowth at the next large batch; a load that fell to a few
# callers gives the memory back within 8 runs.
QUIET_RUNS = 8
FALL = 4

_SHRINK_KEY = "memory.enable_memory_arena_shrinkage"
_CPU_ARENA = "cpu:0"


MEMORY_PATTERNS_REASON = (
    "Memory patterns are off (enable_mem_pattern=False): with them each CPU session keeps its "
    "first run's activation chunks beside the planned block it allocates from the second run on, "
    "about twice its activations (configure= may turn them back on)."
)
"""What a CPU pool's route reason says of its sessions' memory patterns."""

MEMORY_PATTERNS_ON_REASON = (
    "Memory patterns stay on: requests may run side by side on the session, and without them "
    "every activation of every concurrent run is taken from the session's one arena; the rows "
    "a run may hold are measured with them on."
)
"""... and of a pool whose requests may run side by side (the default merging CPU pool)."""


def without_memory_patterns(
    configure: Callable[[Any], None] | None,
) -> Callable[[Any], None]:
    """A ``configure`` for a CPU pool's sessions: memory patterns off, then the caller's own.

    Args:
        configure: The caller's ``configure`` (called after, so it may turn them back on).
    """

    def apply(so: Any) -> None:
        so.enable_mem_pattern = False
        if configure is not None:
            configure(so)

    return apply


def rows_of(feed: Any) -> int | None:
    """The rows (axis 0) of the first array input of ``feed``, or None (no such input)."""
    for value in feed.values():
        shape = getattr(value, "shape", None)
        if shape:
            return int(shape[0])
    return None


class ArenaPeaks:
    """Per session: the largest rows since its last shrink, and the quiet runs since that peak.

    Thread safety: :meth:`run_options` may be called from any thread (each session is run by
    one thread at a time, but the table is shared).
    """

    def __init__(self) -> None:
        self._state: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self.shrinks = 0

    def shrink_due(self, sess: Any, rows: int) -> bool:
        """Record a run of ``rows`` on ``sess``; True where this run should shrink the arena."""
        with self._lock:
            try:
                state = self._state.get(sess)
                if state is None:
                    self._state[sess] = [rows, 0]
                    return False
            except TypeError:  # a session that cannot be weakly referenced: not tracked
                return False
            peak, quiet = state
            if rows > peak:
                state[:] = [rows, 0]
                return False
            quiet = quiet + 1 if rows * FALL <= peak else 0
            if quiet < QUIET_RUNS:
                state[1] = quiet
                return False
            state[:] = [rows, 0]  # the arena keeps what this run needs: the new peak
            self.shrinks += 1
            return True

    def run_options(self, sess: Any, feed: Any, given: Any) -> Any:
        """The run options for a run of ``feed`` on ``sess``: ``given``, or a shrinking one.

        A caller's own run options are never changed (nor shrunk for: ORT's ``RunOptions``
        cannot be copied).
        """
        if given is not None:
            return given
        rows = rows_of(feed)
        if rows is None or not self.shrink_due(sess, rows):
            return None
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry(_SHRINK_KEY, _CPU_ARENA)
        return options
