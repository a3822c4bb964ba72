"""prepare: every placement moves to one aligned file, outputs stay equal, bad input is refused."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
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
from sharedml.model._graph import iter_graphs, tensor_nbytes

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
    """Every external tensor is aligned by the layout rule, holds the expected bytes, and ranges
    don't overlap; nothing at or above the threshold stayed in the graph."""
    limit = max(threshold, 128)  # prepare keeps tensors under 128 bytes inline regardless
    assert result.manifest.alignment_bytes == alignment
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
            # Large tensors at the alignment, small ones at 64 bytes (or their size's largest
            # power of two): never padded by more than their own size.
            rule = (
                alignment
                if length >= alignment
                else min(64, 1 << (max(length, 1).bit_length() - 1))
            )
            assert result.manifest.alignment_for(length) == rule
            assert offset % rule == 0
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
    # 64 KiB weights: large at either alignment; the Scan's state (512 bytes) is small.
    model = build_model(["initializer", "constant", "scan_initializer"], dim=128)
    result = sharedml.prepare(
        save_model(model, tmp_path / "m.onnx"), tmp_path / "p.onnx", alignment_bytes=alignment
    )
    check_layout(result, original_tensors(model), alignment)
    assert result.manifest.size_bytes % 4096 == 0  # the file ends on a page


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


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
def test_symlink_escaping_the_folder_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 256)
    src = external_model(tmp_path, "w.bin")
    (src.parent / "w.bin").symlink_to(secret)
    with pytest.raises(sharedml.UnsafePathError, match="resolves to"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")


@pytest.mark.skipif(os.name != "posix", reason="symlinks")
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
    # The outputs are read-only, and why: a copy over a live pool's weights crashes it.
    assert "read-only" in out.out and "SIGBUS" in out.out and "mv" in out.out


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
@pytest.mark.parametrize(("umask", "expected"), [(0o022, 0o444), (0o027, 0o440), (0o077, 0o400)])
def test_outputs_are_read_only_with_the_permissions_the_umask_gives(
    tmp_path: Path, umask: int, expected: int
) -> None:
    # Readable by whom the umask allows (workers often run as another user), writable by
    # nobody: a `cp` over the weights of a live pool would crash it with SIGBUS.
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    old = os.umask(umask)
    try:
        result = sharedml.prepare(src, tmp_path / "out" / "m.onnx")
        again = sharedml.prepare(src, tmp_path / "out" / "m.onnx")  # replaces read-only files
    finally:
        os.umask(old)
    assert again.manifest == result.manifest
    for path in (result.model_path, result.weights_path):
        assert path.stat().st_mode & 0o777 == expected


def _copy_over_prepared_weights_fails(folder: Path) -> None:
    src = save_model(build_model(["initializer"], dim=DIM), folder / "m.onnx")
    result = sharedml.prepare(src, folder / "out" / "m.onnx")
    try:
        open(result.weights_path, "r+b").close()  # what `cp new.weights m.weights` does
    except PermissionError:
        pass
    else:
        raise AssertionError(f"the owner could open '{result.weights_path}' for writing")
    again = sharedml.prepare(src, folder / "out" / "m.onnx")  # renames still replace them
    assert again.manifest == result.manifest


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_the_owner_cannot_copy_over_prepared_weights(
    other_user: Callable[[Callable[[], None]], None],
) -> None:
    # Root writes any file, so the owner is a second, unprivileged user, made for the test, in
    # a folder of theirs (pytest's tmp folders are private to root).
    folder = Path(tempfile.mkdtemp(prefix="sharedml-other-user-"))
    try:
        os.chown(folder, other_user.uid, other_user.gid)  # type: ignore[attr-defined]
        other_user(lambda: _copy_over_prepared_weights_fails(folder))
    finally:
        shutil.rmtree(folder)


# ---------------------------------------------------------------------------------------------
# Layout: small tensors are packed, so the output stays a small multiple of the input

TINY_TENSORS = 100_000


def tiny_external_model(folder: Path, count: int) -> Path:
    """``count`` one-byte external tensors in one data file: a model of ~6 MB of entries."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "w.bin").write_bytes(bytes(range(256)) * (count // 256 + 1))
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    for i in range(count):
        t = graph.initializer.add(name=f"t{i}", data_type=TensorProto.UINT8, dims=[1])
        t.data_location = TensorProto.EXTERNAL
        t.external_data.add(key="location", value="w.bin")
        t.external_data.add(key="offset", value=str(i))
        t.external_data.add(key="length", value="1")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_many_tiny_tensors_do_not_each_cost_a_page(tmp_path: Path) -> None:
    src = tiny_external_model(tmp_path / "src", TINY_TENSORS)
    input_bytes = sum(p.stat().st_size for p in src.parent.iterdir())
    result = sharedml.prepare(src, tmp_path / "out" / "m.onnx")
    output_bytes = result.model_path.stat().st_size + result.weights_path.stat().st_size
    # Was 62x (a page per tensor: 410 MB for 6.6 MB). Every padding is now smaller than its
    # tensor, so the weights stay under twice their data plus the final page.
    assert result.tensors_moved == TINY_TENSORS
    assert result.manifest.size_bytes <= 2 * result.bytes_moved + 4096
    assert output_bytes <= 2 * input_bytes + 4096, (output_bytes, input_bytes)
    store = sharedml.weights.WeightStore.open(
        result.model_path
    )  # the store accepts the packed offsets
    assert len(store.slots) == TINY_TENSORS
    data = (src.parent / "w.bin").read_bytes()
    for slot in store.slots[:: TINY_TENSORS // 100]:
        i = int(slot.name[1:])
        assert bytes(store.buffer[slot.offset : slot.offset + 1]) == data[i : i + 1]


SMALL_TYPES = [np.uint8, np.float16, np.float32, np.int64, np.float64]


def mixed_size_model(folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """Constants of many sizes and element types, external and inline, each summed to an output.

    Sizes straddle every class boundary of the layout (1 element, under 64 bytes, just under and
    over a page), for element sizes from 1 to 8 bytes.
    """
    rng = np.random.default_rng(3)
    arrays: dict[str, np.ndarray] = {}
    for dtype in SMALL_TYPES:
        itemsize = np.dtype(dtype).itemsize
        for count in sorted({1, 3, 8, 40 // itemsize or 1, 4095 // itemsize, 5000 // itemsize}):
            values = rng.standard_normal(count) * 10
            arrays[f"{np.dtype(dtype).name}_{count}"] = values.astype(dtype)
    model_inits = [numpy_helper.from_array(a, name) for name, a in arrays.items()]
    nodes, outputs = [], []
    for name, a in arrays.items():
        nodes.append(helper.make_node("Identity", [name], [f"out_{name}"]))
        outputs.append(
            helper.make_tensor_value_info(
                f"out_{name}", helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)
            )
        )
    graph = helper.make_graph(nodes, "mixed", [], outputs, initializer=model_inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = save_model(model, folder / "m.onnx", external="one", threshold=0)
    return path, arrays


@pytest.mark.parametrize(
    "mechanism",
    [
        pytest.param("in-memory-file", marks=pytest.mark.capability("files-in-memory")),
        "add-initializer",
        "ort-mmap",
    ],
)
def test_packed_small_tensors_load_through_every_mechanism(tmp_path: Path, mechanism: str) -> None:
    src, arrays = mixed_size_model(tmp_path / "src")
    result = sharedml.prepare(src, tmp_path / "out" / "m.onnx", size_threshold_bytes=0)
    store = sharedml.weights.WeightStore.open(result.model_path)
    for slot in store.slots:
        assert slot.offset % result.manifest.alignment_for(slot.length) == 0
        itemsize = np.dtype(arrays[slot.name].dtype).itemsize
        assert slot.offset % itemsize == 0, slot  # natural alignment for the element type
        assert slot.length < 4096 or slot.offset % 4096 == 0, slot
    assert any(s.offset % 4096 for s in store.slots)  # small ones really are packed
    del store
    with sharedml.SessionPool(result.model_path, sessions=1, mechanism=mechanism) as pool:
        outputs = pool.run(None, {})
    for got, want in zip(outputs, arrays.values(), strict=True):  # outputs in graph order
        np.testing.assert_array_equal(got, want)


def test_the_weights_writer_records_the_digest_of_exactly_the_bytes_it_left(
    tmp_path: Path,
) -> None:
    # A family's writer rolls back a tensor the file holds already: the file and its recorded
    # digest must be what they would be had that tensor never been written.
    from sharedml.prepared._format import WeightsManifest, WeightsWriter

    layout = WeightsManifest("w.weights", 0, "", 4096, 2)
    pieces = [bytes([n]) * size for n, size in ((1, 5000), (2, 10_000), (3, 70))]
    with open(tmp_path / "w.weights", "wb") as fh:
        writer = WeightsWriter(fh, layout)
        first = writer.add([pieces[0][:10], pieces[0][10:]], len(pieces[0]))
        mark = writer.mark()
        writer.add([pieces[1]], len(pieces[1]))
        writer.rollback(mark)
        last = writer.add([pieces[2]], len(pieces[2]))
        manifest = writer.finish()
    data = (tmp_path / "w.weights").read_bytes()
    assert (first, last) == (0, 5000 + (-5000 % 64))  # 70 bytes start at a multiple of 64
    assert data[first : first + 5000] == pieces[0] and data[last : last + 70] == pieces[2]
    assert len(data) == manifest.size_bytes == 8192  # the file ends on a page
    assert hashlib.sha256(data).hexdigest() == manifest.sha256
    assert sharedml.prepared.WeightsManifest.from_json(manifest.to_json()) == manifest


def test_a_format_1_prepared_model_still_loads(tmp_path: Path) -> None:
    # Format 1 aligned every tensor to alignment_bytes; those offsets satisfy today's rule.
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    result = sharedml.prepare(src, tmp_path / "out" / "m.onnx")
    model = onnx.load_model(str(result.model_path), load_external_data=False)
    for prop in model.metadata_props:
        if prop.key == "sharedml.weights":
            raw = json.loads(prop.value)
            del raw["small_alignment_bytes"]
            prop.value = json.dumps({**raw, "format": 1})
    old = tmp_path / "old" / "m.onnx"
    old.parent.mkdir()
    old.write_bytes(model.SerializeToString())
    (old.parent / "m.weights").write_bytes(result.weights_path.read_bytes())
    store = sharedml.weights.WeightStore.open(old)
    assert store.manifest.small_alignment_bytes == store.manifest.alignment_bytes == 4096
    del store
    np.testing.assert_array_equal(run_ort(old, feeds(DIM)), run_ort(src, feeds(DIM)))
    for prop in model.metadata_props:
        if prop.key == "sharedml.weights":
            prop.value = json.dumps({**json.loads(prop.value), "format": 99})
    old.chmod(0o644)
    old.write_bytes(model.SerializeToString())
    with pytest.raises(sharedml.InvalidModelError, match=r"format 99.*prepare the model again"):
        sharedml.weights.WeightStore.open(old)


@pytest.mark.parametrize("alignment", [2**40, 2**31, 3 * 4096])
def test_alignment_is_bounded(
    tmp_path: Path, alignment: int, capsys: pytest.CaptureFixture[str]
) -> None:
    from sharedml.cli import main

    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    with pytest.raises(ValueError, match=r"alignment_bytes must be a power of two from 4096 to"):
        sharedml.prepare(src, tmp_path / "p.onnx", alignment_bytes=alignment)
    argv = ["prepare", str(src), "-o", str(tmp_path / "p.onnx"), "--alignment", str(alignment)]
    assert main(argv) == 1  # one line, no MemoryError traceback
    err = capsys.readouterr().err
    assert err.startswith("sharedml: error: alignment_bytes") and err.count("\n") == 1
    assert not (tmp_path / "p.onnx").exists()


def test_the_largest_alignment_costs_nothing_for_small_tensors(tmp_path: Path) -> None:
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    result = sharedml.prepare(src, tmp_path / "p.onnx", alignment_bytes=2**30)
    assert result.manifest.size_bytes == 4 * DIM * DIM  # 16 KiB < 1 GiB: packed, no padding
    np.testing.assert_array_equal(run_ort(result.model_path, feeds(DIM)), run_ort(src, feeds(DIM)))


# ---------------------------------------------------------------------------------------------
# Outputs: never an input, never anything but a regular file, any legal name


def data_model(folder: Path, *, name: str = "model.onnx", data: str = "model.onnx.data") -> Path:
    """A model whose weights are external in ``data``, with ``name`` as its file name."""
    model = build_model(["initializer"], dim=DIM)
    path = folder / name
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save_model(
        onnx.ModelProto.FromString(model.SerializeToString()),
        str(path),
        save_as_external_data=True,
        location=data,
        size_threshold=0,
    )
    return path


def snapshot_folder(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    ("src_name", "data_name", "dst_name", "match"),
    [
        ("model.onnx", "model.onnx.data", "model.onnx.data", "external data"),
        ("net.weights", "net.data", "net.onnx", "the source model"),
        ("m.onnx", "m.data", "m.weights", "weights file"),
        ("m.onnx", "shared.weights", "shared.onnx", "external data"),
    ],
    ids=["graph_over_data", "weights_over_model", "graph_is_weights", "weights_over_data"],
)
def test_an_output_that_is_an_input_is_refused(
    tmp_path: Path, src_name: str, data_name: str, dst_name: str, match: str
) -> None:
    src = data_model(tmp_path, name=src_name, data=data_name)
    before = snapshot_folder(tmp_path)
    with pytest.raises(sharedml.PrepareError, match=match) as info:
        sharedml.prepare(src, tmp_path / dst_name)
    refused = tmp_path / dst_name
    assert str(refused) in str(info.value) or str(refused.with_suffix(".weights")) in str(
        info.value
    )
    assert snapshot_folder(tmp_path) == before  # nothing written, nothing destroyed
    np.testing.assert_array_equal(run_ort(src, feeds(DIM)).shape, (1, DIM))


def test_an_output_hard_linked_to_an_input_is_refused(tmp_path: Path) -> None:
    src = data_model(tmp_path / "src")
    (tmp_path / "out").mkdir()
    os.link(src.parent / "model.onnx.data", tmp_path / "out" / "p.weights")
    before = (src.parent / "model.onnx.data").read_bytes()
    with pytest.raises(sharedml.PrepareError, match="overwrite its source"):
        sharedml.prepare(src, tmp_path / "out" / "p.onnx")
    assert (src.parent / "model.onnx.data").read_bytes() == before


@pytest.mark.skipif(os.name != "posix", reason="symlinks and FIFOs")
@pytest.mark.parametrize("which", ["graph", "weights"])
@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder", "device"])
def test_an_output_that_is_not_a_regular_file_is_refused(
    tmp_path: Path, which: str, kind: str
) -> None:
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "src" / "m.onnx")
    out = tmp_path / "out"
    out.mkdir()
    target = out / ("p.onnx" if which == "graph" else "p.weights")
    if kind == "symlink":
        (tmp_path / "victim").write_bytes(b"keep me")
        target.symlink_to(tmp_path / "victim")
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
    else:  # as root, `-o /dev/null` used to replace /dev/null itself
        try:
            os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        except (PermissionError, AttributeError):
            pytest.skip("creating a device node needs root (and a system that allows it)")
    mode = os.lstat(target).st_mode
    if kind == "folder" and which == "graph":
        # An existing folder as the graph output means "into it", as cp does.
        result = sharedml.prepare(src, out / "p.onnx")
        assert result.model_path == target / "m.onnx" and result.weights_path.is_file()
        return
    with pytest.raises(sharedml.PrepareError, match="replaces only regular files") as info:
        sharedml.prepare(src, out / "p.onnx")
    assert str(target) in str(info.value)
    assert os.lstat(target).st_mode == mode  # still what it was
    assert leftovers(out) == []
    if kind == "symlink":
        assert (tmp_path / "victim").read_bytes() == b"keep me"


@pytest.mark.skipif(
    os.name == "nt", reason="onnxruntime on Windows cannot open a path over MAX_PATH (260)"
)
def test_a_240_character_output_name_works(tmp_path: Path) -> None:
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    dst = tmp_path / "out" / ("n" * 235 + ".onnx")  # its weights file's name has 243
    result = sharedml.prepare(src, dst)
    assert result.weights_path.name == "n" * 235 + ".weights"
    assert leftovers(dst.parent) == []
    np.testing.assert_array_equal(run_ort(dst, feeds(DIM)), run_ort(src, feeds(DIM)))


# ---------------------------------------------------------------------------------------------
# Write failures: a SharedMLError (and an OSError) naming the path and the fix


def assert_output_error(exc: BaseException, path: Path, fix: str) -> None:
    assert isinstance(exc, sharedml.SharedMLError), f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, OSError) and isinstance(exc, sharedml.PrepareError)
    assert type(exc).__name__ == "OutputError"
    assert str(path) in str(exc) and fix in str(exc), str(exc)


def test_an_output_folder_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    src = save_model(build_model(["initializer"], dim=DIM), tmp_path / "m.onnx")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError) as info:
        sharedml.prepare(src, tmp_path / "file" / "sub" / "p.onnx")
    assert_output_error(info.value, tmp_path / "file" / "sub", "is a file, not a folder")


def _prepare_into_unwritable_folder(src: Path, out: Path) -> None:
    try:
        sharedml.prepare(src, out / "p.onnx")
    except OSError as exc:
        assert_output_error(exc, out / "p.weights", "may not write")
    else:
        raise AssertionError(f"prepare wrote into '{out}'")
    assert list(out.iterdir()) == []


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_an_unwritable_output_folder_is_a_clear_error(request: pytest.FixtureRequest) -> None:
    # Root may write any folder: as root, the writer is a second user, made for the test.
    folder = Path(tempfile.mkdtemp(prefix="sharedml-unwritable-"))
    try:
        os.chmod(folder, 0o755)
        src = save_model(build_model(["initializer"], dim=DIM), folder / "m.onnx")
        out = folder / "ro"
        out.mkdir(mode=0o555)
        if os.geteuid() == 0:
            other_user = request.getfixturevalue("other_user")
            other_user(lambda: _prepare_into_unwritable_folder(src, out))
        else:
            _prepare_into_unwritable_folder(src, out)
    finally:
        shutil.rmtree(folder)


FULL_DISK = textwrap.dedent(
    r"""
    import resource, signal, sys
    import sharedml
    # A file size limit: writes past it fail with EFBIG, as they fail with ENOSPC on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))
    try:
        if sys.argv[1] == "direct":
            sharedml.prepare(sys.argv[2], sys.argv[4])
        else:
            sharedml.prepared_model_for(sys.argv[2], cache_dir=sys.argv[4])
    except BaseException as exc:
        kinds = [c.__name__ for c in type(exc).__mro__]
        print(" ".join(kinds))
        print(" ".join(str(exc).split()))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE and SIGXFSZ")
@pytest.mark.parametrize("where", ["direct", "cache"])
def test_a_full_disk_is_a_clear_error_and_leaves_nothing(tmp_path: Path, where: str) -> None:
    src = save_model(build_model(["initializer"] * 4, dim=128), tmp_path / "src" / "m.onnx")
    dst = tmp_path / "out" / "p.onnx" if where == "direct" else tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-c", FULL_DISK, where, str(src), str(100_000), str(dst)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    kinds, message = out.stdout.strip().splitlines()[-2:]
    if where == "direct":
        assert "OutputError" in kinds.split() and "OSError" in kinds.split(), kinds
        assert str(dst.with_suffix(".weights")) in message and "ulimit -f" in message, message
        assert leftovers(dst.parent) == []
    else:
        assert "CacheError" in kinds.split(), kinds
        assert str(src) in message and "SHAREDML_CACHE_DIR" in message, message
        assert [p.name for p in (dst / "models").iterdir()] == []


# ---------------------------------------------------------------------------------------------
# The cache key and the prepared bytes come from the same read


def versioned_source(folder: Path) -> tuple[Path, bytes, bytes]:
    """A model with its weights in ``m.data``, and the data of two same-shaped versions."""
    v1 = save_model(
        build_model(["initializer"], dim=DIM, seed=1), folder / "v1" / "m.onnx", external="one"
    )
    v2 = save_model(
        build_model(["initializer"], dim=DIM, seed=2), folder / "v2" / "m.onnx", external="one"
    )
    assert v1.read_bytes() == v2.read_bytes()  # the graphs are equal; only the data differs
    live = folder / "live" / "m.onnx"
    live.parent.mkdir()
    live.write_bytes(v1.read_bytes())
    data1, data2 = ((v / "m.data").read_bytes() for v in (v1.parent, v2.parent))
    (live.parent / "m.data").write_bytes(data1)
    return live, data1, data2


def deploy(folder: Path, data: bytes) -> None:
    """Replace the live data file by a rename, as a deploy does."""
    (folder / "m.data.new").write_bytes(data)
    os.replace(folder / "m.data.new", folder / "m.data")


def test_a_source_changed_between_key_and_copy_is_cached_under_its_own_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sharedml.cache import _stamps
    from sharedml.prepared import _prepare

    monkeypatch.setattr(_stamps, "RACY_WINDOW_NS", 0)  # stamps too, so that none can mislead
    src, data1, data2 = versioned_source(tmp_path)
    v1, v2 = tmp_path / "v1" / "m.onnx", tmp_path / "v2" / "m.onnx"
    real_prepare = _prepare.prepare
    calls: list[int] = []

    def deploy_then_prepare(*args: object, **kwargs: object) -> sharedml.PrepareResult:
        if not calls:  # v2 lands after the key of v1 was computed, before the copy
            deploy(src.parent, data2)
        calls.append(1)
        return real_prepare(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_prepare, "prepare", deploy_then_prepare)
    entry = sharedml.prepared_model_for(src)
    monkeypatch.setattr(_prepare, "prepare", real_prepare)
    # The entry holds v2's weights, and its key is v2's: never v2's bytes under v1's key.
    np.testing.assert_array_equal(run_ort(entry, feeds(DIM)), run_ort(v2, feeds(DIM)))
    assert entry.parent.name == _prepare.content_key(src, size_threshold_bytes=1024)
    # Roll back to v1: its own key, its own weights (was: v2's weights, for good).
    deploy(src.parent, data1)
    rolled_back = sharedml.prepared_model_for(src)
    assert rolled_back != entry
    np.testing.assert_array_equal(run_ort(rolled_back, feeds(DIM)), run_ort(v1, feeds(DIM)))
    assert rolled_back.parent.name == _prepare.content_key(src, size_threshold_bytes=1024)


@pytest.mark.skipif(
    os.name == "nt",
    reason="Windows refuses to replace a file another handle has open: the race cannot happen",
)
def test_source_sha256_covers_what_was_copied(tmp_path: Path) -> None:
    src, _data1, data2 = versioned_source(tmp_path)
    first = sharedml.prepare(src, tmp_path / "a" / "m.onnx")
    again = sharedml.prepare(src, tmp_path / "b" / "m.onnx")
    assert first.source_sha256 == again.source_sha256
    changed: list[int] = []

    def change_mid_copy(done: int, total: int) -> None:
        if not changed:  # during the copy: whatever was read is what is hashed
            deploy(src.parent, data2)
            changed.append(done)

    mid = sharedml.prepare(src, tmp_path / "c" / "m.onnx", progress=change_mid_copy)
    assert changed
    # The data file was opened before the change, so the copy is v1's, and so is the digest.
    assert mid.source_sha256 == first.source_sha256
    assert mid.manifest.sha256 == first.manifest.sha256
    after = sharedml.prepare(src, tmp_path / "d" / "m.onnx")
    assert after.source_sha256 != first.source_sha256
    assert after.manifest.sha256 != first.manifest.sha256


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
    from sharedml import cli
    from sharedml.prepared import _format, _plan

    assert cli._THRESHOLD == _plan.DEFAULT_SIZE_THRESHOLD_BYTES
    assert cli._ALIGNMENT == _format.DEFAULT_ALIGNMENT_BYTES
