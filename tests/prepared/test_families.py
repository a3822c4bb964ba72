"""Model families: graphs that hold the same tensors, prepared over one weights file.

Identity is by content (dtype, shape, SHA-256 of the bytes), never by name: the variants below
rename every tensor. The distinct-byte figures the assertions compare against are computed here
from the source models' own arrays, not taken from prepare's result.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import sharedml
from sharedml.prepared._family import FAMILY_WEIGHTS_PATTERN
from sharedml.weights._store import _MappedFile
from tools.families import decoder_pair, encoder_heads, renamed_variant
from tools.realistic_models import mlp

WIDTH = 256


def _arrays(path: Path) -> list[np.ndarray]:
    model = onnx.load(str(path))
    return [onnx.numpy_helper.to_array(t) for t in model.graph.initializer]


def _distinct_bytes(paths: list[Path], *, floor: int = 1024) -> tuple[int, int]:
    """(distinct, total) data bytes of the tensors prepare moves, by content."""
    seen: set[tuple[str, tuple[int, ...], str]] = set()
    distinct = total = 0
    for path in paths:
        for array in _arrays(path):
            if array.nbytes < floor:
                continue
            total += array.nbytes
            key = (array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest())
            if key not in seen:
                seen.add(key)
                distinct += array.nbytes
    return distinct, total


def _plain(path: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


@pytest.fixture
def variants(tmp_path: Path) -> list[Path]:
    """An MLP and two re-exports of it: every tensor renamed, one extra layer each."""
    base = Path(mlp(tmp_path / "src" / "mlp.onnx", target_bytes=4 * 2**20, width=WIDTH).path)
    return [
        base,
        renamed_variant(base, tmp_path / "src" / "mlp_a.onnx", extra_bytes=2**20, seed=1),
        renamed_variant(base, tmp_path / "src" / "mlp_b.onnx", extra_bytes=2**20, seed=2),
    ]


@pytest.mark.capability("prepacked-save")
def test_a_prepared_family_of_three_variants_stores_each_distinct_tensor_once(
    tmp_path: Path, variants: list[Path]
) -> None:
    out = tmp_path / "family"
    result = sharedml.prepare_family(variants, out)
    distinct, total = _distinct_bytes(variants)
    size = result.weights_path.stat().st_size
    print(f"distinct {distinct} B, total {total} B, weights file {size} B ({size / distinct:.3f}x)")
    assert total > 2 * distinct  # the sources really repeat their tensors
    assert result.bytes_distinct == distinct and result.bytes_total == total
    assert size <= 1.05 * distinct
    assert [p.name for p in result.model_paths] == [p.name for p in variants]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [result.weights_path.name, *(p.name for p in variants)]
    )
    feed = {"input": np.random.default_rng(0).standard_normal((2, WIDTH)).astype(np.float32)}
    for src, prepared in zip(variants, result.model_paths, strict=True):
        np.testing.assert_array_equal(_plain(prepared, feed)[0], _plain(src, feed)[0])
        with sharedml.SessionPool(prepared, sessions=2) as pool:
            np.testing.assert_array_equal(pool.run(None, feed)[0], _plain(src, feed)[0])


def test_members_of_a_family_share_one_mapping_of_the_weights_file(
    tmp_path: Path, variants: list[Path]
) -> None:
    result = sharedml.prepare_family(variants[:2], tmp_path / "family")
    before = _MappedFile.live()
    a = sharedml.weights.WeightStore.open(result.model_paths[0])
    b = sharedml.weights.WeightStore.open(result.model_paths[1])
    assert a is not b and a.mapping_id == b.mapping_id
    assert _MappedFile.live() == before + 1
    a.close()
    assert _MappedFile.live() == before + 1  # b still maps it
    b.close()
    assert _MappedFile.live() == before


def test_the_decoder_pair_prepared_as_a_family_stores_one_models_weights(tmp_path: Path) -> None:
    dec, past = decoder_pair(tmp_path / "src")
    result = sharedml.prepare_family([dec, past], tmp_path / "family")
    one = sharedml.prepare(dec, tmp_path / "single" / "decoder_model.onnx")
    size, single = result.weights_path.stat().st_size, one.weights_path.stat().st_size
    print(f"family weights {size} B, one model's {single} B ({size / single:.3f}x)")
    assert size <= 1.15 * single
    ids = np.array([[1, 5, 9, 3]], np.int64)
    for src, prepared in zip((dec,), result.model_paths[:1], strict=True):
        for got, want in zip(
            _plain(prepared, {"input_ids": ids}), _plain(src, {"input_ids": ids}), strict=True
        ):
            np.testing.assert_array_equal(got, want)
    # decoder_with_past, fed the decoder's presents: same outputs as its original.
    sess = ort.InferenceSession(str(dec), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    presents = dict(zip(names, sess.run(None, {"input_ids": ids[:, :3]}), strict=True))
    feed = {"input_ids": ids[:, 3:]}
    feed |= {"past" + n[len("present") :]: v for n, v in presents.items() if n != "logits"}
    for got, want in zip(_plain(result.model_paths[1], feed), _plain(past, feed), strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_encoder_with_two_heads_stores_the_encoder_once(tmp_path: Path) -> None:
    paths = list(encoder_heads(tmp_path / "src"))
    result = sharedml.prepare_family(paths, tmp_path / "family")
    distinct, total = _distinct_bytes(paths)
    assert total > 1.8 * distinct
    assert result.weights_path.stat().st_size <= 1.05 * distinct + 4096  # + the end's page


# --------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing written


def test_two_members_with_one_file_name_are_refused_before_anything_is_written(
    tmp_path: Path, variants: list[Path]
) -> None:
    other = tmp_path / "elsewhere" / variants[1].name
    other.parent.mkdir()
    other.write_bytes(variants[1].read_bytes())
    out = tmp_path / "family"
    with pytest.raises(sharedml.FamilyError, match="same path") as info:
        sharedml.prepare_family([variants[1], other], out)
    assert variants[1].name in str(info.value)
    assert not out.exists()


def test_a_member_inside_the_output_folder_is_refused(tmp_path: Path, variants: list[Path]) -> None:
    folder = variants[0].parent
    before = sorted(os.listdir(folder))
    with pytest.raises(sharedml.FamilyError, match="inside the output folder"):
        sharedml.prepare_family(variants, folder)
    with pytest.raises(sharedml.FamilyError, match="inside the output folder"):
        sharedml.prepare_family(variants, folder.parent)  # a folder above the member: still inside
    assert sorted(os.listdir(folder)) == before


def test_a_missing_member_is_refused_before_anything_is_written(
    tmp_path: Path, variants: list[Path]
) -> None:
    out = tmp_path / "family"
    with pytest.raises(sharedml.ModelNotFoundError, match=r"missing\.onnx"):
        sharedml.prepare_family([variants[0], tmp_path / "missing.onnx"], out)
    assert not out.exists()


def test_an_empty_family_is_refused(tmp_path: Path) -> None:
    with pytest.raises(sharedml.FamilyError, match="empty"):
        sharedml.prepare_family([], tmp_path / "family")


def test_a_family_member_whose_shared_weights_file_is_gone_is_a_clear_error(
    tmp_path: Path, variants: list[Path]
) -> None:
    result = sharedml.prepare_family(variants[:2], tmp_path / "family")
    result.weights_path.unlink()
    with pytest.raises(sharedml.WeightsMismatchError, match="missing"):
        sharedml.weights.WeightStore.open(result.model_paths[1])


# --------------------------------------------------------------------------------------------
# Redeploying one member


def test_redeploying_one_member_keeps_running_pools_and_removes_only_unreferenced_files(
    tmp_path: Path, variants: list[Path]
) -> None:
    out = tmp_path / "family"
    first = sharedml.prepare_family(variants[:2], out)
    mine = out / "family-0123456789abcdef.txt"  # not of the naming scheme: never removed
    mine.write_text("a user's file")
    feed = {"input": np.ones((1, WIDTH), np.float32)}
    with sharedml.SessionPool(first.model_paths[0], sessions=1, prepacking="off") as pool:
        want = pool.run(None, feed)[0]  # unpacked kernels: compared with itself, not plain ORT
        # Redeploy: the variant changes (another extra layer), the base does not.
        renamed_variant(variants[0], variants[1], extra_bytes=2**20, seed=99)
        second = sharedml.prepare_family(variants[:2], out)
        assert second.weights_path != first.weights_path  # new content, new name
        if os.name == "nt":  # Windows refuses to delete a mapped file: it stays, for now
            assert first.weights_path.exists() and second.removed == ()
        else:
            assert not first.weights_path.exists()  # no graph in the folder refers to it
            assert second.removed == (first.weights_path,)
        np.testing.assert_array_equal(pool.run(None, feed)[0], want)  # its mapping survives
    if os.name == "nt":  # once no pool maps it, the next prepare removes it
        del pool
        gc.collect()
        assert sharedml.prepare_family(variants[:2], out).removed == (first.weights_path,)
        assert not first.weights_path.exists()
    assert mine.exists()
    for src, prepared in zip(variants[:2], second.model_paths, strict=True):
        np.testing.assert_array_equal(_plain(prepared, feed)[0], _plain(src, feed)[0])


def test_a_weights_file_another_graph_of_the_folder_refers_to_is_kept(
    tmp_path: Path, variants: list[Path]
) -> None:
    out = tmp_path / "family"
    first = sharedml.prepare_family(variants[:2], out)
    # variants[2] alone, into the same folder: the first family's graphs still need its file.
    second = sharedml.prepare_family([variants[2]], out)
    assert first.weights_path.exists() and second.weights_path.exists()
    assert second.removed == ()


def test_preparing_the_same_family_again_keeps_the_same_weights_file(
    tmp_path: Path, variants: list[Path]
) -> None:
    out = tmp_path / "family"
    first = sharedml.prepare_family(variants, out)
    inode = first.weights_path.stat().st_ino
    second = sharedml.prepare_family(variants, out)
    assert second.weights_path == first.weights_path
    assert second.weights_path.stat().st_ino == inode  # kept, not replaced (pools map it)


def test_prepare_given_a_list_is_refused_naming_prepare_family(
    tmp_path: Path, variants: list[Path]
) -> None:
    for given in (variants[:2], tuple(variants[:2])):
        with pytest.raises(TypeError, match=r"call sharedml\.prepare_family\(models, folder\)"):
            sharedml.prepare(given, tmp_path / "old")  # type: ignore[arg-type]
    assert not (tmp_path / "old").exists()  # refused before writing anything


def test_the_cli_prepares_a_family_into_a_folder(tmp_path: Path, variants: list[Path]) -> None:
    out = tmp_path / "family"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharedml",
            "prepare",
            *map(str, variants),
            "-o",
            str(out),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["bytes_distinct"] < summary["bytes_total"]
    assert FAMILY_WEIGHTS_PATTERN.fullmatch(Path(summary["weights_path"]).name)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharedml",
            "prepare",
            str(variants[0]),
            str(variants[0]),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "same path" in bad.stderr


# --------------------------------------------------------------------------------------------
# Device store: one device copy per distinct tensor, whichever member it came from

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


def _decoder_feeds(dec: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    ids = np.array([[1, 5, 9, 3]], np.int64)
    sess = ort.InferenceSession(str(dec), providers=[CPU])
    names = [o.name for o in sess.get_outputs()]
    presents = dict(zip(names, sess.run(None, {"input_ids": ids[:, :3]}), strict=True))
    step = {"input_ids": ids[:, 3:]}
    step |= {"past" + n[len("present") :]: v for n, v in presents.items() if n != "logits"}
    return {"input_ids": ids}, step


def _device_sessions(
    path: Path, store: sharedml.weights.DeviceWeightStore, provider: str
) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.disable_prepacking", "1")  # as the pool does on CPU
    store.register(so)
    return ort.InferenceSession(str(path), so, providers=list(dict.fromkeys([provider, CPU])))


def _device_family_check(tmp_path: Path, provider: str, route: str) -> None:
    dec, past = decoder_pair(tmp_path / "src")
    family = sharedml.prepare_family([dec, past], tmp_path / "family")
    hosts = [sharedml.weights.WeightStore.open(p) for p in family.model_paths]
    first = sharedml.weights.DeviceWeightStore.for_store(hosts[0], provider, 0, route=route)
    alone = first.device_bytes
    second = sharedml.weights.DeviceWeightStore.for_store(hosts[1], provider, 0, route=route)
    assert second is not first  # per model: its own tensor names
    assert set(second.tensor_names) == {s.name for s in hosts[1].slots}
    print(f"{provider} {route}: one member {alone} B on the device, both {second.device_bytes} B")
    assert second.device_bytes <= 1.15 * alone
    ptrs = {
        (s.offset, s.length): first._upload.values[s.name].data_ptr()  # type: ignore[union-attr]
        for s in hosts[0].slots
    }
    shared = [
        s
        for s in hosts[1].slots
        if second._upload.values[s.name].data_ptr() == ptrs.get((s.offset, s.length))  # type: ignore[union-attr]
    ]
    assert len(shared) == len(hosts[1].slots)  # every tensor of the pair is one device copy
    prompt, step = _decoder_feeds(dec)
    for prepared, src, feed, store in (
        (family.model_paths[0], dec, prompt, first),
        (family.model_paths[1], past, step, second),
    ):
        got = _device_sessions(prepared, store, provider).run(None, feed)
        plain = ort.InferenceSession(str(src), providers=list(dict.fromkeys([provider, CPU])))
        want = plain.run(None, feed)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.capability("dlpack")
@pytest.mark.parametrize("route", ["ort-slab", "ort-per-tensor"])
def test_family_members_borrow_one_device_copy_of_each_tensor_on_the_cpu_device(
    tmp_path: Path, route: str
) -> None:
    _device_family_check(tmp_path, CPU, route)


@pytest.mark.gpu
@pytest.mark.skipif(
    CUDA not in ort.get_available_providers(), reason="needs onnxruntime-gpu with a CUDA device"
)
def test_family_members_borrow_one_cuda_copy_of_each_tensor(tmp_path: Path) -> None:
    from sharedml.weights import _probe as _device_probe

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    route = _device_probe.select_route(CUDA, 0)
    assert route is not None
    _device_family_check(tmp_path, CUDA, route)
    # And through pools, each member's pool over the same device values.
    dec, past = decoder_pair(tmp_path / "src2")
    family = sharedml.prepare_family([dec, past], tmp_path / "family2")
    prompt, step = _decoder_feeds(dec)
    providers = [CUDA, CPU]
    with (
        sharedml.SessionPool(family.model_paths[0], sessions=2, providers=providers) as a,
        sharedml.SessionPool(family.model_paths[1], sessions=2, providers=providers) as b,
    ):
        assert a.mechanism == "device" and b.mechanism == "device", a.mechanism_reason
        for pool, src, feed in ((a, dec, prompt), (b, past, step)):
            want = ort.InferenceSession(str(src), providers=providers).run(None, feed)
            for g, w in zip(pool.run(None, feed), want, strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------
# Memory: pools over family members, measured in fresh processes (as tests/pool/test_pool_memory.py)

POOLS = r"""
import ctypes, gc, json, sys
import numpy as np, psutil
import sharedml
sharedml.SessionPool  # the modules load lazily: before the baseline
libc = ctypes.CDLL("libc.so.6")
def pss():
    gc.collect(); libc.malloc_trim(0); return psutil.Process().memory_full_info().pss
