"""The route planner: the mechanism and prepacking a provider, model and options get, and why.

Everything here asks :func:`sharedml.route._planner.plan_route` and reads the recipe it returns
(its mechanism, its reason, the options a session gets): no pool. DirectML and CUDA plans are
made with ``plan_providers(..., available=...)``, so their routes are planned on any machine
(planning creates no session of those providers).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _models import PLACEMENTS, batchable_model, build_model, save_model

from sharedml._errors import ProviderError, SessionCreationError
from sharedml._host._platform import usable_cores
from sharedml.route._options import (
    Mechanism,
    Prepacking,
    RouteOptions,
    SessionSettings,
    WeightsSettings,
)
from sharedml.route._planner import SessionRecipe, open_model, plan_route
from sharedml.runtime._capabilities import WITHOUT_ENV
from sharedml.runtime._options import config_entry
from sharedml.runtime._providers import DML_NO_DEVICE_ROUTE, plan_providers
from sharedml.weights._store import zero_copy_mechanisms

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
DML = "DmlExecutionProvider"
PACKED_DIM = 256  # MatMul weights of 256 KiB: ORT's CPU MatMul packs them
RAW_REASONS = {
    Mechanism.IN_MEMORY_FILE: "the mapped weights file is lent whole to every session",
    Mechanism.ADD_INITIALIZER: "each tensor is lent to every session from the mapped file",
    Mechanism.ORT_MMAP: "ORT maps the weights file in every session (one page-cache copy)",
}


@pytest.fixture(autouse=True)
def _no_route_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WITHOUT_ENV, raising=False)


@pytest.fixture
def packed(tmp_path: Path) -> Path:
    """An MLP whose weights ORT's CPU kernels prepack."""
    return batchable_model(tmp_path / "mlp.onnx", dim=PACKED_DIM)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """32x32 weights: ORT packs them, but each is too small for the saved model's data file."""
    return save_model(build_model(list(PLACEMENTS), dim=32), tmp_path / "small.onnx")


@pytest.fixture
def unpacked(tmp_path: Path) -> Path:
    """x * a + b with 16 KiB vectors: no kernel packs or derives anything."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "a"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
        "elementwise",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4096])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4096])],
        [numpy_helper.from_array(rng.random(4096, np.float32), n) for n in ("a", "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    return save_model(model, tmp_path / "elementwise.onnx")


@pytest.fixture
def conv_bn(tmp_path: Path) -> Path:
    """Conv + BatchNormalization: ORT fuses the pair (a derived weight) and packs nothing."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    channels = 64
    inits = [numpy_helper.from_array(rng.random((channels, channels, 3, 3), np.float32), "w")]
    names = ("scale", "bias", "mean", "var")
    for name in names:
        inits.append(numpy_helper.from_array(1 + rng.random(channels, np.float32), name))
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", ["c", *names], ["y"]),
        ],
        "conv_bn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return save_model(model, tmp_path / "conv_bn.onnx")


def route(model: Path | bytes, providers: list[str] | None = None, **kwargs: Any) -> SessionRecipe:
    available = [DML, CUDA, CPU] if providers else None
    plan = plan_providers(providers, available=available)
    sessions = kwargs.pop("max_sessions", 2)
    session = SessionSettings(**{k: kwargs.pop(k) for k in ("sess_options",) if k in kwargs})
    options = RouteOptions(plan, sessions, session, WeightsSettings.parse(**kwargs))
    return plan_route(open_model(model, options.weights), options)


def disable_prepacking(recipe: SessionRecipe) -> str | None:
    return config_entry(recipe.options(), "session.disable_prepacking")


def best_raw() -> Mechanism:
    return Mechanism(zero_copy_mechanisms()[0])


# --------------------------------------------------------------------------------------------
# CPU, prepacking "auto": the saved optimized model where ORT packs or derives a weight


@pytest.mark.capability("prepacked-save")
def test_a_model_ort_packs_gets_the_prepacked_file(packed: Path) -> None:
    recipe = route(packed)
    assert recipe.mechanism is Mechanism.PREPACKED_FILE
    assert recipe.prepacking is Prepacking.AUTO
    assert recipe.reason.endswith("are mapped once for every session.")
    assert "prepacked blobs" in recipe.reason
    assert recipe.prepacked is not None and recipe.load_path == recipe.prepacked.model_path
    assert recipe.load_path != recipe.model_path  # sessions load the saved model by path
    assert recipe.runtime_stats.prepacked_blobs > 0


