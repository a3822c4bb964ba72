"""sharedml on the real DirectML runtime: the contract the pool exists to keep.

Each scenario runs in a child process (``tests/_dml_child.py``): a crash there is an outcome to
assert on, never the end of the test run. The first test reproduces, without sharedml, the
failure the project exists for (two threads in ``Run`` on one DML session crash the process),
so the harness provably sees a crash; the others put the pool through what would crash it if
it ever let two runs meet. Skipped where DirectML cannot run (``tests/_dml.py``); on Linux,
``tools/windows/setup.sh`` runs them on the real onnxruntime-directml under Wine.
"""

from __future__ import annotations

import pytest
from _dml import run_scenario
from _models import batchable_model

pytestmark = pytest.mark.dml


CRASH_WAIT_S = 90.0  # seconds a child that should crash may take before it counts as hung


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("dml")
    a = batchable_model(folder / "a.onnx", dim=64, layers=2, seed=1)
    b = batchable_model(folder / "b.onnx", dim=48, layers=3, seed=2)
    return str(a), str(b)


def test_two_threads_on_one_plain_dml_session_crash_the_process(models: tuple[str, str]) -> None:
    # The locked run of the same 400 runs takes seconds; the crash comes sooner.
    outcome = run_scenario(
        "plain_threads", model=models[0], runs=400, locked=False, timeout_s=CRASH_WAIT_S
    )
    # The process dies before its result line: a crash status (STATUS_ACCESS_VIOLATION), or,
    # in about one run in three under Wine, a crashed process that Wine reports as status 0;
    # now and then under Wine the faulted process never exits ("Unhandled page fault ...
    # starting debugger", with winedbg disabled), and is killed after CRASH_WAIT_S.
    dead = outcome.crash is not None or outcome.returncode == 0 or outcome.hung
    assert outcome.result is None and dead, (
        "two threads in Run on one DML session did not crash the process: the crash these "
        f"tests guard against no longer shows (exit {outcome.returncode}, result "
        f"{outcome.result})"
    )


def test_the_same_two_threads_taking_turns_never_crash(models: tuple[str, str]) -> None:
    result = run_scenario("plain_threads", model=models[0], runs=400, locked=True).ok()
    assert result["counts"] == {"ok": 800}, result


@pytest.mark.parametrize(("batching", "sessions"), [(True, 1), (False, 1), (False, 2)])
def test_the_pool_never_lets_two_runs_meet(
    models: tuple[str, str], batching: bool, sessions: int
) -> None:
    threads, runs = 32, 14
    result = run_scenario(
        "pool_threads",
        model=models[0],
        threads=threads,
        runs=runs,
        batching=batching,
        sessions=sessions,
    ).ok()
    counts = result["counts"]
    assert "error" not in counts and "wrong" not in counts, result
    assert "accepted-bad" not in counts, result
    # Every request answered: good ones (runs and checkouts) equal the CPU, bad ones refused.
    kinds = [
        ("good", "bad-shape", "good", "checkout", "bad-dtype", "good", "missing-input")[(i + r) % 7]
        for i in range(threads)
        for r in range(runs)
    ]
    assert counts["ok"] == sum(k in ("good", "checkout") for k in kinds), result
    assert counts["refused"] == len(kinds) - counts["ok"], result
    assert result["busy"] == 0 and result["waiting"] == 0
    if batching:
        assert result["max_batch_rows"] > 3, "queued requests were never merged (one has <= 3 rows)"


def test_two_models_pools_share_one_device(models: tuple[str, str]) -> None:
    result = run_scenario(
        "two_models", model_a=models[0], model_b=models[1], threads=16, runs=10
    ).ok()
    assert result["counts"] == {"ok": 160}, result


def test_a_pool_created_while_another_model_serves(models: tuple[str, str]) -> None:
    result = run_scenario(
        "create_while_serving", model_a=models[0], model_b=models[1], threads=8, creations=3
    ).ok()
    assert result["created"]["counts"] == {"ok": 3}, result
    serving = result["serving"]["counts"]
    assert set(serving) == {"ok"}, result
    # Model A kept being served across the creations (each waited for new runs of A).
    assert len(result["served_before"]) == 3 and serving["ok"] > result["served_before"][-1]


def test_close_under_load_ends_every_caller_with_pool_closed(models: tuple[str, str]) -> None:
    threads = 16
    result = run_scenario("close_under_load", model=models[0], threads=threads).ok()
    assert result["ended"] == {"closed": threads}, result
    assert set(result["counts"]) == {"ok"} and result["counts"]["ok"] >= 2 * threads, result
    assert result["closed"] is True


def test_outputs_equal_the_cpu_and_the_route_says_why(models: tuple[str, str]) -> None:
    result = run_scenario("outputs_and_route", model=models[0]).ok()
    assert result["providers"][0] == "DmlExecutionProvider"
    assert max(result["diffs"].values()) <= 1e-4 and result["plain_dml_diff"] <= 1e-4, result
    assert result["max_sessions"] == 1 and result["batching"] is True
    # No device route is tried on DML, and nothing warns about one: the reason says it plainly.
    assert result["mechanism"] == "ort-mmap"
    assert "device copy of the weights per session" in result["reason"], result["reason"]
    assert not [w for w in result["warnings"] if "dlpack" in w.lower() or "Device weight" in w]
