"""Identical tensors of different unprepared models: one copy on disk, in memory, on the device."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import sharedml
import sharedml.cache
from sharedml._errors import UnsafePathError
from sharedml.cache import Cache, _entries
from sharedml.model._graph import load_graph
from sharedml.prepared._format import SharedWeights, WeightsManifest, read_manifest
from sharedml.prepared._prepare import prepared_model_for
from tests._models import build_model, feeds, save_model
from tools.families import decoder_pair, renamed_variant

if TYPE_CHECKING:
    from tests.conftest import Unprivileged

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
DIM = 256


def _manifest(model: Path) -> WeightsManifest:
    manifest = read_manifest(load_graph(model))
    assert manifest is not None
    return manifest


def _plain(model: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(model), providers=[CPU]).run(None, feed)


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    """A model and its variant: every tensor renamed, one extra 1 MiB layer."""
    base = save_model(build_model(["initializer", "initializer"], dim=DIM), tmp_path / "a.onnx")
    return base, renamed_variant(base, tmp_path / "b.onnx", extra_bytes=2**20)


def test_the_second_entry_links_the_first_entrys_weights_and_stores_only_the_rest(
    pair: tuple[Path, Path],
) -> None:
    a, b = (prepared_model_for(p) for p in pair)
    ma, mb = _manifest(a), _manifest(b)
    assert not ma.shared  # the first entry had no one to share with: format 2, as before
    (linked,) = mb.shared
    assert linked.file.startswith("shared-") and linked.sha256 == ma.sha256
    # the same inode: one set of pages for every process that maps either entry
    assert os.stat(b.parent / linked.file).st_ino == os.stat(a.parent / ma.file).st_ino
    assert os.stat(a.parent / ma.file).st_nlink == 2
    # the variant's own file holds its extra layer only (plus alignment)
    assert 2**20 <= mb.size_bytes < 2**20 + 2 * 4096
    shared = {
        e.key: e for e in sharedml.cache.list_entries() if e.kind == "models" and e.path == b.parent
    }
    assert [e.uses for e in shared.values()] == [(a.parent.name,)]  # sharedml cache list


@pytest.mark.parametrize("prepacking", ["off", "auto"])
def test_pools_over_both_give_plain_outputs_and_map_each_file_once(
    pair: tuple[Path, Path], prepacking: str
) -> None:
    feed = feeds(DIM)
    with (
        sharedml.SessionPool(pair[0], sessions=2, prepacking=prepacking) as pa,
        sharedml.SessionPool(pair[1], sessions=2, prepacking=prepacking) as pb,
    ):
        for pool, src in ((pa, pair[0]), (pb, pair[1])):
            for got, want in zip(pool.run(None, feed), _plain(src, feed), strict=True):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        # b's store maps a's weights file itself (its inode), and its own file only besides
        sa, sb = (sharedml.weights.WeightStore.open(prepared_model_for(p)) for p in pair)
        assert sa.file_key in sb.file_keys.values() and len(sb.file_keys) == 2


@pytest.mark.capability("dlpack")
@pytest.mark.parametrize("route", ["ort-slab", "ort-per-tensor"])
def test_the_device_store_uploads_each_shared_tensor_once(
    pair: tuple[Path, Path], route: str
) -> None:
    hosts = [sharedml.weights.WeightStore.open(prepared_model_for(p)) for p in pair]
    first = sharedml.weights.DeviceWeightStore.for_store(hosts[0], CPU, 0, route=route)
    second = sharedml.weights.DeviceWeightStore.for_store(hosts[1], CPU, 0, route=route)
    extra = sum(s.length for s in hosts[1].slots if s.file == hosts[1].manifest.file)
    assert extra >= 2**20
    # the second adds its extra layer, not a second copy of the shared tensors
    assert second.device_bytes <= first.device_bytes + extra + 4096
    values = {
        (s.offset, s.length): first._upload.values[s.name].data_ptr()  # type: ignore[union-attr]
        for s in hosts[0].slots
    }
    borrowed = [
        s
        for s in hosts[1].slots
        if s.file != hosts[1].manifest.file
        and second._upload.values[s.name].data_ptr() == values[(s.offset, s.length)]  # type: ignore[union-attr]
    ]
    assert len(borrowed) == len(hosts[0].slots)
    feed = feeds(DIM)
    for prepared, src, store in zip(
        (h.model_path for h in hosts), pair, (first, second), strict=True
    ):
        so = ort.SessionOptions()
        so.add_session_config_entry("session.disable_prepacking", "1")
        store.register(so)
        got = ort.InferenceSession(str(prepared), so, providers=[CPU]).run(None, feed)
        for g, w in zip(got, _plain(src, feed), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_a_model_whose_tensors_all_exist_elsewhere_keeps_no_file_of_its_own(
    tmp_path: Path,
) -> None:
    dec, past = decoder_pair(tmp_path / "src")
    a, b = prepared_model_for(dec), prepared_model_for(past)
    mb = _manifest(b)
    assert mb.file.startswith("shared-") and not mb.shared
    assert sorted(p.name for p in b.parent.glob("*.weights")) == [mb.file]
    assert mb.sha256 == _manifest(a).sha256
    ids = np.array([[1, 5, 9]], np.int64)
    with sharedml.SessionPool(dec, sessions=1, prepacking="off") as pool:
        np.testing.assert_allclose(
            pool.run(None, {"input_ids": ids})[0], _plain(dec, {"input_ids": ids})[0], atol=1e-5
        )


@pytest.mark.parametrize("lender_has_subgraphs", [True, False])
def test_subgraph_tensors_never_point_at_a_link_nor_are_lent(
    tmp_path: Path, lender_has_subgraphs: bool
) -> None:
    """onnx refuses subgraph external data in a file with several hard links (silero-vad)."""
    with_if = save_model(
        build_model(["initializer", "if_initializer"], dim=DIM), tmp_path / "if.onnx"
    )
    mlp = save_model(build_model(["initializer"], dim=DIM), tmp_path / "mlp.onnx")
    order = [with_if, mlp] if lender_has_subgraphs else [mlp, with_if]
    prepared = {p: prepared_model_for(p) for p in order}
    if_entry = prepared[with_if]
    main = _manifest(if_entry).file
    # the file that the If body's tensors are in has one link: the check ORT runs passes
    assert os.stat(if_entry.parent / main).st_nlink == 1
    if not lender_has_subgraphs:  # W_0 of the If model's main graph comes from the MLP's entry
        assert _manifest(if_entry).shared
    feed = feeds(DIM)
    for model in [*order, *order]:
        for prepacking, mechanism in (("off", "auto"), ("off", "ort-mmap"), ("auto", "auto")):
            with sharedml.SessionPool(
                model, sessions=1, prepacking=prepacking, mechanism=mechanism
            ) as pool:
                np.testing.assert_allclose(
                    pool.run(None, feed)[0], _plain(model, feed)[0], rtol=1e-5, atol=1e-5
                )


def test_a_tampered_lender_is_not_linked_and_the_borrower_is_rebuilt(
    pair: tuple[Path, Path],
) -> None:
    a = prepared_model_for(pair[0])
    weights = a.parent / _manifest(a).file
    os.chmod(weights, 0o644)
    with open(weights, "r+b") as fh:  # one flipped byte in the first tensor
        fh.seek(0)
        byte = fh.read(1)
        fh.seek(0)
        fh.write(bytes([byte[0] ^ 0xFF]))
    b = prepared_model_for(pair[1])  # built now: the lender fails its hash, nothing is linked
    assert not _manifest(b).shared
    feed = feeds(DIM)
    with sharedml.SessionPool(pair[1], sessions=1, prepacking="off") as pool:
        np.testing.assert_allclose(pool.run(None, feed)[0], _plain(pair[1], feed)[0], atol=1e-5)


def test_removing_the_lender_leaves_the_borrower_whole(pair: tuple[Path, Path]) -> None:
    a, b = (prepared_model_for(p) for p in pair)
    for prepared in (a, b):  # a lookup holds its entry until a store maps it; then let go
        sharedml.weights.WeightStore.open(prepared).close()
    removed = sharedml.cache.remove_entries(
        [e for e in sharedml.cache.list_entries() if e.path == a.parent]
    )
    assert removed and not a.parent.exists()
    feed = feeds(DIM)
    with sharedml.SessionPool(b, sessions=1, prepacking="off") as pool:  # verified: whole
        np.testing.assert_allclose(pool.run(None, feed)[0], _plain(pair[1], feed)[0], atol=1e-5)


def _share_in_the_default_cache(folder: Path) -> None:
    """As the user this runs as: two pools' entries in the default cache under its HOME."""
    os.environ["HOME"] = str(folder / "home")
    for name in ("SHAREDML_CACHE_DIR", "XDG_CACHE_HOME"):
        os.environ.pop(name, None)
    assert sharedml.cache_dir() == folder / "home" / ".cache" / "sharedml"
    a = prepared_model_for(folder / "a.onnx")
    b = prepared_model_for(folder / "b.onnx")  # links a's weights: the step root never failed
    (linked,) = _manifest(b).shared
    assert os.stat(b.parent / linked.file).st_ino == os.stat(a.parent / _manifest(a).file).st_ino
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o444 for p in b.parent.glob("*.*"))


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_an_ordinary_user_shares_identical_weights_in_the_default_cache(
    pair: tuple[Path, Path], unprivileged: Unprivileged
) -> None:
    # The dedupe step rewrote the read-only model.onnx that prepare had just written: every
    # user but root got "Permission denied" (blamed on disk space) for the second model.
    for src in pair:
        shutil.copy(src, unprivileged.folder / src.name)
        os.chown(unprivileged.folder / src.name, unprivileged.uid, -1)
    unprivileged.run(lambda: _share_in_the_default_cache(unprivileged.folder))


