"""Stamps: start-up skips re-hashing files that have not changed since they were hashed.

A stamp is (device, inode, size, mtime, ctime) of a file when its digest was computed. These
tests change files the ways that matter (in place, same size, mtime put back) and check that
every such change is seen, and that an unchanged file is not read again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from _models import build_model, feeds, run_ort, save_model

import sharedml
import sharedml._host._hashing
from sharedml.cache import Cache, _stamps
from sharedml.cache._stamps import recall_stamp, record_stamp, snapshot

POSIX = os.name == "posix"
# Windows gets no stamps: its st_ctime is the creation time, which no write moves, so a file
# rewritten in place with its mtime put back would keep its stamp (the first two tests below).
needs_stamps = pytest.mark.skipif(
    os.name == "nt", reason="no stamps on Windows (st_ctime is the creation time)"
)


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Replace ``path``'s bytes without changing its inode, size or mtime (only ctime moves)."""
    before = os.stat(path)
    assert len(data) == before.st_size
    time.sleep(0.05)  # past the kernel's timestamp tick, so the write moves ctime
    with open(path, "r+b") as fh:
        fh.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


def same_size_variant(path: Path, seed: int, tmp_path: Path) -> bytes:
    other = save_model(build_model(["initializer"], dim=64, seed=seed), tmp_path / "other.onnx")
    data = other.read_bytes()
    assert len(data) == path.stat().st_size
    return data


@pytest.fixture
def source(tmp_path: Path) -> Path:
    return save_model(build_model(["initializer"], dim=64), tmp_path / "src" / "m.onnx")


@needs_stamps
def test_an_unchanged_source_is_found_without_parsing_or_hashing_it(
    source: Path, no_racy_window: None, forbid_reading: Callable[..., None]
) -> None:
    first = sharedml.prepared_model_for(source)
    forbid_reading(source)
    assert sharedml.prepared_model_for(source) == first


def test_a_source_rewritten_in_place_gets_its_own_entry(
    source: Path, tmp_path: Path, no_racy_window: None
) -> None:
    first = sharedml.prepared_model_for(source)
    rewrite_in_place(source, same_size_variant(source, 7, tmp_path))
    second = sharedml.prepared_model_for(source)
    assert second != first
    feed = feeds(64)
    np.testing.assert_allclose(
        run_ort(second, feed), run_ort(tmp_path / "other.onnx", feed), rtol=1e-5
    )


def test_an_external_data_file_rewritten_in_place_gets_its_own_entry(
    tmp_path: Path, no_racy_window: None
) -> None:
    src = save_model(
        build_model(["initializer"], dim=64), tmp_path / "a" / "m.onnx", external="one"
    )
    other = save_model(
        build_model(["initializer"], dim=64, seed=9), tmp_path / "b" / "m.onnx", external="one"
    )
    (data,) = [p for p in src.parent.iterdir() if p.name != "m.onnx"]
    first = sharedml.prepared_model_for(src)
    rewrite_in_place(data, (other.parent / data.name).read_bytes())
    second = sharedml.prepared_model_for(src)
    assert second != first
    feed = feeds(64)
    np.testing.assert_allclose(run_ort(second, feed), run_ort(other, feed), rtol=1e-5)


@pytest.mark.skipif(os.name != "nt", reason="Windows")
def test_windows_gets_no_stamps(source: Path, no_racy_window: None) -> None:
    assert not record_stamp("test", snapshot(source), "v1", cache=Cache.at(None))
    sharedml.prepared_model_for(source)
    assert recall_stamp("test", source, cache=Cache.at(None)) is None


def test_a_file_written_just_now_gets_no_stamp(source: Path) -> None:
    # Within the timestamp granularity a second write could leave every stamp field unchanged.
    assert not record_stamp("test", snapshot(source), "value", cache=Cache.at(None))
    sharedml.prepared_model_for(source)
    assert not (sharedml.cache_dir() / "stamps").exists() or not any(
        (sharedml.cache_dir() / "stamps").iterdir()
    )


