"""Memory on the real DirectML runtime, as ratios: what the DirectML defaults rest on.

Each figure is the resident memory a configuration adds in a fresh child process (after a tiny
DML session has loaded the runtime). Only on a software adapter does that include the device's
memory: under Wine the DML device is Mesa's lavapipe, whose "device memory" is this process's
heap, and which inflates every session (about 1.5 GiB each here, for any model). So only ratios
and differences against plain ORT in the same test mean anything; docs/directml.md has the
figures and what they decided.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _dml import is_wine, run_scenario
from _models import batchable_model

pytestmark = [
    pytest.mark.dml,
    pytest.mark.slow,
    pytest.mark.skipif(
        not is_wine(),
        reason="device memory shows in the process's memory only on a software adapter "
        "(lavapipe under Wine); on a GPU it is not in the working set",
    ),
]

MiB = 2**20
SESSIONS = 4  # plain sessions, and the threads the pool serves at once


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 8 layers of 1024x1024 float32: 32 MiB of weights, far above the figures' noise (~3 MiB).
    return str(batchable_model(tmp_path_factory.mktemp("dmlmem") / "m.onnx", dim=1024, layers=8))


def added(model: str, config: str, *, sessions: int = 1, threads: int = 1) -> int:
    result = run_scenario("memory", model=model, config=config, sessions=sessions, threads=threads)
    return int(result.ok()["added_bytes"])


def weights_bytes(model: str) -> int:
    return sum(f.stat().st_size for f in Path(model).parent.iterdir())


def test_the_pool_serving_n_threads_holds_a_fraction_of_n_plain_sessions(model: str) -> None:
    plain = added(model, "plain", sessions=SESSIONS)
    pool = added(model, "pool", threads=SESSIONS)
    print(f"{SESSIONS} plain DML sessions: {plain / MiB:.0f} MiB; pool: {pool / MiB:.0f} MiB")
    assert pool <= 0.5 * plain, (pool / MiB, plain / MiB)


def test_graph_fusion_costs_no_memory_for_one_session(model: str) -> None:
    on = added(model, "plain")
    off = added(model, "plain-fusion-off")
    print(f"one DML session, fusion on: {on / MiB:.0f} MiB; off: {off / MiB:.0f} MiB")
    assert on <= off + 0.25 * weights_bytes(model), (on / MiB, off / MiB)


def test_loading_weights_from_the_file_holds_no_host_copy_the_in_memory_file_does(
    model: str,
) -> None:
    from_file = added(model, "pool:ort-mmap")
    in_memory = added(model, "pool:in-memory-file")
    plain = added(model, "plain")
    print(
        f"one DML session: plain {plain / MiB:.0f} MiB; pool ort-mmap {from_file / MiB:.0f} "
        f"MiB; pool in-memory-file {in_memory / MiB:.0f} MiB"
    )
    weights = weights_bytes(model)
    # The in-memory route keeps the mapped file resident beside the device copy: one more copy.
    assert in_memory - from_file >= 0.75 * weights, (in_memory / MiB, from_file / MiB)
    # Loading from the file costs no more than a plain session: no copy of the weights beside
    # the device's (one would add a whole ``weights``; the software driver's own allocations
    # move both figures by 10-15 MiB from run to run).
    assert from_file - plain <= 0.5 * weights, (from_file / MiB, plain / MiB)
