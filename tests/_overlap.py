"""A real ORT custom op that records how many Runs are inside it at once, process-wide.

The DirectML contract ("one Run at a time across the process") cannot run on Linux, so the tests
check sharedml's side of it on the CPU with this op in the graph: it counts its own concurrent
entries and sleeps inside (which releases the GIL, so overlapping Runs really overlap; a busy
wait would hide them). onnxruntime-extensions runs it as a Python custom op.

Two traps of onnxruntime-extensions 0.15 shape this file: an exception raised inside the op
aborts the process, so a "bad request" (a row with ``x[i, 0] == -1``) returns a wrongly shaped
tensor that makes the next node fail the Run instead; and the op must be defined (this module
imported) before a session registers the library, or session creation crashes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _models import OPSET, save_model
from onnx import TensorProto, helper, numpy_helper
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

import sharedml

DOMAIN = "ai.onnx.contrib"
SLEEP_S = 0.002  # seconds inside the op: the window in which another Run could overlap
SLOW = 7.0  # a Run with a row whose x[i, 0] is SLOW sleeps SLOW_S instead
SLOW_S = 3.0
BIAS = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
# The probe is a custom op the row-independence analysis cannot see into: it is row-wise
# (2x + bias), so batching tests give their word for it.
BATCHING = sharedml.Batching(rows_independent=True)


class Detector:
    """Counts Runs inside the op: the most at once, and the batch size of each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.active = self.max_active = 0
            self.rows: list[int] = []
            self.runs: list[tuple[str, int, float, float]] = []  # (thread, rows, start, end)

    def enter(self, rows: int) -> float:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.rows.append(rows)
        return time.perf_counter()

    def leave(self, rows: int, start: float) -> None:
        with self._lock:
            self.active -= 1
            name = threading.current_thread().name
            self.runs.append((name, rows, start, time.perf_counter()))


DETECTOR = Detector()


@onnx_op(op_type="OverlapProbe", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
def overlap_probe(x: np.ndarray) -> np.ndarray:
    start = DETECTOR.enter(int(x.shape[0]))
    try:
        slow = x.size and (x[:, 0] == SLOW).any()
        time.sleep(SLOW_S if slow else SLEEP_S)  # releases the GIL: other Runs can enter
        if x.size and (x[:, 0] == -1.0).any():  # per row: a bad row fails any Run it is in
            return np.zeros((x.shape[0], 3), np.float32)  # the Add below fails the Run
        return x * np.float32(2.0)
    finally:
        DETECTOR.leave(int(x.shape[0]), start)


def probe_model(path: Path) -> Path:
    """``x: float32[N, 4]`` -> OverlapProbe -> ``+ bias`` -> ``y: float32[N, 4]`` = 2x + bias."""
    graph = helper.make_graph(
        [
            helper.make_node("OverlapProbe", ["x"], ["t"], domain=DOMAIN),
            helper.make_node("Add", ["t", "bias"], ["y"]),
        ],
        "overlap_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(BIAS, "bias")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)]
    )
    model.ir_version = 8
    return save_model(model, path)


def register(so: Any) -> None:
    """A pool's ``configure=``: sessions load the library that runs the op."""
    so.register_custom_ops_library(get_library_path())
