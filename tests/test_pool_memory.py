"""Memory: a pool of N sessions costs about one copy of the weights, measured in fresh processes.

Each configuration runs in its own subprocess, so one measurement's allocations cannot hide or
inflate another's. PSS (proportional set size) counts shared pages once across processes, so
it is the honest figure for mapped weights; the ratio is taken against plain ORT sessions
measured by the same test on the same machine.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _memory import measure_pss

import sharedml

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps"),
]

SESSIONS = 8
WEIGHTS_MIB = 100


def measure(strategy: str, model: Path, n: int) -> int:
    return measure_pss(strategy, model, n, batch=1, width=2048)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("memory")
    info = mlp(folder / "mlp.onnx", target_bytes=WEIGHTS_MIB * 2**20, width=2048)
    os.environ["SHAREDML_CACHE_DIR"] = str(folder / "cache")
    sharedml.prepared_model_for(info.path)  # prepare outside the measured processes
    return Path(info.path)


def test_eight_shared_sessions_cost_under_a_third_of_eight_plain_ones(model: Path) -> None:
    naive = measure("naive", model, SESSIONS)
    shared = measure("shared", model, SESSIONS)
    weights = sharedml.SessionPool(model, sessions=1).weights.nbytes
    print(
        f"PSS growth, {SESSIONS} sessions: plain {naive / 2**20:.0f} MiB, shared "
        f"{shared / 2**20:.0f} MiB ({shared / naive:.2f}x), weights {weights / 2**20:.0f} MiB"
    )
    assert naive > SESSIONS * weights  # the baseline really holds a copy per session
    assert shared <= 0.3 * naive


def test_each_extra_session_adds_under_five_percent_of_the_weights(model: Path) -> None:
    one = measure("shared", model, 1)
    many = measure("shared", model, SESSIONS)
    weights = sharedml.SessionPool(model, sessions=1).weights.nbytes
    per_extra = (many - one) / (SESSIONS - 1)
    activations = 2 * 2048 * 4 * 64  # generous: a few [1, 2048] float buffers per layer
    print(
        f"one session {one / 2**20:.1f} MiB, {SESSIONS} sessions {many / 2**20:.1f} MiB, "
        f"{per_extra / 2**20:.2f} MiB per extra session ({per_extra / weights:.1%} of weights)"
    )
    assert one >= 0.9 * weights  # the weights really were mapped and touched once
    assert per_extra <= 0.05 * weights + activations
