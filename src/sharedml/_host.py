"""Facts about this process and machine, each computed in one place.

Heap trimming, usable cores, available memory, the per-process map limit, the CPU fingerprint,
the environment of child processes, durable renames, file hashing and which file systems are
remote. Modules that need one of
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
import re
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "HASH_CHUNK_BYTES",
    "REMOTE_FILESYSTEMS",
    "available_bytes",
    "child_env",
    "cpu_fingerprint",
    "filesystem_type",
    "fsync_dir",
    "is_remote_filesystem",
    "max_map_count",
    "package_root",
    "release_freed_heap",
    "sha256_file",
    "usable_cores",
]

HASH_CHUNK_BYTES = 8 * 1024 * 1024  # bytes read at a time when hashing: bounds memory
_DEFAULT_MAX_MAP_COUNT = 65530  # Linux's default vm.max_map_count
_MOUNTINFO = "/proc/self/mountinfo"
# File systems whose pages come over a network (or a user-space bridge to one). A mapped file on
# one of them is served by that network, revalidated and evicted by its client, not kept like a
# local file's page cache. FUSE mounts count as remote (sshfs, s3fs, gcsfuse, rclone, blobfuse)
# except ``fuseblk``, a local block device (ntfs-3g, exfat).
REMOTE_FILESYSTEMS = frozenset(
    (
        "9p",
        "afs",
        "beegfs",
        "ceph",
        "cifs",
        "fuse",
        "glusterfs",
        "gpfs",
        "lustre",
        "ncpfs",
        "nfs",
        "nfs4",
        "smb3",
        "smbfs",
        "wekafs",
    )
)


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


def _unescape_mount_path(text: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes come octal-escaped."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def filesystem_type(path: str | os.PathLike[str], *, mountinfo: str | None = None) -> str | None:
    """The type of the file system that holds ``path`` (``"ext4"``, ``"nfs4"``...).

    Read from ``/proc/self/mountinfo``: the mount whose mount point is the longest prefix of
    ``path``'s real path (the last one mounted wins where mounts are stacked).

    Args:
        path: Any path; it need not exist (its nearest mount is found from the text).
        mountinfo: The text of a mountinfo file, for tests (default: this process's).

    Returns:
        The type, or None where it cannot be read (not Linux, no ``/proc``).
    """
    if mountinfo is None:
        try:
            mountinfo = Path(_MOUNTINFO).read_text()
        except OSError:
            return None
    real = os.path.realpath(path)
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if not sep or len(parts) < 5 or not rest.split():
            continue
        mount_point = _unescape_mount_path(parts[4])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= best[0]):
            best = (len(mount_point), rest.split()[0])
    return best[1] if best is not None else None


def is_remote_filesystem(fstype: str | None) -> bool:
    """Whether a file system type (from :func:`filesystem_type`) serves its pages remotely."""
    if fstype is None:
        return False
    return fstype in REMOTE_FILESYSTEMS or (fstype.startswith("fuse.") and fstype != "fuseblk")