prepacking, width, warm_model, models = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
feed = {"input": np.ones((1, width), np.float32)}
# ORT's environment and thread pools, from another model: the baseline holds none of the weights.
warm = sharedml.SessionPool(warm_model, sessions=1, prepacking=prepacking)
warm.run(None, feed)
base = pss()
pools = [sharedml.SessionPool(m, sessions=4, prepacking=prepacking) for m in models]
outputs = []
for pool in pools:
    pool.wait_ready()
    with pool.session() as a, pool.session() as b, pool.session() as c, pool.session() as d:
        outputs.append([s.run(None, feed)[0].tolist() for s in (a, b, c, d)])
grown = pss() - base
print(json.dumps({"pss": grown, "mechanisms": [p.mechanism for p in pools], "outputs": outputs}))
for pool in pools:
    pool.close()
warm.close()
"""

MEMORY_WIDTH = 1024
MEMORY_BASE_BYTES = 100 * 2**20  # a 100 MiB MLP ...
MEMORY_EXTRA_BYTES = 16 * 2**20  # ... and a variant with a 16 MiB extra layer


def _about_one_copy(alone: int) -> float:
    """The most the model and its variant may cost together if their common weights are shared.

    Sharing nothing adds a whole second copy (``MEMORY_BASE_BYTES``) to ``alone``. Sharing
    adds the extra layer (twice where it is prepacked: raw and packed forms), the second pool's
    arenas, and allocator noise, which moved a run as an ordinary user by ~30 MiB: a third of
    a copy covers those and stays far below a second copy.
    """
    return alone + 2 * MEMORY_EXTRA_BYTES + MEMORY_BASE_BYTES / 3


def _pss_of_pools(models: list[Path], prepacking: str, warm: Path) -> tuple[int, list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", POOLS, prepacking, str(MEMORY_WIDTH), str(warm), *map(str, models)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    feed = {"input": np.ones((1, MEMORY_WIDTH), np.float32)}
    for model, outputs in zip(models, result["outputs"], strict=True):
        want = _plain(_original(model), feed)[0]
        for got in outputs:  # every session of every pool: a plain session's outputs
            if prepacking == "off":  # unpacked kernels sum in another order
                np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-4, atol=1e-4)
            else:
                np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    return int(result["pss"]), list(result["mechanisms"])


def _original(model: Path) -> Path:
    """The source model of a family member (same file name in the sources' folder)."""
    return model if model.parent.name == "src" else model.parent.parent / "src" / model.name


@pytest.fixture(scope="module")
def memory_family(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Path, list[Path], Path]:
    folder = tmp_path_factory.mktemp("family-memory")
    warm = mlp(folder / "warm" / "warm.onnx", target_bytes=1, width=MEMORY_WIDTH, seed=5).path
    base = Path(
        mlp(folder / "src" / "mlp.onnx", target_bytes=MEMORY_BASE_BYTES, width=MEMORY_WIDTH).path
    )
    variant = renamed_variant(
        base, folder / "src" / "mlp_variant.onnx", extra_bytes=MEMORY_EXTRA_BYTES
    )
    family = sharedml.prepare_family([base, variant], folder / "family")
    return base, variant, list(family.model_paths), Path(warm)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps")
def test_raw_pools_over_a_model_and_its_variant_cost_about_one_copy_prepared_or_not(
    memory_family: tuple[Path, Path, list[Path], Path], tmp_path: Path
) -> None:
    """Raw sharing (prepacking="off"): a prepared family's members map its one weights file;
    unprepared, the variant's cache entry links the model's entry's file
    (sharedml.prepared._dedupe)."""
    base, variant, members, warm = memory_family
    alone, _ = _pss_of_pools([members[0]], "off", warm)
    both, mechanisms = _pss_of_pools(members, "off", warm)
    unprepared, _ = _pss_of_pools([base, variant], "off", warm)  # no family named
    other = mlp(
        tmp_path / "src" / "other.onnx", target_bytes=MEMORY_BASE_BYTES, width=MEMORY_WIDTH, seed=9
    ).path
    unrelated, _ = _pss_of_pools([base, Path(other)], "off", warm)  # no tensor in common
    print(
        f"pools of 4, prepacking off ({mechanisms}): first member alone {alone / 2**20:.1f} MiB, "
        f"both members {both / 2**20:.1f} MiB ({both / alone:.2f}x), the two unprepared "
        f"models {unprepared / 2**20:.1f} MiB ({unprepared / alone:.2f}x), the model and an "
        f"unrelated one of its size {unrelated / 2**20:.1f} MiB ({unrelated / alone:.2f}x)"
    )
    assert alone >= 0.9 * MEMORY_BASE_BYTES  # the weights really were touched
    assert both <= _about_one_copy(alone)
    assert unprepared <= _about_one_copy(alone)
    assert unrelated >= 1.7 * alone  # the baseline: two copies where nothing is identical


@pytest.mark.capability("prepacked-save")
@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps")
def test_pools_over_a_model_and_its_renamed_variant_share_identical_weights_automatically(
    memory_family: tuple[Path, Path, list[Path], Path], tmp_path: Path
) -> None:
    """Pool defaults, no family named: identical weights (packed too) share across entries."""
    base, variant, members, warm = memory_family
    alone, _ = _pss_of_pools([base], "auto", warm)
    both, both_mechanisms = _pss_of_pools([base, variant], "auto", warm)
    family, _ = _pss_of_pools(members, "auto", warm)
    print(
        f"pools of 4, defaults ({both_mechanisms}): the model alone {alone / 2**20:.1f} MiB, "
        f"with its variant {both / 2**20:.1f} MiB ({both / alone:.2f}x), the prepared family "
        f"{family / 2**20:.1f} MiB ({family / alone:.2f}x)"
    )
    assert alone >= 0.9 * MEMORY_BASE_BYTES
    assert both <= _about_one_copy(alone)
    assert family <= _about_one_copy(alone)


# --------------------------------------------------------------------------------------------
# The decoder / decoder-with-past pair on every CPU route, and sharedml inspect A B


@pytest.fixture(scope="module")
def decoders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[Path]]:
    folder = tmp_path_factory.mktemp("decoders")
    # 80 MiB of weights (GPT-2-small's layout: 4 layers of width 512, 8192 tokens, the head).
    dec, past = decoder_pair(folder / "src", layers=4, width=512, vocab=8192)
    family = sharedml.prepare_family([dec, past], folder / "family")
    return dec, past, list(family.model_paths)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS is read from Linux smaps")