@pytest.mark.capability("prepacked-save")
def test_a_model_ort_only_derives_weights_of_gets_the_optimized_file(conv_bn: Path) -> None:
    recipe = route(conv_bn)
    assert recipe.mechanism is Mechanism.OPTIMIZED_FILE
    assert recipe.reason.startswith("ORT packs no weight of this model on this CPU")
    assert "mechanism 'optimized-file'" in recipe.reason
    assert recipe.runtime_stats.derived_bytes == 64 * 64 * 9 * 4  # the fused Conv weight


@pytest.mark.capability("prepacked-save")
def test_a_model_ort_neither_packs_nor_derives_shares_raw_weights_unpacked(
    unpacked: Path,
) -> None:
    recipe = route(unpacked)
    assert recipe.mechanism is best_raw() and recipe.prepacked is None
    assert recipe.load_path == recipe.model_path
    assert recipe.reason.startswith(
        "ORT saves no packed form of any weight of this model on this CPU, at any size, and "
        "derives none"
    )
    assert recipe.reason.endswith(
        f"Raw weights shared: {RAW_REASONS[best_raw()]}; prepacking is off, so kernels run on "
        "unpacked weights."
    )
    assert disable_prepacking(recipe) == "1"


@pytest.mark.capability("prepacked-save")
def test_a_model_whose_packed_weights_are_all_small_packs_them_in_each_session(
    small: Path,
) -> None:
    # No blob in the saved model (each weight under its 64 KiB threshold stays inline), yet
    # ORT packs them: with prepacking off those MatMuls ran unpacked, other values than plain.
    recipe = route(small)
    assert recipe.mechanism is best_raw() and recipe.prepacked is None
    assert recipe.prepacking is Prepacking.PER_SESSION
    assert re.match(r"ORT packs \d+ weight\(s\) of this model \(", recipe.reason)
    assert "each session packs its own copy, as plain ORT does" in recipe.reason
    assert disable_prepacking(recipe) == "0"


@pytest.mark.capability("prepacked-save")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="vm.max_map_count is Linux's")
def test_more_maps_than_the_kernel_allows_keeps_raw_weights(packed: Path) -> None:
    recipe = route(packed, max_sessions=10**7)
    assert recipe.mechanism is best_raw()
    assert "over half of vm.max_map_count" in recipe.reason
    assert recipe.intra_op_threads == 1


def test_without_the_saved_model_capability_auto_shares_raw_weights(
    packed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WITHOUT_ENV, "prepacked-save")
    recipe = route(packed)
    assert recipe.mechanism is best_raw()
    assert recipe.reason.startswith("The saved prepacked model is not used: ")
    assert WITHOUT_ENV in recipe.reason
    with pytest.raises(SessionCreationError, match=r"prepacking='shared' needs ORT's saved"):
        route(packed, prepacking="shared")


# --------------------------------------------------------------------------------------------
# CPU, other prepacking settings and requested mechanisms


@pytest.mark.capability("prepacked-save")
def test_shared_prepacking_takes_the_saved_model_even_where_it_does_not_pay(small: Path) -> None:
    recipe = route(small, prepacking="shared")
    assert recipe.mechanism is Mechanism.OPTIMIZED_FILE  # nothing packed: named for what it is
    assert recipe.prepacking is Prepacking.SHARED


def test_prepacking_off_shares_raw_weights_with_packing_off(small: Path) -> None:
    recipe = route(small, prepacking="off")
    assert recipe.mechanism is best_raw() and recipe.prepacking is Prepacking.OFF
    assert recipe.reason == (
        f"Raw weights shared: {RAW_REASONS[best_raw()]}; prepacking is off, so kernels run on "
        "unpacked weights."
    )
    assert disable_prepacking(recipe) == "1"


@pytest.mark.capability("prepacked-save")
def test_prepacking_off_warns_where_every_session_derives_its_own_weights(conv_bn: Path) -> None:
    with pytest.warns(RuntimeWarning, match=r"prepacking='off' shares only the raw weights"):
        recipe = route(conv_bn, prepacking="off")
    assert recipe.mechanism is best_raw()
    assert "ORT's optimizers derive 0.1 MiB of weights" in recipe.reason
    assert recipe.reason.endswith("kernels run on unpacked weights.")


def test_per_session_prepacking_is_ort_behaviour_and_says_so(small: Path) -> None:
    recipe = route(small, prepacking="per-session")
    assert recipe.mechanism is best_raw() and recipe.prepacked is None
    assert recipe.reason.endswith(
        "each session packs a private copy of its packed weights (prepacking='per-session')."
    )
    assert disable_prepacking(recipe) == "0"


