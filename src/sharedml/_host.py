"""Facts about this process and machine, each computed in one place.

Heap trimming, usable cores, available memory, the per-process map limit, the CPU fingerprint,
the environment of child processes, durable renames and file hashing. Modules that need one of
these import it from here, so that a platform difference is handled once (``packaging`` keeps
its libc probing in ``_manylinux.py`` for the same reason).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import platform
import sys
import sysconfig
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "HASH_CHUNK_BYTES",
    "ORT_DISTRIBUTIONS",
    "available_bytes",
    "check_one_onnxruntime",
    "child_env",
    "cpu_fingerprint",
    "fsync_dir",
    "max_map_count",
    "onnxruntime_distributions",
    "package_root",
    "release_freed_heap",
    "sha256_file",
    "usable_cores",
]

HASH_CHUNK_BYTES = 8 * 1024 * 1024  # bytes read at a time when hashing: bounds memory
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


# Distributions that install the `onnxruntime` package: any two of them overwrite each other's
# files, so which build `import onnxruntime` gets depends on install order.
ORT_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "onnxruntime-migraphx",
    "onnxruntime-cann",
    "onnxruntime-training",
    "ort-nightly",
    "ort-nightly-gpu",
    "ort-nightly-directml",
)


def onnxruntime_distributions() -> list[tuple[str, str]]:
    """``(name, version)`` of every installed distribution that provides ``onnxruntime``."""
    import importlib.metadata as metadata

    found = []
    for name in ORT_DISTRIBUTIONS:
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            continue
    return found


@functools.cache
def check_one_onnxruntime() -> str | None:
    """Warn (once per process) when two onnxruntime distributions are installed; say the fix.

    Called where sharedml first needs onnxruntime (planning a pool's or a measurement's
    providers), not at ``import sharedml``. A warning, not an error: the mixed install may still
    work for what the user runs, but it is an accident of install order (``pip install
    onnxruntime-gpu`` next to ``onnxruntime`` leaves whichever came last, in part).

    Returns:
        The warning's text, or None when at most one is installed.
    """
    found = onnxruntime_distributions()
    if len(found) < 2:
        return None
    listed = ", ".join(f"{name} {version}" for name, version in found)
    names = " ".join(name for name, _ in found)
    keep = next((name for name, _ in found if name != "onnxruntime"), found[0][0])
    message = (
        f"sharedml: {len(found)} onnxruntime distributions are installed ({listed}); they all "
        "write the same 'onnxruntime' package, so the build you get (and its execution "
        f"providers) depends on install order. Keep exactly one: pip uninstall -y {names} && "
        f"pip install {keep} (README, Install)."
    )
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return message


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


def package_root() -> Path:
    """The folder that holds this ``sharedml`` package (a site-packages or a ``src/`` folder)."""
    return Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """The environment for a Python child that must import this very sharedml and onnxruntime.

    The child may be started by a process whose imports came from ``sys.path`` entries that the
    child would not have (a ``PYTHONPATH`` set by a launcher, a folder added at run time), so
    those entries travel in ``PYTHONPATH``, after this package's own folder. The standard
    library's folders stay out: the child has them anyway, and putting them early in
    ``PYTHONPATH`` could shadow them with same-named packages.
    """
    env = dict(os.environ)
    stdlib = {
        os.path.normcase(os.path.realpath(p))
        for key in ("stdlib", "platstdlib")
        if (p := sysconfig.get_paths().get(key))
    }
    paths = [str(package_root())]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in sys.path:
        if entry and os.path.isdir(entry):
            real = os.path.normcase(os.path.realpath(entry))
            if real not in stdlib and not real.startswith(tuple(s + os.sep for s in stdlib)):
                paths.append(entry)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable, where the platform and filesystem allow it.

    Best effort by design: the rename has already happened and is visible; some filesystems
    refuse ``fsync`` on a folder (EINVAL), and failing the whole operation for that would turn
    a durability nicety into an outage.
    """
    if os.name != "posix":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike[str], sha: Any | None = None) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks.

    Args:
        path: The file.
        sha: A ``hashlib`` object to feed instead of a fresh one (its hex digest is returned).
    """
    sha = sha if sha is not None else hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            sha.update(chunk)
    return str(sha.hexdigest())