@pytest.mark.parametrize(("route", "prepared"), [("pooled", False), ("raw", True), ("raw", False)])
def test_the_decoder_pair_costs_about_one_models_weights_on_every_cpu_route(
    decoders: tuple[Path, Path, list[Path]], tmp_path: Path, route: str, prepared: bool
) -> None:
    from sharedml.inspection._family import measure_family

    dec, past, members = decoders
    # Pool defaults (packed blobs shared across cache entries): the unprepared pair, no family
    # named. Raw sharing (prepacking off): the pair prepared as a family, or unprepared (the
    # second cache entry links the first's weights file).
    pair = [str(m) for m in members] if prepared else [str(dec), str(past)]
    measure_family(route, 1, pair)  # the cache's one-off builds are not counted

    def pss(models: list[str]) -> tuple[float, list[str]]:
        # The least of two fresh processes: the same measurement varies from one process to
        # the next (docs/families.md, "Figures"); not sharing the weights would add 80 MiB to
        # every run.
        runs = [measure_family(route, 4, models) for _ in range(2)]
        return min(r["pss"] for r in runs), runs[0]["mechanisms"]

    one = max(pss([m])[0] for m in pair)  # the larger member alone
    both_pss, mechanisms = pss(pair)
    both = {"pss": both_pss, "mechanisms": mechanisms}
    print(
        f"{route}, pools of 4 ({both['mechanisms']}): one member alone {one / 2**20:.1f} "
        f"MiB, both {both['pss'] / 2**20:.1f} MiB ({both['pss'] / one:.2f}x)"
    )
    assert one >= 0.9 * 80 * 2**20
    assert both["pss"] <= 1.15 * one


