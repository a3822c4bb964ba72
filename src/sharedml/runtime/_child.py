"""Run Python in a child process and read its one JSON result: the one child-process runner.

Three kinds of work run in a child: a measurement (what one strategy allocated must neither hide
nor inflate another's figures), a probe that may crash the process (a crash must cost the child,
never the caller), and a family's memory (plain sessions against pools). All three go through
:func:`run_child`, so every child:

- gets :func:`sharedml._host._children.child_env` (it imports this very sharedml and onnxruntime);
- is killed after ``timeout_s``, and the error names what timed out;
- gives one result: a ``RESULT`` line of JSON on stdout (:data:`RESULT_PREFIX`); the other
  stdout lines (progress) go to a callback;
- fails with one :class:`ChildFailed` whose message names what was run, how it ended (timed out,
  crashed, an exit status, no or unreadable result) and the last line of its stderr.

A child that runs a function of sharedml is started with :func:`entry_code`: the function is
called with the child's arguments (strings) and returns a JSON-ready value; where it raises, its
error becomes the last stderr line (one line, ``TypeName: message``) and the exit status 1.

Thread safety: :func:`run_child` may be called from several threads; each call has its own child.
"""

from __future__ import annotations

import collections
import importlib
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from sharedml._errors import SharedMLError
from sharedml._host._children import child_env, crash_name

__all__ = ["RESULT_PREFIX", "ChildFailed", "child_entry", "entry_code", "run_child"]

RESULT_PREFIX = "RESULT "
_STDERR_LINES_KEPT = 50  # of the child's stderr, for error messages
_NO_STDERR = "(no output on stderr)"
_SIGKILL_EXIT = -9  # the kernel's OOM killer sends SIGKILL


class ChildFailed(SharedMLError):
    """A child process gave no result.

    The message is one sentence: ``"{what} {how}. Last stderr line: {last}"``.

    Attributes:
        what: What was run, as the caller named it ("Measuring strategy 'naive'").
        how: How it ended: ``"took longer than 5 s and was stopped"``, ``"crashed (SIGSEGV)"``,
            ``"failed: its process exited with status 1"``, ...
        tail: Its last stderr lines (empty lines left out), oldest first.
        returncode: Its exit status (None where it could not start).
        crash: What killed it (``"SIGSEGV"``, a Windows NTSTATUS), else None.
        timeout_s: The limit it was stopped at, else None.
    """

    def __init__(
        self,
        what: str,
        how: str,
        tail: Sequence[str] = (),
        *,
        returncode: int | None = None,
        crash: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.what = what
        self.how = how
        self.tail = tuple(tail)
        self.returncode = returncode
        self.crash = crash
        self.timeout_s = timeout_s
        super().__init__(f"{what} {how}. Last stderr line: {self.last}")

    @property
    def timed_out(self) -> bool:
        """It was stopped after ``timeout_s``."""
        return self.timeout_s is not None

    @property
    def last(self) -> str:
        """The child's last stderr line: where a sharedml child puts its error."""
        return self.tail[-1] if self.tail else _NO_STDERR


def entry_code(target: str) -> str:
    """The ``python -c`` program that runs ``target`` (``"module:function"``) as a child.

    ``-c`` rather than ``-m``: runpy would import the target's module a second time as
    ``__main__``.
    """
    return (
        "import sys; from sharedml.runtime._child import child_entry; "
        f"sys.exit(child_entry({target!r}, sys.argv[1:]))"
    )


def _one_line(exc: BaseException) -> str:
    text = " ".join((str(exc).strip() or type(exc).__name__).split())
    return f"{type(exc).__name__}: {text}"


def child_entry(target: str, argv: Sequence[str]) -> int:
    """Run ``target(*argv)`` in this (child) process and print its result; the exit status.

    Args:
        target: ``"module:function"``; the function takes the arguments as strings and returns
            a JSON-ready value.
        argv: Its arguments.

    Returns:
        0 after the ``RESULT`` line; 1 after the error, one line last on stderr.
    """
    try:
        module, _, name = target.partition(":")
        function: Callable[..., Any] = getattr(importlib.import_module(module), name)
        text = json.dumps(function(*argv))
    except BaseException as exc:  # one line, last on stderr: the parent quotes it
        print(_one_line(exc), file=sys.stderr, flush=True)
        return 1
    print(RESULT_PREFIX + text, flush=True)
    return 0


def run_child(
    args: Sequence[str],
    *,
    code: str,
    what: str,
    timeout_s: float | None,
    on_line: Callable[[str], None] | None = None,
) -> Any:
    """Run ``python -c code *args`` and return the JSON of its ``RESULT`` line.

    Args:
        args: The child's arguments (``sys.argv[1:]`` there).
        code: The program: :func:`entry_code` of a function, or a program of its own that
            prints the ``RESULT`` line itself (one that must import nothing of sharedml before
            it reads its memory).
        what: What is run, for the error message ("Measuring strategy 'naive'").
        timeout_s: Kill the child after this many seconds (None: no limit).
        on_line: Called with every other stdout line (progress), from this thread; where it
            raises, the child is killed and the error propagates.

    Returns:
        The result.

    Raises:
        ChildFailed: the child could not start, timed out, crashed, exited with a non-zero
            status, or gave no result or one that is not JSON.
    """
    tail: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES_KEPT)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            encoding="utf-8",
            errors="replace",
            env=child_env(),
        )
    except OSError as exc:  # Windows' message names no file: say which Python it was
        raise ChildFailed(what, f"could not start {sys.executable}: {exc}") from None
    assert proc.stdout is not None and proc.stderr is not None
    stderr = proc.stderr

    def drain_stderr() -> None:  # a full pipe would block the child
        for line in stderr:
            if line.strip():
                tail.append(line.strip())

    drainer = threading.Thread(target=drain_stderr, name="sharedml-child-stderr", daemon=True)
    drainer.start()
    timed_out = threading.Event()
    timer: threading.Timer | None = None
    if timeout_s is not None:

        def kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout_s, kill)
        timer.daemon = True
        timer.start()
    result: str | None = None
    try:
        for line in proc.stdout:
            if line.startswith(RESULT_PREFIX):
                result = line[len(RESULT_PREFIX) :]
            elif on_line is not None:
                on_line(line.rstrip("\n"))
        returncode = proc.wait()
    finally:
        if timer is not None:
            timer.cancel()
        if proc.poll() is None:  # interrupted (Ctrl-C) or a callback raised: leave no child
            proc.kill()
            proc.wait()
        drainer.join(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
    if timed_out.is_set():
        raise ChildFailed(
            what,
            f"took longer than {timeout_s} s and was stopped",
            tail,
            returncode=returncode,
            timeout_s=timeout_s,
        )
    crash = crash_name(returncode)
    if crash is not None:
        how = f"crashed ({crash})"
        if returncode == _SIGKILL_EXIT:  # nothing crashes with SIGKILL: it was killed
            how = f"was killed ({crash}: out of memory?)"
        raise ChildFailed(what, how, tail, returncode=returncode, crash=crash)
    if returncode != 0:
        raise ChildFailed(
            what,
            f"failed: its process exited with status {returncode}",
            tail,
            returncode=returncode,
        )
    if result is None:
        raise ChildFailed(what, "exited without a result", tail, returncode=returncode)
    try:
        return json.loads(result)
    except ValueError:
        shown = result.strip()[:200]
        raise ChildFailed(
            what, f"gave a result that is not JSON ({shown!r})", tail, returncode=returncode
        ) from None
