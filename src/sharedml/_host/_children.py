"""Python child processes: an environment that imports this very sharedml, and what killed one."""

from __future__ import annotations

import os
import signal
import sys
import sysconfig
from pathlib import Path

__all__ = [
    "child_env",
    "crash_name",
    "package_root",
]


def package_root() -> Path:
    """The folder that holds this ``sharedml`` package (a site-packages or a ``src/`` folder)."""
    return Path(__file__).resolve().parents[2]  # sharedml/_host/_children.py


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