@needs_stamps
def test_a_recorded_stamp_is_recalled_until_the_file_changes(
    source: Path, tmp_path: Path, no_racy_window: None
) -> None:
    assert record_stamp("test", snapshot(source), "v1", "params", cache=Cache.at(None))
    assert recall_stamp("test", source, "params", cache=Cache.at(None)) == "v1"
    assert recall_stamp("test", source, "other params", cache=Cache.at(None)) is None
    assert recall_stamp("other kind", source, "params", cache=Cache.at(None)) is None
    rewrite_in_place(source, same_size_variant(source, 3, tmp_path))
    assert recall_stamp("test", source, "params", cache=Cache.at(None)) is None


@needs_stamps
def test_a_replaced_file_is_not_recalled(source: Path, no_racy_window: None) -> None:
    assert record_stamp("test", snapshot(source), "v1", cache=Cache.at(None))
    data = source.read_bytes()
    source.unlink()
    source.write_bytes(data)  # same bytes, new inode: the stamp cannot prove that
    assert recall_stamp("test", source, cache=Cache.at(None)) is None


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_stamps_in_a_folder_others_can_write_are_ignored(
    source: Path, no_racy_window: None
) -> None:
    assert record_stamp("test", snapshot(source), "v1", cache=Cache.at(None))
    stamps = sharedml.cache_dir() / "stamps"
    os.chmod(stamps, 0o777)  # another user could have planted this stamp
    assert recall_stamp("test", source, cache=Cache.at(None)) is None
    assert record_stamp(
        "test", snapshot(source), "v2", cache=Cache.at(None)
    )  # recording makes the folder private again
    assert oct(os.stat(stamps).st_mode & 0o777) == oct(0o700)
    assert recall_stamp("test", source, cache=Cache.at(None)) == "v2"


