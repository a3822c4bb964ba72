"""Compressed weights: MatMul/Gemm weights in 8- or 4-bit blocks, built once, shared, batchable."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from _models import conv_model
from _waiting import wait_until
from onnx import TensorProto, helper, numpy_helper
from packaging.version import Version

import sharedml
from sharedml._errors import CompressError
from sharedml.cache import list_entries
from sharedml.cli import main
from sharedml.cli._inspect import compressed_lines
from sharedml.inspection._compressed import compare_outputs
from sharedml.pool._batching import signature_of
from sharedml.pool._pool import SessionPool
from sharedml.prepared import _compress
from sharedml.prepared._compress import (
    WeightsFormat,
    compress,
    compressed_model_for,
    compression_unavailable,
    tables_unavailable,
)

WIDTH = 256
CLASSES = 10
# The largest difference from the float model, as a fraction of the float output's largest
# magnitude, on this generated classifier (Gaussian weights: a hard case for 4 bits). Measured
# 0.9% (int8) and 10.4% (int4) on onnxruntime 1.32; docs/compress.md has real models' figures.
TOLERANCE = {"int8": 0.02, "int4": 0.2}


def classifier(path: Path, *, seed: int = 0) -> Path:
    """x[N, 256] -> Gemm(transB, alpha, beta) -> Relu -> MatMul + Add -> Relu -> Gemm -> [N, 10]."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    inits = [
        numpy_helper.from_array(w(WIDTH, WIDTH), "W1"),
        numpy_helper.from_array(w(WIDTH) * 0.1, "b1"),
        numpy_helper.from_array(w(WIDTH, WIDTH), "W2"),
        numpy_helper.from_array(w(WIDTH) * 0.1, "b2"),
        numpy_helper.from_array(w(CLASSES, WIDTH), "W3"),
        numpy_helper.from_array(w(CLASSES), "b3"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"], transB=1, alpha=0.5, beta=2.0),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("Gemm", ["r2", "W3", "b3"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.save(model, path)
    return path


def needs(weights: str) -> None:
    """Skip, with the reason, where the installed onnxruntime cannot make ``weights``."""
    why = compression_unavailable(WeightsFormat.parse(weights))
    if why is not None:
        pytest.skip(why)


def rows(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, WIDTH)).astype(np.float32)


def plain(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]  # type: ignore[no-any-return]


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return classifier(tmp_path / "classifier.onnx")


def _models_entries(cache: Path) -> dict[str, float]:
    return {
        e.key: e.path.joinpath("entry.json").stat().st_mtime_ns
        for e in list_entries(cache_dir=cache)
        if e.kind == "models"
    }


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_compressed_model_is_built_once_and_reused_by_a_second_pool(
    model: Path, tmp_path: Path, weights: str
) -> None:
    needs(weights)
    cache = tmp_path / "cache"
    with SessionPool(model, sessions=1, cache_dir=cache, weights=weights) as first:
        built = _models_entries(cache)
        path = first.recipe.model_path
    # The float model's entry and the compressed one, which holds MatMulNBits and no float W.
    assert len(built) == 2
    graph = onnx.load(str(path), load_external_data=False).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 3
    # int8 computes in int8 (no float scratch of the weights per run); int4 in float, whose
    # merged rows stay within float rounding of solo rows (docs/compress.md).
    levels = {a.i for n in nbits for a in n.attribute if a.name == "accuracy_level"}
    assert levels == ({4} if weights == "int8" else set())
    assert not {"W1", "W2", "W3"} & {t.name for t in graph.initializer}
    with SessionPool(model, sessions=1, cache_dir=cache, weights=weights) as second:
        assert second.recipe.model_path == path
        assert second.recipe.source_path == model
    assert _models_entries(cache) == built  # nothing built or rebuilt


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_outputs_stay_within_the_stated_tolerance_of_the_float_model(
    model: Path, tmp_path: Path, weights: str
) -> None:
    needs(weights)
    x = rows(64)
    want = plain(model, x)
    with SessionPool(model, sessions=1, cache_dir=tmp_path / "cache", weights=weights) as pool:
        got = pool.run(None, {"x": x})[0]
    scale = float(np.max(np.abs(want)))
    assert 0 < float(np.max(np.abs(got - want))) <= TOLERANCE[weights] * scale
    agreement = float(np.mean(got.argmax(axis=1) == want.argmax(axis=1)))
    assert agreement >= (0.95 if weights == "int8" else 0.75)


