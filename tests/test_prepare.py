"""prepare: every placement moves to one aligned file, outputs stay equal, bad input is refused."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from _models import PLACEMENTS, build_model, feeds, run_ort, save_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import sharedml
from sharedml._onnx import iter_graphs, tensor_nbytes

DIM = 64


def original_tensors(model: onnx.ModelProto) -> dict[str, bytes]:
    """Name -> raw bytes of every initializer and Constant value (Constants by output name)."""
    out: dict[str, bytes] = {}
    for graph, _ in iter_graphs(model.graph):
        for t in graph.initializer:
            out[t.name] = numpy_helper.to_array(t).tobytes()
        for node in graph.node:
            if node.op_type == "Constant":
                out[node.output[0]] = numpy_helper.to_array(node.attribute[0].t).tobytes()
    return out


def check_layout(
    result: sharedml.PrepareResult,
    expected: dict[str, bytes],
    alignment: int,
    threshold: int = 1024,
) -> None:
    """Every external tensor is aligned, holds the expected bytes, and ranges don't overlap;
    nothing at or above the threshold stayed in the graph."""
    limit = max(threshold, 128)  # prepare keeps tensors under 128 bytes inline regardless
    model = onnx.load_model(str(result.model_path), load_external_data=False)
    data = result.weights_path.read_bytes()
    assert len(data) == result.manifest.size_bytes
    assert hashlib.sha256(data).hexdigest() == result.manifest.sha256
    ranges = []
    for graph, _ in iter_graphs(model.graph):
        for node in graph.node:
            assert node.op_type != "Constant" or tensor_nbytes(node.attribute[0].t) < limit
        for t in graph.initializer:
            if t.data_location != TensorProto.EXTERNAL:
                assert tensor_nbytes(t) < limit, t.name
                continue
            info = {e.key: e.value for e in t.external_data}
            assert info["location"] == result.weights_path.name
            offset, length = int(info["offset"]), int(info["length"])
            assert offset % alignment == 0
            assert data[offset : offset + length] == expected[t.name]
            ranges.append((offset, offset + length))
    ranges.sort()
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert start >= end
    assert len(ranges) == result.tensors_moved


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("external", [None, "one", "many"])
def test_every_placement_moves_to_the_weights_file(
    tmp_path: Path, placement: str, external: str | None
) -> None:
    model = build_model([placement, "initializer"], dim=DIM)
    src = save_model(model, tmp_path / "src" / "m.onnx", external=external)
    before = {p.name: p.read_bytes() for p in src.parent.iterdir()}

    result = sharedml.prepare(src, tmp_path / "out" / "m.onnx")

    assert result.weights_path == tmp_path / "out" / "m.weights"
    check_layout(result, original_tensors(model), 4096)
    # Every DxD weight moved, wherever it was; nothing large stayed in the graph.
    assert result.bytes_moved >= result.tensors_moved * DIM * DIM * 4 // 2
    assert result.model_path.stat().st_size < 8 * 1024
    for flag in (True, False):
        np.testing.assert_array_equal(
            run_ort(result.model_path, feeds(DIM, flag=flag)), run_ort(src, feeds(DIM, flag=flag))
        )
    # The source and its data files are untouched.
    assert {p.name: p.read_bytes() for p in src.parent.iterdir()} == before


def test_constant_nodes_become_initializers_of_their_own_graph(tmp_path: Path) -> None:
    model = build_model(["constant", "if_constant", "loop_constant"], dim=DIM)
    result = sharedml.prepare(save_model(model, tmp_path / "m.onnx"), tmp_path / "p" / "m.onnx")
    assert result.constants_converted == 4  # one, two If branches, one Loop body
    prepared = onnx.load_model(str(result.model_path), load_external_data=False)
    big_constants = [
        n
        for g, _ in iter_graphs(prepared.graph)
        for n in g.node
        if n.op_type == "Constant" and tensor_nbytes(n.attribute[0].t) >= 1024
    ]
    assert big_constants == []


def test_small_tensors_stay_inline_and_threshold_is_honoured(tmp_path: Path) -> None:
    model = build_model(["initializer", "loop_initializer"], dim=16)  # 1 KiB weights
    src = save_model(model, tmp_path / "m.onnx")
    kept = sharedml.prepare(src, tmp_path / "a" / "m.onnx", size_threshold_bytes=4096)
    moved = sharedml.prepare(src, tmp_path / "b" / "m.onnx", size_threshold_bytes=0)
    assert kept.tensors_moved == 0 and kept.tensors_inline > 0
    # Only the tensors under 128 bytes (Loop's trip count, condition, scale) stay inline.
    assert moved.tensors_inline == 3 and moved.tensors_moved == kept.tensors_inline - 3
    for r in (kept, moved):
        np.testing.assert_array_equal(run_ort(r.model_path, feeds(16)), run_ort(src, feeds(16)))


@pytest.mark.parametrize("alignment", [4096, 65536])
def test_alignment_is_configurable(tmp_path: Path, alignment: int) -> None:
    model = build_model(["initializer", "constant", "scan_initializer"], dim=DIM)
    result = sharedml.prepare(
        save_model(model, tmp_path / "m.onnx"), tmp_path / "p.onnx", alignment_bytes=alignment
    )
    check_layout(result, original_tensors(model), alignment)
    assert result.manifest.size_bytes % alignment == 0


@pytest.mark.parametrize("alignment", [0, 1000, 2048])
def test_bad_alignment_is_refused(tmp_path: Path, alignment: int) -> None:
    src = save_model(build_model(["initializer"], dim=8), tmp_path / "m.onnx")
    with pytest.raises(ValueError, match="alignment_bytes"):
        sharedml.prepare(src, tmp_path / "p.onnx", alignment_bytes=alignment)


def test_preparing_a_prepared_model_is_safe_and_equivalent(tmp_path: Path) -> None:
    model = build_model(["constant", "if_initializer", "nested_if_in_loop"], dim=DIM)
    src = save_model(model, tmp_path / "m.onnx", external="many")
    first = sharedml.prepare(src, tmp_path / "one" / "m.onnx")
    second = sharedml.prepare(first.model_path, tmp_path / "two" / "m.onnx")
    assert second.manifest.sha256 == first.manifest.sha256
    assert second.tensors_moved == first.tensors_moved
    np.testing.assert_array_equal(run_ort(second.model_path, feeds(DIM)), run_ort(src, feeds(DIM)))


def test_tied_weights_are_written_once(tmp_path: Path) -> None:
    model = build_model(["initializer"], dim=DIM)
    src = save_model(model, tmp_path / "m.onnx", external="one")
    proto = onnx.load_model(str(src), load_external_data=False)
    w = next(t for t in proto.graph.initializer if t.name.startswith("W"))
    twin = proto.graph.initializer.add()
    twin.CopyFrom(w)
    twin.name = "W_twin"
    proto.graph.node.append(helper.make_node("MatMul", ["x", "W_twin"], ["z"]))
    proto.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, DIM]))
    onnx.save_model(proto, str(src))
    result = sharedml.prepare(src, tmp_path / "p" / "m.onnx")
    assert result.tensors_moved == 2
    assert result.manifest.size_bytes == 4096 * 4  # one 16 KiB copy, not two


# ---------------------------------------------------------------------------------------------
# Property: any mix of placements, sizes and thresholds round-trips.


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    placements=st.lists(st.sampled_from(PLACEMENTS), min_size=1, max_size=5),
    dim=st.sampled_from([4, 8, 16, 24, 40]),
    threshold=st.sampled_from([0, 64, 1024, 4096]),
    external=st.sampled_from([None, "one", "many"]),
    seed=st.integers(0, 2**16),
)
def test_any_mix_of_placements_round_trips(
    tmp_path_factory: pytest.TempPathFactory,
    placements: list[str],
    dim: int,
    threshold: int,
    external: str | None,
    seed: int,
) -> None:
    tmp = tmp_path_factory.mktemp("prop")
    model = build_model(placements, dim=dim, seed=seed)
    src = save_model(model, tmp / "src" / "m.onnx", external=external, threshold=256)
    result = sharedml.prepare(src, tmp / "out" / "m.onnx", size_threshold_bytes=threshold)
    check_layout(result, original_tensors(model), 4096, threshold)
    for flag in (True, False):
        np.testing.assert_array_equal(
            run_ort(result.model_path, feeds(dim, flag=flag)), run_ort(src, feeds(dim, flag=flag))
        )


# ---------------------------------------------------------------------------------------------
# Bad input: one clear SharedMLError, nothing written, nothing damaged.


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def external_model(
    tmp_path: Path, location: str, *, offset: int = 0, length: int | None = None
) -> Path:
    """A model whose one weight (64 floats) is external at `location`."""
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[8, 8])
    w.data_location = TensorProto.EXTERNAL
    entries = {"location": location, "offset": str(offset)}
    if length is not None:
        entries["length"] = str(length)
    for k, v in entries.items():
        e = w.external_data.add()
        e.key, e.value = k, v
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def test_garbage_file_is_not_a_model(tmp_path: Path) -> None:
    src = tmp_path / "garbage.onnx"
    src.write_bytes(os.urandom(3000))
    with pytest.raises(sharedml.InvalidModelError, match=r"garbage\.onnx"):
        sharedml.prepare(src, tmp_path / "out" / "m.onnx")
    assert not (tmp_path / "out").exists() or leftovers(tmp_path / "out") == []


def test_missing_model(tmp_path: Path) -> None:
    with pytest.raises(sharedml.ModelNotFoundError, match=r"nope\.onnx"):
        sharedml.prepare(tmp_path / "nope.onnx", tmp_path / "p.onnx")


def test_missing_external_data(tmp_path: Path) -> None:
    src = external_model(tmp_path, "w.bin")
    with pytest.raises(sharedml.ExternalDataError, match=r"Tensor 'w'.*w\.bin.*does not exist"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")


def test_truncated_external_data(tmp_path: Path) -> None:
    src = external_model(tmp_path, "w.bin")
    (src.parent / "w.bin").write_bytes(b"\0" * 100)  # 256 needed
    with pytest.raises(sharedml.ExternalDataError, match=r"'w'.*outside.*w\.bin.*truncated"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")
    assert leftovers(tmp_path / "out") == [] if (tmp_path / "out").exists() else True


def test_offset_past_end_of_file(tmp_path: Path) -> None:
    src = external_model(tmp_path, "w.bin", offset=10_000, length=256)
    (src.parent / "w.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(sharedml.ExternalDataError, match="10000"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")


def test_length_that_does_not_match_the_shape(tmp_path: Path) -> None:
    src = external_model(tmp_path, "w.bin", length=128)
    (src.parent / "w.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(sharedml.ExternalDataError, match="does not match its shape"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")


@pytest.mark.parametrize("location", ["../secret.bin", "sub/../../secret.bin"])
def test_parent_directory_locations_are_refused(tmp_path: Path, location: str) -> None:
    src = external_model(tmp_path, location)
    (tmp_path / "secret.bin").write_bytes(b"\0" * 256)
    with pytest.raises(sharedml.UnsafePathError, match="outside the model's folder"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")


def test_absolute_locations_are_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 256)
    src = external_model(tmp_path, str(secret))
    with pytest.raises(sharedml.UnsafePathError, match="absolute"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")


def test_symlink_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 256)
    src = external_model(tmp_path, "w.bin")
    (src.parent / "w.bin").symlink_to(secret)
    with pytest.raises(sharedml.UnsafePathError, match="resolves to"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")


def test_symlink_inside_the_folder_is_fine(tmp_path: Path) -> None:
    src = external_model(tmp_path, "w.bin")
    (src.parent / "real.bin").write_bytes(np.ones(64, np.float32).tobytes())
    (src.parent / "w.bin").symlink_to(src.parent / "real.bin")
    result = sharedml.prepare(src, tmp_path / "out" / "p.onnx")
    assert result.tensors_moved == 1


def test_in_place_prepare_is_refused_and_leaves_the_source_working(tmp_path: Path) -> None:
    model = build_model(["initializer"], dim=DIM)
    src = save_model(model, tmp_path / "m.onnx")
    before = src.read_bytes()
    with pytest.raises(sharedml.PrepareError, match="overwrite its source"):
        sharedml.prepare(src, src)
    assert src.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_weights_file_that_would_overwrite_source_data_is_refused(tmp_path: Path) -> None:
    model = build_model(["initializer"], dim=DIM)
    src = save_model(model, tmp_path / "m.onnx", external="one")  # data in m.data
    (tmp_path / "m.data").rename(tmp_path / "x.weights")
    proto = onnx.load_model(str(src), load_external_data=False)
    for t in proto.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "x.weights"
    onnx.save_model(proto, str(src))
    before = (tmp_path / "x.weights").read_bytes()
    with pytest.raises(sharedml.PrepareError, match="external data"):
        sharedml.prepare(src, tmp_path / "x.onnx")
    assert (tmp_path / "x.weights").read_bytes() == before


def test_overwriting_an_earlier_output_is_atomic(tmp_path: Path) -> None:
    a = save_model(build_model(["initializer"], dim=DIM, seed=1), tmp_path / "a.onnx")
    b = save_model(build_model(["initializer"], dim=DIM, seed=2), tmp_path / "b.onnx")
    sharedml.prepare(a, tmp_path / "out" / "p.onnx")
    sharedml.prepare(b, tmp_path / "out" / "p.onnx")
    np.testing.assert_array_equal(
        run_ort(tmp_path / "out" / "p.onnx", feeds(DIM)), run_ort(b, feeds(DIM))
    )
    assert leftovers(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_prepare_prints_a_json_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sharedml.cli import main

    src = save_model(build_model(["constant", "initializer"], dim=DIM), tmp_path / "m.onnx")
    assert main(["prepare", str(src), "-o", str(tmp_path / "p.onnx"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tensors_moved"] == 2
    assert summary["bytes_moved"] == 2 * DIM * DIM * 4
    assert summary["weights_path"] == str(tmp_path / "p.weights")
    assert {"model_path", "bytes_inline", "tensors_inline"} <= summary.keys()


def test_cli_prepare_text_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sharedml.cli import main

    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    assert main(["prepare", str(src), "-o", str(tmp_path / "p.onnx")]) == 0
    out = capsys.readouterr()
    assert "1 tensors" in out.out and out.err == ""  # no progress bar when not a terminal


def test_cli_errors_are_one_line_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sharedml.cli import main

    assert main(["prepare", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "p.onnx")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sharedml: error: ") and err.count("\n") == 1
    assert "Traceback" not in err
    with pytest.raises(sharedml.ModelNotFoundError):
        main(["--debug", "prepare", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "p.onnx")])


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_outputs_get_the_permissions_the_umask_gives(tmp_path: Path) -> None:
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    old = os.umask(0o022)
    try:
        result = sharedml.prepare(src, tmp_path / "out" / "m.onnx")
    finally:
        os.umask(old)
    for path in (result.model_path, result.weights_path):
        assert path.stat().st_mode & 0o777 == 0o644  # readable by workers running as others


def test_an_existing_folder_as_output_means_folder_slash_model_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sharedml.cli import main

    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "model.onnx")
    out = tmp_path / "out"
    out.mkdir()
    assert main(["prepare", str(src), "-o", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["model_path"] == str(out / "model.onnx")
    assert summary["weights_path"] == str(out / "model.weights")
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.weights"]
    np.testing.assert_array_equal(run_ort(out / "model.onnx", feeds(DIM)), run_ort(src, feeds(DIM)))


def test_an_output_path_that_is_a_folder_inside_the_folder_is_refused_before_writing(
    tmp_path: Path,
) -> None:
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "model.onnx")
    (tmp_path / "out" / "model.onnx").mkdir(parents=True)
    with pytest.raises(sharedml.PrepareError, match="is a folder"):
        sharedml.prepare(src, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.onnx"]


@pytest.mark.parametrize("earlier_output", [False, True])
def test_a_failure_placing_the_graph_leaves_no_file_and_restores_the_old_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier_output: bool
) -> None:
    src = save_model(build_model(["initializer"], dim=DIM, seed=3), tmp_path / "m.onnx")
    out = tmp_path / "out"
    out.mkdir()
    if earlier_output:
        old = save_model(build_model(["initializer"], dim=DIM, seed=4), tmp_path / "old.onnx")
        sharedml.prepare(old, out / "p.onnx")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_replace = os.replace

    def failing_replace(a: Any, b: Any) -> None:
        if Path(b) == out / "p.onnx":
            raise OSError(28, "No space left on device")
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        sharedml.prepare(src, out / "p.onnx")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_the_cli_help_quotes_the_defaults_prepare_uses() -> None:
    from sharedml import _prepare, cli

    assert cli._THRESHOLD == _prepare.DEFAULT_SIZE_THRESHOLD_BYTES
    assert cli._ALIGNMENT == _prepare.DEFAULT_ALIGNMENT_BYTES
