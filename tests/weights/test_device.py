"""The device weight store: routes, probes, fallbacks, and (with a GPU) sessions borrowing VRAM.

Everything but the ``gpu`` tests runs on the CPU: the store's upload / view / register path
works the same with ORT's CPU device, and a CPU session's output shows whether it borrowed the
store's buffer (change the buffer, see the output change). Probe failures are simulated by
swapping the probe child's code, so crash handling is tested with real crashing processes.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _models import build_model, feeds, save_model
from onnx import TensorProto

import sharedml
from sharedml._host._children import crash_name
from sharedml.route._options import RouteOptions, WeightsSettings
from sharedml.route._planner import open_model, plan_route
from sharedml.runtime._providers import DML_NO_DEVICE_ROUTE, plan_providers
from sharedml.weights import _device
from sharedml.weights import _probe as _device_probe
from sharedml.weights._device import DeviceWeightStore
from sharedml.weights._probe import RouteProbe
from sharedml.weights._store import TensorSlot

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
DML = "DmlExecutionProvider"
HAS_CUDA = CUDA in ort.get_available_providers()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a CUDA device")


@pytest.fixture(autouse=True)
def _fresh_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_device_probe.ROUTE_ENV, raising=False)
    monkeypatch.setattr(_device_probe, "_PROBES", {})


@pytest.fixture
def prepared(tmp_path: Path) -> Path:
    model = build_model(["initializer", "if_initializer", "loop_constant"], dim=64)
    src = save_model(model, tmp_path / "m.onnx")
    dst = tmp_path / "prepared" / "m.onnx"
    sharedml.prepare(src, dst)
    return dst


def _cpu_session(path: Path, store: DeviceWeightStore) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    # CPU MatMul prepacks (copies) its weight unless told not to; the pool does the same.
    so.add_session_config_entry("session.disable_prepacking", "1")
    store.register(so)
    return ort.InferenceSession(str(path), so, providers=[CPU])


def _scaled(buffer: np.ndarray, factor: float) -> np.ndarray:
    return (np.array(buffer).view(np.float32) * np.float32(factor)).view(np.uint8)


# --------------------------------------------------------------------------------------------
# Uploads and views (CPU device)


@pytest.mark.capability("dlpack")
@pytest.mark.parametrize("route", ["ort-slab", "ort-per-tensor"])
def test_sessions_borrow_the_uploaded_buffers_in_subgraphs_too(prepared: Path, route: str) -> None:
    weights = sharedml.weights.WeightStore.open(prepared)
    store = DeviceWeightStore.for_store(weights, CPU, 0, route=route)
    assert set(store.tensor_names) == {s.name for s in weights.slots}
    assert store.host_tensors == ()
    sessions = [_cpu_session(prepared, store) for _ in range(3)]
    feed = feeds(64)
    before = [s.run(None, feed)[0] for s in sessions]
    for out in before[1:]:
        np.testing.assert_array_equal(out, before[0])

    store.reload(_scaled(weights.buffer, 2.0))
    after = [s.run(None, feed)[0] for s in sessions]
    # Every weight on the path doubled, in place, in every session: the main graph's, the
    # If branch's and the Loop body's (which runs more than once).
    ratio = np.abs(after[0]).sum() / np.abs(before[0]).sum()
    assert ratio >= 8.0 - 1e-3
    for out in after[1:]:
        np.testing.assert_array_equal(out, after[0])


@pytest.mark.capability("dlpack")
def test_slab_views_point_into_one_buffer_at_the_file_offsets(prepared: Path) -> None:
    weights = sharedml.weights.WeightStore.open(prepared)
    store = DeviceWeightStore.for_store(weights, CPU, 0, route="ort-slab")
    lo = min(s.offset for s in weights.slots) // 256 * 256
    hi = max(s.offset + s.length for s in weights.slots)
    assert store.device_bytes == hi - lo
    values = store._upload.values  # type: ignore[union-attr]
    base = values[weights.slots[0].name].data_ptr() - (weights.slots[0].offset - lo)
    for slot in weights.slots:
        assert values[slot.name].data_ptr() == base + slot.offset - lo
        assert tuple(values[slot.name].shape()) == slot.dims
        expected = weights.buffer[slot.offset : slot.offset + slot.length].view(np.float32)
        np.testing.assert_array_equal(values[slot.name].numpy().ravel(), expected)


def _packed_model(tmp_path: Path) -> Path:
    """A prepared model whose first device tensor sits at a 16-byte offset, before a page one.

    A bool (which DLPack does not carry) takes offset 0, a 16-byte float tensor packs at 16,
    and a 4 KiB one starts on the next page.
    """
    inits = [
        onnx.numpy_helper.from_array(np.array([True, False, True]), "flags"),
        onnx.numpy_helper.from_array(np.arange(4, dtype=np.float32), "small"),
        onnx.numpy_helper.from_array(np.arange(1024, dtype=np.float32), "large"),
    ]
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])],
        "packed",
        [onnx.helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=inits,
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    src = save_model(model, tmp_path / "src" / "m.onnx", external="one", threshold=0)
    return sharedml.prepare(src, tmp_path / "p" / "m.onnx", size_threshold_bytes=0).model_path


@pytest.mark.capability("dlpack")
@pytest.mark.parametrize("route", ["ort-slab", "ort-per-tensor"])
def test_device_views_keep_the_file_alignment_of_packed_tensors(tmp_path: Path, route: str) -> None:
    weights = sharedml.weights.WeightStore.open(_packed_model(tmp_path))
    offsets = {s.name: s.offset for s in weights.slots}
    assert offsets == {"flags": 0, "small": 16, "large": 4096}
    store = DeviceWeightStore.for_store(weights, CPU, 0, route=route)
    assert store.host_tensors == ("flags",)
    values = store._upload.values  # type: ignore[union-attr]
    for slot in weights.slots[1:]:
        # ORT's CPU allocations are 64-byte aligned: a view keeps its file alignment up to that.
        wanted = min(64, weights.manifest.alignment_for(slot.length))
        assert values[slot.name].data_ptr() % wanted == 0, (slot, values[slot.name].data_ptr())
        expected = weights.buffer[slot.offset : slot.offset + slot.length].view(np.float32)
        np.testing.assert_array_equal(values[slot.name].numpy().ravel(), expected)


@pytest.mark.capability("dlpack")
def test_views_keep_the_slab_alive_after_the_store_is_closed() -> None:
    # 64 MiB: the allocator hands a block this large back to the OS when it is freed, so a
    # view that outlived its slab would fault here instead of reading stale bytes.
    size = 64 << 20
    buffer = np.zeros(size, np.uint8)
    buffer[-4096:].view(np.float32)[:] = 5.0
    slot = TensorSlot("last", TensorProto.FLOAT, (1024,), size - 4096, 4096)
    store = DeviceWeightStore(
        _device_probe._ProbeWeights(buffer, (slot,)), CPU, 0, route="ort-slab"
    )
    value = store._upload.values["last"]  # type: ignore[union-attr]
    store.close()
    del store
    gc.collect()
    churn = [np.full(size // 8, 7.0) for _ in range(4)]
    np.testing.assert_array_equal(value.numpy(), np.full(1024, 5.0, np.float32))
    del churn


@pytest.mark.capability("dlpack")
def test_for_store_returns_the_live_store(prepared: Path) -> None:
    weights = sharedml.weights.WeightStore.open(prepared)
    a = DeviceWeightStore.for_store(weights, CPU, 0, route="ort-slab")
    assert DeviceWeightStore.for_store(weights, CPU, 0, route="ort-slab") is a
    assert DeviceWeightStore.for_store(weights, CPU, 0, route="ort-per-tensor") is not a
    a.close()
    b = DeviceWeightStore.for_store(weights, CPU, 0, route="ort-slab")
    assert b is not a and b.device_bytes > 0


@pytest.mark.capability("dlpack")
def test_types_dlpack_cannot_carry_stay_in_the_file() -> None:
    buffer = np.zeros(4 * 4096, np.uint8)
    slots = (
        TensorSlot("f32", TensorProto.FLOAT, (256,), 0, 1024),
        TensorSlot("bf16", TensorProto.BFLOAT16, (512,), 4096, 1024),
        TensorSlot("flag", TensorProto.BOOL, (1024,), 8192, 1024),
        TensorSlot("i64", TensorProto.INT64, (128,), 12288, 1024),
    )
    store = DeviceWeightStore(_device_probe._ProbeWeights(buffer, slots), CPU, 0, route="ort-slab")
    assert set(store.tensor_names) == {"f32", "i64"}
    assert store.host_tensors == ("bf16", "flag")


@pytest.mark.capability("dlpack")
def test_closed_store_refuses_to_register(prepared: Path) -> None:
    store = DeviceWeightStore(sharedml.weights.WeightStore.open(prepared), CPU, 0, route="ort-slab")
    store.close()
    with pytest.raises(sharedml.ProviderError, match="closed"):
        store.register(ort.SessionOptions())


def test_unknown_route_and_provider_are_refused(prepared: Path) -> None:
    weights = sharedml.weights.WeightStore.open(prepared)
    with pytest.raises(sharedml.ProviderError, match="Unknown device weight route"):
        DeviceWeightStore(weights, CPU, 0, route="magic")
    with pytest.raises(sharedml.ProviderError, match="sharedml knows how for"):
        DeviceWeightStore(weights, "OpenVINOExecutionProvider", 0, route="ort-slab")


def test_cupy_route_needs_cuda(prepared: Path) -> None:
    with pytest.raises(sharedml.ProviderError, match="cupy-slab"):
        DeviceWeightStore(sharedml.weights.WeightStore.open(prepared), CPU, 0, route="cupy-slab")


# --------------------------------------------------------------------------------------------
# Probes and route selection


@pytest.mark.capability("dlpack")
def test_probe_child_finds_the_slab_route_on_cpu() -> None:
    (probe,) = _device_probe.probe_routes(CPU, 0, routes=("ort-slab",))
    assert probe.ok, probe.reason
    assert probe.route == "ort-slab" and probe.seconds > 0


def test_a_probe_that_crashes_is_reported_not_propagated(monkeypatch: pytest.MonkeyPatch) -> None:
    # A real crash, reading address 0 in C: SIGSEGV on POSIX, STATUS_ACCESS_VIOLATION on Windows
    # (where a fault inside a ctypes call becomes an OSError instead).
    monkeypatch.setattr(
        _device_probe, "_PROBE_CODE", "import faulthandler; faulthandler._read_null()"
    )
    probe = _device_probe._run_probe(CPU, 0, "ort-slab", timeout_s=60)
    assert not probe.ok
    crash = "STATUS_ACCESS_VIOLATION, 0xC0000005" if os.name == "nt" else "SIGSEGV"
    assert f"the probe crashed ({crash})" in probe.reason, probe.reason


@pytest.mark.parametrize(
    ("returncode", "windows", "name"),
    [
        (-11, False, "SIGSEGV"),
        (-15, False, "SIGTERM"),
        (1, False, None),
        (0xC0000005, True, "STATUS_ACCESS_VIOLATION, 0xC0000005"),
        (-1073741819, True, "STATUS_ACCESS_VIOLATION, 0xC0000005"),  # the same, as a signed int
        (0xC0000409, True, "STATUS_STACK_BUFFER_OVERRUN, 0xC0000409"),
        (0xC0000142, True, "NTSTATUS 0xC0000142"),
        (3, True, None),  # abort()'s status on Windows: not told apart from an exit(3)
        (11, True, None),  # os.kill(pid, 11) on Windows is TerminateProcess with status 11
    ],
)
def test_crash_statuses_are_read_per_platform(
    returncode: int, windows: bool, name: str | None
) -> None:
    assert crash_name(returncode, windows=windows) == name


def test_directml_is_not_probed_for_device_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_device_probe, "_run_probe", _fake_probes({}, calls))
    monkeypatch.setattr(_device_probe, "_provider_available", lambda provider: True)
    monkeypatch.setattr(_device_probe, "_PROBES", {})
    monkeypatch.delenv(_device_probe.ROUTE_ENV, raising=False)
    probes = _device_probe.probe_routes(DML)
    assert calls == []  # no child started: no route can work there
    assert [p.route for p in probes] == list(_device.ROUTES)
    assert all(not p.ok and p.reason == DML_NO_DEVICE_ROUTE for p in probes)
    assert not _device_probe.device_mechanism_available(DML)


def test_a_probe_that_hangs_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device_probe, "_PROBE_CODE", "import time; time.sleep(60)")
    probe = _device_probe._run_probe(CPU, 0, "ort-slab", timeout_s=1)
    assert not probe.ok and "did not finish" in probe.reason


def test_a_probe_that_fails_gives_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_device_probe, "_PROBE_CODE", "import sys; sys.exit('no luck')")
    probe = _device_probe._run_probe(CPU, 0, "ort-slab", timeout_s=60)
    assert not probe.ok and "status 1" in probe.reason and "no luck" in probe.reason


def _fake_probes(results: dict[str, bool], calls: list[str]):  # type: ignore[no-untyped-def]
    def fake(provider: str, device_id: int, route: str, timeout_s: float) -> RouteProbe:
        calls.append(route)
        ok = results[route]
        return RouteProbe(route, provider, device_id, ok, "" if ok else "crashed (SIGSEGV)")

    return fake


@pytest.mark.capability("dlpack")
def test_a_crashing_route_falls_back_to_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    fake = _fake_probes({"ort-slab": False, "ort-per-tensor": True, "cupy-slab": True}, calls)
    monkeypatch.setattr(_device_probe, "_run_probe", fake)
    monkeypatch.setattr(_device_probe, "_provider_available", lambda provider: True)
    assert _device_probe.select_route(CUDA) == "ort-per-tensor"
    assert calls == ["ort-slab", "ort-per-tensor"]  # stops at the first that works
    assert _device_probe.device_mechanism_available(CUDA)
    assert calls == ["ort-slab", "ort-per-tensor"]  # cached for the process


@pytest.mark.capability("dlpack")
def test_no_working_route_means_no_device_mechanism(
    monkeypatch: pytest.MonkeyPatch, prepared: Path
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(
        _device_probe, "_run_probe", _fake_probes(dict.fromkeys(_device.ROUTES, False), calls)
    )
    monkeypatch.setattr(_device_probe, "_provider_available", lambda provider: True)
    assert not _device_probe.device_mechanism_available(CUDA)
    assert calls == list(_device.ROUTES)
    plan = plan_providers([CUDA], available=[CUDA, CPU])
    with pytest.raises(sharedml.ProviderError, match=r"ort-slab: crashed \(SIGSEGV\)"):
        options = RouteOptions(plan, 1, weights=WeightsSettings.parse(mechanism="device"))
        plan_route(open_model(prepared, options.weights), options)


def test_probe_errors_never_escape_device_mechanism_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def boom(provider: str, device_id: int, route: str, timeout_s: float) -> RouteProbe:
        raise OSError("fork failed")

    monkeypatch.setattr(_device_probe, "_run_probe", boom)
    monkeypatch.setattr(_device_probe, "_provider_available", lambda provider: True)
    assert _device_probe.device_mechanism_available(CUDA) is False


def test_missing_or_hostless_providers_are_not_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_device_probe, "_run_probe", _fake_probes({}, calls))
    monkeypatch.setattr(_device_probe, "_provider_available", lambda provider: False)
    assert not _device_probe.device_mechanism_available(CUDA)
    assert not _device_probe.device_mechanism_available(CPU)  # CPU sessions share host memory
    assert not _device_probe.device_mechanism_available("OpenVINOExecutionProvider")
    assert _device_probe.probe_routes(CUDA) == ()
    assert calls == []


def test_environment_forces_a_route_without_probing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(_device_probe, "_run_probe", _fake_probes({}, calls))
    monkeypatch.setenv(_device_probe.ROUTE_ENV, "cupy-slab")
    assert _device_probe.select_route(CUDA) == "cupy-slab"
    monkeypatch.setenv(_device_probe.ROUTE_ENV, "none")
    assert _device_probe.select_route(CUDA) is None
    assert not _device_probe.device_mechanism_available(CUDA)
    monkeypatch.setenv(_device_probe.ROUTE_ENV, "telepathy")
    with pytest.raises(sharedml.ProviderError, match="SHAREDML_DEVICE_ROUTE"):
        _device_probe.select_route(CUDA)
    assert calls == []


# --------------------------------------------------------------------------------------------
# CUDA (skipped without onnxruntime-gpu and a device)


@pytest.fixture(scope="module")
def cuda_ready() -> None:
    if not HAS_CUDA:
        pytest.skip("needs onnxruntime-gpu with a CUDA device")
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()


def _cuda_model(tmp_path: Path) -> tuple[Path, Path]:
    model = build_model(["initializer", "initializer", "if_initializer"], dim=256)
    src = save_model(model, tmp_path / "cuda.onnx")
    dst = tmp_path / "prepared" / "cuda.onnx"
    sharedml.prepare(src, dst)
    return src, dst


@gpu
@needs_cuda
def test_cuda_probe_finds_a_route(cuda_ready: None) -> None:
    probes = _device_probe.probe_routes(CUDA, 0)
    assert probes and probes[-1].ok, probes


@gpu
@needs_cuda
def test_cuda_sessions_borrow_one_upload(cuda_ready: None, tmp_path: Path) -> None:
    src, dst = _cuda_model(tmp_path)
    weights = sharedml.weights.WeightStore.open(dst)
    route = _device_probe.select_route(CUDA, 0)
    assert route is not None
    store = DeviceWeightStore.for_store(weights, CUDA, 0, route=route)
    providers = [(CUDA, {"device_id": "0"}), CPU]
    sessions = []
    for _ in range(3):
        so = ort.SessionOptions()
        so.log_severity_level = 3
        store.register(so)
        sessions.append(ort.InferenceSession(str(dst), so, providers=providers))
    plain = ort.InferenceSession(str(src), providers=providers)
    feed = feeds(256)
    ref = plain.run(None, feed)[0]
    for sess in sessions:
        np.testing.assert_array_equal(sess.run(None, feed)[0], ref)
    store.reload(_scaled(weights.buffer, 2.0))
    for sess in sessions:  # two main-graph weights and the If branch's: 2**3
        np.testing.assert_allclose(sess.run(None, feed)[0], 8.0 * ref, rtol=1e-5, atol=1e-6)
    store.reload(weights.buffer)


@gpu
@needs_cuda
def test_cuda_pool_threads_all_match_a_plain_session(cuda_ready: None, tmp_path: Path) -> None:
    src, dst = _cuda_model(tmp_path)
    feed = feeds(256)
    ref = ort.InferenceSession(str(src), providers=[CUDA, CPU]).run(None, feed)[0]
    with sharedml.SessionPool(dst, sessions=4, providers=[CUDA]) as pool:
        assert pool.mechanism == "device"
        threads, barrier = 8, threading.Barrier(8)
        outputs: list[np.ndarray] = []
        lock = threading.Lock()
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)

        def work() -> None:
            barrier.wait()
            for _ in range(20):
                out = pool.run(None, feed)[0]
                with lock:
                    outputs.append(out)

        try:
            workers = [threading.Thread(target=work) for _ in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            sys.setswitchinterval(old)
        assert len(outputs) == threads * 20
        for out in outputs:
            np.testing.assert_array_equal(out, ref)
        pool.wait_ready()
        assert pool.stats().created == 4


@gpu
@needs_cuda
def test_cli_inspect_reports_device_memory_with_cuda(cuda_ready: None, tmp_path: Path) -> None:
    # The acceptance: `sharedml inspect --providers CUDAExecutionProvider` on a GPU
    # machine reports device memory per strategy, and the pool's is below plain sessions'.
    import json
    import subprocess

    from tools.realistic_models import mlp

    info = mlp(tmp_path / "mlp.onnx", target_bytes=64 * 2**20, width=2048)
    out = subprocess.run(
        [
            *(sys.executable, "-m", "sharedml", "inspect", str(info.path)),
            "--sessions",
            "4",
            "--providers",
            CUDA,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    strategies = report["strategies"]
    naive, shared = strategies["naive"], strategies["shared"]
    print(
        "\ninspect, CUDA, 4 sessions of a 64 MiB MLP: device "
        f"naive {naive['device_bytes']} ({naive['device_metric']}), "
        f"shared {shared['device_bytes']} ({shared['device_metric']}); notes: "
        f"{naive['device_note']!r} {shared['device_note']!r}"
    )
    assert naive["device_bytes"] is not None, naive["device_note"]
    assert shared["device_bytes"] is not None, shared["device_note"]
    # Both include the process's CUDA context (~500 MiB on an H200) and cuBLAS workspaces; the
    # plain sessions hold three more copies of the weights. NVML's figure for them moves by two
    # copies from run to run (naive against shared: 964 vs 710 MiB in one run, 838 vs 710 in
    # another; the cause, likely where each session's arena chunks land, is not pinned down),
    # so the test asks for 1.5 copies, which every run seen met.
    weights = 64 * 2**20
    assert naive["device_bytes"] - shared["device_bytes"] >= 1.5 * weights


# --------------------------------------------------------------------------------------------
# CUDA graphs (tests/pool/test_graphs.py runs the machinery on the CPU device)

GRAPHS = [(CUDA, {"enable_cuda_graph": "1"})]


def _graph_model(tmp_path: Path) -> Path:
    from _models import batchable_model

    return batchable_model(tmp_path / "graph.onnx", dim=256, layers=4)


def _rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 256)).astype(np.float32)


@gpu
@needs_cuda
def test_a_cuda_graph_pool_replays_concurrently_and_matches_plain(
    cuda_ready: None, tmp_path: Path
) -> None:
    model = _graph_model(tmp_path)
    plain = ort.InferenceSession(str(model), providers=[CUDA, CPU])
    with sharedml.SessionPool(model, sessions=4, providers=GRAPHS) as pool:
        pool.warm_up({"x": _rows(1, 0)})
        barrier = threading.Barrier(8)
        results: list[tuple[int, np.ndarray]] = []
        lock = threading.Lock()

        def work(i: int) -> None:
            barrier.wait()
            for j in range(25):
                seed = i * 100 + j
                out = pool.run(None, {"x": _rows(1, seed)})[0]
                with lock:
                    results.append((seed, out))

        workers = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(120)
        assert len(results) == 200
        for seed, out in results:
            expected = plain.run(None, {"x": _rows(1, seed)})[0]
            np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@gpu
@needs_cuda
def test_a_cuda_graph_pool_batches_into_captured_buckets(cuda_ready: None, tmp_path: Path) -> None:
    model = _graph_model(tmp_path)
    plain = ort.InferenceSession(str(model), providers=[CUDA, CPU])
    batching = sharedml.Batching(max_batch_size=8)
    with sharedml.SessionPool(model, sessions=1, providers=GRAPHS, batching=batching) as pool:
        pool.warm_up({"x": _rows(1, 0)})
        for n in (1, 3, 5, 8):
            out = pool.run(None, {"x": _rows(n, n)})[0]
            expected = plain.run(None, {"x": _rows(n, n)})[0]
            np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
        outs: list[np.ndarray] = []
        threads = [
            threading.Thread(target=lambda s=s: outs.append(pool.run(None, {"x": _rows(1, s)})[0]))
            for s in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(outs) == 16
        assert pool.stats().max_batch_rows >= 1


@gpu
@needs_cuda
def test_cuda_batching_gives_every_bucket_of_a_conv_model_its_own_session(
    cuda_ready: None, tmp_path: Path
) -> None:
    from _models import conv_model

    from sharedml.pool import _graphs

    model = conv_model(tmp_path / "conv.onnx")
    plain = ort.InferenceSession(str(model), providers=[CUDA, CPU])
    batching = sharedml.Batching(max_batch_size=8)
    images = np.random.default_rng(0).standard_normal((8, 4, 8, 8)).astype(np.float32)
    with sharedml.SessionPool(model, sessions=1, providers=[CUDA], batching=batching) as pool:
        pool.warm_up({"x": images[:1]})
        with pool.session() as sess:
            assert isinstance(sess, _graphs.ShapeSessions)
            assert sess.shapes == [{"batch": n} for n in (1, 2, 4, 8)]
        for n in (1, 3, 5, 8):
            out = pool.run(None, {"x": images[:n]})[0]
            expected = plain.run(None, {"x": images[:n]})[0]
            np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-3)  # TF32 on
    mlp = _graph_model(tmp_path)  # no convolution: one session runs every bucket
    with sharedml.SessionPool(mlp, sessions=1, providers=[CUDA], batching=batching) as pool:
        pool.warm_up({"x": _rows(1, 0)})
        with pool.session() as sess:
            assert not isinstance(sess, _graphs.ShapeSessions)


def _bert_feed(rows: int, seed: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, 1000, (rows, 32), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones((rows, 32), np.int64)}


@gpu
@needs_cuda
def test_ort_refuses_cuda_graphs_for_a_model_with_symbolic_shape_arithmetic(
    cuda_ready: None, tmp_path: Path
) -> None:
    """The ORT fact the graph pool works around: position ids from Shape -> Range go to the CPU."""
    from tools.realistic_models import bert_like

    model = bert_like(tmp_path / "bert.onnx", size="tiny").path
    with pytest.raises(Exception, match="partitioned to the CUDAExecutionProvider"):
        ort.InferenceSession(str(model), providers=[(CUDA, {"enable_cuda_graph": "1"}), CPU])


@gpu
@needs_cuda
def test_a_graph_pool_fixes_the_dims_so_that_such_a_model_captures(
    cuda_ready: None, tmp_path: Path
) -> None:
    from tools.realistic_models import bert_like

    model = bert_like(tmp_path / "bert.onnx", size="tiny").path
    plain = ort.InferenceSession(str(model), providers=[CUDA, CPU])
    batching = sharedml.Batching(max_batch_size=4)
    with sharedml.SessionPool(model, sessions=2, providers=GRAPHS, batching=batching) as pool:
        pool.warm_up(_bert_feed(1, 0))
        for rows in (1, 3, 4):
            out = pool.run(None, _bert_feed(rows, rows))[0]
            expected = plain.run(None, _bert_feed(rows, rows))[0]
            np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-3)
        with pool.session() as sess:
            slot = sess.slot(_bert_feed(2, 0))
        assert slot.dims == {"batch": 2, "seq": 32}
        assert slot.session.get_providers()[0] == CUDA


CONCURRENT_CAPTURE = r"""
import sys, threading
import numpy as np, onnxruntime as ort
ort.preload_dlls()
model = sys.argv[1]
graphs = [("CUDAExecutionProvider", {"enable_cuda_graph": "1"}), "CPUExecutionProvider"]
other = ort.InferenceSession(model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
errors = []
def one_round():
    # Each session starts (warms up, captures) while the ones before it keep replaying: the
    # way callers reach a server. Inputs copied in and outputs read each time, as users do.
    sessions = [ort.InferenceSession(model, providers=graphs) for _ in range(8)]
    started = [threading.Event() for _ in range(len(sessions) + 1)]
    started[0].set()
    done = threading.Event()
    def graph_caller(i, sess):
        try:
            started[i].wait(60)
            x = ort.OrtValue.ortvalue_from_shape_and_type([1, 256], np.float32, "cuda", 0)
            y = ort.OrtValue.ortvalue_from_shape_and_type([1, 256], np.float32, "cuda", 0)
            binding = sess.io_binding()
            binding.bind_ortvalue_input("x", x)
            binding.bind_ortvalue_output("y", y)
            k = 0
            while not done.is_set():
                x.update_inplace(np.full((1, 256), k, np.float32))
                sess.run_with_iobinding(binding)
                y.numpy()
                k += 1
                if k == 5:
                    started[i + 1].set()
                if k == 20 and i == len(sessions) - 1:
                    done.set()
        except Exception as exc:
            errors.append(str(exc))
        finally:
            started[i + 1].set()
            if i == len(sessions) - 1:
                done.set()
    def plain_caller():
        # and another session of the process runs as usual meanwhile
        try:
            while not done.is_set():
                other.run(None, {"x": np.ones((1, 256), np.float32)})
        except Exception as exc:
            errors.append(str(exc))
    threads = [threading.Thread(target=graph_caller, args=(i, s)) for i, s in enumerate(sessions)]
    background = threading.Thread(target=plain_caller)
    background.start()
    [t.start() for t in threads]; [t.join() for t in threads]
    done.set(); background.join()
for _ in range(5):  # the failure is a race: a few rounds make it (near) certain
    one_round()
    if errors:
        break
print("ERRORS", len(errors), errors[0][:300] if errors else "")
"""


@gpu
@needs_cuda
def test_capturing_while_other_sessions_run_fails_without_the_pool(
    cuda_ready: None, tmp_path: Path
) -> None:
    """The failure the pool prevents: plain graph sessions on 8 threads, captures overlapping.

    Run in a child process: a broken capture can leave its stream unusable.
    """
    import subprocess

    model = _graph_model(tmp_path)
    out = subprocess.run(
        [sys.executable, "-c", CONCURRENT_CAPTURE, str(model)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(out.stdout[-2000:], out.stderr[-2000:])
    line = next((x for x in out.stdout.splitlines() if x.startswith("ERRORS ")), "")
    errors = int(line.split()[1]) if line else -1  # -1: the child crashed before reporting
    assert errors != 0, "8 plain CUDA-graph sessions captured concurrently without a failure"
    # ORT reports the broken capture through whichever CUDA call meets it first: "operation
    # not permitted when stream is capturing" (900), or a cuBLAS launch failure (13).
    assert errors < 0 or "capturing" in line or "cuda" in line.lower(), line
