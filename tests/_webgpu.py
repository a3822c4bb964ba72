"""Running scenarios on the real WebGPU plugin EP, each in a child process of its own.

A crash on WebGPU ends the process that crashed, so every scenario runs in a child
(``tests/_webgpu_child.py``) and the test reads its exit status and its one result line. Where
WebGPU cannot run (no ``onnxruntime-ep-webgpu``, an onnxruntime without plugin EPs, no adapter),
the tests marked ``webgpu`` skip with the reason :func:`missing` gives; ``tools/webgpu/setup.sh``
provides it on Linux without a GPU (Mesa's lavapipe: ``docs/webgpu.md``).
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

from sharedml._host._children import child_env, crash_name

MARKER = "SHAREDML-WEBGPU-RESULT:"
TESTS = Path(__file__).resolve().parent
_CHILD_CODE = (
    "import sys; sys.path[:0] = [{tests!r}, {root!r}]; import _webgpu_child; "
    "sys.exit(_webgpu_child.main(sys.argv[1:]))"
)
# Finding out whether WebGPU runs here may itself crash: asked once, in a child.
_PROBE_CODE = (
    "import sys; sys.path[:0] = [{tests!r}]; import _webgpu_child as c, numpy as np; "
    "s = c.plain_session(c.tiny_model()); s.run(None, {{'x': np.ones((2, 8), np.float32)}}); "
    "print('WEBGPU-OK')"
)


@functools.cache
def missing() -> str | None:
    """Why the WebGPU tests cannot run here, or None where a WebGPU session really runs."""
    import importlib.util

    import onnxruntime as ort

    if importlib.util.find_spec("onnxruntime_ep_webgpu") is None:
        return (
            "needs the WebGPU plugin EP (pip install onnxruntime-ep-webgpu) and a WebGPU adapter "
            "(tools/webgpu/setup.sh sets one up without a GPU: docs/webgpu.md)"
        )
    if not hasattr(ort, "register_execution_provider_library"):
        return f"onnxruntime {ort.__version__} cannot load plugin execution providers (1.23+)"
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE_CODE.format(tests=str(TESTS))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=child_env(),
    )
    if "WEBGPU-OK" not in proc.stdout:
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1:]
        hint = ""
        if os.environ.get("ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER") != "1":
            hint = " (without a GPU: ORT_WEBGPU_EP_ALLOW_SOFTWARE_ADAPTER=1)"
        return f"no WebGPU session runs here{hint}: {' '.join(last) or proc.returncode}"
    return None


@dataclasses.dataclass
class Outcome:
    """What one scenario child did.

    Attributes:
        returncode: Its exit status.
        crash: What killed it (``SIGSEGV``, ``SIGABRT``), or None.
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
    """Run ``_webgpu_child.<name>(**kwargs)`` in a fresh Python child process."""
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
            env=child_env(),
        )
    except subprocess.TimeoutExpired as exc:
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
