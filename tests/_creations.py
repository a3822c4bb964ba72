"""Another pool opening while a pool under test reads the process's memory."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest
from _models import batchable_model
from _waiting import DEADLINE_S

import sharedml


@contextlib.contextmanager
def another_pool_opening(tmp_path: Path, *, width: int) -> Iterator[list[bool]]:
    """While the block runs, the first ORT Run whose input ``x`` is ``width`` wide (the model
    prepared already: not one of its preparation's Runs) starts
    opening another pool on a thread, and gives that pool's session up to a second to be
    created before the Run goes on. Yields a list that then holds whether it was: a Run that
    reads memory must keep it out. At the end, the other pool must have been created.
    """
    other = batchable_model(tmp_path / "other.onnx", dim=max(1, width // 2))
    created, started = threading.Event(), threading.Event()
    overlapped: list[bool] = []

    def open_another_pool() -> None:
        with sharedml.SessionPool(other, sessions=1, cache_dir=tmp_path / "c2"):
            created.set()  # its session exists

    another = threading.Thread(target=open_another_pool)
    run = ort.InferenceSession.run

    def run_as_another_pool_opens(
        self: ort.InferenceSession, names: Any, feed: Any, *rest: Any
    ) -> Any:
        if feed["x"].shape[1:] == (width,) and not started.is_set():
            started.set()
            another.start()
            overlapped.append(created.wait(1.0))  # ample for a small MLP's pool
        return run(self, names, feed, *rest)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ort.InferenceSession, "run", run_as_another_pool_opens)
        yield overlapped
    if started.is_set():
        another.join(DEADLINE_S)
    assert started.is_set() and created.is_set()