def test_inspect_reports_a_familys_distinct_and_total_weights_and_its_memory(
    tmp_path: Path,
) -> None:
    dec, past = decoder_pair(tmp_path / "src")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharedml",
            "inspect",
            str(dec),
            str(past),
            "--json",
            "--sessions",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    distinct, total = _distinct_bytes([dec, past])
    assert (report["distinct_bytes"], report["total_bytes"]) == (distinct, total)
    assert report["total_bytes"] == 2 * report["distinct_bytes"]  # same weights, renamed
    assert report["sessions"] == 2 and len(report["mechanisms"]) == 2
    assert 0 < report["pooled_bytes"] < report["plain_bytes"]


@pytest.mark.capability("prepacked-save")
def test_the_cache_says_which_entries_share_weights_and_pruning_one_keeps_the_other(
    variants: list[Path],
) -> None:
    import sharedml.cache

    feed = {"input": np.ones((1, WIDTH), np.float32)}
    for model in variants[:2]:
        with sharedml.SessionPool(model, sessions=1) as pool:
            assert pool.mechanism == "prepacked-file", pool.mechanism_reason
            pool.run(None, feed)
    prepacked = [e for e in sharedml.cache.list_entries() if e.kind == "prepacked"]
    assert len(prepacked) == 2
    user = next(e for e in prepacked if e.uses)  # the second one built links the first's file
    lender = next(e for e in prepacked if e is not user)
    assert user.uses == (lender.key,)
    assert set(user.linked.values()) == {2} and set(lender.linked.values()) == {2}
    sharedml.cache.remove_entries([lender])
    assert not lender.path.exists()
    verified = sharedml.cache.verify_entries()
    assert user.key in {e.key for e in verified}
    assert all(e.problem is None for e in verified)  # the link kept the lender's bytes
    with sharedml.SessionPool(variants[1], sessions=1) as pool:
        np.testing.assert_array_equal(pool.run(None, feed)[0], _plain(variants[1], feed)[0])


