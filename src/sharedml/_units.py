"""Figures for people: one formatter of bytes and seconds for every report and message."""

from __future__ import annotations

import math

__all__ = ["human_bytes", "human_seconds", "parse_bytes"]

_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


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


def parse_bytes(text: str) -> int:
    """``"500M"``, ``"1.5GiB"``, ``"2G"``, ``"123"``: a size in bytes (binary units: K = 1024).

    Raises:
        ValueError: anything else (the message shows the accepted forms).
    """
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = value[-1:] if value[-1:] in _UNITS else ""
    number = value[: len(value) - len(unit)].strip()
    try:
        size = float(number) * _UNITS[unit]
    except ValueError:
        size = -1.0
    if not number or not 0 <= size < math.inf:  # NaN and infinity too ("1e400" is infinity)
        raise ValueError(
            f"{text!r} is not a size: give bytes or a number with K, M, G or T (binary units), "
            "e.g. 500M or 1.5G."
        )
    return int(size)
