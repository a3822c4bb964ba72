"""Plugin execution providers, on any machine: registration, device choice, the fallback check.

ORT is faked only at its public seam: ``onnxruntime.register_execution_provider_library`` and
``onnxruntime.get_ep_devices`` (a fake registry that behaves as ORT 1.32 does: the same name
twice raises "already registered", a library that cannot load raises), and, for sessions,
``onnxruntime.InferenceSession`` and ``SessionOptions.add_provider_for_devices``. Every test uses
EP names of its own, because registration is per process (as in ORT). The real WebGPU plugin runs
in ``tests/test_webgpu.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest
from _models import batchable_model

import sharedml
from sharedml.runtime._plugins import (
    KNOWN_PLUGINS,
    SOFTWARE_ADAPTER_ENV,
    WEBGPU,
    DeviceSelector,
    KnownPlugin,
    registered_libraries,
)
from sharedml.runtime._providers import (
    CPU,
    PROVIDER_FACTS,
    facts_for,
    plan_from_spec,
    plan_providers,
    runs_rule,
)

pytestmark = pytest.mark.skipif(
    not hasattr(ort, "register_execution_provider_library"),
    reason="plugin execution providers need onnxruntime 1.23+",
)

GPU = ort.OrtHardwareDeviceType.GPU
NPU = ort.OrtHardwareDeviceType.NPU


def hardware(kind: Any, vendor: str, vendor_id: int, device_id: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        type=kind, vendor=vendor, vendor_id=vendor_id, device_id=device_id, metadata={}
    )


class FakeOrt:
    """ORT's plugin registry as 1.32 behaves, for libraries that are files in a test folder."""

    def __init__(self, real_devices: Any) -> None:
        self.libraries: dict[str, list[Any]] = {}  # library path -> the devices it offers
        self.registered: dict[str, str] = {}  # registration name -> library path
        self.calls: list[tuple[str, str]] = []
        self.delay = threading.Event()  # set: registering takes a while (a race is likely)
        self._real = real_devices
        self._lock = threading.Lock()

    def library(self, folder: Path, ep_name: str, *hw: Any) -> str:
        path = folder / f"lib{ep_name}.so"
        path.write_bytes(b"\x7fELF fake")
        self.libraries[str(path)] = [
            types.SimpleNamespace(
                ep_name=ep_name,
                ep_vendor="Test",
                ep_metadata={"library_path": str(path), "seq": str(i)},
                ep_options={},
                device=h,
            )
            for i, h in enumerate(hw)
        ]
        return str(path)

    def register(self, name: str, path: str) -> None:
        self.calls.append((name, path))
        if self.delay.is_set():
            threading.Event().wait(0.05)
        with self._lock:
            if name in self.registered:
                raise RuntimeError(f"Fail: EP library is already registered under {name}")
            if path not in self.libraries:
                raise RuntimeError(f"Fail: Failed to load library {path} with error: invalid ELF")
            self.registered[name] = path

    def get_ep_devices(self) -> list[Any]:
        with self._lock:
            mine = [d for p in self.registered.values() for d in self.libraries[p]]
        return [*self._real(), *mine]


@pytest.fixture
def fake_ort(monkeypatch: pytest.MonkeyPatch) -> FakeOrt:
    fake = FakeOrt(ort.get_ep_devices)
    monkeypatch.setattr(ort, "register_execution_provider_library", fake.register)
    monkeypatch.setattr(ort, "get_ep_devices", fake.get_ep_devices)
    return fake


@pytest.fixture
def name() -> str:
    """An EP name no other test registered (registration lasts as long as the process)."""
    return f"Test{uuid.uuid4().hex[:12]}ExecutionProvider"


@pytest.fixture
def packaged(
    fake_ort: FakeOrt, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """``name`` is shipped by a (fake) package sharedml knows, offering two GPUs and an NPU."""
    path = fake_ort.library(
        tmp_path,
        name,
        hardware(GPU, "NVIDIA", 0x10DE, 0x2330),
        hardware(GPU, "NVIDIA", 0x10DE, 0x2330),
        hardware(NPU, "Intel", 0x8086, 0x7D1D),
    )
    module = f"fake_ep_{name.lower()}"
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(get_library_path=lambda: path))
    monkeypatch.setitem(KNOWN_PLUGINS, name, KnownPlugin(module, f"fake-ep-{name.lower()}"))  # type: ignore[index]
    yield path


