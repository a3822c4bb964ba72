"""The session-options table: every key it lists does what its row says, on every route."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest
from _models import build_model, feeds, save_model

import sharedml
from sharedml.runtime._options import (
    CONFIG_KEYS,
    clone_session_options,
    config_entry,
    graph_settings,
)
from sharedml.weights import _prepacked as _prepack

COPIED = sorted(k for k, policy in CONFIG_KEYS.items() if policy.copied)
NOT_COPIED = sorted(k for k, policy in CONFIG_KEYS.items() if not policy.copied)
GRAPH = sorted(k for k, policy in CONFIG_KEYS.items() if policy.changes_graph)

# The keys the prepacked build carried but the sessions that load its result dropped.
ONCE_DROPPED = (
    "optimization.enable_cast_chain_elimination",
    "session.disable_qdq_constant_folding",
    "session.enable_dq_matmulnbits_fusion",
    "session.qdq_matmulnbits_accuracy_level",
    "session.qdq_matmulnbits_block_size",
    "mlas.disable_kleidiai",
    "mlas.use_lut_gemm",
)


def template_with(key: str, value: str = "1") -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.add_session_config_entry(key, value)
    return so


def test_the_table_is_consistent() -> None:
    assert set(ONCE_DROPPED) <= set(COPIED)
    assert not set(GRAPH) & set(NOT_COPIED), "a key that changes the graph must reach sessions"


@pytest.mark.parametrize("key", COPIED)
def test_a_copied_key_reaches_every_session(key: str) -> None:
    assert config_entry(clone_session_options(template_with(key, "7")), key) == "7"


@pytest.mark.parametrize("key", NOT_COPIED)
def test_a_key_that_cannot_reach_every_session_is_refused(key: str) -> None:
    with pytest.raises(sharedml.SharedMLError, match=key.replace(".", r"\.")):
        clone_session_options(template_with(key))


@pytest.mark.parametrize("key", GRAPH)
def test_a_key_that_changes_the_graph_is_part_of_the_prepacked_key(key: str) -> None:
    _, carried = graph_settings(template_with(key, "0"))
    assert carried == {key: "0"}
    plain = _prepack._key_material(b"model", "sha256:w", 1, None, 1024)
    keyed = _prepack._key_material(b"model", "sha256:w", 1, template_with(key, "0"), 1024)
    assert keyed["config"] == {key: "0"} and keyed != plain


def test_runtime_keys_do_not_split_the_prepacked_cache() -> None:
    runtime = sorted(set(COPIED) - set(GRAPH))
    assert runtime
    for key in runtime:
        assert graph_settings(template_with(key))[1] == {}, key


def test_optimized_model_path_in_a_template_is_refused() -> None:
    so = ort.SessionOptions()
    so.optimized_model_filepath = "/tmp/every-session-would-write-this.onnx"
    with pytest.raises(sharedml.SharedMLError, match="optimized_model_filepath"):
        clone_session_options(so)


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return save_model(build_model(["initializer"] * 2, dim=64), tmp_path / "m.onnx")


@pytest.mark.parametrize("prepacking", ["auto", "off", "per-session"])
def test_once_dropped_keys_reach_the_sessions_on_every_route(model: Path, prepacking: str) -> None:
    template = ort.SessionOptions()
    for key in ONCE_DROPPED:
        template.add_session_config_entry(key, "0")
    with sharedml.SessionPool(
        model, sessions=1, sess_options=template, prepacking=prepacking
    ) as pool:
        options = pool.recipe.options()
        assert {key: config_entry(options, key) for key in ONCE_DROPPED} == dict.fromkeys(
            ONCE_DROPPED, "0"
        )
        assert pool.run(None, feeds(64))[0].shape == (1, 64)
