"""Running scenarios on the real DirectML provider, each in a child process of its own.

A crash on DirectML ends the process that crashed, so every scenario runs in a child
(``tests/_dml_child.py``) and the test reads its exit status and its one result line. Where
DirectML is not there (Linux, a Windows without a Direct3D 12 device), the tests marked ``dml``
skip with the reason :func:`missing` gives. ``tools/windows/setup.sh`` provides it on Linux:
the real onnxruntime-directml on Wine and Mesa's software Vulkan (``docs/directml.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from sharedml._host._children import crash_name

DML = "DmlExecutionProvider"
MARKER = "SHAREDML-DML-RESULT:"
TESTS = Path(__file__).resolve().parent
# What a scenario child runs: the scenario's name and its JSON arguments follow in sys.argv.
_CHILD_CODE = (
    "import sys; sys.path[:0] = [{tests!r}, {root!r}]; import _dml_child; "
    "sys.exit(_dml_child.main(sys.argv[1:]))"
)


@functools.cache
def missing() -> str | None:
    """Why the DirectML tests cannot run here, or None where a DML session really runs."""
    import onnxruntime as ort

    if DML not in ort.get_available_providers():
        return (
            "needs onnxruntime-directml with a Direct3D 12 device (Windows; on Linux, "
            "tools/windows/setup.sh runs it under Wine: docs/directml.md)"
        )
    from _dml_child import tiny_model

    # onnxruntime-directml falls back to the CPU, with only a printed error, where it finds no
    # adapter: a session that says it runs on DML is the test.
    sess = ort.InferenceSession(tiny_model(), providers=[(DML, {"device_id": "0"})])
    if sess.get_providers()[0] != DML:
        return (
            f"onnxruntime-directml found no Direct3D 12 adapter (session on {sess.get_providers()})"
        )
    return None


def is_wine() -> bool:
    """Whether this Windows process runs under Wine (where the DML device is lavapipe)."""
    if os.name != "nt":
        return False
    import ctypes

    return hasattr(ctypes.WinDLL("ntdll"), "wine_get_version")


@dataclasses.dataclass
class Outcome:
    """What one scenario child did.

    Attributes:
        returncode: Its exit status.
        crash: What killed it (``STATUS_ACCESS_VIOLATION, 0xC0000005``, ``SIGSEGV``), or None.
        result: The scenario's result (a JSON object), or None if it printed none.
        output: Its stdout and stderr, for the failure message.
        hung: It did not exit within the timeout and was killed (``returncode`` is then -1).
    """

    returncode: int
    crash: str | None
    result: dict[str, Any] | None
    output: str
    hung: bool = False

    def ok(self) -> dict[str, Any]:
        """The result of a scenario that must finish; fails the test with its output if not."""
        assert not self.hung, f"the child did not exit in time:\n{self.output[-4000:]}"
        assert self.crash is None, f"the child crashed ({self.crash}):\n{self.output[-4000:]}"
        assert self.returncode == 0 and self.result is not None, (
            f"the child exited with {self.returncode} and no result:\n{self.output[-4000:]}"
        )
        return self.result


def run_scenario(name: str, *, timeout_s: float = 300.0, **kwargs: Any) -> Outcome:
    """Run ``_dml_child.<name>(**kwargs)`` in a fresh Python child process."""
    code = _CHILD_CODE.format(tests=str(TESTS), root=str(TESTS.parent))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, name, json.dumps(kwargs)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # killed by subprocess.run
        output = "".join(
            part.decode(errors="replace") if isinstance(part, bytes) else part
            for part in (exc.stdout or "", exc.stderr or "")
        )
        return Outcome(-1, None, None, output, hung=True)
    result = None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            result = json.loads(line[len(MARKER) :])
            break
    return Outcome(proc.returncode, crash_name(proc.returncode), result, proc.stdout + proc.stderr)