# --------------------------------------------------------------------------------------------
# Registration


def test_a_known_package_is_registered_once_and_its_first_device_chosen(
    fake_ort: FakeOrt, packaged: str, name: str
) -> None:
    first = plan_providers([name])
    again = plan_providers([(name, {"opt": 1})])
    assert fake_ort.calls == [(name, packaged)]  # once per process
    assert first.providers == (name, CPU) and again.provider_options[0] == {"opt": "1"}
    assert first.plugin is not None and first.plugin.library == packaged
    assert first.plugin.found == f"package fake-ep-{name.lower()}"
    assert first.plugin.selector == DeviceSelector(
        type="gpu", vendor_id=0x10DE, device_id=0x2330, index=0
    )
    assert "NVIDIA" in first.device and again.device_key == first.device_key
    assert registered_libraries()[name] == packaged


def test_threads_asking_at_once_register_the_library_once(
    fake_ort: FakeOrt, packaged: str, name: str, fast_switching: None
) -> None:
    fake_ort.delay.set()  # each registration takes 50 ms: a check-then-register races
    barrier = threading.Barrier(8)
    keys: list[str] = []
    errors: list[BaseException] = []

    def plan() -> None:
        barrier.wait()
        try:
            keys.append(plan_providers([name]).device_key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=plan) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert fake_ort.calls == [(name, packaged)]
    assert len(keys) == 8 and len(set(keys)) == 1


def test_a_library_the_caller_registered_first_is_used_as_it_is(
    fake_ort: FakeOrt, name: str, tmp_path: Path
) -> None:
    path = fake_ort.library(tmp_path, name, hardware(GPU, "AMD", 0x1002, 0x744C))
    ort.register_execution_provider_library("the-callers-own-name", path)
    plan = plan_providers([name])  # neither known nor given: found registered
    assert fake_ort.calls == [("the-callers-own-name", path)]  # sharedml did not register it
    assert plan.plugin is not None and plan.plugin.found == "registered before sharedml"
    assert plan.plugin.library == path  # from the device's metadata: children register it
    assert plan.to_spec()["ep_libraries"] == {name: path}


def test_a_library_given_for_a_name_the_caller_registered_is_not_registered_twice(
    fake_ort: FakeOrt, name: str, tmp_path: Path
) -> None:
    path = fake_ort.library(tmp_path, name, hardware(GPU, "AMD", 0x1002, 0x744C))
    ort.register_execution_provider_library(name, path)
    plan = plan_providers([name], ep_libraries={name: path})
    assert [c for c in fake_ort.calls if c[0] == name] == [(name, path)]
    assert plan.plugin is not None and plan.plugin.found == "registered before sharedml"


def test_a_name_registered_first_without_devices_is_a_no_device_error(
    fake_ort: FakeOrt, name: str, tmp_path: Path
) -> None:
    path = fake_ort.library(tmp_path, name)  # offers no device here
    ort.register_execution_provider_library(name, path)
    with pytest.raises(sharedml.ProviderError, match="offers no device on this machine"):
        plan_providers([name], ep_libraries={name: path})


def test_a_missing_library_is_refused_naming_the_path_and_the_fix(
    fake_ort: FakeOrt, name: str, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere" / "libfoo.so"
    with pytest.raises(sharedml.ProviderError) as info:
        plan_providers([name], ep_libraries={name: missing})
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)
    assert f"--ep-library {name}=PATH" in str(info.value)
    with pytest.raises(sharedml.ProviderError, match="is a folder"):
        plan_providers([name], ep_libraries={name: tmp_path})
    assert fake_ort.calls == []


def test_a_file_that_is_not_a_plugin_library_is_refused_with_orts_reason(
    fake_ort: FakeOrt, name: str, tmp_path: Path
) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("not a library")
    with pytest.raises(sharedml.ProviderError) as info:
        plan_providers([name], ep_libraries={name: bad})
    text = str(info.value)
    assert f"could not register '{bad}' as the library of {name}" in text
    assert "invalid ELF" in text and "CreateEpFactories" in text
    assert name not in registered_libraries()  # a later, right path may still register