@pytest.mark.capability("prepacked-save")
def test_without_hard_links_a_prepacked_entry_keeps_its_own_blobs_and_still_matches_plain(
    variants: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import sharedml.cache

    feed = {"input": np.ones((1, WIDTH), np.float32)}
    with sharedml.SessionPool(variants[0], sessions=1) as pool:
        pool.run(None, feed)

    def no_links(*_args: object) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with sharedml.SessionPool(variants[1], sessions=1) as pool:
        assert pool.mechanism == "prepacked-file"
        np.testing.assert_array_equal(pool.run(None, feed)[0], _plain(variants[1], feed)[0])
    prepacked = [e for e in sharedml.cache.list_entries() if e.kind == "prepacked"]
    assert len(prepacked) == 2 and all(not e.uses and not e.linked for e in prepacked)


@pytest.mark.capability("prepacked-save")
@pytest.mark.parametrize("lender_has_subgraphs", [True, False])
def test_an_entry_with_subgraph_weights_is_never_broken_by_another_sharing_its_file(
    tmp_path: Path, lender_has_subgraphs: bool
) -> None:
    """onnx refuses subgraph external data in a file with several hard links (silero-vad).

    A model with weights in an ``If`` body and one without share their main-graph weight
    ``W_0``: whichever is built first, every model still loads afterwards, with its outputs.
    """
    from _models import build_model, feeds, save_model

    import sharedml.cache

    with_if = save_model(
        build_model(["initializer", "if_initializer"], dim=256), tmp_path / "a.onnx"
    )
    plain_mlp = save_model(build_model(["initializer"], dim=256), tmp_path / "b.onnx")
    order = [with_if, plain_mlp] if lender_has_subgraphs else [plain_mlp, with_if]
    feed = feeds(256)
    for model in [*order, *order]:  # the second round loads entries built in the first
        with sharedml.SessionPool(model, sessions=1) as pool:
            assert pool.mechanism == "prepacked-file", pool.mechanism_reason
            want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
            np.testing.assert_array_equal(pool.run(None, feed)[0], want.run(None, feed)[0])
    prepacked = {e.key: e for e in sharedml.cache.list_entries() if e.kind == "prepacked"}
    assert len(prepacked) == 2
    # Sharing happens only when the lender's file holds no subgraph tensor.
    assert any(e.uses for e in prepacked.values()) is not lender_has_subgraphs


def _pairs_model(path: Path, seed: int) -> Path:
    """x: float32[batch, n] -> rows of 2 -> MatMul: runs only where n is even."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((2, 512)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["x", "pairs"], ["r"]),
            helper.make_node("MatMul", ["r", "w"], ["y"]),
        ],
        "pairs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[
            numpy_helper.from_array(np.array([-1, 2], np.int64), "pairs"),
            numpy_helper.from_array(w, "w"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_family_inspect_takes_dims_shapes_and_inputs_for_every_member(tmp_path: Path) -> None:
    from sharedml._errors import MeasurementError
    from sharedml.inspection._family import inspect_family

    models = [_pairs_model(tmp_path / f"m{i}.onnx", i) for i in (0, 1)]
    with pytest.raises(MeasurementError, match=r"(?s)every symbolic dim set to 1.*--dim"):
        inspect_family(models, sessions=1)  # n = 1 rows cannot pair up
    for sizes in (
        {"dims": {"n": 4}},
        {"shapes": {"x": (1, 6)}},
        {"inputs": _npz(tmp_path / "feeds.npz", x=np.ones((3, 2), np.float32))},
    ):
        report = inspect_family(models, sessions=1, **sizes)  # type: ignore[arg-type]
        assert report.plain_bytes is not None and report.pooled_bytes is not None


def test_family_inspect_past_its_timeout_is_one_measurement_error(tmp_path: Path) -> None:
    from sharedml._errors import MeasurementError
    from sharedml.inspection._family import inspect_family

    models = [_pairs_model(tmp_path / f"m{i}.onnx", i) for i in (0, 1)]
    with pytest.raises(MeasurementError, match=r"^Measuring pooled sessions .*longer than 0\.01 s"):
        inspect_family(models, sessions=1, timeout_s=0.01, dims={"n": 4})


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


# --------------------------------------------------------------------------------------------
# A weights file already at the family's content name: kept only if it is ours alone


def _planted_copy(reference: Path, folder: Path) -> Path:
    """The family's weights file, copied into ``folder`` under its content name."""
    planted = folder / reference.name
    planted.write_bytes(reference.read_bytes())
    return planted


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions and links")
@pytest.mark.parametrize("how", ["writable by others", "a second link"])
def test_a_weights_file_others_can_write_is_replaced_not_kept(
    tmp_path: Path, variants: list[Path], how: str
) -> None:
    reference = sharedml.prepare_family(variants[:2], tmp_path / "reference").weights_path
    out = tmp_path / "deploy"
    out.mkdir()
    planted = _planted_copy(reference, out)
    if how == "writable by others":
        os.chmod(planted, 0o666)
    else:
        os.link(planted, tmp_path / "another-name")
    result = sharedml.prepare_family(variants[:2], out)
    assert result.weights_path == planted
    st = os.lstat(planted)
    assert st.st_nlink == 1 and not st.st_mode & 0o022 and st.st_uid == os.geteuid()
    if how == "a second link":  # what the other name changes is no longer the family's file
        assert (tmp_path / "another-name").stat().st_ino != st.st_ino
    again = sharedml.prepare_family(variants[:2], out)  # ours alone now: kept (pools may map it)
    assert os.lstat(again.weights_path).st_ino == st.st_ino


def _plant(reference: bytes, path: Path) -> None:
    path.write_bytes(reference)
    os.chmod(path, 0o666)


def _cannot_write(path: Path) -> None:
    try:
        open(path, "r+b").close()
    except PermissionError:
        return
    raise AssertionError(f"'{path}' can still be opened for writing")


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_weights_file_another_user_planted_is_replaced(
    tmp_path: Path, variants: list[Path], other_user: Callable[[Callable[[], None]], None]
) -> None:
    # The planted file had the right bytes, so prepare kept it ("content-named"); its owner
    # then rewrote 256 bytes of it and a live pool's outputs changed silently.
    reference = sharedml.prepare_family(variants[:2], tmp_path / "reference").weights_path
    shared = Path(tempfile.mkdtemp(prefix="sharedml-deploy-"))
    try:
        os.chmod(shared, 0o777)  # a deploy folder both users may write
        planted = shared / reference.name
        data = reference.read_bytes()
        other_user(lambda: _plant(data, planted))
        result = sharedml.prepare_family(variants[:2], shared)
        assert result.weights_path == planted
        st = os.lstat(planted)
        assert st.st_uid == os.geteuid() and st.st_nlink == 1 and not st.st_mode & 0o222
        other_user(lambda: _cannot_write(planted))
        feed = {"input": np.ones((1, WIDTH), np.float32)}
        with sharedml.SessionPool(result.model_paths[0], sessions=1) as pool:
            np.testing.assert_array_equal(pool.run(None, feed)[0], _plain(variants[0], feed)[0])
    finally:
        shutil.rmtree(shared)


def _prepare_refused(sources: list[Path], folder: Path, owner: int) -> None:
    try:
        sharedml.prepare_family(sources, folder)
    except sharedml.PrepareError as exc:
        assert f"belongs to user id {owner}" in str(exc) and "Nothing was written" in str(exc)
    else:
        raise AssertionError("prepare used a weights file another user planted")
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert not leftovers, leftovers


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_where_the_folder_forbids_replacing_a_planted_file_prepare_refuses(
    tmp_path: Path,
    variants: list[Path],
    other_user: Callable[[Callable[[], None]], None],
    second_other_user: Callable[[Callable[[], None]], None],
) -> None:
    # A sticky folder (like /tmp): the victim may not rename over the attacker's file.
    reference = sharedml.prepare_family(variants[:2], tmp_path / "reference").weights_path
    base = Path(tempfile.mkdtemp(prefix="sharedml-sticky-"))
    try:
        os.chmod(base, 0o755)
        sources = base / "src"
        shutil.copytree(variants[0].parent, sources)
        for path in sources.iterdir():
            os.chmod(path, 0o644)
        shared = base / "deploy"
        shared.mkdir()
        os.chmod(shared, 0o1777)
        data = reference.read_bytes()
        other_user(lambda: _plant(data, shared / reference.name))
        members = [sources / v.name for v in variants[:2]]
        second_other_user(lambda: _prepare_refused(members, shared, other_user.uid))  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(base)
