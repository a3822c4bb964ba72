"""Waiting for a state with a deadline, instead of sleeping and hoping it was long enough."""

from __future__ import annotations

import time
from collections.abc import Callable

DEADLINE_S = 30.0  # seconds: far beyond any state change here, short of a hung test


def wait_until(
    predicate: Callable[[], bool], *, timeout_s: float = DEADLINE_S, what: str = "a state"
) -> None:
    """Poll ``predicate`` until it holds; fail the test if it does not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.001)