def test_an_unknown_provider_says_how_to_give_its_library(fake_ort: FakeOrt, name: str) -> None:
    with pytest.raises(sharedml.ProviderError) as info:
        plan_providers([name])
    text = str(info.value)
    assert f"ep_libraries={{'{name}': PATH}}" in text and f"--ep-library {name}=PATH" in text
    assert "onnxruntime-ep-webgpu" in text  # the packages sharedml finds by itself


def test_a_known_provider_without_its_package_names_the_package(
    fake_ort: FakeOrt, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(KNOWN_PLUGINS, name, KnownPlugin("no_such_module_xyz", "no-such-ep"))  # type: ignore[index]
    with pytest.raises(sharedml.ProviderError, match="pip install no-such-ep"):
        plan_providers([name])


def test_builtin_cuda_and_directml_keep_their_install_hints(fake_ort: FakeOrt) -> None:
    with pytest.raises(sharedml.ProviderError, match="onnxruntime-gpu"):
        plan_providers(["CUDAExecutionProvider"], available=[CPU])
    assert fake_ort.calls == []


def test_a_plugin_runs_first_and_alone(fake_ort: FakeOrt, packaged: str, name: str) -> None:
    with pytest.raises(sharedml.ProviderError, match="runs first and alone"):
        plan_providers(["CUDAExecutionProvider", name], available=[CPU, "CUDAExecutionProvider"])
    with pytest.raises(sharedml.ProviderError, match="does not ask for"):
        plan_providers([CPU], ep_libraries={name: packaged})


# --------------------------------------------------------------------------------------------
# Devices


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (DeviceSelector(type="npu"), ("npu", 0x8086, 0)),
        (DeviceSelector(vendor="nvidia", index=1), ("gpu", 0x10DE, 1)),
        (DeviceSelector(vendor_id=0x10DE, device_id=0x2330), ("gpu", 0x10DE, 0)),
        ("type=gpu,index=1", ("gpu", 0x10DE, 1)),
        ({"type": "npu"}, ("npu", 0x8086, 0)),
    ],
)
def test_a_device_is_chosen_by_type_vendor_and_id(
    fake_ort: FakeOrt, packaged: str, name: str, selector: Any, expected: tuple[Any, ...]
) -> None:
    plan = plan_providers([name], ep_devices={name: selector})
    assert plan.plugin is not None
    pinned = plan.plugin.selector
    assert (pinned.type, pinned.vendor_id, pinned.index) == expected
    # The choice travels as plain data and picks the same device in another process.
    again = plan_from_spec(json.loads(json.dumps(plan.to_spec())))
    assert again.device_key == plan.device_key
    assert again.plugin is not None
    assert again.plugin.devices()[0].ep_metadata == plan.plugin.devices()[0].ep_metadata


def test_no_fitting_device_lists_what_the_provider_offers(
    fake_ort: FakeOrt, packaged: str, name: str
) -> None:
    with pytest.raises(sharedml.ProviderError) as info:
        plan_providers([name], ep_devices={name: DeviceSelector(type="gpu", index=2)})
    assert "fits type=gpu,index=2" in str(info.value)
    assert "NPU device of Intel" in str(info.value) and "GPU device of NVIDIA" in str(info.value)


def test_ep_device_objects_choose_as_windows_ml_hands_them_out(
    fake_ort: FakeOrt, packaged: str, name: str
) -> None:
    plan_providers([name])  # registered: the caller now lists the devices as Windows ML does
    second, npu = [d for d in ort.get_ep_devices() if d.ep_name == name][1:]
    by_object = plan_providers([(npu, {"x": "1"})])
    assert by_object.primary == name and by_object.provider_options[0] == {"x": "1"}
    assert by_object.plugin is not None and by_object.plugin.selector.type == "npu"
    by_mapping = plan_providers([name], ep_devices={name: [second]})
    assert by_mapping.plugin is not None and by_mapping.plugin.selector.index == 1
    with pytest.raises(sharedml.ProviderError, match="given twice"):
        plan_providers([npu], ep_devices={name: DeviceSelector(type="npu")})