def test_float_weights_leave_the_model_as_it_is(model: Path, tmp_path: Path) -> None:
    x = rows(4)
    cache = tmp_path / "cache"
    with SessionPool(model, sessions=1, cache_dir=cache) as default:
        want = default.run(None, {"x": x})[0]
        path = default.recipe.model_path
    with SessionPool(model, sessions=1, cache_dir=cache, weights="float") as pool:
        assert pool.recipe.model_path == path  # the prepared float model: nothing compressed
        assert np.array_equal(pool.run(None, {"x": x})[0], want)
    assert len(_models_entries(cache)) == 1


def test_compressed_graph_is_row_wise_and_merged_batches_equal_solo_runs(
    model: Path, tmp_path: Path
) -> None:
    needs("int4")
    callers = 8
    xs = [rows(1, seed=i) for i in range(callers)]
    results: list[list[np.ndarray]] = [[] for _ in range(callers)]
    with SessionPool(
        model, sessions=1, cache_dir=tmp_path / "cache", weights="int4", batching=True
    ) as pool:
        # The row-independence analysis proves MatMulNBits row-wise (batching=True would raise).
        assert pool.batching is not None
        signature_of(onnx.load(str(pool.recipe.model_path), load_external_data=False), name="m")

        def call(i: int) -> None:
            for _ in range(10):
                results[i].append(pool.run(None, {"x": xs[i]})[0])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
        # The pool's one session held: every caller's first request queues behind it, and the
        # leader that gets it back merges them (a run this short rarely finds others waiting).
        with pool.session():
            for t in threads:
                t.start()
            wait_until(lambda: pool.stats().waiting == callers, what="every caller to queue")
        for t in threads:
            t.join()
        stats = pool.stats()
        solo = ort.InferenceSession(str(pool.recipe.model_path), providers=["CPUExecutionProvider"])
        for i in range(callers):
            alone = solo.run(None, {"x": xs[i]})[0]
            for got in results[i]:
                # A merged run may pick other kernel blockings: float rounding, not other rows.
                np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
    assert stats.batches > 0 and stats.max_batch_rows > 1
    assert stats.batch_mismatches == 0


def test_a_model_with_nothing_to_compress_is_refused_naming_it(tmp_path: Path) -> None:
    path = conv_model(tmp_path / "conv.onnx")
    with pytest.raises(CompressError) as info:
        SessionPool(path, sessions=1, cache_dir=tmp_path / "cache", weights="int4")
    message = str(info.value)
    assert str(path) in message
    assert "no MatMul or Gemm with a constant float weight" in message
    assert "weights='float'" in message


def test_an_unknown_weights_format_is_refused_before_anything_is_built(
    model: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"weights must be one of 'float', 'int8', 'int4'"):
        SessionPool(model, sessions=1, cache_dir=tmp_path / "cache", weights="int3")
    assert not (tmp_path / "cache").exists()