def test_a_permission_error_while_publishing_names_the_file_not_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def build(folder: Path) -> None:
        raise PermissionError(13, "Permission denied", str(folder / "model.onnx"))

    with pytest.raises(sharedml.CacheError) as info:
        _entries.publish("demo", "k", build, cache=Cache(tmp_path / "c"))
    message = str(info.value)
    assert "model.onnx" in message and "Permission denied" in message
    assert "disk space" not in message


def test_a_prepacked_entry_whose_weights_all_sit_in_linked_files_keeps_no_dead_copy(
    tmp_path: Path,
) -> None:
    # Every initializer pointed at the other entry's shared-*.data file, and the entry still
    # kept ORT's own model.data: the same bytes again, which no session maps (32 MiB dead).
    from tools.realistic_models import mlp

    first = Path(mlp(tmp_path / "a.onnx", target_bytes=2**20, width=256).path)
    model = onnx.load(str(first))
    model.doc_string = "the same weights, exported again"
    second = tmp_path / "b.onnx"
    onnx.save(model, str(second))
    feed = {"input": np.ones((2, 256), np.float32)}
    for source in (first, second):
        with sharedml.SessionPool(source, sessions=1) as pool:
            assert pool.mechanism == "prepacked-file", pool.mechanism_reason
            np.testing.assert_allclose(
                pool.run(None, feed)[0], _plain(source, feed)[0], rtol=1e-5, atol=1e-5
            )
    prepacked = [e for e in sharedml.cache.list_entries() if e.kind == "prepacked"]
    (user,) = [e for e in prepacked if e.uses]
    (lender,) = [e for e in prepacked if e is not user]
    assert (user.path / "model.data").stat().st_size == 0
    assert (
        sharedml.cache.disk_bytes(prepacked) < lender.size_bytes + 2**20 // 4
    )  # one copy, plus graphs
    with sharedml.SessionPool(second, sessions=1) as pool:  # the entry as published still loads
        np.testing.assert_allclose(
            pool.run(None, feed)[0], _plain(second, feed)[0], rtol=1e-5, atol=1e-5
        )


