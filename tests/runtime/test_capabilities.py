"""What the installed onnxruntime can do: decided once per process, and every route follows it.

CI runs this file on the newest onnxruntime, on 1.24.4 (the last DirectML release) and on the
floor; ``SHAREDML_ORT_WITHOUT`` lets the newest one take the routes an older one must take.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from _models import PLACEMENTS, batchable_model, build_model, feeds, save_model

import sharedml
from sharedml.model._graph import ExternalData, iter_tensors, load_graph
from sharedml.pool import _graphs
from sharedml.runtime import _capabilities
from sharedml.runtime._capabilities import WITHOUT_ENV, capabilities, capability, run_in_child
from sharedml.weights import _probe as _device_probe

# The first onnxruntime that has each capability (sharedml.runtime._capabilities says why;
# IOBinding as graph sessions use it runs on the floor, 1.20). From there on a missing one is a
# broken probe, which would skip every test marked with it.
SINCE = {"prepacked-save": "1.21", "files-in-memory": "1.24", "dlpack": "1.21", "iobinding": "1.20"}

CPU = "CPUExecutionProvider"
DIM = 256  # MatMul weights of 256 KiB: large enough for ORT to pack and to go external


def plain(model: Path, feed: dict[str, np.ndarray]) -> np.ndarray:
    return ort.InferenceSession(str(model), providers=[CPU]).run(None, feed)[0]


def mlp(tmp_path: Path) -> tuple[Path, list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(3)
    model = batchable_model(tmp_path / "mlp.onnx", dim=DIM)
    return model, [{"x": rng.standard_normal((n, DIM)).astype(np.float32)} for n in (1, 4)]


def subgraphs(tmp_path: Path) -> tuple[Path, list[dict[str, np.ndarray]]]:
    model = save_model(build_model(list(PLACEMENTS), dim=DIM), tmp_path / "sub.onnx")
    return model, [feeds(DIM, flag=True), feeds(DIM, flag=False)]


def test_each_capability_is_decided_once_and_says_why_where_missing() -> None:
    decided = capabilities()
    assert set(decided) == set(_capabilities.CAPABILITIES)
    for name, found in decided.items():
        assert found.name == name and found.available == (found.reason == "")
        if not found.available:
            assert ort.__version__ in found.reason
        assert capability(name) is found  # kept for the process, not tried again


def test_the_installed_onnxruntime_has_exactly_the_capabilities_of_its_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from packaging.version import Version

    monkeypatch.delenv(WITHOUT_ENV, raising=False)
    assert set(SINCE) == set(_capabilities.CAPABILITIES)
    installed = Version(ort.__version__)
    due = {name for name, since in SINCE.items() if installed >= Version(since)}
    decided = capabilities()
    found = {name for name, c in decided.items() if c.available}
    assert found == due, {name: decided[name].reason for name in due - found}


def test_a_capability_declared_missing_is_missing_with_that_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(WITHOUT_ENV, "dlpack, iobinding")
    for name in ("dlpack", "iobinding"):
        assert not capability(name).available
        assert WITHOUT_ENV in capability(name).reason
    monkeypatch.setenv(WITHOUT_ENV, "dlpack,time-travel")
    with pytest.raises(ValueError, match=r"'time-travel'.*prepacked-save"):
        capability("dlpack")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_the_prepacked_probe_maps_nothing_in_the_folder_it_deletes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows deletes no file a process maps: a probe that deleted its folder under a live
    session failed there, and the prepacked route was never offered on Windows."""
    mapped_at_cleanup: list[str] = []

    class WindowsLikeFolder(tempfile.TemporaryDirectory):  # type: ignore[type-arg]
        def cleanup(self) -> None:
            with open("/proc/self/maps") as maps:
                mapped_at_cleanup.extend(line.split()[-1] for line in maps if self.name in line)
            super().cleanup()

    monkeypatch.setattr(tempfile, "TemporaryDirectory", WindowsLikeFolder)
    monkeypatch.setattr(_capabilities, "_DECIDED", {})  # probe again, in this process
    found = capability("prepacked-save")
    assert found.how == "tried in this process"
    assert mapped_at_cleanup == []


def test_a_probe_that_crashes_costs_its_child_only() -> None:
    # A read of address 0: SIGSEGV, or on Windows STATUS_ACCESS_VIOLATION (raise(SIGSEGV), as
    # faulthandler._sigsegv does, is an ordinary exit with status 3 there).
    result = run_in_child("faulthandler:_read_null")
    crash = "STATUS_ACCESS_VIOLATION" if os.name == "nt" else "SIGSEGV"
    assert not result.ok and f"crashed ({crash}" in result.reason, result.reason


