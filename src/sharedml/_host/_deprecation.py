"""Deprecation warnings that point at the user's line, however deep in sharedml they are raised."""

from __future__ import annotations

import sys
import warnings

__all__ = [
    "warn_deprecated",
]


def warn_deprecated(message: str) -> None:
    """A ``DeprecationWarning`` that names the first caller outside sharedml, however deep.

    An old spelling can reach its parser through several of sharedml's own frames (a pool's
    ``prepacking=`` reaches the route planner); the warning points at the user's line.
    """
    frame = sys._getframe(1)
    level = 2  # 1 would name this function, 2 its caller
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith(
        "sharedml."
    ):
        frame = frame.f_back
        level += 1
    warnings.warn(message, DeprecationWarning, stacklevel=level)
