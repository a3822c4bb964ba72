"""Facts about this machine and process, read from the OS: heap, cores, memory, map limit, CPU.

Each is computed in this one place, so that a platform difference is handled once (``packaging``
keeps its libc probing in ``_manylinux.py`` for the same reason); the C library is reached
through ctypes and looked up once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "available_bytes",
    "cpu_fingerprint",
    "heap_trim_available",
    "max_map_count",
    "release_freed_heap",
    "usable_cores",
]

_DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default vm.max_map_count


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """Glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``)."""
    if platform.system() != "Linux":
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Any = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl and other C libraries have no malloc_trim
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    result: Callable[[int], int] = trim
    return result


def release_freed_heap() -> bool:
    """Give heap pages freed during session creation back to the OS (glibc ``malloc_trim(0)``).

    ONNX Runtime frees the transient packs and copies it makes while loading a session, but
    glibc keeps the freed pages in the heap once its dynamic mmap threshold has risen, so a
    process that creates sessions holds far more than its sessions do. No session option
    removes that; trimming does (figures: ``docs/cpu-prepacking.md``). It takes milliseconds.

    Returns:
        True if memory was released; False if none was, or the C library is not glibc.

    Thread safety: may be called from any thread at any time.
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def heap_trim_available() -> bool:
    """Whether :func:`release_freed_heap` can trim at all here (glibc only)."""
    return _malloc_trim() is not None


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def available_bytes() -> int:
    """Memory this process may still use: the machine's available memory or its cgroup's room."""
    import psutil

    available = int(psutil.virtual_memory().available)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit != "max":
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    return available


def max_map_count() -> int:
    """The kernel's limit on memory maps per process (``vm.max_map_count``)."""
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return _DEFAULT_MAX_MAP_COUNT


@functools.cache
def cpu_fingerprint() -> str:
    """Vendor, model and ISA flags of the first CPU, hashed.

    ORT's CPU kernels pick their packed weight layout by ISA, so anything derived from packing
    is valid on this fingerprint only.
    """
    try:
        fields: dict[str, str] = {}
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return f"{platform.machine()}|{platform.processor()}"
    text = "|".join(fields.get(k, "") for k in ("vendor_id", "model name", "flags", "Features"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
