"""The cache owns every entry: one permission policy and one publish path for every kind.

Each kind of entry (prepared models, prepacked models, the demo model) and the stamps folder
get the same checks, so a rule cannot hold for one kind and be missing for another.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
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
            # (.lock: the in-use lock, not part of the entry)
            names = {p.name for p in entry.iterdir()} - {"entry.json", ".lock"}
            assert set(record["files"]) == names
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


KILLED_PREPACK = textwrap.dedent(
    r"""
    import os, signal, sys
    import sharedml
    from sharedml import _prepack

    def killed(*args, **kwargs):  # ORT has written the entry's files: die before publishing
        os.kill(os.getpid(), signal.SIGKILL)

    _prepack._drop_sharedml_metadata = killed
    sharedml.SessionPool(sys.argv[1], sessions=1, cache_dir=sys.argv[2])
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_a_killed_prepacked_build_leaves_a_folder_that_clear_stale_removes(
    mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_PREPACK, str(mlp_model), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    (leftover,) = (root / "prepacked").iterdir()  # nothing published, one dead build
    assert leftover.name.startswith(".") and leftover.name.endswith(".tmp")
    assert {p.name for p in leftover.iterdir()} >= {"model.onnx", "model.data"}
    assert _cache.clear_stale(root) == 0  # young: it could be a build still running
    os.utime(leftover, (1, 1))
    assert _cache.clear_stale(root) == 1
    assert list((root / "prepacked").iterdir()) == []
    use_every_kind(mlp_model, root).close()  # and the next pool builds the entry


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
@pytest.mark.parametrize("kind", ("models", "prepacked"))
def test_another_user_who_creates_a_kind_folder_first_is_not_trusted(
    kind: str, mlp_model: Path, tmp_path: Path, other_user: Callable[[Callable[[], None]], None]
) -> None:
    # A sticky, world-writable cache root is accepted (like /tmp); another user gets there first.
    root = Path(tempfile.mkdtemp(prefix="sharedml-shared-cache-"))
    try:
        os.chmod(root, 0o1777)

        def plant() -> None:
            folder = root / kind
            folder.mkdir(mode=0o777)
            os.chmod(folder, 0o777)
            (folder / "planted").mkdir()
            (folder / "planted" / "entry.json").write_text("{}")

        other_user(plant)
        with pytest.raises(sharedml.CacheError, match=f"belongs to user id {other_user.uid}"):  # type: ignore[attr-defined]
            use_every_kind(mlp_model, root)
    finally:
        shutil.rmtree(root)


# --------------------------------------------------------------------------------------------
# Managing the cache: sharedml cache info / list / verify / prune / clear

HOLDER = r"""
import sys, sharedml
pool = sharedml.SessionPool(sys.argv[1], sessions=1, cache_dir=sys.argv[2])
print(pool.mechanism, flush=True)
sys.stdin.readline()  # hold the pool (and its maps) until the parent says so
pool.close()
"""


def cache_cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sharedml", "cache", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SHAREDML_CACHE_DIR": str(root)},
    )


