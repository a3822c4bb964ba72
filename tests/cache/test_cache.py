"""The cache owns every entry: one permission policy and one publish path for every kind.

Each kind of entry (prepared models, prepacked models, the demo model) and the stamps folder
get the same checks, so a rule cannot hold for one kind and be missing for another.
"""

from __future__ import annotations

import gc
import json
import os
import re
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
import sharedml.cache
from sharedml.cache import Cache, _entries, _locks, _root
from sharedml.inspection._demo import demo_model_path

POSIX = os.name == "posix"
KINDS = ("models", "prepacked", "demo", "stamps")
# The prepacked kind is made only where ORT saves prepacked weights.
PREPACKED = pytest.param("prepacked", marks=pytest.mark.capability("prepacked-save"))
# Files these tests just wrote get stamps too, so that the stamps folder is used.
pytestmark = pytest.mark.usefixtures("no_racy_window")


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


@pytest.mark.capability("prepacked-save")
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
            record = json.loads((entry / _root.ENTRY_FILE).read_text())
            # (.lock: the in-use lock, not part of the entry)
            names = {p.name for p in entry.iterdir()} - {"entry.json", ".lock"}
            assert set(record["files"]) == names
            for file in entry.iterdir():
                assert mode(file) == 0o444, file
    assert mode(root / "stamps") == 0o700


@pytest.mark.capability("prepacked-save")
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
    with _locks.held_lock("a", cache=Cache(root)) as waited:
        assert 0 <= waited < 1  # free: taken at once
        assert mode(root / "locks") == 0o700 and mode(root / "locks" / "a.lock") == 0o600
    os.symlink(tmp_path / "planted", root / "locks" / "b.lock")
    with (
        pytest.raises(sharedml.CacheError, match=r"b\.lock"),
        _locks.held_lock("b", cache=Cache(root)),
    ):
        pass
    assert not (tmp_path / "planted").exists()


