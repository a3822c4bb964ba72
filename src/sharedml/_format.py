"""Figures for people: one formatter of bytes and seconds for every report and message."""

from __future__ import annotations

__all__ = ["human_bytes", "human_seconds"]


def human_bytes(n: float | None) -> str:
    """``48.0 MiB``: bytes in binary units; ``n/a`` for ``None``."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if abs(value) < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def human_seconds(s: float | None) -> str:
    """``0.42 s``, ``12 ms``; ``n/a`` for ``None``."""
    if s is None:
        return "n/a"
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"