@pytest.mark.parametrize(
    ("given", "written"),
    [(None, "'auto'"), (False, "'off'"), (True, "'per-session' (each session packs")],
)
def test_the_old_prepacking_spellings_are_refused_naming_the_new_one(
    small: Path, given: object, written: str
) -> None:
    with pytest.raises(ValueError, match=rf"prepacking={given} is not a setting: write") as caught:
        route(small, prepacking=given, mechanism="ort-mmap")
    assert f"prepacking={written}" in str(caught.value)


def test_a_requested_host_mechanism_is_taken_without_the_saved_model(packed: Path) -> None:
    recipe = route(packed, mechanism="ort-mmap")
    assert recipe.mechanism is Mechanism.ORT_MMAP and recipe.prepacked is None
    assert recipe.reason == (
        f"Raw weights shared: {RAW_REASONS[Mechanism.ORT_MMAP]}; prepacking is off, so kernels "
        "run on unpacked weights."
    )


def test_the_in_memory_file_needs_its_capability(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WITHOUT_ENV, "files-in-memory")
    with pytest.raises(ProviderError, match=r"mechanism='in-memory-file' cannot be used: .*auto"):
        route(small, mechanism="in-memory-file")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mechanism": "prepacked-file"}, r"one of .*'ort-mmap'.*prepacking='shared' asks"),
        ({"mechanism": "optimized-file"}, r"one of .*'ort-mmap'.*prepacking='shared' asks"),
        ({"mechanism": "telepathy"}, r"mechanism must be 'auto' or one of"),
        ({"prepacking": "sometimes"}, r"prepacking must be 'auto', 'shared', 'off'"),
        (
            {"prepacking": "shared", "mechanism": "ort-mmap"},
            r"prepacking='shared' chooses the weight mechanism itself",
        ),
    ],
)
def test_settings_that_name_no_route_are_refused(
    small: Path, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        route(small, **kwargs)


def test_each_cpu_session_gets_its_share_of_the_cores_unless_the_template_sets_it(
    small: Path,
) -> None:
    import onnxruntime as ort

    recipe = route(small, max_sessions=2, mechanism="ort-mmap")
    assert recipe.intra_op_threads == max(1, usable_cores() // 2)
    assert recipe.options().intra_op_num_threads == recipe.intra_op_threads
    template = ort.SessionOptions()
    template.intra_op_num_threads = 3
    mine = route(small, max_sessions=2, mechanism="ort-mmap", sess_options=template)
    assert mine.options().intra_op_num_threads == 3
    assert template.intra_op_num_threads == 3  # the template is never changed


def test_model_bytes_are_planned_like_a_path(small: Path) -> None:
    recipe = route(small.read_bytes(), mechanism="ort-mmap")
    assert recipe.source_path == Path("<model bytes>")
    assert recipe.mechanism is Mechanism.ORT_MMAP


# --------------------------------------------------------------------------------------------
# Device providers


def test_directml_loads_from_the_file_and_says_each_session_holds_a_device_copy(
    small: Path,
) -> None:
    recipe = route(small, [DML])
    assert recipe.mechanism is Mechanism.ORT_MMAP
    assert recipe.reason.startswith(f"{DML_NO_DEVICE_ROUTE}. Host weights (ort-mmap): ")
    assert recipe.intra_op_threads is None and recipe.device_store is None
    requested = route(small, [DML], mechanism="add-initializer")
    assert requested.mechanism is Mechanism.ADD_INITIALIZER
    assert "ORT copies it to the device" in requested.reason
    with pytest.raises(ProviderError, match=r"mechanism='device' with DmlExecutionProvider"):
        route(small, [DML], mechanism="device")


def test_cuda_without_a_device_route_warns_and_shares_host_weights(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SHAREDML_DEVICE_ROUTE", "none")
    with pytest.warns(RuntimeWarning, match=r"Device weight sharing is unavailable for CUDA"):
        recipe = route(small, [CUDA])
    assert recipe.mechanism is best_raw() and recipe.prepacked is None
    assert recipe.reason.startswith("Device weight sharing is unavailable for CUDA")
    assert "every session will upload its own copy" in recipe.reason
    with pytest.raises(ProviderError, match=r"No device weight route works for CUDA"):
        route(small, [CUDA], mechanism="device")