def test_list_and_info_report_every_entry_with_its_source_size_and_ort_build(
    mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    use_every_kind(mlp_model, root).close()
    entries = {e.kind: e for e in _cache.list_entries(cache_dir=root)}
    assert set(entries) == {"models", "prepacked", "demo"}
    for e in entries.values():
        on_disk = sum(p.stat().st_size for p in e.path.iterdir())
        assert e.size_bytes == on_disk and e.problem is None
        assert e.last_used is not None and e.created is not None
    assert entries["models"].source == str(mlp_model)
    assert entries["prepacked"].source == f"{mlp_model} (prepacked)"
    assert entries["prepacked"].ort is not None and ort.__version__ in entries["prepacked"].ort
    assert entries["models"].ort is None
    listed = json.loads(cache_cli(root, "list", "--json").stdout)
    assert {e["kind"] for e in listed} == {"models", "prepacked", "demo"}
    info = json.loads(cache_cli(root, "info", "--json").stdout)
    assert info["root"] == str(root)
    assert info["kinds"]["prepacked"] == {"entries": 1, "bytes": entries["prepacked"].size_bytes}
    assert info["size_bytes"] >= sum(e.size_bytes for e in entries.values())


def test_disk_use_per_model_is_what_the_readme_says(mlp_model: Path, tmp_path: Path) -> None:
    """README: the prepared copy is 1x the weights, the prepacked copy about 2x (fp32 MLP)."""
    root = tmp_path / "c"
    with sharedml.SessionPool(mlp_model, sessions=1, cache_dir=root) as pool:
        weights = pool.weights.nbytes
    sizes = {e.kind: e.size_bytes for e in _cache.list_entries(cache_dir=root)}
    assert 0.95 < sizes["models"] / weights < 1.1
    assert 1.8 < sizes["prepacked"] / weights < 2.2


def test_an_entry_a_live_process_maps_is_never_pruned(mlp_model: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(mlp_model), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "prepacked-file"  # the pool is open
        kept = _cache.prune_cache(max_bytes=0, cache_dir=root)
        assert {e.kind for e in kept.busy} == {"models", "prepacked"} and not kept.removed
        # Where there is no flock (Windows) only an attempt to remove an entry tells.
        busy = True if _cache.LOCKING else None
        assert all(e.busy is busy for e in _cache.list_entries(cache_dir=root))
        out = cache_cli(root, "clear")
        assert out.returncode == 0 and "in use by a live process" in out.stdout
        assert len(_cache.list_entries(cache_dir=root)) == 2
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    gone = _cache.prune_cache(max_bytes=0, cache_dir=root)
    assert {e.kind for e in gone.removed} == {"models", "prepacked"} and not gone.busy
    assert _cache.list_entries(cache_dir=root) == []
    with sharedml.SessionPool(mlp_model, sessions=1, cache_dir=root) as pool:  # built again
        assert pool.run(None, feeds_for(pool))[0].shape[0] == 1


def feeds_for(pool: sharedml.SessionPool) -> dict[str, np.ndarray]:
    (x,) = pool.get_inputs()
    return {x.name: np.ones([d if isinstance(d, int) else 1 for d in x.shape], np.float32)}


def test_this_process_holds_what_its_pools_map_until_they_are_gone(
    mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    pool = sharedml.SessionPool(mlp_model, sessions=1, cache_dir=root)
    assert _cache.prune_cache(max_bytes=0, cache_dir=root).removed == ()
    pool.close()
    del pool
    gc.collect()
    assert len(_cache.prune_cache(max_bytes=0, cache_dir=root).removed) == 2


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_a_closed_pool_keeps_no_session_alive(mlp_model: Path, tmp_path: Path) -> None:
    # ORT's sessions map the prepacked data file; nothing else does. (On Windows a session kept
    # alive keeps that file from being deleted or rewritten: see the damaged-entry test.)
    pool = use_every_kind(mlp_model, tmp_path / "c")
    data = str(pool.recipe.prepacked.model_path.parent / "model.data")
    assert [i.name for i in pool.get_inputs()] == ["input"]

    def mapped() -> bool:
        return data in Path("/proc/self/maps").read_text()

    assert mapped()
    pool.close()
    assert not mapped()
    assert [i.name for i in pool.get_inputs()] == ["input"]  # what the pool said, still said
    assert pool.get_modelmeta().graph_name == pool.get_modelmeta().graph_name


def write_file(name: str, data: bytes) -> Callable[[Path], None]:
    def build(tmp: Path) -> None:
        (tmp / name).write_bytes(data)

    return build


def test_prune_by_age_and_by_size_takes_the_least_recently_used_first(tmp_path: Path) -> None:
    root = tmp_path / "c"
    for i, age_days in enumerate((30, 10, 0)):
        entry = _cache.publish(
            "demo",
            f"e{i}",
            write_file("f", b"x" * (1000 + i)),
            cache_dir=root,
        )
        assert entry.hold is not None
        entry.hold.release()
        then = time.time() - age_days * 86400
        os.utime(entry.path / ".lock", (then, then))
    assert [e.key for e in _cache.list_entries(cache_dir=root)] == ["e0", "e1", "e2"]
    dry = _cache.prune_cache(older_than_s=20 * 86400, dry_run=True, cache_dir=root)
    assert [e.key for e in dry.removed] == ["e0"] and len(_cache.list_entries(cache_dir=root)) == 3
    out = cache_cli(root, "prune", "--older-than", "20")
    assert out.returncode == 0 and "removed 1 entries" in out.stdout, out.stdout + out.stderr
    out = cache_cli(root, "prune", "--max-size", "1.5K", "--json")
    assert [e["key"] for e in json.loads(out.stdout)["removed"]] == ["e1"]
    assert [e.key for e in _cache.list_entries(cache_dir=root)] == ["e2"]


def test_verify_reads_every_byte_and_prune_removes_what_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "c"
    entry = _cache.publish("demo", "k", write_file("f", b"a" * 4096), cache_dir=root)
    assert entry.hold is not None
    entry.hold.release()  # this process is done with it
    assert cache_cli(root, "verify").returncode == 0
    os.chmod(entry.path / "f", 0o644)
    (entry.path / "f").write_bytes(b"b" * 4096)  # same size: only the hash tells
    out = cache_cli(root, "verify")
    assert out.returncode == 1 and "DAMAGED demo/k" in out.stdout
    assert [e.problem is not None for e in _cache.verify_entries(cache_dir=root)] == [True]
    assert [e.key for e in _cache.prune_cache(older_than_s=1e9, cache_dir=root).removed] == []
    (entry.path / "f").write_bytes(b"short")  # a size mismatch: damaged without hashing
    assert [e.key for e in _cache.prune_cache(older_than_s=1e9, cache_dir=root).removed] == ["k"]


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_removal_never_follows_a_symlink_out_of_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "c"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_bytes(b"keep me" * 1000)
    entry = _cache.publish("demo", "k", write_file("f", b"a"), cache_dir=root)
    del entry  # its hold goes with it
    gc.collect()
    os.symlink(outside, root / "demo" / "k" / "link")  # planted inside an entry
    os.symlink(outside, root / "demo" / "planted")  # planted as an entry
    listed = {e.key: e for e in _cache.list_entries(cache_dir=root)}
    assert listed["planted"].problem is not None and "symlink" in listed["planted"].problem
    assert listed["k"].size_bytes < 1000 and listed["planted"].size_bytes < 1000
    assert _cache.cache_summary(cache_dir=root).size_bytes < 7000
    out = cache_cli(root, "clear")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (outside / "data").read_bytes() == b"keep me" * 1000
    assert _cache.list_entries(cache_dir=root) == []


def test_a_size_is_bytes_or_a_number_with_a_binary_unit() -> None:
    from sharedml._format import parse_bytes

    assert parse_bytes("123") == 123
    assert parse_bytes("1.5K") == 1536
    assert parse_bytes("500M") == 500 * 2**20 == parse_bytes("500MiB") == parse_bytes("500mb")
    assert parse_bytes("2G") == 2 * 2**30
    for bad in ("", "M", "-1G", "lots", "nan"):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(bad)
    assert "not a size" in cache_cli(Path("unused"), "prune", "--max-size", "lots").stderr
