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
import sharedml._cache
import sharedml._host
from sharedml._cache import recall_stamp, record_stamp

POSIX = os.name == "posix"


@pytest.fixture
def no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let files written by the test itself get stamps (production waits 3 s after a write)."""
    monkeypatch.setattr(sharedml._cache, "_RACY_WINDOW_NS", 0)


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


def test_a_file_written_just_now_gets_no_stamp(source: Path) -> None:
    # Within the timestamp granularity a second write could leave every stamp field unchanged.
    assert not record_stamp("test", source, "value")
    sharedml.prepared_model_for(source)
    assert not (sharedml.cache_dir() / "stamps").exists() or not any(
        (sharedml.cache_dir() / "stamps").iterdir()
    )


def test_a_recorded_stamp_is_recalled_until_the_file_changes(
    source: Path, tmp_path: Path, no_racy_window: None
) -> None:
    assert record_stamp("test", source, "v1", "params")
    assert recall_stamp("test", source, "params") == "v1"
    assert recall_stamp("test", source, "other params") is None
    assert recall_stamp("other kind", source, "params") is None
    rewrite_in_place(source, same_size_variant(source, 3, tmp_path))
    assert recall_stamp("test", source, "params") is None


def test_a_replaced_file_is_not_recalled(source: Path, no_racy_window: None) -> None:
    assert record_stamp("test", source, "v1")
    data = source.read_bytes()
    source.unlink()
    source.write_bytes(data)  # same bytes, new inode: the stamp cannot prove that
    assert recall_stamp("test", source) is None


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_stamps_in_a_folder_others_can_write_are_ignored(
    source: Path, no_racy_window: None
) -> None:
    assert record_stamp("test", source, "v1")
    stamps = sharedml.cache_dir() / "stamps"
    os.chmod(stamps, 0o777)  # another user could have planted this stamp
    assert recall_stamp("test", source) is None
    assert record_stamp("test", source, "v2")  # recording makes the folder private again
    assert oct(os.stat(stamps).st_mode & 0o777) == oct(0o700)
    assert recall_stamp("test", source) == "v2"


def test_stamps_can_be_turned_off(
    source: Path, no_racy_window: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert record_stamp("test", source, "v1")
    monkeypatch.setenv("SHAREDML_STAMPS", "0")
    assert recall_stamp("test", source) is None


def test_a_damaged_stamp_is_a_miss(source: Path, no_racy_window: None) -> None:
    assert record_stamp("test", source, "v1")
    (stamp,) = (sharedml.cache_dir() / "stamps").iterdir()
    stamp.write_text("{not json")
    assert recall_stamp("test", source) is None


def test_verified_weights_are_not_hashed_again_until_they_change(
    source: Path, no_racy_window: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared = sharedml.prepare(source, source.parent / "prepared" / "m.onnx").model_path
    weights = sharedml.weights_path_for(prepared)
    store = sharedml.WeightStore.open(prepared)
    assert store.verified
    sharedml.WeightStore._registry.clear()  # as in a new process

    hashed: list[Path] = []
    real = sharedml._host.sha256_file

    def counting(path: Path, sha: object = None) -> str:
        hashed.append(Path(path))
        return real(path, sha)

    monkeypatch.setattr(sharedml._host, "sha256_file", counting)
    assert sharedml.WeightStore.open(prepared).verified
    assert hashed == []
    sharedml.WeightStore._registry.clear()

    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(weights, 0o644)
    rewrite_in_place(weights, bytes(data))
    with pytest.raises(sharedml.WeightsMismatchError, match="modified"):
        sharedml.WeightStore.open(prepared)
    assert hashed == [weights]