def test_a_graph_session_runs_in_a_fresh_process_and_gives_plain_outputs() -> None:
    # The iobinding probe drives a real GraphSession on ORT's CPU device in a child. Before the
    # slot bound buffers of its own this crashed (SIGSEGV) on every onnxruntime before 1.30,
    # and on 1.30 and later a second feed was written into the first caller's array.
    result = run_in_child("sharedml.pool._graphs:probe_iobinding")
    assert result.ok, result.reason


@pytest.mark.parametrize("make", [mlp, subgraphs], ids=["mlp", "subgraph-weights"])
def test_the_default_route_gives_plain_outputs_on_this_onnxruntime(
    tmp_path: Path, make: object
) -> None:
    model, feed_list = make(tmp_path)  # type: ignore[operator]
    saves = capability("prepacked-save")
    with sharedml.SessionPool(model, sessions=2) as pool:  # any warning fails the test
        if saves.available:
            assert pool.mechanism == "prepacked-file", pool.mechanism_reason
            entry = pool.recipe.prepacked.model_path
            # The entry reads nothing outside its own folder (ORT's saved subgraph tensors
            # pointed back at the source's weights file on 1.20 and 1.24).
            for ref in iter_tensors(load_graph(entry).graph):
                info = ExternalData.of(ref.tensor)
                assert info is None or (entry.parent / info.location).is_file(), ref.name
        else:
            assert pool.mechanism == sharedml.weights.zero_copy_mechanisms()[0]
            assert saves.reason in pool.mechanism_reason
        for feed in feed_list:
            np.testing.assert_allclose(
                pool.run(None, feed)[0], plain(model, feed), rtol=1e-5, atol=1e-6
            )


def test_without_prepacked_save_the_pool_shares_raw_weights_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WITHOUT_ENV, "prepacked-save")
    model, feed_list = mlp(tmp_path)
    with sharedml.SessionPool(model, sessions=2) as pool:  # no warning: nothing failed
        assert pool.mechanism == sharedml.weights.zero_copy_mechanisms()[0]
        assert f"declared missing by {WITHOUT_ENV}" in pool.mechanism_reason
        for feed in feed_list:
            np.testing.assert_allclose(
                pool.run(None, feed)[0], plain(model, feed), rtol=1e-5, atol=1e-6
            )
    with pytest.raises(sharedml.SessionCreationError, match="prepacking='shared' needs"):
        sharedml.SessionPool(model, sessions=1, prepacking="shared")


@pytest.mark.capability("prepacked-save")
def test_without_files_in_memory_the_saved_model_is_built_from_the_weights_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WITHOUT_ENV, "files-in-memory")
    model, feed_list = subgraphs(tmp_path)
    with sharedml.SessionPool(model, sessions=2) as pool:
        assert pool.mechanism == "prepacked-file"
        for feed in feed_list:
            np.testing.assert_allclose(
                pool.run(None, feed)[0], plain(model, feed), rtol=1e-5, atol=1e-6
            )
    with pytest.raises(sharedml.ProviderError, match=r"in-memory-file.*declared missing"):
        sharedml.SessionPool(model, sessions=1, mechanism="in-memory-file")


def test_without_iobinding_a_graph_pool_runs_plain_sessions_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(_graphs.GRAPH_DEVICES, CPU, "cpu")
    monkeypatch.setenv(WITHOUT_ENV, "iobinding")
    model, feed_list = mlp(tmp_path)
    providers = [(CPU, {"enable_cuda_graph": "1"})]
    with sharedml.SessionPool(model, sessions=1, providers=providers) as pool:
        assert "CUDA graphs are off" in pool.mechanism_reason
        assert "enable_cuda_graph" not in pool.recipe.plan.provider_options[0]
        with pool.session() as sess:
            assert not isinstance(sess, _graphs.GraphSession)
        for feed in feed_list:
            np.testing.assert_allclose(
                pool.run(None, feed)[0], plain(model, feed), rtol=1e-5, atol=1e-6
            )


def test_without_dlpack_no_device_route_is_probed_in_a_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(WITHOUT_ENV, "dlpack")
    (probe,) = _device_probe.probe_routes(CPU, 0, routes=("ort-slab",))
    assert not probe.ok and f"declared missing by {WITHOUT_ENV}" in probe.reason
