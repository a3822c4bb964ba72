"""Facts about this process and machine, each computed in one place.

Heap trimming, usable cores, available memory, the per-process map limit, the CPU fingerprint,
the environment of child processes, durable renames, file hashing, opening a file below a
folder without following symlinks, and which file systems are remote. Modules that need one
of these import it from here, so that a platform difference is handled once (``packaging``
keeps its libc probing in ``_manylinux.py`` for the same reason).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import hashlib
import os
import platform
import re
import signal
import stat
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "warn_deprecated",
    "HASH_CHUNK_BYTES",
    "HashingWriter",
    "LinkSwappedError",
    "ORT_DISTRIBUTIONS",
    "REMOTE_FILESYSTEMS",
    "available_bytes",
    "check_one_onnxruntime",
    "child_env",
    "crash_name",
    "cpu_fingerprint",
    "file_kind",
    "filesystem_type",
    "fsync_dir",
    "is_remote_filesystem",
    "max_map_count",
    "open_below",
    "onnxruntime_distributions",
    "onnxruntime_site",
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
_ORT_PREFIXES = ("onnxruntime", "ort-nightly")  # of the records' folder names, normalized


def onnxruntime_site() -> Path | None:
    """The folder the ``onnxruntime`` package would be imported from, without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent.parent


def onnxruntime_distributions(site: Path | None = None) -> list[tuple[str, str]]:
    """``(name, version)`` of each distribution in ``site`` that provides ``onnxruntime``.

    Args:
        site: a site folder; default: the one ``onnxruntime`` would be imported from
            (:func:`onnxruntime_site`). Distributions in other folders of ``sys.path`` are left
            out: sys.path order decides between folders, and a package shadowed that way cannot
            mix with the one imported. Two in one folder wrote their files over each other.
    """
    import importlib.metadata as metadata

    site = site if site is not None else onnxruntime_site()
    if site is None:
        return []
    found: dict[str, str] = {}
    # Only the records whose folder name can be one of ours are parsed: reading every
    # distribution's metadata costs 0.1 s in a venv of 100 packages, on every pool's start.
    try:
        records = [
            entry
            for entry in os.scandir(site)
            if entry.name.endswith((".dist-info", ".egg-info"))
            and re.sub(r"[-_.]+", "-", entry.name.lower()).startswith(_ORT_PREFIXES)
        ]
    except OSError:
        return []
    for record in sorted(records, key=lambda e: e.name):
        dist = metadata.PathDistribution(Path(record.path))
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in ORT_DISTRIBUTIONS:
            found.setdefault(name, dist.version)
    return sorted(found.items(), key=lambda item: ORT_DISTRIBUTIONS.index(item[0]))


