"""The cache owns every entry: one permission policy and one publish path for every kind.

Each kind of entry (prepared models, prepacked models, the demo model) and the stamps folder
get the same checks, so a rule cannot hold for one kind and be missing for another.
"""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from _models import build_model, feeds, save_model

import sharedml
from sharedml import _cache
from sharedml._demo import demo_model_path

POSIX = os.name == "posix"
KINDS = ("models", "prepacked", "demo", "stamps")


@pytest.fixture(autouse=True)
def no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files this test just wrote get stamps too, so that the stamps folder is used."""
    monkeypatch.setattr(_cache, "_RACY_WINDOW_NS", 0)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def mlp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("mlp")
    return Path(mlp(folder / "mlp.onnx", target_bytes=8 * 2**20, width=512).path)


def use_every_kind(model: Path, root: Path) -> sharedml.SessionPool:
    """A pool on the prepacked route (models/, prepacked/, stamps/) and the demo (demo/)."""
    demo_model_path(cache_dir=root)
    pool = sharedml.SessionPool(model, sessions=1, cache_dir=root)
    assert pool.mechanism == "prepacked-file"
    return pool


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
def test_every_kind_of_entry_is_private_and_read_only(mlp_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    use_every_kind(mlp_model, root).close()
    for kind in ("models", "prepacked", "demo"):
        assert mode(root / kind) == 0o700, kind
        entries = [e for e in (root / kind).iterdir() if not e.name.startswith(".")]
        assert entries, kind
        for entry in entries:
            assert mode(entry) == 0o700, entry
            record = json.loads((entry / _cache.ENTRY_FILE).read_text())
            assert set(record["files"]) == {p.name for p in entry.iterdir()} - {"entry.json"}
            for file in entry.iterdir():
                assert mode(file) == 0o444, file
    assert mode(root / "stamps") == 0o700


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
@pytest.mark.parametrize("kind", KINDS)
def test_a_lax_kind_folder_is_made_private_again(
    kind: str, mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    (root / kind).mkdir(parents=True)
    os.chmod(root / kind, 0o777)
    use_every_kind(mlp_model, root).close()
    assert mode(root / kind) == 0o700


@pytest.mark.skipif(not POSIX, reason="POSIX permissions and flock")
def test_locks_follow_the_policy(tmp_path: Path) -> None:
    root = tmp_path / "c"
    (root / "locks").mkdir(parents=True)
    os.chmod(root / "locks", 0o777)
    with _cache.held_lock("a", cache_dir=root) as waited:
        assert 0 <= waited < 1  # free: taken at once
        assert mode(root / "locks") == 0o700 and mode(root / "locks" / "a.lock") == 0o600
    os.symlink(tmp_path / "planted", root / "locks" / "b.lock")
    with (
        pytest.raises(sharedml.CacheError, match=r"b\.lock"),
        _cache.held_lock("b", cache_dir=root),
    ):
        pass
    assert not (tmp_path / "planted").exists()


@pytest.mark.skipif(not POSIX, reason="symlinks")
@pytest.mark.parametrize("kind", ("models", "prepacked", "demo"))
def test_a_kind_folder_that_is_a_symlink_is_refused(
    kind: str, mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", root / kind)
    with pytest.raises(sharedml.CacheError, match="not a folder"):
        use_every_kind(mlp_model, root)
    assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.skipif(not POSIX or os.geteuid() != 0, reason="needs root to chown")
@pytest.mark.parametrize("kind", ("models", "prepacked", "demo"))
def test_a_kind_folder_owned_by_another_user_is_refused(
    kind: str, mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    (root / kind).mkdir(parents=True, mode=0o700)
    os.chown(root / kind, 65534, 65534)
    with pytest.raises(sharedml.CacheError, match="belongs to user id 65534"):
        use_every_kind(mlp_model, root)


@pytest.mark.parametrize("damage", ["model.data", "model.onnx"])
def test_a_damaged_prepacked_entry_is_never_loaded_but_rebuilt(
    damage: str, mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    with use_every_kind(mlp_model, root) as pool:
        entry = pool.recipe.prepacked.model_path.parent
    target = entry / damage
    original = target.read_bytes()
    os.chmod(target, 0o644)
    data = bytearray(original)
    data[len(data) // 2] ^= 0x40
    target.write_bytes(data)
    feed = {"input": np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)}
    reference = ort.InferenceSession(str(mlp_model), providers=["CPUExecutionProvider"])
    with pytest.warns(RuntimeWarning, match="is damaged"):
        pool = sharedml.SessionPool(mlp_model, sessions=1, cache_dir=root)
    with pool:
        np.testing.assert_allclose(
            pool.run(None, feed)[0], reference.run(None, feed)[0], rtol=1e-4, atol=1e-5
        )
    assert target.read_bytes() == original


def test_concurrent_publishers_of_one_key_all_get_one_whole_entry(tmp_path: Path) -> None:
    barrier = threading.Barrier(4)
    results: list[object] = []

    def build(folder: Path) -> dict[str, str]:
        barrier.wait(timeout=30)  # every builder is inside its own temporary folder
        (folder / "blob").write_bytes(os.urandom(1 << 16))
        return {"builder": threading.current_thread().name}

    def publish() -> None:
        try:
            results.append(_cache.publish("demo", "k", build, cache_dir=tmp_path))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=publish, name=f"b{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    entries = [r for r in results if isinstance(r, _cache.CacheEntry)]
    assert len(entries) == 4, results
    assert len({(e.meta["builder"], e.files["blob"]) for e in entries}) == 1
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["k"]  # no temporary folder left


def test_a_failed_build_publishes_nothing(tmp_path: Path) -> None:
    def build(folder: Path) -> None:
        (folder / "half").write_bytes(b"x")
        raise sharedml.ModelError("the builder failed")

    with pytest.raises(sharedml.ModelError, match="the builder failed"):
        _cache.publish("demo", "k", build, cache_dir=tmp_path)
    assert list((tmp_path / "demo").iterdir()) == []
    assert _cache.open_entry("demo", "k", cache_dir=tmp_path) is None


def test_an_unwritable_cache_folder_is_a_clear_cache_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(sharedml.CacheError, match="SHAREDML_CACHE_DIR") as info:
        sharedml.prepared_model_for(
            save_model(build_model(["initializer"]), tmp_path / "m.onnx"),
            cache_dir=blocker / "cache",
        )
    assert str(blocker / "cache") in str(info.value)


def test_verify_off_still_checks_the_graph(
    tmp_path: Path, forbid_reading: Callable[..., None]
) -> None:
    source = save_model(build_model(["initializer"], dim=64), tmp_path / "m.onnx")
    entry = sharedml.prepared_model_for(source, cache_dir=tmp_path / "c")
    os.chmod(entry, 0o644)
    graph = bytearray(entry.read_bytes())
    graph[-20] ^= 0x01
    entry.write_bytes(graph)
    with pytest.warns(RuntimeWarning, match="is damaged"):
        again = sharedml.prepared_model_for(source, cache_dir=tmp_path / "c", verify=False)
    assert again == entry
    with sharedml.SessionPool(source, sessions=1, cache_dir=tmp_path / "c") as pool:
        assert pool.run(None, feeds(64))[0].shape == (1, 64)