def test_compress_writes_a_prepared_model_that_pools_map_as_it_is(
    model: Path, tmp_path: Path
) -> None:
    needs("int4")
    result = compress(model, tmp_path / "out" / "small.onnx", weights="int4")
    assert result.matrices == 3 and result.weights is WeightsFormat.INT4
    # 4 bits plus a float scale and a 4-bit zero point per 32 values: about 0.16x.
    assert result.compressed_bytes <= 0.2 * result.float_bytes
    assert result.weights_path.stat().st_size < 0.3 * model.stat().st_size
    x = rows(4)
    with SessionPool(result.model_path, sessions=1, cache_dir=tmp_path / "cache") as pool:
        assert pool.recipe.model_path == result.model_path  # prepared already: used as it is
        got = pool.run(None, {"x": x})[0]
    want = plain(model, x)
    assert np.max(np.abs(got - want)) <= TOLERANCE["int4"] * np.max(np.abs(want))
    # The scratch folder (the float copy, the quantizer's output) is gone.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["small.onnx", "small.weights"]


@pytest.fixture
def fresh_probe() -> Iterator[None]:
    """What the installed onnxruntime can do is measured again in the test, and after it."""
    compression_unavailable.cache_clear()
    yield
    compression_unavailable.cache_clear()


@pytest.mark.usefixtures("fresh_probe")
def test_eight_bits_are_refused_clearly_where_the_quantizer_writes_four_only(
    monkeypatch: pytest.MonkeyPatch, model: Path, tmp_path: Path
) -> None:
    # onnxruntime before 1.22 has no matmul_nbits_quantizer module: import it as missing.
    monkeypatch.setitem(sys.modules, "onnxruntime.quantization.matmul_nbits_quantizer", None)
    with pytest.raises(CompressError, match=r"needs onnxruntime 1\.22 or later"):
        compressed_model_for(model, weights="int8", cache_dir=tmp_path / "cache")


@pytest.mark.usefixtures("fresh_probe")
def test_a_missing_quantizer_dependency_names_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch, model: Path, tmp_path: Path
) -> None:
    spec = importlib.util.find_spec("onnxruntime.quantization.matmul_nbits_quantizer")
    if spec is None or spec.origin is None or "onnx_ir" not in Path(spec.origin).read_text():
        pytest.skip("this onnxruntime's quantizer does not import onnx-ir")
    monkeypatch.delitem(sys.modules, "onnxruntime.quantization.matmul_nbits_quantizer", False)
    monkeypatch.setitem(sys.modules, "onnx_ir", None)
    with pytest.raises(CompressError, match=r"pip install onnx-ir"):
        compressed_model_for(model, weights="int4", cache_dir=tmp_path / "cache")