@pytest.mark.skipif(not POSIX, reason="symlinks")
@pytest.mark.parametrize("kind", ("models", PREPACKED, "demo"))
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
@pytest.mark.parametrize("kind", ("models", PREPACKED, "demo"))
def test_a_kind_folder_owned_by_another_user_is_refused(
    kind: str, mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    (root / kind).mkdir(parents=True, mode=0o700)
    os.chown(root / kind, 65534, 65534)
    with pytest.raises(sharedml.CacheError, match="belongs to user id 65534"):
        use_every_kind(mlp_model, root)


@pytest.mark.capability("prepacked-save")
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
            results.append(_entries.publish("demo", "k", build, cache=Cache(tmp_path)))
        except BaseException as exc:
            results.append(exc)

    threads = [threading.Thread(target=publish, name=f"b{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    entries = [r for r in results if isinstance(r, _entries.CacheEntry)]
    assert len(entries) == 4, results
    assert len({(e.meta["builder"], e.files["blob"]) for e in entries}) == 1
    assert [p.name for p in (tmp_path / "demo").iterdir()] == ["k"]  # no temporary folder left


def test_a_failed_build_publishes_nothing(tmp_path: Path) -> None:
    def build(folder: Path) -> None:
        (folder / "half").write_bytes(b"x")
        raise sharedml.ModelError("the builder failed")

    with pytest.raises(sharedml.ModelError, match="the builder failed"):
        _entries.publish("demo", "k", build, cache=Cache(tmp_path))
    assert list((tmp_path / "demo").iterdir()) == []
    assert _entries.open_entry("demo", "k", cache=Cache(tmp_path)) is None


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
    from sharedml.weights import _prepacked as _prepack

    def killed(*args, **kwargs):  # ORT has written the entry's files: die before publishing
        os.kill(os.getpid(), signal.SIGKILL)

    _prepack._drop_sharedml_metadata = killed
    sharedml.SessionPool(sys.argv[1], sessions=1, cache_dir=sys.argv[2])
    """
)


@pytest.mark.capability("prepacked-save")
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
@pytest.mark.parametrize(
    "command", [("clear",), ("prune", "--max-size", "0"), ("prune", "--older-than", "0")]
)
def test_what_a_killed_prepacked_build_left_goes_with_clear_and_prune(
    mlp_model: Path, tmp_path: Path, command: tuple[str, ...]
) -> None:
    # They left it: the folder is removed only once a day old, and the CLI says clear removes it.
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
    assert sharedml.cache.cache_summary(cache_dir=root).temporary[0] == 1
    out = cache_cli(root, *command)
    assert out.returncode == 0, out.stdout + out.stderr
    assert list((root / "prepacked").iterdir()) == []  # its process is gone: removed at once
    use_every_kind(mlp_model, root).close()  # and the next pool builds the entry


LIVE_BUILD = textwrap.dedent(
    r"""
    import sys
    from pathlib import Path
    from sharedml.cache import Cache, _entries

    def build(folder):
        (folder / "half").write_bytes(b"x" * 4096)
        print(folder.name, flush=True)
        sys.stdin.readline()  # still building until the parent says so
        return {}

    _entries.publish("demo", "k", build, cache=Cache(sys.argv[1]))
    """
)


@pytest.mark.skipif(not POSIX, reason="POSIX pids")
def test_a_live_builds_temporary_folder_is_never_removed(tmp_path: Path) -> None:
    root = tmp_path / "c"
    builder = subprocess.Popen(
        [sys.executable, "-c", LIVE_BUILD, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert builder.stdout is not None
        name = builder.stdout.readline().strip()
        assert name.startswith(".k-") and name.endswith(".tmp")
        # An older sharedml's names record no process: those go by age only.
        legacy_young = root / "demo" / ".k-abcdefgh.tmp"
        legacy_old = root / "demo" / ".k-ijklmnop.tmp"
        for folder in (legacy_young, legacy_old):
            folder.mkdir()
        os.utime(legacy_old, (1, 1))
        for command in (("clear",), ("prune", "--max-size", "0")):
            out = cache_cli(root, *command)
            assert out.returncode == 0, out.stdout + out.stderr
        assert _entries.clear_stale(Cache(root)) == 0
        assert sorted(p.name for p in (root / "demo").iterdir()) == sorted(
            [name, legacy_young.name]
        )
        os.utime(root / "demo" / name, (1, 1))  # a day old, and its builder lives: a pid reused?
        assert _entries.clear_stale(Cache(root)) == 1
        assert [p.name for p in (root / "demo").iterdir()] == [legacy_young.name]
    finally:
        builder.communicate("\n", timeout=60)


@pytest.mark.skipif(not POSIX, reason="POSIX permissions")
@pytest.mark.parametrize("kind", ("models", PREPACKED))
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
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SHAREDML_CACHE_DIR": str(root)},
    )


@pytest.mark.capability("prepacked-save")
def test_list_and_info_report_every_entry_with_its_source_size_and_ort_build(
    mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    use_every_kind(mlp_model, root).close()
    entries = {e.kind: e for e in sharedml.cache.list_entries(cache_dir=root)}
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


@pytest.mark.capability("prepacked-save")
def test_disk_use_per_model_is_what_the_readme_says(mlp_model: Path, tmp_path: Path) -> None:
    """README: the prepared copy is 1x the weights, the prepacked copy about 2x (fp32 MLP)."""
    root = tmp_path / "c"
    with sharedml.SessionPool(mlp_model, sessions=1, cache_dir=root) as pool:
        weights = pool.weights.nbytes
    sizes = {e.kind: e.size_bytes for e in sharedml.cache.list_entries(cache_dir=root)}
    assert 0.95 < sizes["models"] / weights < 1.1
    assert 1.8 < sizes["prepacked"] / weights < 2.2


@pytest.mark.capability("prepacked-save")
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
        kept = sharedml.cache.prune_cache(max_bytes=0, cache_dir=root)
        assert {e.kind for e in kept.busy} == {"models", "prepacked"} and not kept.removed
        # Where there is no flock (Windows) only an attempt to remove an entry tells.
        busy = True if sharedml.cache.LOCKING else None
        assert all(e.busy is busy for e in sharedml.cache.list_entries(cache_dir=root))
        out = cache_cli(root, "clear")
        assert out.returncode == 0 and "in use by a live process" in out.stdout
        assert len(sharedml.cache.list_entries(cache_dir=root)) == 2
    finally:
        holder.communicate("\n", timeout=60)
    assert holder.returncode == 0
    gone = sharedml.cache.prune_cache(max_bytes=0, cache_dir=root)
    assert {e.kind for e in gone.removed} == {"models", "prepacked"} and not gone.busy
    assert sharedml.cache.list_entries(cache_dir=root) == []
    with sharedml.SessionPool(mlp_model, sessions=1, cache_dir=root) as pool:  # built again
        assert pool.run(None, feeds_for(pool))[0].shape[0] == 1


def feeds_for(pool: sharedml.SessionPool) -> dict[str, np.ndarray]:
    (x,) = pool.get_inputs()
    return {x.name: np.ones([d if isinstance(d, int) else 1 for d in x.shape], np.float32)}


@pytest.mark.capability("prepacked-save")
def test_this_process_holds_what_its_pools_map_until_they_are_gone(
    mlp_model: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    pool = sharedml.SessionPool(mlp_model, sessions=1, cache_dir=root)
    assert sharedml.cache.prune_cache(max_bytes=0, cache_dir=root).removed == ()
    pool.close()
    del pool
    gc.collect()
    assert len(sharedml.cache.prune_cache(max_bytes=0, cache_dir=root).removed) == 2


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
        entry = _entries.publish(
            "demo",
            f"e{i}",
            write_file("f", b"x" * (1000 + i)),
            cache=Cache(root),
        )
        assert entry.hold is not None
        entry.hold.release()
        then = time.time() - age_days * 86400
        os.utime(entry.path / ".lock", (then, then))
    assert [e.key for e in sharedml.cache.list_entries(cache_dir=root)] == ["e0", "e1", "e2"]
    dry = sharedml.cache.prune_cache(older_than_s=20 * 86400, dry_run=True, cache_dir=root)
    assert [e.key for e in dry.removed] == ["e0"] and len(
        sharedml.cache.list_entries(cache_dir=root)
    ) == 3
    out = cache_cli(root, "prune", "--older-than", "20")
    assert out.returncode == 0 and "removed 1 entries" in out.stdout, out.stdout + out.stderr
    out = cache_cli(root, "prune", "--max-size", "1.5K", "--json")
    assert [e["key"] for e in json.loads(out.stdout)["removed"]] == ["e1"]
    assert [e.key for e in sharedml.cache.list_entries(cache_dir=root)] == ["e2"]


def test_verify_reads_every_byte_and_prune_removes_what_is_damaged(tmp_path: Path) -> None:
    root = tmp_path / "c"
    entry = _entries.publish("demo", "k", write_file("f", b"a" * 4096), cache=Cache(root))
    assert entry.hold is not None
    entry.hold.release()  # this process is done with it
    assert cache_cli(root, "verify").returncode == 0
    os.chmod(entry.path / "f", 0o644)
    (entry.path / "f").write_bytes(b"b" * 4096)  # same size: only the hash tells
    out = cache_cli(root, "verify")
    assert out.returncode == 1 and "DAMAGED demo/k" in out.stdout
    assert [e.problem is not None for e in sharedml.cache.verify_entries(cache_dir=root)] == [True]
    assert [
        e.key for e in sharedml.cache.prune_cache(older_than_s=1e9, cache_dir=root).removed
    ] == []
    (entry.path / "f").write_bytes(b"short")  # a size mismatch: damaged without hashing
    assert [
        e.key for e in sharedml.cache.prune_cache(older_than_s=1e9, cache_dir=root).removed
    ] == ["k"]


@pytest.mark.skipif(not POSIX, reason="symlinks")
def test_removal_never_follows_a_symlink_out_of_the_cache(tmp_path: Path) -> None:
    root = tmp_path / "c"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_bytes(b"keep me" * 1000)
    entry = _entries.publish("demo", "k", write_file("f", b"a"), cache=Cache(root))
    del entry  # its hold goes with it
    gc.collect()
    os.symlink(outside, root / "demo" / "k" / "link")  # planted inside an entry
    os.symlink(outside, root / "demo" / "mlp-v9")  # planted as an entry (a key's name)
    os.symlink(outside, root / "demo" / "planted")  # not sharedml's: left as it is
    listed = {e.key: e for e in sharedml.cache.list_entries(cache_dir=root)}
    assert listed["mlp-v9"].problem is not None and "symlink" in listed["mlp-v9"].problem
    assert listed["planted"].foreign and not listed["mlp-v9"].foreign
    assert all(e.size_bytes < 1000 for e in listed.values())
    assert sharedml.cache.cache_summary(cache_dir=root).size_bytes < 7000
    out = cache_cli(root, "clear")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (outside / "data").read_bytes() == b"keep me" * 1000
    assert [(e.key, e.foreign) for e in sharedml.cache.list_entries(cache_dir=root)] == [
        ("planted", True)
    ]
    assert os.path.islink(root / "demo" / "planted")


def test_a_size_is_bytes_or_a_number_with_a_binary_unit() -> None:
    from sharedml._units import parse_bytes

    assert parse_bytes("123") == 123
    assert parse_bytes("1.5K") == 1536
    assert parse_bytes("500M") == 500 * 2**20 == parse_bytes("500MiB") == parse_bytes("500mb")
    assert parse_bytes("2G") == 2 * 2**30
    for bad in ("", "M", "-1G", "lots", "nan"):
        with pytest.raises(ValueError, match="not a size"):
            parse_bytes(bad)
    assert "not a size" in cache_cli(Path("unused"), "prune", "--max-size", "lots").stderr


# --------------------------------------------------------------------------------------------
# A folder that is not sharedml's, and what sharedml did not make inside its own


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root``: its mode and size (what an adopter could change)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            st = os.lstat(os.path.join(folder, name))
            found[os.path.relpath(os.path.join(folder, name), root)] = (st.st_mode, st.st_size)
    return found


def data_folder(root: Path) -> Path:
    """A folder of someone's data that happens to have a ``models`` folder."""
    (root / "models" / "bert").mkdir(parents=True)
    (root / "models" / "resnet").mkdir()
    (root / "models" / "bert" / "weights.bin").write_bytes(b"w" * 1000)
    (root / "models" / "README.txt").write_text("our models\n")
    os.chmod(root / "models", 0o755)
    return root


def test_a_folder_of_other_data_is_never_adopted_as_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SHAREDML_CACHE_DIR=/data: one pool made /data/models 0700, and 'cache prune' removed
    # models/bert, models/resnet and models/README.txt as damaged entries.
    data = data_folder(tmp_path / "data")
    before = tree(data)
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(data))
    source = save_model(build_model(["initializer"]), tmp_path / "m.onnx")
    with pytest.raises(sharedml.CacheError, match="sharedml did not create") as info:
        sharedml.SessionPool(source, sessions=1)
    assert str(data) in str(info.value) and "SHAREDML_CACHE_DIR" in str(info.value)
    for command in (
        ("prune", "--older-than", "30"),
        ("prune", "--max-size", "0"),
        ("clear",),
        ("list",),
        ("verify",),
        ("info",),
    ):
        out = cache_cli(data, *command)
        assert out.returncode == 1 and "sharedml did not create" in out.stderr, command
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert tree(data) == before


# Windows: entries are read-only files that rmtree cannot remove, and NTFS file ids are not
# handed out again soon.
@pytest.mark.skipif(not POSIX, reason="inode numbers as POSIX file systems reuse them")
def test_a_data_folder_given_the_inode_of_a_removed_cache_is_not_taken_for_it(
    tmp_path: Path,
) -> None:
    # A process remembers the cache folders it checked. Keyed by (device, inode) alone, a data
    # folder made after a cache was removed, with the inode that cache had, was adopted.
    source = save_model(build_model(["initializer"]), tmp_path / "m.onnx")
    cache = tmp_path / "cache"
    with sharedml.SessionPool(source, sessions=1, cache_dir=cache):  # closed: nothing held open
        pass
    inode = cache.stat().st_ino
    shutil.rmtree(cache)
    for i in range(1000):
        data = tmp_path / f"data{i}"
        data.mkdir()
        if data.stat().st_ino == inode:
            break
    else:
        pytest.skip("this file system gave no folder the removed cache's inode in 1000 tries")
    data_folder(data)
    before = tree(data)
    with pytest.raises(sharedml.CacheError, match="sharedml did not create"):
        sharedml.SessionPool(source, sessions=1, cache_dir=data)
    assert tree(data) == before


def test_an_empty_folder_or_a_cache_without_its_marker_is_adopted(
    mlp_model: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    sharedml.prepared_model_for(mlp_model, cache_dir=empty)
    assert (empty / _root.MARKER_FILE).read_text().startswith("Signature: 8a477f597d28d172")
    # A cache an earlier sharedml made (no marker) holds only what sharedml makes: adopted.
    older = tmp_path / "older"
    use_every_kind(mlp_model, older).close()
    (older / _root.MARKER_FILE).unlink()
    again = subprocess.run(  # a new process: this one remembers the folder it adopted
        [sys.executable, "-c", HOLDER, str(mlp_model), str(older)],
        input="\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0 and "prepacked-file" in again.stdout, again.stderr[-3000:]
    assert (older / _root.MARKER_FILE).is_file()


def test_what_sharedml_did_not_make_in_its_cache_is_reported_and_left_alone(
    tmp_path: Path,
) -> None:
    root = tmp_path / "c"
    entry = _entries.publish("demo", "k", write_file("f", b"a" * 4096), cache=Cache(root))
    del entry
    gc.collect()
    data_folder(root)  # someone's files inside the cache's own models/ folder
    (root / "stamps").mkdir(mode=0o700)
    (root / "stamps" / "notes.txt").write_text("mine")
    before = {k: v for k, v in tree(root).items() if k.startswith(("models", "stamps"))}
    outputs = {
        command: cache_cli(root, *command)
        for command in (("list",), ("verify",), ("prune", "--older-than", "0"), ("clear",))
    }
    assert {k: v for k, v in tree(root).items() if k.startswith(("models", "stamps"))} == before
    assert not (root / "demo" / "k").exists()  # sharedml's own entry went
    for command, out in outputs.items():
        assert out.returncode == 0, (command, out.stdout, out.stderr)
        assert "README.txt" in out.stdout and "DAMAGED" not in out.stdout, out.stdout
    assert outputs[("list",)].stdout.count("not made by sharedml") == 3
    listed = sharedml.cache.list_entries(cache_dir=root)
    assert sorted(e.key for e in listed if e.foreign) == ["README.txt", "bert", "resnet"]
    assert sharedml.cache.cache_summary(cache_dir=root).foreign[0] == 3


# --------------------------------------------------------------------------------------------
# Files hard-linked between entries count once


def du(root: Path) -> int:
    """Bytes of the files under ``root``, each inode once (what ``du`` counts, less folders)."""
    seen = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def borrowing_entries(root: Path, borrowers: int) -> list[str]:
    """Entry ``a`` with a 64 KiB file, then ``borrowers`` entries that link it.

    Each borrower has 1 KiB of its own; they were last used in that order, and none is held.
    Returns the keys, oldest first.
    """
    lender = _entries.publish(
        "demo", "a", write_file("w", os.urandom(64 * 1024)), cache=Cache(root)
    )
    keys = ["a"]
    for i in range(borrowers):

        def build(tmp: Path, i: int = i, lender: _entries.CacheEntry = lender) -> None:
            (tmp / "x").write_bytes(bytes([i]) * 1024)
            assert lender.link_file("w", tmp, "shared-", ".bin") is not None

        _entries.publish("demo", f"b{i}", build, cache=Cache(root))
        keys.append(f"b{i}")
    del lender
    gc.collect()
    for age, key in enumerate(reversed(keys)):
        then = time.time() - 3600 * (age + 1)
        os.utime(root / "demo" / key / ".lock", (then, then))
    return keys


def test_info_and_list_count_a_file_linked_by_several_entries_once(tmp_path: Path) -> None:
    # info said 140 MiB where du said 93: each entry's link counted in full.
    root = tmp_path / "c"
    borrowing_entries(root, 4)
    on_disk = du(root)
    summary = sharedml.cache.cache_summary(cache_dir=root)
    assert summary.size_bytes == on_disk
    assert summary.kinds["demo"][1] <= on_disk < 2 * 64 * 1024
    info = json.loads(cache_cli(root, "info", "--json").stdout)
    assert info["size_bytes"] == on_disk
    assert sharedml.cache.disk_bytes(sharedml.cache.list_entries(cache_dir=root)) == du(
        root / "demo"
    )
    out = cache_cli(root, "list").stdout
    assert "on disk" in out and "SIGBUS" in out and "cp" in out  # the linked-file hazard


def test_prune_to_a_size_counts_linked_files_once_and_stops_at_the_target(
    tmp_path: Path,
) -> None:
    # 'prune --max-size 100M' with 93 MiB on disk removed entries and freed nothing, and with
    # 500M it removed 35 entries and left 273 MB: sizes counted each link in full.
    root = tmp_path / "c"
    keys = borrowing_entries(root, 4)
    entries = du(root / "demo")
    kept = cache_cli(root, "prune", "--max-size", str(entries), "--json")
    assert json.loads(kept.stdout)["removed"] == [], kept.stdout + kept.stderr
    # 512 bytes over the target: the oldest entry frees only its record (its big file is
    # still linked), so the next goes too, and then the oldest is not needed any more.
    target = entries - 512
    result = json.loads(cache_cli(root, "prune", "--max-size", str(target), "--json").stdout)
    assert [e["key"] for e in result["removed"]] == ["b0"]
    assert du(root / "demo") <= target
    assert result["freed_bytes"] == entries - du(root / "demo")
    assert sorted(p.name for p in (root / "demo").iterdir()) == sorted(set(keys) - {"b0"})
    # Down to what the newest entry needs alone: each removal frees its share, and the big
    # file goes with its last link.
    last = sharedml.cache.list_entries(cache_dir=root)[-1]
    assert last.key == keys[-1]
    before = du(root / "demo")
    removal = sharedml.cache.prune_cache(
        max_bytes=sharedml.cache.disk_bytes([last]), cache_dir=root
    )
    assert [e.key for e in sharedml.cache.list_entries(cache_dir=root)] == [keys[-1]]
    assert removal.freed_bytes == before - du(root / "demo")


# --------------------------------------------------------------------------------------------
# A removal between a pool's lookup of its entry and its hold on it


def test_a_clear_between_a_pools_lookup_and_its_mapping_does_not_fail_the_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lookup returned a path and dropped the entry: a 'sharedml cache clear' in another
    # process then removed it, and the pool failed with ModelNotFoundError.
    root = tmp_path / "c"
    source = save_model(build_model(["initializer"], dim=64), tmp_path / "m.onnx")
    real_open = sharedml.weights.WeightStore.open.__func__  # type: ignore[attr-defined]
    cleared: list[str] = []

    def open_after_a_clear(cls: type, model_path: Path, **kwargs: object) -> object:
        if not cleared:
            out = cache_cli(root, "clear")
            cleared.append(out.stdout)
        return real_open(cls, model_path, **kwargs)

    monkeypatch.setattr(sharedml.weights.WeightStore, "open", classmethod(open_after_a_clear))
    with sharedml.SessionPool(source, sessions=1, cache_dir=root, prepacking="off") as pool:
        assert pool.run(None, feeds(64))[0].shape == (1, 64)
    assert "in use by a live process" in cleared[0]


# --------------------------------------------------------------------------------------------
# What 'sharedml cache' shows


def test_an_entry_names_its_source_by_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It kept the path as the first pool was given it ('models/x.onnx'), which 'cache list'
    # then showed from any folder.
    save_model(build_model(["initializer"], dim=64), tmp_path / "models" / "x.onnx")
    monkeypatch.chdir(tmp_path)
    with sharedml.SessionPool(Path("models/x.onnx"), sessions=1, prepacking="off"):
        pass
    (entry,) = [e for e in sharedml.cache.list_entries() if e.kind == "models"]
    assert entry.source == str(tmp_path / "models" / "x.onnx")


def test_keys_show_at_one_length_and_any_unique_start_of_one_selects_it(tmp_path: Path) -> None:
    # 'list' showed 16 hex digits, 'verify' 64 or 32.
    root = tmp_path / "c"
    source = save_model(build_model(["initializer"], dim=64), tmp_path / "m.onnx")
    subprocess.run(
        [sys.executable, "-c", HOLDER, str(source), str(root)],
        input="\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    keys = {e.kind: e.key for e in sharedml.cache.list_entries(cache_dir=root)}
    assert set(keys) == {"models", "prepacked"}
    shown = {f"{kind}/{key[:16]}" for kind, key in keys.items()}
    listed = cache_cli(root, "list").stdout
    verified = cache_cli(root, "verify").stdout
    for kind, key in keys.items():
        assert key[:16] in listed and key not in listed
        assert f"{kind}/{key[:16]}" in verified and key not in verified
    assert set(re.findall(r"(?:models|prepacked)/[0-9a-f]+", verified)) == shown
    one = cache_cli(root, "verify", keys["models"][:6])
    assert one.returncode == 0 and "1 of 1 entries intact" in one.stdout, one.stdout + one.stderr
    prefix = f"prepacked/{keys['prepacked'][:5]}"
    listed_one = json.loads(cache_cli(root, "list", "--json", prefix).stdout)
    assert [e["key"] for e in listed_one] == [keys["prepacked"]]
    unknown = cache_cli(root, "verify", "zz")
    assert unknown.returncode == 1 and "starting with 'zz'" in unknown.stderr


def test_a_key_start_that_names_several_entries_is_refused() -> None:
    def status(kind: str, key: str) -> sharedml.cache.EntryStatus:
        return sharedml.cache.EntryStatus(kind, key, Path(key), 0, None, None, None, None, None)

    entries = [status("models", "ab12" + "0" * 60), status("prepacked", "ab34" + "0" * 28)]
    with pytest.raises(ValueError, match="2 cache entries have keys starting with 'ab'"):
        sharedml.cache.select_entries(entries, ["ab"])
    assert sharedml.cache.select_entries(entries, ["prepacked/ab", "ab1"]) == entries[::-1]


@pytest.mark.skipif(not POSIX, reason="SIGPIPE")
def test_a_reader_that_leaves_early_gets_no_broken_pipe_error(tmp_path: Path) -> None:
    # 'sharedml cache info | head -2' ended with "sharedml: error: [Errno 32] Broken pipe".
    root = tmp_path / "c"
    _entries.publish("demo", "k", write_file("f", b"a"), cache=Cache(root))
    for command in (("info",), ("list",), ("list", "--json")):
        proc = subprocess.Popen(
            [sys.executable, "-m", "sharedml", "cache", *command],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "SHAREDML_CACHE_DIR": str(root)},
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the first line
        with proc.stderr:
            err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 128 + signal.SIGPIPE, err
        assert err == "", err


# --------------------------------------------------------------------------------------------
# The Cache object: resolved once, carried to everything that uses it


def test_a_cache_object_keeps_the_folder_it_was_resolved_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(first))
    cache = Cache.at(None)
    assert Cache.at(cache) is cache  # a Cache passed on is not resolved again
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(second))
    demo = demo_model_path(cache_dir=cache)
    source = save_model(build_model(["initializer"]), tmp_path / "m.onnx")
    with sharedml.SessionPool(source, sessions=1, cache_dir=cache) as pool:
        assert pool.run(None, feeds(64))[0].shape == (1, 64)
    assert demo.is_relative_to(first)
    assert [e.kind for e in sharedml.cache.list_entries(cache_dir=cache)].count("models") == 1
    assert not second.exists()


def test_a_weight_store_verifies_against_the_cache_it_was_opened_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The store is opened unverified, and verified later, after $SHAREDML_CACHE_DIR changed:
    # the stamp of that check belongs in the store's cache, not in whatever the variable names
    # by then (which nothing else of this store uses).
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(first))
    source = save_model(build_model(["initializer"], seed=7), tmp_path / "m.onnx")
    prepared = sharedml.prepare(source, tmp_path / "prepared.onnx").model_path
    store = sharedml.weights.WeightStore.open(prepared, verify=False)
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(second))
    assert sharedml.weights.WeightStore.open(prepared, verify=True) is store
    assert store.verified
    if os.name != "nt":  # Windows keeps no stamps: its st_ctime does not move on writes
        assert list((first / "stamps").iterdir())
    assert not second.exists()
    store.close()


def test_the_default_folder_is_the_platforms_user_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import platformdirs
    import platformdirs.windows

    monkeypatch.delenv("SHAREDML_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert sharedml.cache_dir() == tmp_path / "xdg" / "sharedml"
        monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty: unset, as the XDG spec says
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert sharedml.cache_dir() == tmp_path / "home" / ".cache" / "sharedml"
    # Windows' rules (the local application data folder, which platformdirs reads from the
    # environment where this is not Windows: its override variable since 4.x, %LOCALAPPDATA%
    # before): %LOCALAPPDATA%\sharedml, as before platformdirs named it; no author folder, no
    # "Cache" folder below it.
    for name in ("WIN_PD_OVERRIDE_LOCAL_APPDATA", "LOCALAPPDATA"):
        monkeypatch.setenv(name, r"C:\Users\u\AppData\Local")
    monkeypatch.setattr(platformdirs, "PlatformDirs", platformdirs.windows.Windows)
    assert str(sharedml.cache_dir()) == os.path.join(r"C:\Users\u\AppData\Local", "sharedml")
    assert sharedml.cache_dir(tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.setenv("SHAREDML_CACHE_DIR", str(tmp_path / "env"))
    assert sharedml.cache_dir() == tmp_path / "env"
