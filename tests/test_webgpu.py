"""The WebGPU plugin EP for real: pools never crash, never fall back, and cost a fraction.

Two plain WebGPU sessions in ``Run`` at once crash the process (ORT issue #32561:
``tools/webgpu/canary.py`` watches it on every CI run). Every scenario here runs in a fresh child
process (``tests/_webgpu_child.py``), so a crash is an outcome the test asserts on. On Linux
without a GPU, ``tools/webgpu/setup.sh`` provides WebGPU on Mesa's software Vulkan (lavapipe),
whose device memory is this process's memory: only ratios mean anything (``docs/webgpu.md``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _models import batchable_model, conv_model
from _webgpu import missing, run_scenario

pytestmark = pytest.mark.webgpu

WEBGPU = "WebGpuExecutionProvider"
MiB = 2**20


@pytest.fixture(autouse=True)
def _needs_webgpu() -> Iterator[None]:
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    yield


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(batchable_model(tmp_path_factory.mktemp("webgpu") / "mlp.onnx", dim=64, layers=3))


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(conv_model(tmp_path_factory.mktemp("webgpu") / "cnn.onnx", channels=8, size=16))


def test_sessions_equal_the_cpu_and_the_pool_says_how_it_runs(mlp: str, cnn: str) -> None:
    result = run_scenario("outputs_and_route", models=[mlp, cnn]).ok()
    for name, seen in result["models"].items():
        assert seen["plain_max_diff"] <= 1e-4 and seen["pool_max_diff"] <= 1e-4, (name, seen)
        assert seen["providers"][0] == WEBGPU, seen  # never a silent CPU pool
        assert seen["max_sessions"] == 1 and seen["serialized_runs"], seen
        assert "ORT issue #32561" in seen["runs_rule"]
        assert seen["mechanism"] == "ort-mmap"
        assert "WebGPU sessions cannot share device weights" in seen["mechanism_reason"]
        assert seen["device"].startswith(WEBGPU)
        assert seen["warnings"] == []
        # A child process given the plan's spec registers the same library, same device.
        assert seen["spec"]["ep_libraries"][WEBGPU].endswith(
            ("onnxruntime_providers_webgpu.so", "onnxruntime_providers_webgpu.dll")
        )
    assert result["models"]["mlp.onnx"]["batching"]  # rows proven independent: merged


@pytest.mark.parametrize("attempt", range(2))
def test_the_default_pool_serves_16_threads_without_a_crash(mlp: str, attempt: int) -> None:
    result = run_scenario("pool_threads", model=mlp, threads=16, runs=24).ok()
    assert result["counts"] == {"ok": 16 * 24}, result
    assert result["sessions"] == 1 and result["batches"] > 0 and result["serialized_runs"]


@pytest.mark.parametrize("attempt", range(2))
def test_four_sessions_under_16_threads_take_turns_and_never_crash(mlp: str, attempt: int) -> None:
    # Plain ORT crashes with 4 sessions running at once; the pool's run lock lets one run.
    result = run_scenario("pool_threads", model=mlp, threads=16, runs=24, sessions=4).ok()
    assert result["counts"] == {"ok": 16 * 24}, result
    assert result["sessions"] == 4 and result["serialized_runs"]


def test_two_models_pools_share_one_device(mlp: str, cnn: str) -> None:
    # Plain sessions of two different models crash too: the lock is the device's, not a pool's.
    result = run_scenario("two_models", model_a=mlp, model_b=cnn, threads=16, runs=20).ok()
    assert result["counts"] == {"ok": 16 * 20}, result


def test_a_pool_created_and_closed_while_another_serves(mlp: str, cnn: str) -> None:
    result = run_scenario(
        "create_while_serving", model_a=mlp, model_b=cnn, threads=8, cycles=3
    ).ok()
    assert result["created"] == 3, result
    assert set(result["counts"]) == {"ok"} and result["counts"]["ok"] >= 9, result


def test_the_pool_serving_16_threads_costs_a_third_of_4_plain_sessions(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # 32 MiB of weights, far above the software driver's noise (a few MiB from run to run).
    model = str(
        batchable_model(tmp_path_factory.mktemp("webgpumem") / "m.onnx", dim=1024, layers=8)
    )
    weights = sum(f.stat().st_size for f in Path(model).parent.iterdir())
    plain = run_scenario("memory", model=model, config="plain", sessions=4, threads=1).ok()
    pool = run_scenario("memory", model=model, config="pool", sessions=1, threads=16).ok()
    lent = run_scenario(
        "memory", model=model, config="pool:in-memory-file", sessions=1, threads=16
    ).ok()
    ratio = pool["pss"] / plain["pss"]
    print(
        f"4 plain WebGPU sessions: {plain['pss'] / MiB:.0f} MiB; the pool serving 16 threads: "
        f"{pool['pss'] / MiB:.0f} MiB ({ratio:.2f}x); with the in-memory file: "
        f"{lent['pss'] / MiB:.0f} MiB"
    )
    assert ratio <= 0.35, (pool, plain)
    # The pool's route, ORT loading the weights from the file, holds no host copy beside the
    # device's; the in-memory file stays resident beside it: about one more copy.
    assert lent["pss"] - pool["pss"] >= 0.75 * weights, (lent, pool)


def test_inspect_measures_webgpu_one_session_at_a_time_and_names_the_device(mlp: str) -> None:
    result = run_scenario("inspect_cli", model=mlp, sessions=2).ok()
    assert result["returncode"] == 0, result["stderr"]
    report = result["report"]
    assert report["providers"][0] == WEBGPU and report["device"].startswith(WEBGPU)
    assert report["trial"]["error"] is None
    for name, strategy in report["strategies"].items():
        # Every measuring child registered the plugin and ran its sessions one at a time.
        assert not strategy["concurrent_runs"], name
        assert strategy["outputs_agree"], name
    assert report["sharedml_fixed"]["error"] is None