_CHILD = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    from sharedml.pool._pool import SessionPool

    with SessionPool(sys.argv[1], sessions=2, cache_dir=sys.argv[2], weights="int4") as pool:
        pool.run(None, {"x": np.ones((1, 256), np.float32)})
        weights = str(pool.weights.path)
        with open("/proc/self/maps") as fh:
            mapped = sorted({line.split()[-1] for line in fh if line.rstrip().endswith(".weights")})
        print(json.dumps({"weights": weights, "ino": os.stat(weights).st_ino, "mapped": mapped}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_two_processes_map_the_same_compressed_file(model: Path, tmp_path: Path) -> None:
    needs("int4")
    cache = tmp_path / "cache"
    compressed_model_for(model, weights="int4", cache_dir=cache)  # built once, here
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(model), str(cache)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    seen = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert seen[0] == seen[1]
    assert seen[0]["mapped"] == [seen[0]["weights"]]
    assert Path(seen[0]["weights"]).parent.parent == cache / "models"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps")
def test_compressed_weights_cost_well_under_the_float_size(tmp_path: Path) -> None:
    from tools.realistic_models import mlp

    formats = [w for w in ("int4", "int8") if compression_unavailable(WeightsFormat(w)) is None]
    if not formats:
        needs("int4")  # skips, saying why
    info = mlp(tmp_path / "mlp.onnx", target_bytes=64 * 2**20, width=2048)
    cache = tmp_path / "cache"
    env = {"SHAREDML_CACHE_DIR": str(cache)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        # Each in a fresh subprocess: one plain ORT session over the float model, then a pool of
        # one session over its int4 and int8 weights (the cache entries are built first).
        measured = {
            s: sharedml.measure.measure(info.path, s, sessions=1)
            for s in ("single", *(f"shared-{w}" for w in formats))
        }
    float_cost = measured["single"].total_bytes
    assert float_cost is not None and float_cost >= 0.9 * info.weights_bytes
    # Where ORT maps a saved pack of the blocks (1.28 and later) one session costs about the
    # compressed bytes; before, it holds the mapped blocks and its own pack of them (1.24.4:
    # int4 0.36x, int8 0.60x of the float session).
    bounds = {"shared-int4": (0.3, 0.45), "shared-int8": (0.4, 0.7)}
    for strategy, (mapped_pack, own_pack) in bounds.items():
        if strategy not in measured:
            continue
        cost = measured[strategy].total_bytes
        assert cost is not None
        mapped = measured[strategy].details.get("mechanism") == "prepacked-file"
        bound = mapped_pack if mapped else own_pack
        print(
            f"{strategy}: {cost / 2**20:.1f} MiB against plain ORT float {float_cost / 2**20:.1f} "
            f"MiB ({cost / float_cost:.2f}x), route {measured[strategy].details.get('mechanism')}"
        )
        assert cost <= bound * float_cost


# --------------------------------------------------------------------------------------------
# sharedml inspect --compress


def test_compare_outputs_gives_abs_and_relative_differences_and_top1_agreement() -> None:
    want = np.array([[1.0, 3.0, 2.0], [4.0, 0.0, -1.0]], np.float32)
    got = np.array([[1.0, 2.0, 2.5], [4.0, 0.5, -1.0]], np.float32)  # row 0's class changes
    hidden = np.ones((2, 3, 4), np.float32)
    (logits, states) = compare_outputs(
        {"out0": want, "out1": hidden}, {"out0": got, "out1": hidden}
    )
    assert logits.max_abs_diff == 1.0 and logits.max_rel_diff == 0.25
    assert logits.top1_agreement == 0.5 and logits.top1_rows == 2
    assert states.max_abs_diff == 0.0 and states.top1_agreement is None  # not classifier-like


def test_inspect_reports_compressed_memory_speed_and_accuracy(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs("int4")
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(tmp_path / "cache"))
    report = sharedml.inspect(
        model, sessions=1, strategies=["shared"], dims={"N": 16}, compress="int4"
    )
    measured = {m.strategy: m for m in report.measurements}
    assert set(measured) == {"shared", "shared-int4"}
    assert measured["shared-int4"].total_bytes is not None
    assert measured["shared-int4"].first_run_seconds is not None
    assert report.compressed is not None and report.compressed.error is None
    (logits,) = report.compressed.outputs
    assert 0 < logits.max_rel_diff <= TOLERANCE["int4"]
    assert logits.top1_rows == 16 and logits.top1_agreement is not None
    # Deliberate differences are reported in their own section, not as a numerics finding.
    assert all("shared-int4" not in f.text for f in report.findings)
    assert json.loads(json.dumps(report.to_dict()))["compressed"]["weights"] == "int4"
    lines = compressed_lines(report)
    assert lines[0].startswith("memory (") and "MiB float" in lines[0]
    assert any("top-1 agreement" in line and "/16 rows" in line for line in lines)


def test_inspect_compress_refuses_a_model_with_nothing_to_compress_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(tmp_path / "cache"))
    path = conv_model(tmp_path / "conv.onnx")
    code = main(["inspect", str(path), "--compress", "int4"])
    out, err = capsys.readouterr()
    assert code != 0 and out == ""
    assert err.count("\n") == 1 and err.startswith("sharedml: error: ")
    assert "nothing to compress" in err and str(path) in err


def test_inspect_compress_takes_one_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = classifier(tmp_path / "a.onnx"), classifier(tmp_path / "b.onnx", seed=1)
    code = main(["inspect", str(a), str(b), "--compress", "int8"])
    out, err = capsys.readouterr()
    assert code != 0 and out == "" and "--compress inspects one model" in err


# --------------------------------------------------------------------------------------------
# Embedding tables

VOCAB, HIDDEN = 512, 256


def embedder(path: Path, *, tie: bool = False, axis: int = 0, width: int = HIDDEN) -> Path:
    """ids[N, 8] -> Gather(table) -> MatMul(W) -> ReduceMean over the tokens -> [N, width].

    With ``tie``, the table is also read by a MatMul (a language model's tied output layer);
    with ``axis`` 1 the lookup picks columns (the table then has ``width`` rows)."""
    rng = np.random.default_rng(3)
    table = rng.standard_normal((VOCAB, width) if axis == 0 else (width, VOCAB))
    w = rng.standard_normal((width, width)) / np.sqrt(width)
    inits = [
        numpy_helper.from_array(table.astype(np.float32), "table"),
        numpy_helper.from_array(w.astype(np.float32), "W"),
        numpy_helper.from_array(np.array([1], np.int64), "tokens"),
    ]
    looked = "emb" if axis == 0 else "columns"  # [width, N, 8] -> [N, 8, width]
    nodes = [
        helper.make_node("Gather", ["table", "ids"], [looked], axis=axis),
        *([helper.make_node("Transpose", ["columns"], ["emb"], perm=[1, 2, 0])] if axis else []),
        helper.make_node("MatMul", ["emb", "W"], ["h"]),
        helper.make_node("ReduceMean", ["h", "tokens"], ["y"], keepdims=0),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])]
    if tie:
        nodes.append(helper.make_node("MatMul", ["y", "table_t"], ["logits"]))
        nodes.insert(0, helper.make_node("Transpose", ["table"], ["table_t"]))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", VOCAB]))
    graph = helper.make_graph(
        nodes,
        "embedder",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 8])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    onnx.save(model, path)
    return path