@needs_stamps
def test_stamps_can_be_turned_off(
    source: Path, no_racy_window: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert record_stamp("test", snapshot(source), "v1", cache=Cache.at(None))
    monkeypatch.setenv("SHAREDML_STAMPS", "0")
    assert recall_stamp("test", source, cache=Cache.at(None)) is None


@needs_stamps
def test_a_damaged_stamp_is_a_miss(source: Path, no_racy_window: None) -> None:
    assert record_stamp("test", snapshot(source), "v1", cache=Cache.at(None))
    (stamp,) = (sharedml.cache_dir() / "stamps").iterdir()
    stamp.write_text("{not json")
    assert recall_stamp("test", source, cache=Cache.at(None)) is None


@needs_stamps
def test_verified_weights_are_not_hashed_again_until_they_change(
    source: Path, no_racy_window: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = sharedml.prepare(source, source.parent / "prepared" / "m.onnx").model_path
    weights = sharedml.prepared.weights_path_for(prepared)
    store = sharedml.weights.WeightStore.open(prepared)
    assert store.verified
    del store
    sharedml.weights.WeightStore._registry.clear()  # as in a new process: no store, no mapping
    sharedml.weights._store._MappedFile._registry.clear()

    hashed: list[Path] = []
    real = sharedml._host._hashing.sha256_file

    def counting(path: Path, sha: object = None) -> str:
        hashed.append(Path(path))
        return real(path, sha)

    monkeypatch.setattr(sharedml._host._hashing, "sha256_file", counting)
    assert sharedml.weights.WeightStore.open(prepared).verified
    assert hashed == []
    sharedml.weights.WeightStore._registry.clear()
    sharedml.weights._store._MappedFile._registry.clear()

    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(weights, 0o644)
    rewrite_in_place(weights, bytes(data))
    with pytest.raises(sharedml.WeightsMismatchError, match="modified"):
        sharedml.weights.WeightStore.open(prepared)
    assert hashed == [weights]


# ---------------------------------------------------------------------------------------------
# Stamps must not go stale: links are resolved again, and a stamp vouches only for
# bytes that did not change while they were hashed.


def two_weight_versions(folder: Path) -> tuple[Path, Path, Path]:
    """A model whose data file ``m.data`` is a symlink to ``v1.bin``; ``v2.bin`` is beside it.

    The two versions have the same size and different weights (a deploy layout:
    ``current -> v1``, then retargeted to v2). Returns (model, a v1 reference, a v2 reference).
    """
    v1 = save_model(
        build_model(["initializer"], dim=64, seed=1), folder / "v1" / "m.onnx", external="one"
    )
    v2 = save_model(
        build_model(["initializer"], dim=64, seed=2), folder / "v2" / "m.onnx", external="one"
    )
    live = folder / "live"
    live.mkdir()
    (live / "m.onnx").write_bytes(v1.read_bytes())
    assert v1.read_bytes() == v2.read_bytes()  # the graphs are equal; only the data differs
    (live / "v1.bin").write_bytes((v1.parent / "m.data").read_bytes())
    (live / "v2.bin").write_bytes((v2.parent / "m.data").read_bytes())
    (live / "m.data").symlink_to("v1.bin")
    return live / "m.onnx", v1, v2


def retarget(link: Path, target: str) -> None:
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(target)
    os.replace(tmp, link)


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_a_retargeted_data_symlink_does_not_serve_the_old_entry(
    tmp_path: Path, no_racy_window: None
) -> None:
    src, v1, v2 = two_weight_versions(tmp_path)
    first = sharedml.prepared_model_for(src)
    np.testing.assert_array_equal(run_ort(first, feeds(64)), run_ort(v1, feeds(64)))
    assert sharedml.prepared_model_for(src) == first  # stamped, and found by the stamp
    retarget(src.parent / "m.data", "v2.bin")  # the data file itself did not change
    second = sharedml.prepared_model_for(src)
    assert second != first
    np.testing.assert_array_equal(run_ort(second, feeds(64)), run_ort(v2, feeds(64)))


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_one_model_file_under_two_names_gets_each_folders_data(
    tmp_path: Path, no_racy_window: None
) -> None:
    # a/m.onnx and b/m.onnx link to one graph; each folder has its own m.data beside it, which
    # is the one ORT reads. A stamp named by the graph's real path served a's entry for b.
    src, v1, v2 = two_weight_versions(tmp_path)
    for name, version in (("a", "v1.bin"), ("b", "v2.bin")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.onnx").symlink_to(src)
        os.link(src.parent / version, tmp_path / name / "m.data")
    a = sharedml.prepared_model_for(tmp_path / "a" / "m.onnx")
    b = sharedml.prepared_model_for(tmp_path / "b" / "m.onnx")
    assert a != b
    np.testing.assert_array_equal(run_ort(a, feeds(64)), run_ort(v1, feeds(64)))
    np.testing.assert_array_equal(run_ort(b, feeds(64)), run_ort(v2, feeds(64)))


def test_a_write_during_the_hash_is_not_stamped_as_good(
    source: Path, no_racy_window: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = sharedml._host._hashing.sha256_file(source)
    real = sharedml._host._hashing.sha256_file

    def hash_then_write(path: Path, sha: object = None) -> str:
        digest = real(path, sha)  # the bytes read were good...
        with open(path, "ab") as fh:  # ...and a write lands before the stamp is taken
            fh.write(b"tampered")
        return digest

    monkeypatch.setattr(sharedml._host._hashing, "sha256_file", hash_then_write)
    assert _stamps.verified_sha256(source, good, cache=Cache.at(None))
    monkeypatch.setattr(sharedml._host._hashing, "sha256_file", real)
    _stamps._DIGESTS.clear()  # as in a new process
    assert not _stamps.verified_sha256(source, good, cache=Cache.at(None))  # hashed again: changed


@needs_stamps
def test_a_source_changed_after_its_key_was_read_is_not_stamped(
    tmp_path: Path, no_racy_window: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, v1, v2 = two_weight_versions(tmp_path)
    real_prepare = sharedml.prepared._prepare.prepare

    def prepare_then_deploy(*args: object, **kwargs: object) -> sharedml.PrepareResult:
        result = real_prepare(*args, **kwargs)  # type: ignore[arg-type]
        retarget(src.parent / "m.data", "v2.bin")  # a deploy lands before the stamp is taken
        return result

    monkeypatch.setattr(sharedml.prepared._prepare, "prepare", prepare_then_deploy)
    first = sharedml.prepared_model_for(src)
    monkeypatch.setattr(sharedml.prepared._prepare, "prepare", real_prepare)
    np.testing.assert_array_equal(run_ort(first, feeds(64)), run_ort(v1, feeds(64)))
    # No stamp vouches for v2 with v1's key: the source is hashed again and gets v2's entry.
    second = sharedml.prepared_model_for(src)
    np.testing.assert_array_equal(run_ort(second, feeds(64)), run_ort(v2, feeds(64)))
