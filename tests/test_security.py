"""Security: hostile models and a tampered cache are refused with clear errors, reading nothing.

The threat model is in ``docs/security.md``. Every model here is generated, and every hostile
``external_data`` entry is written by hand. Each refusal must be a ``SharedMLError`` whose
message names the model file and the tensor, and must leave nothing behind.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _models import build_model, feeds, save_model
from onnx import TensorProto, helper, numpy_helper

import sharedml
import sharedml._host._files
from sharedml.cache import Cache
from sharedml.cache._entries import clear_stale

N = 256  # elements of every hand-written tensor: 1 KiB of float32, above every threshold
NBYTES = 4 * N
POSIX = os.name == "posix"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(tmp_path / "cache"))


# --------------------------------------------------------------------------------------------
# Hand-written models


def external(
    name: str,
    location: str | None,
    *,
    offset: object = 0,
    length: object = NBYTES,
    dims: Sequence[int] = (N,),
) -> TensorProto:
    """A float tensor whose data is claimed to live in ``location`` (entries omitted if None)."""
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(dims))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        if value is not None:
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
    return tensor


def add_chain(
    initializers: Sequence[TensorProto] = (),
    *,
    constants: Sequence[TensorProto] = (),
    shape: Sequence[int] = (N,),
) -> onnx.ModelProto:
    """``y = x + t0 + t1 + ...`` over the given initializers and ``Constant`` values."""
    nodes = []
    names = [t.name for t in initializers]
    for i, value in enumerate(constants):
        names.append(f"const_{i}")
        nodes.append(helper.make_node("Constant", [], [f"const_{i}"], value=value))
    x = "x"
    for i, name in enumerate(names):
        nodes.append(helper.make_node("Add", [x, name], [f"sum_{i}"]))
        x = f"sum_{i}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "hostile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def write(model: onnx.ModelProto, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())  # as is: onnx.save would touch external data
    return path


def data_file(path: Path, n_floats: int = 4 * N) -> np.ndarray:
    values = np.arange(n_floats, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(values.tobytes())
    return values


def assert_names(exc: BaseException, *parts: object) -> None:
    """A sharedml error whose message names every part (file paths, tensor names)."""
    assert isinstance(exc, sharedml.SharedMLError), f"{type(exc).__name__}: {exc}"
    message = str(exc)
    for part in parts:
        assert str(part) in message, f"{part!s} not named in: {message}"


def assert_nothing_written(folder: Path) -> None:
    assert not folder.exists() or not any(folder.iterdir()), list(folder.iterdir())


# --------------------------------------------------------------------------------------------
# External data locations, offsets and lengths


def _case(tmp: Path, case: str) -> tuple[Path, type[sharedml.SharedMLError], str]:
    """Build the hostile model ``case`` in ``tmp/model``; returns (model, error, tensor name)."""
    folder = tmp / "model"
    data_file(folder / "w.bin")  # 4 KiB of real data the hostile entries point at or past
    secret = data_file(tmp / "secret.bin")  # beside the model's folder: must never be read
    del secret
    unsafe, bad = sharedml.UnsafePathError, sharedml.ExternalDataError
    if case.startswith("symlink") and not POSIX:
        pytest.skip("symlinks: Windows makes them only with a privilege; Wine cannot resolve them")
    if case == "symlink_file":
        os.symlink(tmp / "secret.bin", folder / "link.bin")
    if case == "symlink_folder":
        os.symlink(tmp, folder / "up", target_is_directory=True)
    if case == "fifo_as_file":
        os.mkfifo(folder / "pipe.bin")  # opening it to read would wait for a writer forever
    size = 4 * NBYTES
    table: dict[str, tuple[TensorProto, type[sharedml.SharedMLError]]] = {
        "parent": (external("w", "../secret.bin"), unsafe),
        "parent_deep": (external("w", "sub/../../secret.bin"), unsafe),
        "absolute": (external("w", str(tmp / "secret.bin")), unsafe),
        "absolute_inside": (external("w", str(folder / "w.bin")), unsafe),
        "symlink_file": (external("w", "link.bin"), unsafe),
        "symlink_folder": (external("w", "up/secret.bin"), unsafe),
        "missing_file": (external("w", "nope.bin"), bad),
        "no_location": (external("w", None), bad),
        "folder_as_file": (external("w", "."), bad),
        "fifo_as_file": (external("w", "pipe.bin"), bad),
        "offset_at_eof": (external("w", "w.bin", offset=size), bad),
        "offset_past_eof": (external("w", "w.bin", offset=size + 4096), bad),
        "length_past_eof": (
            external("w", "w.bin", offset=size - 4, length=NBYTES),
            bad,
        ),
        "offset_overflows_uint64": (external("w", "w.bin", offset=2**64 - 8), bad),
        "offset_overflows_int64": (external("w", "w.bin", offset=2**63 - 1), bad),
        "length_overflows_uint64": (
            external("w", "w.bin", length=2**64 + NBYTES, dims=(2**62 + N,)),
            bad,
        ),
        "negative_offset": (external("w", "w.bin", offset=-NBYTES), bad),
        "negative_length": (external("w", "w.bin", length=-NBYTES), bad),
        "offset_not_a_number": (external("w", "w.bin", offset="0x10"), bad),
        "length_not_a_number": (external("w", "w.bin", length="1e3"), bad),
        "length_does_not_match_shape": (external("w", "w.bin", length=NBYTES - 4), bad),
        "huge_dims_without_length": (external("w", "w.bin", length=None, dims=(2**40,)), bad),
    }
    tensor, error = table[case]
    return write(add_chain([tensor]), folder / "m.onnx"), error, tensor.name


HOSTILE_CASES = [
    "parent",
    "parent_deep",
    "absolute",
    "absolute_inside",
    "symlink_file",
    "symlink_folder",
    "missing_file",
    "no_location",
    "folder_as_file",
    *(["fifo_as_file"] if hasattr(os, "mkfifo") else []),
    "offset_at_eof",
    "offset_past_eof",
    "length_past_eof",
    "offset_overflows_uint64",
    "offset_overflows_int64",
    "length_overflows_uint64",
    "negative_offset",
    "negative_length",
    "offset_not_a_number",
    "length_not_a_number",
    "length_does_not_match_shape",
    "huge_dims_without_length",
]


@pytest.mark.parametrize("case", HOSTILE_CASES)
def test_hostile_external_data_is_refused_naming_file_and_tensor(tmp_path: Path, case: str) -> None:
    model, error, tensor = _case(tmp_path, case)
    with pytest.raises(error) as info:
        sharedml.prepare(model, tmp_path / "out" / "m.onnx")
    assert_names(info.value, model, tensor)
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("case", ["parent", "symlink_file", "offset_past_eof", "negative_offset"])
def test_hostile_external_data_is_refused_by_the_pool_and_leaves_no_cache_entry(
    tmp_path: Path, case: str
) -> None:
    model, error, tensor = _case(tmp_path, case)
    with pytest.raises(error) as info:
        sharedml.SessionPool(model, sessions=1, cache_dir=tmp_path / "cache")
    assert_names(info.value, model, tensor)
    assert_nothing_written(tmp_path / "cache" / "models")


def test_unsafe_locations_are_also_permission_errors(tmp_path: Path) -> None:
    model, _, _ = _case(tmp_path, "parent")
    with pytest.raises(PermissionError):
        sharedml.prepare(model, tmp_path / "out" / "m.onnx")


def test_hostile_constant_node_is_refused_like_an_initializer(tmp_path: Path) -> None:
    data_file(tmp_path / "model" / "w.bin")
    data_file(tmp_path / "secret.bin")
    model = write(
        add_chain(constants=[external("c", "../secret.bin")]), tmp_path / "model" / "m.onnx"
    )
    with pytest.raises(sharedml.UnsafePathError) as info:
        sharedml.prepare(model, tmp_path / "out" / "m.onnx")
    assert_names(info.value, model, "../secret.bin")


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_symlink_inside_the_folder_and_adjacent_ranges_are_accepted(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    values = data_file(folder / "data" / "w.bin")
    os.symlink("data/w.bin", folder / "alias.bin")
    tensors = [
        external("a", "alias.bin", offset=0),
        external("b", "data/w.bin", offset=NBYTES),  # starts exactly where `a` ends
        external("c", "./data/../alias.bin", offset=3 * NBYTES),
    ]
    model = write(add_chain(tensors), folder / "m.onnx")
    result = sharedml.prepare(model, tmp_path / "out" / "m.onnx")
    assert result.tensors_moved == 3
    expected = values[:N] + values[N : 2 * N] + values[3 * N :]
    with sharedml.SessionPool(result.model_path, sessions=1) as pool:
        out = pool.run(None, {"x": np.zeros(N, np.float32)})[0]
    np.testing.assert_array_equal(out, expected)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
@pytest.mark.parametrize(
    ("case", "kind"), [("fifo_as_file", "a FIFO"), ("folder_as_file", "a folder")]
)
def test_external_data_that_is_not_a_regular_file_says_so(
    tmp_path: Path, case: str, kind: str
) -> None:
    model, _, _ = _case(tmp_path, case)
    with pytest.raises(sharedml.ExternalDataError, match=f"is not a regular file: it is {kind}"):
        sharedml.prepare(model, tmp_path / "out" / "m.onnx")


# --------------------------------------------------------------------------------------------
# A symlink swapped in between prepare's check and its read (check-then-open)

FLIP_TRIES = 200  # the flipper leaked on try 64


def _flipper(folder: Path, location: str, secret_folder: Path, stop: threading.Event) -> None:
    """Swap ``folder/location`` (a file, or the folder holding it) for a symlink outside, and back.

    Each swap is atomic where the OS allows it (a file: ``rename`` over it); a folder cannot be
    renamed over, so it is moved aside and a link put in its place (missing in between).
    """
    first, *rest = Path(location).parts
    path, parked = folder / first, folder / f".parked-{first}"
    outside = secret_folder / first
    link = folder / f".link-{first}"
    while not stop.is_set():
        if rest:  # the folder component
            os.rename(path, parked)
            os.symlink(outside, path)
            os.unlink(path)
            os.rename(parked, path)
        else:
            os.symlink(outside, link)
            os.replace(link, path)  # now a symlink to the secret
            os.link(folder / "good.bin", link)
            os.replace(link, path)  # a regular file again


@pytest.mark.skipif(not POSIX, reason="symlinks")
@pytest.mark.parametrize("how", ["no-follow", "compare"])
@pytest.mark.parametrize("location", ["w.bin", "sub/w.bin"], ids=["file", "folder"])
def test_a_symlink_swapped_in_while_prepare_reads_never_leaks_an_outside_file(
    tmp_path: Path,
    location: str,
    how: str,
    fast_switching: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if how == "compare":  # the fallback where there is no O_NOFOLLOW (Windows), run here
        monkeypatch.setattr(sharedml._host._files, "_O_NOFOLLOW", 0)
    folder, secret_folder = tmp_path / "model", tmp_path / "secret"
    good = data_file(folder / "good.bin", N)  # 1 KiB of 0, 1, 2, ...
    data_file(folder / location, N)
    (folder / location).unlink()
    os.link(folder / "good.bin", folder / location)
    secret = np.full(N, 1337, np.float32)
    (secret_folder / Path(location).parent).mkdir(parents=True, exist_ok=True)
    (secret_folder / location).write_bytes(secret.tobytes())
    model = write(add_chain([external("w", location)]), folder / "m.onnx")
    stop = threading.Event()
    flipper = threading.Thread(
        target=_flipper, args=(folder, location, secret_folder, stop), daemon=True
    )
    flipper.start()
    outcomes: dict[str, int] = {}
    try:
        for i in range(FLIP_TRIES):
            out = tmp_path / "out" / f"{i}.onnx"
            try:
                result = sharedml.prepare(model, out)
            except sharedml.SharedMLError as exc:
                outcomes[type(exc).__name__] = outcomes.get(type(exc).__name__, 0) + 1
                continue
            weights = np.frombuffer(result.weights_path.read_bytes()[:NBYTES], np.float32)
            assert not np.array_equal(weights, secret), f"try {i} read the outside file"
            np.testing.assert_array_equal(weights, good)
            outcomes["read the good file"] = outcomes.get("read the good file", 0) + 1
    finally:
        stop.set()
        flipper.join(30)
    assert not flipper.is_alive()
    assert sum(outcomes.values()) == FLIP_TRIES, outcomes


# --------------------------------------------------------------------------------------------
# Overlapping byte ranges


@pytest.mark.parametrize(
    ("offset_b", "length_b"),
    [(NBYTES // 2, NBYTES), (0, NBYTES // 2), (NBYTES // 4, NBYTES // 2), (4, NBYTES)],
    ids=["straddles", "prefix", "inside", "shifted"],
)
def test_partially_overlapping_tensors_are_refused(
    tmp_path: Path, offset_b: int, length_b: int
) -> None:
    folder = tmp_path / "model"
    data_file(folder / "w.bin")
    tensors = [
        external("first", "w.bin", offset=0, length=NBYTES),
        external("second", "w.bin", offset=offset_b, length=length_b, dims=(length_b // 4,)),
    ]
    model = write(add_chain(tensors, shape=(1,)), folder / "m.onnx")
    with pytest.raises(sharedml.ExternalDataError, match="overlapping") as info:
        sharedml.prepare(model, tmp_path / "out" / "m.onnx")
    assert_names(info.value, model, "first", "second", folder / "w.bin")
    assert_nothing_written(tmp_path / "out")


def test_identical_ranges_are_tied_weights_stored_once(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    values = data_file(folder / "w.bin")
    tensors = [
        external("tied_a", "w.bin", offset=NBYTES),
        external("tied_b", "w.bin", offset=NBYTES),
        external("other", "w.bin", offset=2 * NBYTES),
    ]
    model = write(add_chain(tensors), folder / "m.onnx")
    result = sharedml.prepare(model, tmp_path / "out" / "m.onnx")
    prepared = onnx.load_model(str(result.model_path), load_external_data=False)
    offsets = {
        t.name: {e.key: e.value for e in t.external_data}["offset"]
        for t in prepared.graph.initializer
    }
    assert offsets["tied_a"] == offsets["tied_b"] != offsets["other"]
    # Two distinct 1 KiB tensors, packed at 64 bytes: one page in all, not a page each.
    assert result.manifest.size_bytes == 4096
    with sharedml.SessionPool(result.model_path, sessions=1) as pool:
        out = pool.run(None, {"x": np.zeros(N, np.float32)})[0]
    np.testing.assert_array_equal(out, 2 * values[N : 2 * N] + values[2 * N : 3 * N])


# --------------------------------------------------------------------------------------------
# Huge declared tensors: refused before anything that size is allocated

HUGE_SCRIPT = textwrap.dedent(
    r"""
    import json, resource, sys
    import sharedml
    from pathlib import Path

    # Address space: what is mapped now plus 256 MiB. Any attempt to allocate a declared
    # multi-GiB tensor fails with MemoryError instead of silently reserving it.
    with open("/proc/self/statm") as fh:
        mapped = int(fh.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 256 * 2**20, resource.RLIM_INFINITY))
    results = {}
    for model in sys.argv[1:]:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            sharedml.prepare(model, Path(model).with_suffix(".out.onnx"))
            outcome = "accepted"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            error = isinstance(exc, sharedml.SharedMLError)
        else:
            error = False
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        results[model] = {"outcome": outcome, "sharedml_error": error, "maxrss_kib": grew}
    print(json.dumps(results))
    """
)


def run_huge(models: Sequence[Path]) -> dict[str, dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-c", HUGE_SCRIPT, *map(str, models)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results: dict[str, dict[str, object]] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def _huge_models(folder: Path) -> list[tuple[Path, str]]:
    data_file(folder / "w.bin")
    gib8 = (2**31,)  # 8 GiB of float32 declared by a model of a few hundred bytes
    no_length = external("huge", "w.bin", length=None, dims=gib8)
    with_length = external("huge", "w.bin", length=2**33, dims=gib8)
    cases: list[tuple[str, onnx.ModelProto, str]] = [
        ("external_no_length", add_chain([no_length]), "huge"),
        ("external_length", add_chain([with_length]), "huge"),
    ]
    raw = numpy_helper.from_array(np.zeros(N, np.float32), "huge")
    del raw.dims[:]
    raw.dims.extend(gib8)
    cases.append(("inline_raw", add_chain([raw]), "huge"))
    constant = numpy_helper.from_array(np.zeros(N, np.float32), "value")
    del constant.dims[:]
    constant.dims.extend(gib8)
    cases.append(("constant_raw", add_chain(constants=[constant]), "const_0"))
    out = []
    for label, model, tensor in cases:
        path = write(model, folder / f"{label}.onnx")
        assert path.stat().st_size < 4096
        out.append((path, tensor))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc")
def test_tiny_model_declaring_huge_tensors_is_refused_before_allocation(tmp_path: Path) -> None:
    cases = _huge_models(tmp_path / "model")
    results = run_huge([path for path, _ in cases])
    for path, tensor in cases:
        result = results[str(path)]
        assert result["sharedml_error"], result["outcome"]  # not MemoryError: nothing tried
        assert str(path) in str(result["outcome"]) and tensor in str(result["outcome"])
        assert int(result["maxrss_kib"]) < 64 * 1024  # KiB: peak RSS grew by < 64 MiB


def _typed_huge_model(folder: Path) -> Path:
    tensor = TensorProto(name="huge", data_type=TensorProto.FLOAT, dims=[2**31])
    tensor.float_data.extend([1.0] * 4)  # four values stored, 2**31 declared
    return write(add_chain([tensor]), folder / "typed.onnx")


def test_huge_tensor_declared_over_a_few_typed_values_is_a_clear_error(tmp_path: Path) -> None:
    model = _typed_huge_model(tmp_path)
    with pytest.raises(sharedml.InvalidModelError) as info:
        sharedml.prepare(model, tmp_path / "out" / "m.onnx")
    assert_names(info.value, model, "huge")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc")
def test_huge_typed_tensor_is_never_allocated(tmp_path: Path) -> None:
    # Whatever error class it raises today, prepare must not try to allocate 8 GiB.
    model = _typed_huge_model(tmp_path)
    result = run_huge([model])[str(model)]
    assert "MemoryError" not in str(result["outcome"]) and result["outcome"] != "accepted"
    assert int(result["maxrss_kib"]) < 64 * 1024


def test_location_with_a_nul_byte_is_a_clear_error(tmp_path: Path) -> None:
    data_file(tmp_path / "model" / "w.bin")
    model = write(
        add_chain([external("w", "w.bin\0../../etc/passwd")]), tmp_path / "model" / "m.onnx"
    )
    with pytest.raises(sharedml.ExternalDataError) as info:
        sharedml.prepare(model, tmp_path / "out" / "m.onnx")
    assert_names(info.value, model, "w")


# --------------------------------------------------------------------------------------------
# Files that are not models


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"\x08\x07garbage\xff\xfe" * 100, sharedml.InvalidModelError),
        (os.urandom(4096), sharedml.InvalidModelError),
        (b"", sharedml.InvalidModelError),  # parses as an empty ModelProto: no graph
        (None, sharedml.ModelNotFoundError),
        ("folder", sharedml.InvalidModelError),
    ],
    ids=["garbage", "random", "empty", "missing", "folder"],
)
def test_files_that_are_not_models_are_clear_errors(
    tmp_path: Path, content: bytes | str | None, error: type[Exception]
) -> None:
    path = tmp_path / "m.onnx"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "folder":
        path.mkdir()
    for attempt in (
        lambda: sharedml.prepare(path, tmp_path / "out" / "m.onnx"),
        lambda: sharedml.SessionPool(path, sessions=1),
        lambda: sharedml.weights.WeightStore.open(path),
    ):
        with pytest.raises(error) as info:
            attempt()
        assert_names(info.value, path)
    assert_nothing_written(tmp_path / "out")
    assert_nothing_written(tmp_path / "cache" / "models")


def test_missing_model_is_also_a_file_not_found_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        sharedml.SessionPool(tmp_path / "nope.onnx")


# --------------------------------------------------------------------------------------------
# A prepared model whose weights file or graph was tampered with


@pytest.fixture
def prepared(tmp_path: Path) -> sharedml.PrepareResult:
    src = save_model(build_model(["initializer", "initializer"], dim=64), tmp_path / "src.onnx")
    return sharedml.prepare(src, tmp_path / "prep" / "m.onnx")


def _copy_prepared(result: sharedml.PrepareResult, folder: Path) -> Path:
    """A fresh path: the store caches by path per process, so each case gets its own."""
    folder.mkdir(parents=True)
    (folder / result.model_path.name).write_bytes(result.model_path.read_bytes())
    (folder / result.weights_path.name).write_bytes(result.weights_path.read_bytes())
    return folder / result.model_path.name


@pytest.mark.parametrize("damage", ["truncated", "grown", "one_byte_changed", "missing"])
def test_damaged_weights_file_is_detected_at_load(
    prepared: sharedml.PrepareResult, tmp_path: Path, damage: str
) -> None:
    model = _copy_prepared(prepared, tmp_path / damage)
    weights = model.with_suffix(".weights")
    data = bytearray(weights.read_bytes())
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "grown":
        weights.write_bytes(data + b"\0" * 4096)
    elif damage == "one_byte_changed":
        data[len(data) // 3] ^= 0xFF
        weights.write_bytes(data)
    else:
        weights.unlink()
    with pytest.raises(sharedml.WeightsMismatchError) as info:
        sharedml.weights.WeightStore.open(model)
    assert_names(info.value, weights)
    assert "again" in str(info.value)  # the fix: prepare again
    with pytest.raises(sharedml.WeightsMismatchError):
        sharedml.SessionPool(model, sessions=1)


def test_size_check_holds_even_without_hash_verification(
    prepared: sharedml.PrepareResult, tmp_path: Path
) -> None:
    model = _copy_prepared(prepared, tmp_path / "noverify")
    weights = model.with_suffix(".weights")
    weights.write_bytes(weights.read_bytes()[:-4096])
    with pytest.raises(sharedml.WeightsMismatchError, match="bytes"):
        sharedml.SessionPool(model, sessions=1, verify_weights=False)


def _tamper_slot(model: Path, key: str, value: int) -> None:
    graph = onnx.load_model(str(model), load_external_data=False)
    for entry in graph.graph.initializer[0].external_data:
        if entry.key == key:
            entry.value = str(value)
    model.write_bytes(graph.SerializeToString())


# Values relative to the weights file's size, named so that parametrize ids stay readable.
_RELATIVE = {"size-100": lambda size: size - 100, "-size": lambda size: -size}


def _slot_value(value: int | str, size: int) -> int:
    return value if isinstance(value, int) else _RELATIVE[value](size)


@pytest.mark.parametrize(
    "mechanism",
    [pytest.param("in-memory-file", marks=pytest.mark.capability("files-in-memory")), "ort-mmap"],
)
@pytest.mark.parametrize(
    ("key", "value"),
    [("offset", 2**40), ("offset", "size-100"), ("offset", -4096), ("length", 2**30)],
)
def test_tampered_slots_are_refused_by_onnxruntime_mechanisms(
    prepared: sharedml.PrepareResult, tmp_path: Path, mechanism: str, key: str, value: int | str
) -> None:
    model = _copy_prepared(prepared, tmp_path / "t")
    _tamper_slot(model, key, _slot_value(value, prepared.manifest.size_bytes))
    with pytest.raises(sharedml.SharedMLError):
        sharedml.SessionPool(model, sessions=1, mechanism=mechanism)


@pytest.mark.parametrize(
    ("key", "value"),
    [("offset", "-size"), ("offset", -4096), ("offset", 2**40), ("offset", 100), ("length", 8)],
    ids=["reads_other_bytes", "negative", "past_end", "misaligned", "short"],
)
def test_tampered_slots_are_refused_by_the_weight_store(
    prepared: sharedml.PrepareResult, tmp_path: Path, key: str, value: int | str
) -> None:
    model = _copy_prepared(prepared, tmp_path / "t")
    _tamper_slot(model, key, _slot_value(value, prepared.manifest.size_bytes))
    with pytest.raises(sharedml.ExternalDataError) as info:
        sharedml.SessionPool(model, sessions=1, mechanism="add-initializer")
    assert_names(info.value, model, prepared.manifest.file)


@pytest.mark.parametrize(
    ("shift", "why"), [(4, "misaligned"), (8, "misaligned"), (1 << 20, "past_end")]
)
def test_a_tampered_small_tensor_offset_is_refused_by_the_weight_store(
    tmp_path: Path, shift: int, why: str
) -> None:
    # 1 KiB tensors are packed at 64 bytes: an offset off that grid (or past the end) is a
    # graph changed after prepare, and would hand ORT a buffer misaligned for its type.
    folder = tmp_path / "model"
    data_file(folder / "w.bin")
    tensors = [external(name, "w.bin", offset=i * NBYTES) for i, name in enumerate("abc")]
    result = sharedml.prepare(
        write(add_chain(tensors), folder / "m.onnx"), tmp_path / "p" / "m.onnx"
    )
    model = _copy_prepared(result, tmp_path / "t")
    graph = onnx.load_model(str(model), load_external_data=False)
    entry = next(e for e in graph.graph.initializer[1].external_data if e.key == "offset")
    assert int(entry.value) % 64 == 0 and int(entry.value) % 4096  # packed, not on a page
    entry.value = str(int(entry.value) + shift)
    model.write_bytes(graph.SerializeToString())
    with pytest.raises(sharedml.ExternalDataError, match="changed after prepare") as info:
        sharedml.SessionPool(model, sessions=1, mechanism="add-initializer")
    assert_names(info.value, model, "b")


def _symlinked_weights(prepared: sharedml.PrepareResult, tmp_path: Path) -> tuple[Path, bytes]:
    """A prepared model whose weights file is a symlink to a same-size file outside its folder."""
    model = _copy_prepared(prepared, tmp_path / "evil")
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.full(prepared.manifest.size_bytes // 4, 7, np.float32).tobytes())
    model.with_suffix(".weights").unlink()
    os.symlink(secret, model.with_suffix(".weights"))
    return model, secret.read_bytes()


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_weights_symlink_escaping_the_folder_fails_verification(
    prepared: sharedml.PrepareResult, tmp_path: Path
) -> None:
    model, _ = _symlinked_weights(prepared, tmp_path)
    with pytest.raises(sharedml.SharedMLError):
        sharedml.SessionPool(model, sessions=1, verify_weights=True)


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_weights_symlink_escaping_the_folder_is_refused_without_verification(
    prepared: sharedml.PrepareResult, tmp_path: Path
) -> None:
    model, _ = _symlinked_weights(prepared, tmp_path)
    with pytest.raises(sharedml.UnsafePathError) as info:
        sharedml.SessionPool(model, sessions=1, verify_weights=False, mechanism="in-memory-file")
    assert_names(info.value, model.with_suffix(".weights"))


def test_verification_is_not_skipped_because_an_unverified_store_is_open(
    prepared: sharedml.PrepareResult, tmp_path: Path
) -> None:
    model = _copy_prepared(prepared, tmp_path / "v")
    weights = model.with_suffix(".weights")
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF  # same size, same mtime below: only the hash can tell
    stat_before = weights.stat()
    weights.write_bytes(data)
    os.utime(weights, ns=(stat_before.st_atime_ns, stat_before.st_mtime_ns))
    unverified = sharedml.weights.WeightStore.open(model, verify=False)
    with pytest.raises(sharedml.WeightsMismatchError):
        sharedml.weights.WeightStore.open(model, verify=True)
    del unverified


# --------------------------------------------------------------------------------------------
# The cache: private folders, read-only files, never rewritten in place


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return save_model(build_model(["initializer", "constant"], dim=64), tmp_path / "src" / "m.onnx")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_cache_folders_are_private_and_entries_read_only(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "newcache" / "sharedml"
    entry = sharedml.prepared_model_for(source, cache_dir=root)
    assert entry.parent.parent == root / "models"
    for folder in (root, root / "models", entry.parent):
        assert mode(folder) == 0o700, (folder, oct(mode(folder)))
    files = sorted(entry.parent.iterdir())
    # .lock: the in-use lock and use-stamp (not part of the entry's record)
    assert [f.name for f in files] == [".lock", "entry.json", "model.onnx", "model.weights"]
    for file in files:
        assert mode(file) == 0o444, (file, oct(mode(file)))


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_lax_models_folder_is_made_private(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    (root / "models").mkdir(parents=True)
    os.chmod(root / "models", 0o777)
    sharedml.prepared_model_for(source, cache_dir=root)
    assert mode(root / "models") == 0o700


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_cache_folder_writable_by_others_is_refused(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(sharedml.CacheError, match="writable by other users") as info:
        sharedml.SessionPool(source, sessions=1, cache_dir=root)
    assert_names(info.value, root, "chmod go-w")
    os.chmod(root, 0o1777)  # sticky, like /tmp: others cannot replace our models/ folder
    assert sharedml.prepared_model_for(source, cache_dir=root).is_file()


@pytest.mark.skipif(not POSIX or os.geteuid() != 0, reason="needs root to chown")
def test_models_folder_owned_by_another_user_is_refused(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    (root / "models").mkdir(parents=True, mode=0o700)
    os.chown(root / "models", 65534, 65534)
    with pytest.raises(sharedml.CacheError, match="belongs to user id 65534") as info:
        sharedml.prepared_model_for(source, cache_dir=root)
    assert_names(info.value, root / "models")


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_models_folder_that_is_a_symlink_is_refused(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", root / "models")
    with pytest.raises(sharedml.CacheError, match="not a folder"):
        sharedml.prepared_model_for(source, cache_dir=root)


def test_cache_entries_are_never_rewritten(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    first = sharedml.prepared_model_for(source, cache_dir=root)
    # Every file but .lock, whose mtime records the entry's last use.
    published = [p for p in first.parent.iterdir() if p.name != ".lock"]
    before = {p.name: os.stat(p) for p in published}
    again = sharedml.prepared_model_for(source, cache_dir=root)
    assert again == first
    for p in published:
        st = os.stat(p)
        assert (st.st_ino, st.st_mtime_ns, st.st_size) == (
            before[p.name].st_ino,
            before[p.name].st_mtime_ns,
            before[p.name].st_size,
        )
    # A changed source gets a new entry; the old one stays as it was for processes using it.
    save_model(build_model(["initializer", "constant"], dim=64, seed=7), source)
    changed = sharedml.prepared_model_for(source, cache_dir=root)
    assert changed != first and first.is_file()
    for p in published:
        assert os.stat(p).st_ino == before[p.name].st_ino
    assert sorted(p.name for p in (root / "models").iterdir()) == sorted(
        [first.parent.name, changed.parent.name]
    )


def test_preparing_over_a_live_model_never_touches_its_mapped_file(tmp_path: Path) -> None:
    # prepare replaces dst by rename: a pool mapping the old weights keeps its own inode.
    a = save_model(build_model(["initializer"], dim=64, seed=1), tmp_path / "a.onnx")
    b = save_model(build_model(["initializer"], dim=64, seed=2), tmp_path / "b.onnx")
    dst = tmp_path / "live" / "m.onnx"
    sharedml.prepare(a, dst)
    with sharedml.SessionPool(dst, sessions=1) as old:
        before = old.run(None, feeds(64))[0]
        if os.name == "nt":  # Windows refuses to replace a mapped file: an error says so
            weights = dst.with_suffix(".weights").read_bytes()
            with pytest.raises(sharedml.OutputError, match="in use: Windows refuses") as info:
                sharedml.prepare(b, dst)
            assert str(dst.with_suffix(".weights")) in str(info.value)
            assert dst.with_suffix(".weights").read_bytes() == weights
            np.testing.assert_array_equal(old.run(None, feeds(64))[0], before)
            return
        inode = os.stat(dst.with_suffix(".weights")).st_ino
        sharedml.prepare(b, dst)
        assert os.stat(dst.with_suffix(".weights")).st_ino != inode
        np.testing.assert_array_equal(old.run(None, feeds(64))[0], before)
        with sharedml.SessionPool(dst, sessions=1) as new:
            assert not np.array_equal(new.run(None, feeds(64))[0], before)


TAMPERED_CACHE_SCRIPT = textwrap.dedent(
    r"""
    import sys, warnings
    import numpy as np
    import sharedml
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        with sharedml.SessionPool(sys.argv[1], sessions=1, cache_dir=sys.argv[2]) as pool:
            out = pool.run(None, {"x": np.ones((1, 64), np.float32), "flag": np.array(True)})
            np.save(sys.argv[3], out[0])
            print("model", pool.model_path)
    for w in caught:
        print("warning", " ".join(str(w.message).split()))
    """
)


@pytest.mark.parametrize("damage", ["truncated", "changed", "graph changed"])
def test_a_damaged_cache_entry_is_never_loaded_but_rebuilt(
    source: Path, tmp_path: Path, damage: str
) -> None:
    root = tmp_path / "c"
    entry = sharedml.prepared_model_for(source, cache_dir=root)
    target = entry if damage == "graph changed" else entry.with_suffix(".weights")
    os.chmod(target, 0o644)  # the owner can still do this: the cache is not a vault
    original = target.read_bytes()
    data = bytearray(original)
    if damage == "truncated":
        with open(target, "r+b") as fh:
            fh.truncate(len(data) // 2)
    else:
        data[-50] ^= 0x01
        target.write_bytes(data)
    out = subprocess.run(
        [sys.executable, "-c", TAMPERED_CACHE_SCRIPT, str(source), str(root), str(tmp_path / "y")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert any(
        line.startswith("warning The cache entry") and "is damaged" in line for line in lines
    ), lines
    reference = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    expected = reference.run(None, {"x": np.ones((1, 64), np.float32), "flag": np.array(True)})
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected[0], rtol=1e-5, atol=1e-6)
    # The damaged entry was moved aside and built again: whole, read-only, the same bytes.
    assert target.read_bytes() == original and mode(target) == 0o444
    assert sharedml.prepared_model_for(source, cache_dir=root) == entry


def test_clear_stale_removes_only_old_temporary_folders(source: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    entry = sharedml.prepared_model_for(source, cache_dir=root)
    models = root / "models"
    old = models / ".0123456789abcdef-dead.tmp"
    young = models / ".0123456789abcdef-busy.tmp"
    for folder in (old, young):
        folder.mkdir()
        (folder / "model.weights").write_bytes(b"partial")
    os.utime(old, (1, 1))
    assert clear_stale(Cache(root)) == 1
    assert not old.exists() and young.exists() and entry.is_file()
    assert clear_stale(Cache(root), older_than_s=-1) == 1
    assert not young.exists() and entry.is_file()