def ids(n: int, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (n, 8), dtype=np.int64)


def lookups(path: Path) -> list[onnx.NodeProto]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return [  # the table lookups (not the index checks before them)
        n
        for n in graph.node
        if n.op_type in ("Gather", "GatherBlockQuantized") and n.output[0] in ("emb", "columns")
    ]


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_embedding_tables_are_compressed_and_their_lookups_stay_row_wise(
    tmp_path: Path, weights: str
) -> None:
    needs(weights)
    if (why := tables_unavailable(WeightsFormat.INT8)) is not None:
        # 1.20 has no 8-bit GatherBlockQuantized; 1.24 and later run it (a probe that broke
        # there would keep every table float without a word).
        assert Version(ort.__version__) < Version("1.24"), why
        pytest.skip(why)
    src = embedder(tmp_path / "emb.onnx")
    result = compress(src, tmp_path / "out" / "small.onnx", weights=weights)
    assert (result.matrices, result.tables) == (1, 1)
    [lookup] = lookups(result.model_path)
    assert (lookup.op_type, lookup.domain) == ("GatherBlockQuantized", "com.microsoft")
    names = {t.name for t in onnx.load(str(result.model_path)).graph.initializer}
    assert "table" not in names  # the float table is gone from the compressed model
    float_bytes = (VOCAB + HIDDEN) * HIDDEN * 4
    assert result.float_bytes == float_bytes
    assert result.compressed_bytes < 0.3 * float_bytes
    assert result.compressed_bytes == _compress._nbits_bytes(onnx.load(str(result.model_path)))

    # Every looked-up value is within half a quantization step of the table's own: 8-bit
    # blocks, whatever the matrices' format.
    table = numpy_helper.to_array(onnx.load(str(src)).graph.initializer[0])
    step = (table.max() - min(table.min(), 0)) / 255
    x = ids(4)
    got = ort.InferenceSession(str(result.model_path)).run(None, {"ids": x})[0]
    want = ort.InferenceSession(str(src)).run(None, {"ids": x})[0]
    w = numpy_helper.to_array(onnx.load(str(src)).graph.initializer[1])
    bound = 0.5 * step * np.abs(w).sum(axis=0).max() + TOLERANCE[weights] * np.abs(want).max()
    assert np.abs(got - want).max() <= bound

    # An index past the table fails the run as the float model's does: the quantized lookup
    # checks nothing itself, and would hand back whatever memory lies beyond the table.
    quantized = ort.InferenceSession(str(result.model_path))
    for bad in (VOCAB, -VOCAB - 1, 10**9, -(10**9)):
        x = ids(2)
        x[1, 3] = bad
        for sess in (quantized, ort.InferenceSession(str(src))):
            with pytest.raises(Exception, match="out of data bounds"):
                sess.run(None, {"ids": x})
    negative = ids(2) - VOCAB  # in range from the end: the same rows
    np.testing.assert_array_equal(
        quantized.run(None, {"ids": negative})[0], quantized.run(None, {"ids": ids(2)})[0]
    )

    # Batched: rows merged from 6 callers equal their solo runs.
    callers = 6
    results: list[np.ndarray | None] = [None] * callers
    barrier = threading.Barrier(callers)
    with SessionPool(
        src,
        sessions=1,
        cache_dir=tmp_path / "cache",
        weights=weights,
        batching=sharedml.Batching(max_delay_ms=200),
    ) as pool:
        assert pool.batching is not None  # the analysis proves the quantized lookup row-wise
        assert [n.op_type for n in lookups(pool.recipe.model_path)] == ["GatherBlockQuantized"]

        def call(i: int) -> None:
            barrier.wait()
            results[i] = pool.run(None, {"ids": ids(1, seed=i)})[0]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        solo = ort.InferenceSession(str(pool.recipe.model_path))
        for i, got_i in enumerate(results):
            alone = solo.run(None, {"ids": ids(1, seed=i)})[0]
            np.testing.assert_allclose(got_i, alone, rtol=0, atol=1e-5 * np.abs(alone).max())
        assert pool.stats().max_batch_rows > 1 and pool.stats().batch_mismatches == 0