def test_a_manifest_naming_a_shared_file_outside_the_folder_is_refused() -> None:
    good = WeightsManifest(
        "model.weights", 4096, "0" * 64, 4096, 1, shared=(SharedWeights("x.weights", 1, "1"),)
    )
    assert json.loads(good.to_json())["format"] == 3
    assert WeightsManifest.from_json(good.to_json()) == good
    for name in ("../x.weights", "sub/x.weights", "model.weights"):
        raw = json.loads(good.to_json())
        raw["shared"][0]["file"] = name
        with pytest.raises((UnsafePathError, sharedml.InvalidModelError)):
            WeightsManifest.from_json(json.dumps(raw))


# --------------------------------------------------------------------------------------------
# CUDA: the decoder pair's device memory, unprepared (on an H200 through benchmarks/gpu_run.sh)

_DEVICE_CHILD = r"""
import json, sys
import numpy as np, onnxruntime as ort, torch
ort.preload_dlls()
import sharedml
models = sys.argv[1:]
providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
torch.cuda.init(); torch.zeros(1, device="cuda")
warm = ort.InferenceSession(models[0], providers=providers)  # CUDA EP context and handles
del warm
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
pools = [sharedml.SessionPool(m, sessions=1, providers=providers, create_in_background=False)
         for m in models]
torch.cuda.synchronize()
print(json.dumps({"bytes": free0 - torch.cuda.mem_get_info()[0],
                  "mechanisms": [str(p.mechanism) for p in pools]}))
"""


def _device_growth(models: list[Path]) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", _DEVICE_CHILD, *map(str, models)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["mechanisms"]) == {"device"}, result
    return int(result["bytes"])


@pytest.mark.gpu
@pytest.mark.skipif(
    CUDA not in ort.get_available_providers(), reason="needs onnxruntime-gpu with a CUDA device"
)
def test_the_unprepared_decoder_pair_holds_about_one_copy_on_the_cuda_device(
    tmp_path: Path,
) -> None:
    # 80 MiB of weights each (GPT-2-small's layout at 4 layers), the same tensors renamed.
    dec, past = decoder_pair(tmp_path / "src", layers=4, width=512, vocab=8192)
    other, _ = decoder_pair(tmp_path / "other", layers=4, width=512, vocab=8192, seed=3)
    _device_growth([dec, past, other])  # builds every cache entry once
    one = _device_growth([dec])
    twice = _device_growth([dec, dec])  # two pools over one model: one copy, two sessions
    both = _device_growth([dec, past])
    unrelated = _device_growth([dec, other])  # nothing in common: two copies
    print(
        f"CUDA device memory, one session per pool: decoder {one / 2**20:.0f} MiB, decoder "
        f"twice {twice / 2**20:.0f} MiB, decoder + decoder-with-past {both / 2**20:.0f} MiB "
        f"({both / twice:.2f}x of twice), decoder + an unrelated decoder "
        f"{unrelated / 2**20:.0f} MiB"
    )
    weights = 80 * 2**20
    assert both - twice <= 0.15 * weights  # the pair's weights: about one copy
    assert unrelated - twice >= 0.8 * weights  # the baseline it saves: a second copy