@functools.cache
def check_one_onnxruntime() -> str | None:
    """Warn (once per process) when two onnxruntime distributions share one folder; say the fix.

    Called where sharedml first needs onnxruntime (planning a pool's or a measurement's
    providers), not at ``import sharedml``. A warning, not an error: the mixed install may still
    work for what the user runs, but it is an accident of install order (``pip install
    onnxruntime-gpu`` next to ``onnxruntime`` leaves whichever came last, in part). A build
    installed in a folder of its own ahead on ``sys.path`` (``pip install --target``) is not
    mixed, and is not warned of.

    Returns:
        The warning's text, or None when at most one is installed there.
    """
    site = onnxruntime_site()
    found = onnxruntime_distributions(site)
    if len(found) < 2:
        return None
    listed = ", ".join(f"{name} {version}" for name, version in found)
    names = " ".join(name for name, _ in found)
    keep = next((name for name, _ in found if name != "onnxruntime"), found[0][0])
    message = (
        f"sharedml: {len(found)} onnxruntime distributions are installed in {site} ({listed}); "
        "they all write the same 'onnxruntime' package, so the build you get (and its execution "
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


# NTSTATUS values a crashed Windows process exits with (its "exit code" is the exception code).
_WINDOWS_CRASHES = {
    0x80000003: "STATUS_BREAKPOINT",
    0xC0000005: "STATUS_ACCESS_VIOLATION",
    0xC000001D: "STATUS_ILLEGAL_INSTRUCTION",
    0xC0000094: "STATUS_INTEGER_DIVIDE_BY_ZERO",
    0xC00000FD: "STATUS_STACK_OVERFLOW",
    0xC0000374: "STATUS_HEAP_CORRUPTION",
    0xC0000409: "STATUS_STACK_BUFFER_OVERRUN",  # also __fastfail, as the CRT's abort() may use
}


def crash_name(returncode: int, *, windows: bool | None = None) -> str | None:
    """What killed a child process, from its exit status; None if it exited by itself.

    POSIX reports a fatal signal as a negative status (``SIGSEGV``). Windows has no signals: a
    process that crashes exits with the exception's NTSTATUS as its status (``0xC0000005``,
    ``STATUS_ACCESS_VIOLATION``), an error-severity code no program returns by itself.

    Args:
        returncode: ``subprocess.Popen.returncode``.
        windows: Read it as a Windows status (default: whether this is Windows).
    """
    if windows is None:
        windows = os.name == "nt"
    if windows:
        code = returncode & 0xFFFFFFFF
        if code in _WINDOWS_CRASHES:
            return f"{_WINDOWS_CRASHES[code]}, 0x{code:08X}"
        return f"NTSTATUS 0x{code:08X}" if code >= 0xC0000000 else None
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


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


_ZEROS = bytes(64 * 1024)  # padding is written from this, so no padding is ever allocated


class HashingWriter:
    """Bytes on their way to a file (or to nowhere), hashed and counted as they pass.

    The one hashing writer: prepare's weights files, a family's, the cache's rewrite of an
    entry's own file, and :func:`sha256_file` (which writes to nowhere) all go through it, so
    the digest a manifest records is computed by the same code that checks it.

    Attributes:
        position: Bytes written so far.
        sha: The running ``hashlib`` object over them.

    Not thread-safe: one writer, one thread.
    """

    def __init__(self, fh: IO[bytes] | None = None, sha: Any | None = None) -> None:
        """Write to ``fh`` (``None``: hash only), feeding ``sha`` (default: a fresh SHA-256)."""
        self._fh = fh
        self.position = 0
        self.sha = sha if sha is not None else hashlib.sha256()

    def hexdigest(self) -> str:
        """The hex digest of everything written so far."""
        return str(self.sha.hexdigest())

    def write(self, data: bytes | memoryview) -> None:
        """Write ``data`` and hash it."""
        if self._fh is not None:
            self._fh.write(data)
        self.sha.update(data)
        self.position += len(data)

    def write_all(self, chunks: Iterable[bytes | memoryview]) -> None:
        """Write each of ``chunks``."""
        for chunk in chunks:
            self.write(chunk)

    def through(self, chunks: Iterable[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        """Each of ``chunks``, written (and hashed) before it is handed on."""
        for chunk in chunks:
            self.write(chunk)
            yield chunk

    def copy_from(self, source: IO[bytes]) -> None:
        """Write everything ``source`` has left, read in :data:`HASH_CHUNK_BYTES` chunks."""
        self.write_all(iter(lambda: source.read(HASH_CHUNK_BYTES), b""))

    def pad_to(self, alignment: int) -> None:
        """Write zeros up to the next multiple of ``alignment`` bytes."""
        pad = -self.position % alignment
        while pad:  # from a small buffer of zeros: padding costs no memory, whatever its size
            step = min(pad, len(_ZEROS))
            self.write(memoryview(_ZEROS)[:step])
            pad -= step

    def mark(self) -> tuple[int, Any]:
        """Where the writer is now, to go back to with :meth:`rollback`."""
        return self.position, self.sha.copy()

    def rollback(self, mark: tuple[int, Any]) -> None:
        """Forget everything written since ``mark``: the file is truncated back to it."""
        position, sha = mark
        if self._fh is not None:
            self._fh.seek(position)
            self._fh.truncate()
        self.position, self.sha = position, sha


def sha256_file(path: str | os.PathLike[str], sha: Any | None = None) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks.

    Args:
        path: The file.
        sha: A ``hashlib`` object to feed instead of a fresh one (its hex digest is returned).
    """
    hashing = HashingWriter(sha=sha)
    with open(path, "rb") as fh:
        hashing.copy_from(fh)
    return hashing.hexdigest()


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISREG, "a regular file"),
)


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, for messages: ``"a FIFO (named pipe)"``, ``"a folder"``, ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


# Flags that are absent on some platforms (Windows has none of these): 0 leaves them out.
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # opening a FIFO must not wait for a writer
_O_BINARY = getattr(os, "O_BINARY", 0)


class LinkSwappedError(OSError):
    """A path below the folder became a symlink (or another file) while it was being opened."""


def open_below(folder: Path, target: Path) -> int:
    """Open ``target``, a resolved path inside the resolved ``folder``, without following links.

    The caller has checked ``target`` (``os.path.realpath``) against ``folder``; a symlink
    swapped into any component below ``folder`` between that check and this open would make a
    plain ``open`` read another file. Where the platform allows it (POSIX), every component is
    opened from its parent's descriptor with ``O_NOFOLLOW``, so the walk cannot leave
    ``folder``; elsewhere (Windows: no ``O_NOFOLLOW``, no ``dir_fd``) the file is opened by
    path and the descriptor's own path (``GetFinalPathNameByHandle``) must be ``target``, which
    refuses a link followed by the open whatever happens to the path after it. (Comparing the
    path's ``stat`` after the open is not enough: measured, it leaked.) The file is opened
    non-blocking so that
    a FIFO swapped in cannot hang the caller; callers ``fstat`` the descriptor for its kind.

    Returns:
        A read-only descriptor, owned by the caller.

    Raises:
        LinkSwappedError: a component is now a symlink, or the opened file is not ``target``.
        OSError: the file cannot be opened (missing, permissions).
    """
    parts = target.relative_to(folder).parts
    if not parts:
        raise IsADirectoryError(f"'{target}' is the folder itself")
    if not (_O_NOFOLLOW and os.open in os.supports_dir_fd):
        return _open_and_compare(target)
    dir_fd = os.open(folder, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        for part in parts[:-1]:
            next_fd = _open_component(part, os.O_RDONLY | _O_DIRECTORY, dir_fd, target)
            os.close(dir_fd)
            dir_fd = next_fd
        return _open_component(parts[-1], os.O_RDONLY | _O_NONBLOCK, dir_fd, target)
    finally:
        os.close(dir_fd)


def _open_component(name: str, flags: int, dir_fd: int, target: Path) -> int:
    try:
        return os.open(name, flags | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        # ELOOP: a symlink where O_NOFOLLOW forbids one (EMLINK on FreeBSD); ENOTDIR: a
        # folder component replaced by a file or a link.
        if exc.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
            raise LinkSwappedError(
                exc.errno, f"'{name}' became a symlink or changed while being opened", str(target)
            ) from None
        raise


def _open_and_compare(target: Path) -> int:
    """Open by path, then check that the descriptor's own path is ``target`` (no link followed).

    Comparing ``stat`` results of the path after the open is not enough: the path can change
    between those calls too (measured: a flipper leaked through such a check on try 23). The
    descriptor's path is a property of the open file itself, so no later swap can change it.
    """
    fd = os.open(target, os.O_RDONLY | _O_BINARY | _O_NONBLOCK)
    try:
        opened = _descriptor_path(fd)
        if opened is None:  # no way to ask: the best the path can tell (racy, see above)
            same = os.path.samestat(os.fstat(fd), os.lstat(target))
            same = same and os.path.realpath(target) == str(target)
        else:
            # realpath brings the descriptor's path (which holds no link) to the form `target`
            # already has; `target` itself must not be resolved again, or a link swapped in
            # now would resolve to the file opened through it (measured: it leaked).
            same = _canonical(opened) == os.path.normcase(str(target))
        if not same:
            raise LinkSwappedError(
                errno.ELOOP, f"the file opened is '{opened}', not the one checked", str(target)
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _canonical(path: str) -> str:
    return os.path.normcase(os.path.realpath(path))


def _descriptor_path(fd: int) -> str | None:
    """The path of the file open at ``fd`` (Windows, Linux, macOS), or None where unknown."""
    if sys.platform == "win32":
        import msvcrt

        handle = msvcrt.get_osfhandle(fd)
        kernel32: Any = ctypes.WinDLL("kernel32", use_last_error=True)
        buffer = ctypes.create_unicode_buffer(32768)
        if not kernel32.GetFinalPathNameByHandleW(handle, buffer, len(buffer), 0):
            return None
        path = str(buffer.value)
        if path.startswith("\\\\?\\UNC\\"):
            return "\\\\" + path[8:]
        return path[4:] if path.startswith("\\\\?\\") else path
    if sys.platform == "darwin":
        import fcntl

        raw = fcntl.fcntl(fd, 50, b"\0" * 1024)  # F_GETPATH
        return os.fsdecode(raw.split(b"\0", 1)[0])
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


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