@pytest.mark.parametrize(
    "kind", ["tied to an output layer", "columns looked up", "width not whole blocks"]
)
def test_tables_read_otherwise_stay_float(tmp_path: Path, kind: str) -> None:
    needs("int4")
    src = embedder(
        tmp_path / "emb.onnx",
        tie=kind == "tied to an output layer",
        axis=1 if kind == "columns looked up" else 0,
        width=HIDDEN + 16 if kind == "width not whole blocks" else HIDDEN,
    )
    result = compress(src, tmp_path / "out" / "small.onnx", weights="int4")
    assert result.tables == 0
    assert [n.op_type for n in lookups(result.model_path)] == ["Gather"]
    x = ids(2) if kind != "columns looked up" else ids(2) % HIDDEN
    got = ort.InferenceSession(str(result.model_path)).run(None, {"ids": x})[0]
    want = ort.InferenceSession(str(src)).run(None, {"ids": x})[0]
    assert np.abs(got - want).max() <= TOLERANCE["int4"] * np.abs(want).max()


@pytest.mark.usefixtures("fresh_probe")
def test_an_onnxruntime_that_cannot_run_quantized_tables_keeps_them_float(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs("int4")
    tables_unavailable.cache_clear()
    real = ort.InferenceSession

    def refusing(model: object, *args: object, **kwargs: object) -> object:
        if isinstance(model, bytes) and b"GatherBlockQuantized" in model:
            raise RuntimeError("Could not find an implementation for GatherBlockQuantized(1)")
        return real(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ort, "InferenceSession", refusing)
    why = tables_unavailable(WeightsFormat.INT8)
    assert why is not None and "could not run int8 GatherBlockQuantized" in why
    result = compress(embedder(tmp_path / "emb.onnx"), tmp_path / "out" / "s.onnx", weights="int4")
    assert (result.matrices, result.tables) == (1, 0)
    monkeypatch.undo()
    tables_unavailable.cache_clear()
