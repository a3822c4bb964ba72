"""Reading this process's memory: PSS where the platform gives it, else what can be read.

This file imports nothing of sharedml: the measuring child that finds sharedml's own fixed cost
runs it (``runpy.run_path``) before sharedml is imported, so that its readings, taken over a
process holding only Python, numpy and onnxruntime, count every module sharedml brings.

psutil's ``memory_full_info()`` (PSS and USS on Linux, USS elsewhere) walks the process's page
tables or working set, and is missing or refused in places: Windows programs under Wine, some
sandboxes and containers. Then the readings fall back to ``memory_info()``: RSS (the working
set on Windows) and, on Windows, private bytes, and :func:`metric_of` says which one leads and
why (:data:`FALLBACK_NOTES`). Nothing here raises for a metric it cannot read.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FALLBACK_NOTES", "METRICS", "metric_of", "read_memory", "trim_heap"]

METRICS = ("pss", "uss", "rss", "private")
"""Headline metrics in order of preference: the first one a reading has leads."""

FALLBACK_NOTES = {
    "uss": "USS counts only pages no other process maps: shared libraries and files that "
    "other processes also map are left out",
    "rss": "RSS counts every resident page the process maps, a page mapped twice (a file "
    "mapped by each session) twice, and a page shared with other processes in full",
    "private": "private bytes leave out mapped files, so weights a pool maps from its weights "
    "file do not show",
}
"""What a figure of each fallback metric leaves out or counts twice, for the report."""


def read_memory() -> dict[str, Any]:
    """This process's memory now, in bytes: ``pss``, ``uss``, ``rss``, ``private``.

    Each is ``None`` where it cannot be read here; ``error`` holds why the full reading
    (``memory_full_info``) failed, if it did. Never raises for a metric that is missing.
    """
    import psutil

    proc = psutil.Process()
    out: dict[str, Any] = {"pss": None, "uss": None, "rss": None, "private": None, "error": None}
    info: Any = None
    try:
        info = proc.memory_full_info()
    except Exception as exc:  # AccessDenied, NotImplementedError, OSError (Wine), ...
        out["error"] = f"psutil's memory_full_info() failed: {type(exc).__name__}: {exc}".strip()
    if info is None:
        try:
            info = proc.memory_info()
        except Exception as exc:
            out["error"] = f"{out['error']}; memory_info() failed too: {type(exc).__name__}: {exc}"
            return out
    for key in METRICS:
        value = getattr(info, key, None)
        out[key] = int(value) if value is not None else None
    return out


def metric_of(reading: dict[str, Any]) -> str | None:
    """The headline metric of a :func:`read_memory` reading: the first of :data:`METRICS` it has."""
    return next((m for m in METRICS if reading.get(m) is not None), None)


def trim_heap() -> bool:
    """Give freed heap back to the OS (glibc ``malloc_trim(0)``); False where there is none."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl has no malloc_trim
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim(0)
    return True
