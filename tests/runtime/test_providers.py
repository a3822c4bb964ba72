"""Provider policy: what the pool passes to ORT for CPU, CUDA and DirectML.

DirectML cannot run on Linux, so these tests check the *plan* (providers, options, session
settings, run serialization) that the pool applies; ``.github/workflows/windows-directml.yml``
runs the suite with onnxruntime-directml on Windows.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import onnxruntime as ort
import pytest
from _models import batchable_model, build_model, save_model

import sharedml
import sharedml.pool._pool
from sharedml.runtime import _providers
from sharedml.runtime._providers import (
    CPU,
    CUDA,
    DML,
    ProviderPlan,
    plan_providers,
    serialize_runs_by_default,
)
from sharedml.weights import _probe as _device_probe

ALL = [CPU, CUDA, DML]


def test_no_providers_means_cpu() -> None:
    plan = plan_providers(None, available=[CPU])
    assert plan.providers == (CPU,)
    assert plan.provider_options == ({},)
    assert plan.primary == CPU and plan.device_id == 0
    assert plan.config_entries == ()
    assert not plan.disable_mem_pattern and not plan.sequential_execution


def test_cuda_gets_a_device_id_and_cpu_as_fallback() -> None:
    plan = plan_providers([CUDA], available=ALL)
    assert plan.providers == (CUDA, CPU)
    assert plan.provider_options[0]["device_id"] == "0"
    assert plan.provider_options[1] == {}
    assert plan.config_entries == ()
    assert not plan.disable_mem_pattern and not plan.sequential_execution


def test_callers_options_win_and_become_strings() -> None:
    plan = plan_providers(
        [(CUDA, {"device_id": 1, "gpu_mem_limit": 2 << 30})],
        available=ALL,
    )
    assert plan.device_id == 1
    assert plan.provider_options[0]["device_id"] == "1"
    assert plan.provider_options[0]["gpu_mem_limit"] == str(2 << 30)

    plan = plan_providers([CUDA], [{"device_id": 3}], available=ALL)
    assert plan.device_id == 3


def test_cuda_sessions_get_one_stream_each_unless_the_caller_says_otherwise() -> None:
    assert _providers.CUDA_SESSION_DEFAULTS == {"use_ep_level_unified_stream": "1"}
    # Measured: 8 pool sessions over 1 GiB take 1638 MiB with it, 2808 without (docs/gpu.md).
    plan = plan_providers([CUDA], available=ALL)
    assert plan.provider_options[0]["use_ep_level_unified_stream"] == "1"
    plan = plan_providers([(CUDA, {"use_ep_level_unified_stream": "0"})], available=ALL)
    assert plan.provider_options[0]["use_ep_level_unified_stream"] == "0"
    assert (
        "use_ep_level_unified_stream"
        not in plan_providers([DML], available=ALL).provider_options[0]
    )


def test_a_single_provider_name_is_accepted() -> None:
    assert plan_providers(CUDA, available=ALL).providers == (CUDA, CPU)


def test_cpu_is_not_added_twice_and_keeps_its_place() -> None:
    plan = plan_providers([CUDA, CPU], available=ALL)
    assert plan.providers == (CUDA, CPU)


def test_directml_plan_has_the_settings_dml_needs() -> None:
    plan = plan_providers([DML], available=ALL)
    assert plan.providers == (DML, CPU)
    assert plan.provider_options[0] == {"device_id": "0"}
    # ORT forces both for DML (with a warning); the pool sets them so that it does not have to.
    assert plan.disable_mem_pattern
    assert plan.sequential_execution
    # Graph fusion stays on: it costs sharing only where device weights are shared.
    assert plan.config_entries == ()


def test_directml_device_id_is_kept() -> None:
    plan = plan_providers([(DML, {"device_id": "1"})], available=ALL)
    assert plan.device_id == 1


def test_mismatched_provider_options_are_refused() -> None:
    with pytest.raises(sharedml.ProviderError, match="one dict per provider"):
        plan_providers([CUDA, CPU], [{}], available=ALL)


@pytest.mark.parametrize(
    ("provider", "hint"),
    [(CUDA, "onnxruntime-gpu"), (DML, "onnxruntime-directml")],
)
def test_missing_providers_are_an_error_with_the_package_to_install(
    provider: str, hint: str
) -> None:
    with pytest.raises(sharedml.ProviderError, match=hint) as info:
        plan_providers([provider], available=[CPU])
    assert provider in str(info.value) and "available: CPUExecutionProvider" in str(info.value)


def test_unknown_providers_pass_through_when_available() -> None:
    plan = plan_providers(
        ["OpenVINOExecutionProvider"], available=[CPU, "OpenVINOExecutionProvider"]
    )
    assert plan.providers == ("OpenVINOExecutionProvider", CPU)
    assert plan.provider_options[0] == {}


def test_default_availability_comes_from_onnxruntime() -> None:
    assert _providers.available_providers() == ort.get_available_providers()


@pytest.mark.parametrize(
    ("version", "serialize"),
    [
        ("1.17.3", False),  # the last release where concurrent DML sessions worked (#20713)
        ("1.18.0", True),
        ("1.18.0.dev20240501", True),
        ("1.20.1", True),
        ("1.24.4", True),
        ("2.0.0rc1", True),
        ("1.9.0", False),
    ],
)
def test_directml_runs_are_serialized_from_1_18(version: str, serialize: bool) -> None:
    plan = plan_providers([DML], available=ALL)
    assert serialize_runs_by_default(plan, version) is serialize


@pytest.mark.parametrize("provider", [CPU, CUDA])
def test_other_providers_are_not_serialized(provider: str) -> None:
    plan = plan_providers([provider], available=ALL)
    assert serialize_runs_by_default(plan, "1.24.0") is False


def test_serialization_reads_the_installed_version_by_default() -> None:
    plan = ProviderPlan(providers=(DML, CPU), provider_options=({"device_id": "0"}, {}))
    expected = _providers._version_tuple(ort.__version__) >= (1, 18)
    assert serialize_runs_by_default(plan) is expected


# --------------------------------------------------------------------------------------------
# The pool applies a DirectML plan (sessions are never created here: min_sessions=0)


@pytest.fixture
def dml(monkeypatch: pytest.MonkeyPatch) -> None:
    """This build "has" DirectML; no device route works for it (as on Windows today)."""
    monkeypatch.setattr(_providers, "available_providers", lambda: [DML, CPU])
    monkeypatch.setattr(_device_probe, "_PROBES", {})
    monkeypatch.delenv(_device_probe.ROUTE_ENV, raising=False)
    monkeypatch.setattr(sharedml.pool._pool, "_WARNED_SESSIONS", set())


def dml_pool(model: Path, **kwargs: object) -> sharedml.SessionPool:
    # min_sessions=0: no DML session is created on this machine (it has no DirectML).
    return sharedml.SessionPool(model, providers=[DML], min_sessions=0, **kwargs)  # type: ignore[arg-type]


SERIALIZED = _providers._version_tuple(ort.__version__) >= (1, 18)


@pytest.mark.skipif(not SERIALIZED, reason="DirectML serializes runs on onnxruntime >= 1.18")
def test_directml_defaults_to_one_fused_session_with_batching(dml: None, tmp_path: Path) -> None:
    with dml_pool(batchable_model(tmp_path / "b.onnx")) as pool:
        assert pool.max_sessions == 1 and pool.batching is not None
        so = pool.recipe.options()
        assert so.enable_mem_pattern is False
        assert so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
        # Fusion stays on: it cost no memory on DirectML (docs/directml.md).
        with pytest.raises(RuntimeError):
            so.get_session_config_entry("ep.dml.disable_graph_fusion")


@pytest.mark.skipif(not SERIALIZED, reason="DirectML serializes runs on onnxruntime >= 1.18")
def test_directml_runs_unbatched_where_the_model_cannot_batch(dml: None, tmp_path: Path) -> None:
    # build_model's input is float32[1, D]: axis 0 is fixed, so nothing can merge.
    model = save_model(build_model(["initializer"], dim=32), tmp_path / "m.onnx")
    with dml_pool(model) as pool:
        assert pool.max_sessions == 1 and pool.batching is None


@pytest.mark.skipif(not SERIALIZED, reason="DirectML serializes runs on onnxruntime >= 1.18")
def test_extra_directml_sessions_warn_once_unless_the_caller_says_why(
    dml: None, tmp_path: Path
) -> None:
    model = batchable_model(tmp_path / "b.onnx")
    with pytest.warns(
        RuntimeWarning, match="4 sessions on DmlExecutionProvider.*per_session_state"
    ):
        dml_pool(model, sessions=4).close()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*sessions on DmlExecutionProvider")
        sharedml.SessionPool(model, providers=[DML], min_sessions=0, sessions=4).close()  # once
        sharedml.pool._pool._WARNED_SESSIONS.clear()
        sharedml.SessionPool(
            model, providers=[DML], min_sessions=0, sessions=4, per_session_state=True
        ).close()


def test_directml_loads_weights_from_the_file_and_says_each_session_uploads_its_own(
    dml: None, tmp_path: Path
) -> None:
    # No device route is probed on DML (none can work) and nothing warns: the reason says it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pool = dml_pool(batchable_model(tmp_path / "b.onnx"))
    with pool:
        assert pool.mechanism == "ort-mmap"
        assert "ORT uploads a device copy of the weights per session" in pool.mechanism_reason
        assert "frees its host copy after the upload" in pool.mechanism_reason


@pytest.mark.parametrize("mechanism", ["in-memory-file", "add-initializer"])
def test_directml_with_a_host_mechanism_asked_for_says_what_it_costs(
    dml: None, tmp_path: Path, mechanism: str
) -> None:
    with dml_pool(batchable_model(tmp_path / "b.onnx"), mechanism=mechanism) as pool:
        assert pool.mechanism == mechanism
        assert "device copy of the weights per session" in pool.mechanism_reason
        assert ("resident" if mechanism == "in-memory-file" else "copies it") in (
            pool.mechanism_reason
        )


def test_directml_refuses_device_weights_and_says_why(dml: None, tmp_path: Path) -> None:
    with pytest.raises(sharedml.ProviderError, match="DLPack bridge exports CPU and CUDA"):
        dml_pool(batchable_model(tmp_path / "b.onnx"), mechanism="device")


def test_pool_keeps_a_callers_graph_fusion_setting(dml: None, tmp_path: Path) -> None:
    template = ort.SessionOptions()
    template.add_session_config_entry("ep.dml.disable_graph_fusion", "0")
    with dml_pool(
        batchable_model(tmp_path / "b.onnx"), sess_options=template, serialize_runs=False
    ) as pool:
        so = pool.recipe.options()
        assert so.get_session_config_entry("ep.dml.disable_graph_fusion") == "0"
        assert pool.max_sessions == 4  # runs may overlap: the usual default