@pytest.mark.parametrize(
    ("text", "error"),
    [("type=tpu", "cpu, gpu, npu"), ("colour=red", "key=value"), ("index=two", "a number")],
)
def test_a_bad_selector_is_refused_saying_what_fits(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        DeviceSelector.parse(text)


# --------------------------------------------------------------------------------------------
# Sessions: chosen by device, never by providers=, and checked


def test_sessions_add_the_device_and_refuse_a_cpu_fallback(
    fake_ort: FakeOrt,
    packaged: str,
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    added: list[tuple[Any, dict[str, str]]] = []
    created: list[dict[str, Any]] = []
    real_session = ort.InferenceSession

    def add_provider_for_devices(self: Any, devices: Any, options: Any) -> None:
        added.append((devices, dict(options)))

    def fallback_session(path: Any, so: Any = None, **kwargs: Any) -> Any:
        # What ORT does when the provider fails to start (and fallback is on): a CPU session.
        created.append(kwargs)
        return real_session(path, providers=[CPU])

    monkeypatch.setattr(ort.SessionOptions, "add_provider_for_devices", add_provider_for_devices)
    monkeypatch.setattr(ort, "InferenceSession", fallback_session)
    model = batchable_model(tmp_path / "b.onnx")
    with pytest.raises(sharedml.ProviderError) as info:
        sharedml.SessionPool(model, providers=[(name, {"k": "v"})], create_in_background=False)
    assert f"runs on {CPU} instead of {name}" in str(info.value)
    assert "fell back" in str(info.value)
    assert len(added) == 1 and added[0][1] == {"k": "v"}
    assert added[0][0][0].device.vendor == "NVIDIA"
    assert created[-1] == {"enable_fallback": 0}  # no providers=: ORT would ignore the devices


def test_a_session_on_the_provider_passes_and_loses_its_run_time_fallback(
    fake_ort: FakeOrt, packaged: str, name: str
) -> None:
    plan = plan_providers([name])
    disabled: list[bool] = []
    sess = types.SimpleNamespace(
        get_providers=lambda: [name, CPU], disable_fallback=lambda: disabled.append(True)
    )
    plan.check_session(sess, "A session")
    assert disabled == [True]


def test_a_template_with_devices_added_is_refused(tmp_path: Path) -> None:
    template = ort.SessionOptions()
    cpu = next(d for d in ort.get_ep_devices() if d.ep_name == CPU)
    template.add_provider_for_devices([cpu], {})
    with pytest.raises(sharedml.ProviderError, match="ORT cannot read back"):
        sharedml.SessionPool(batchable_model(tmp_path / "b.onnx"), sess_options=template)


def test_configure_that_adds_devices_is_refused(tmp_path: Path) -> None:
    cpu = next(d for d in ort.get_ep_devices() if d.ep_name == CPU)
    with pytest.raises(sharedml.ProviderError, match="configure added execution providers"):
        sharedml.SessionPool(
            batchable_model(tmp_path / "b.onnx"),
            configure=lambda so: so.add_provider_for_devices([cpu], {}),
            create_in_background=False,
        )


# --------------------------------------------------------------------------------------------
# The provider table


def test_the_table_has_a_row_for_each_provider_it_promises() -> None:
    assert {
        "CPUExecutionProvider",
        "CUDAExecutionProvider",
        "DmlExecutionProvider",
        WEBGPU,
        "OpenVINOExecutionProvider",
        "nv_tensorrt_rtx",
    } <= set(PROVIDER_FACTS)
    webgpu = PROVIDER_FACTS[WEBGPU]
    assert not webgpu.runs_overlap and webgpu.serialized("1.32.0")
    assert webgpu.default_sessions == 1 and webgpu.weights == "ort-mmap"
    assert not webgpu.device_route


def test_an_unknown_plugin_is_serialized_until_the_caller_says_otherwise(
    fake_ort: FakeOrt, packaged: str, name: str, tmp_path: Path
) -> None:
    plan = plan_providers([name])
    rule = runs_rule(plan)
    assert rule.serialized and "not in sharedml's provider table" in rule.reason
    assert "serialize_runs=False" in rule.reason
    assert facts_for(name, plugin=True).weights == "ort-mmap"
    model = batchable_model(tmp_path / "b.onnx")
    with sharedml.SessionPool(model, providers=[name], min_sessions=0) as pool:
        stats = pool.stats()
        assert stats.serialized_runs and stats.runs_rule == rule.reason
        assert pool.max_sessions == 1 and pool.batching is not None
        assert pool.mechanism == "ort-mmap" and "cannot share device weights" in (
            pool.mechanism_reason
        )
        assert "NVIDIA" in stats.device
    with sharedml.SessionPool(
        model, providers=[name], min_sessions=0, serialize_runs=False
    ) as pool:
        assert not pool.stats().serialized_runs
        assert "by the caller (serialize_runs=False)" in pool.stats().runs_rule
        assert pool.max_sessions == 4


def test_pools_of_one_device_share_one_run_lock_and_other_devices_do_not(
    fake_ort: FakeOrt, packaged: str, name: str, tmp_path: Path
) -> None:
    from sharedml.pool._runlock import run_lock_for

    first = plan_providers([name], ep_devices={name: DeviceSelector(index=0)})
    same = plan_providers([name])
    other = plan_providers([name], ep_devices={name: DeviceSelector(index=1)})
    assert run_lock_for(first) is run_lock_for(same)
    assert run_lock_for(first) is not run_lock_for(other)


# --------------------------------------------------------------------------------------------
# WebGPU's own messages, each in a fresh process (the switch is read when it registers)

_WEBGPU_CHILD = textwrap.dedent(
    """
    import os, sys, types
    import onnxruntime as ort
    registered = []
    ort.register_execution_provider_library = lambda name, path: registered.append(name)
    ort.get_ep_devices = lambda: []  # WebGPU found no adapter
    package = types.SimpleNamespace(get_library_path=lambda: sys.argv[1])
    sys.modules["onnxruntime_ep_webgpu"] = package
    import sharedml
    from sharedml.runtime._providers import plan_providers
    for step in sys.argv[2:]:
        if step == "set":
            os.environ["{env}"] = "1"
            continue
        try:
            plan_providers(["WebGpuExecutionProvider"])
        except sharedml.ProviderError as exc:
            print("ERROR", exc)
    """
).format(env=SOFTWARE_ADAPTER_ENV)


def _webgpu_messages(tmp_path: Path, *steps: str, switch: bool) -> list[str]:
    library = tmp_path / "libwebgpu.so"
    library.write_bytes(b"\x7fELF fake")
    env = {k: v for k, v in os.environ.items() if k != SOFTWARE_ADAPTER_ENV}
    if switch:
        env[SOFTWARE_ADAPTER_ENV] = "1"
    out = subprocess.run(
        [sys.executable, "-c", _WEBGPU_CHILD, str(library), *steps],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout
    return [line for line in out.splitlines() if line.startswith("ERROR")]


def test_webgpu_without_the_software_switch_says_to_set_it(tmp_path: Path) -> None:
    (message,) = _webgpu_messages(tmp_path, "plan", switch=False)
    assert f"set {SOFTWARE_ADAPTER_ENV}=1 in the environment" in message
    assert "no GPU adapter" in message


def test_webgpu_with_the_switch_set_too_late_says_so(tmp_path: Path) -> None:
    first, late = _webgpu_messages(tmp_path, "plan", "set", "plan", switch=False)
    assert "no GPU adapter" in first
    assert f"before {SOFTWARE_ADAPTER_ENV}=1 was set" in late


def test_webgpu_without_any_adapter_says_which_driver_is_missing(tmp_path: Path) -> None:
    (message,) = _webgpu_messages(tmp_path, "plan", switch=True)
    assert f"even with {SOFTWARE_ADAPTER_ENV}=1" in message
    assert "mesa-vulkan-drivers" in message and "vulkaninfo" in message


def test_a_plugin_the_caller_registered_stays_a_plugin_when_ort_lists_it_as_available(
    fake_ort: FakeOrt, name: str, tmp_path: Path
) -> None:
    # onnxruntime 1.32 lists a registered plugin EP in get_available_providers() too.
    path = fake_ort.library(tmp_path, name, hardware(GPU, "AMD", 0x1002, 0x744C))
    ort.register_execution_provider_library(name, path)
    plan = plan_providers([name], available=[CPU, name])
    assert plan.plugin is not None and plan.to_spec()["ep_libraries"] == {name: path}
