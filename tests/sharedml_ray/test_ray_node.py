"""sharedml.ray's node pieces without a cluster: prepared once per node, local copies, pools.

Replicas of one node are processes sharing a cache folder; here they are plain processes that
start at the same moment, which is what Serve does when it places several replicas on a node.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import ipaddress
import json
import multiprocessing
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from _models import build_model, save_model

import sharedml
import sharedml.cache
import sharedml.ray
from sharedml._host import _filesystems
from sharedml.cache import Cache, _entries, _locks
from sharedml.pool._calibrate import candidate_splits
from sharedml.ray import NodeModel, create_pool, prepare_on_node
from sharedml.ray import _node as node_module

ROOT = Path(__file__).resolve().parents[2]
JOIN_S = 120  # seconds: far above any legitimate wait; reaching it means a hang


@pytest.fixture(scope="module")
def mlp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("mlp")
    return Path(mlp(folder / "mlp.onnx", target_bytes=4 * 2**20, width=512).path)


# --------------------------------------------------------------------------------------------
# Replicas starting together on a node prepare once


def _replica(model: str, cache: str, log: str, start: Any, results: Any) -> None:
    """One replica process: open the node's pool once ``start`` lets every replica go."""
    import sharedml.ray
    from sharedml.prepared import _prepare

    publish, prepare = _entries.publish, _prepare.prepare

    # Both builds are slowed down: every replica reaches the cache while one is still building.
    def slow(what: str, build: Callable[..., Any]) -> Callable[..., Any]:
        def logged(*args: Any, **kwargs: Any) -> Any:
            with open(log, "a") as fh:
                fh.write(f"{what(*args)} {os.getpid()}\n")
            time.sleep(0.5)
            return build(*args, **kwargs)

        return logged

    _entries.publish = slow(lambda kind, *_: f"publish {kind}", publish)
    _prepare.prepare = slow(lambda *_: "prepare", prepare)
    start.wait(JOIN_S)
    pool, node = sharedml.ray.create_pool(model, sessions=1, cache_dir=cache)
    with pool:
        pool.run(None, {"input": np.ones((1, 512), np.float32)})
    results.put(node.to_dict())


def start_replicas(n: int, model: Path, cache: Path, log: Path) -> list[dict[str, Any]]:
    """Start ``n`` processes that open a pool over ``model`` at the same moment."""
    context = multiprocessing.get_context("spawn")  # as Ray starts workers: fresh interpreters
    start, results = context.Barrier(n), context.Queue()
    procs = [
        context.Process(target=_replica, args=(str(model), str(cache), str(log), start, results))
        for _ in range(n)
    ]
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=JOIN_S) for _ in procs]
    finally:
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()
        assert [p.exitcode for p in procs] == [0] * n


@pytest.mark.capability("prepacked-save")
@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX flock")
def test_replicas_starting_together_prepare_and_derive_once(
    mlp_model: Path, tmp_path: Path
) -> None:
    cache, log = tmp_path / "node-cache", tmp_path / "log"
    reports = start_replicas(3, mlp_model, cache, log)

    events = log.read_text().split("\n")[:-1]
    # One prepare and one prepacked build on the node, by one replica; the others only mapped.
    assert sorted(e.rsplit(" ", 1)[0] for e in events) == [
        "prepare",
        "publish models",
        "publish prepacked",
    ], events
    assert len({e.rsplit(" ", 1)[1] for e in events}) == 1
    builders = [r for r in reports if r["built"]]
    assert len(builders) == 1 and len(builders[0]["published"]) == 2
    assert {Path(p).parent.name for p in builders[0]["published"]} == {"models", "prepacked"}
    assert all(r["published"] == [] for r in reports if not r["built"])
    assert max(r["waited_s"] for r in reports) > 0.4  # the others really waited their turn
    assert len({r["path"] for r in reports}) == 1
    assert Path(reports[0]["path"]).is_relative_to(cache / "models")
    assert len(list((cache / "models").iterdir())) == 1

    # A replica started later (a replacement) prepares nothing: it maps the node's file.
    (again,) = start_replicas(1, mlp_model, cache, tmp_path / "log2")
    assert again["published"] == [] and again["path"] == reports[0]["path"]
    assert not (tmp_path / "log2").exists()


def test_prepare_on_node_reports_what_it_built(mlp_model: Path, tmp_path: Path) -> None:
    first = prepare_on_node(mlp_model, cache_dir=tmp_path / "c")
    assert first.built and not first.copied
    assert first.path.is_relative_to(tmp_path / "c" / "models")
    assert first.weights_path == first.path.with_suffix(".weights")
    second = prepare_on_node(mlp_model, cache_dir=tmp_path / "c")
    assert not second.built and second.path == first.path
    as_bytes = prepare_on_node(mlp_model.read_bytes(), cache_dir=tmp_path / "c")
    # the same model as bytes is keyed as prepare keys what it reads: the same entry, not rebuilt
    assert as_bytes.source == "<model bytes>" and not as_bytes.built
    assert as_bytes.path == first.path
    assert json.loads(json.dumps(first.to_dict()))["built"] is True


def test_lock_timeout_names_the_lock(mlp_model: Path, tmp_path: Path) -> None:
    name = node_module._lock_name(mlp_model)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from sharedml.cache import Cache, _locks\n"
            f"with _locks.held_lock({name!r}, cache=Cache({str(tmp_path)!r})):\n"
            "    print('held', flush=True); sys.stdin.readline()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        errors: list[BaseException] = []

        def wait_for_the_lock() -> None:
            try:
                prepare_on_node(mlp_model, cache_dir=tmp_path, lock_timeout_s=0.3)
            except BaseException as exc:
                errors.append(exc)

        waiter = threading.Thread(target=wait_for_the_lock, daemon=True)
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive(), "lock_timeout_s=0.3 still waiting after 10 s"
        assert len(errors) == 1 and isinstance(errors[0], sharedml.CacheError), errors
        assert re.search(r"locks[/\\]prepare-.*\.lock.*for more than 0\.3 s", str(errors[0]))
    finally:
        holder.kill()  # a killed holder holds nothing: the OS drops its lock (flock, or
        # on Windows the byte-range lock filelock takes)
        holder.wait(JOIN_S)
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
    assert prepare_on_node(mlp_model, cache_dir=tmp_path, lock_timeout_s=10).built


def test_lock_names_must_be_plain_file_names(tmp_path: Path) -> None:
    for bad in ("", "../x", "a/b", ".hidden"):
        lock = _locks.held_lock(bad, cache=Cache(tmp_path))
        with pytest.raises(ValueError, match="plain file name"), lock:
            pass


# --------------------------------------------------------------------------------------------
# A prepared model on shared storage is copied to the node's disk


MOUNTINFO = textwrap.dedent(
    r"""
    22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
    30 22 0:40 / /mnt/models rw,relatime shared:9 - nfs4 server:/export rw,vers=4.2
    31 30 0:41 / /mnt/models/local rw - ext4 /dev/sdb1 rw
    32 22 0:42 / /mnt/my\040bucket rw - fuse.s3fs s3fs rw
    33 22 0:43 / /media/usb rw - fuseblk /dev/sdc1 rw
    bad line without separator
    """
)


@pytest.mark.parametrize(
    ("path", "fstype", "remote"),
    [
        ("/srv/model.onnx", "ext4", False),
        ("/mnt/models/bert/model.onnx", "nfs4", True),
        ("/mnt/models", "nfs4", True),
        ("/mnt/modelsX/m.onnx", "ext4", False),  # a sibling, not inside the mount
        ("/mnt/models/local/m.onnx", "ext4", False),  # a local mount inside a remote one
        ("/mnt/my bucket/m.onnx", "fuse.s3fs", True),
        ("/media/usb/m.onnx", "fuseblk", False),
    ],
)
@pytest.mark.skipif(sys.platform != "linux", reason="mountinfo and its paths are Linux's")
def test_filesystem_type_from_mountinfo(path: str, fstype: str, remote: bool) -> None:
    assert _filesystems.filesystem_type(path, mountinfo=MOUNTINFO) == fstype
    assert _filesystems.is_remote_filesystem(fstype) is remote


@pytest.mark.skipif(sys.platform != "linux", reason="mountinfo is Linux's")
def test_filesystem_type_of_this_machine() -> None:
    if not Path("/proc/self/mountinfo").exists():
        assert _filesystems.filesystem_type(ROOT) is None
    else:
        assert _filesystems.filesystem_type("/proc/self") == "proc"
    assert not _filesystems.is_remote_filesystem(None)


@pytest.fixture
def shared_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder that sharedml.ray sees as an NFS mount; everything else is local ext4."""
    shared = tmp_path / "nfs"
    shared.mkdir()

    def fake_type(path: str | os.PathLike[str]) -> str:
        return "nfs4" if Path(os.path.realpath(path)).is_relative_to(shared) else "ext4"

    monkeypatch.setattr(node_module, "filesystem_type", fake_type)
    return shared


@pytest.mark.capability("prepacked-save")
def test_prepared_model_on_shared_storage_is_copied_to_the_node(
    shared_storage: Path, tmp_path: Path
) -> None:
    src = save_model(build_model(["initializer"] * 2, dim=64), tmp_path / "m.onnx")
    prepared = sharedml.prepare(src, shared_storage / "m.onnx").model_path
    node = prepare_on_node(prepared, cache_dir=tmp_path / "cache")
    assert node.copied and node.built
    assert node.path.is_relative_to(tmp_path / "cache" / "models")
    assert node.weights_path.stat().st_size == prepared.with_suffix(".weights").stat().st_size
    again = prepare_on_node(prepared, cache_dir=tmp_path / "cache")
    assert again.path == node.path and again.copied and not again.built
    pool, opened = create_pool(prepared, sessions=1, cache_dir=tmp_path / "cache")
    with pool:
        assert pool.model_path == opened.path == node.path  # the node's copy, not the share
        # The node's copy was reused; opening the pool derived ORT's prepacked form, once.
        assert [p.parent.name for p in opened.published] == ["prepacked"]
    # Asked not to copy, it is used where it lies; a prepared local model is never copied.
    kept = prepare_on_node(prepared, cache_dir=tmp_path / "cache", local_copy=False)
    assert kept.path == prepared and not kept.copied
    local = sharedml.prepare(src, tmp_path / "local" / "m.onnx").model_path
    assert prepare_on_node(local, cache_dir=tmp_path / "cache").path == local
    forced = prepare_on_node(local, cache_dir=tmp_path / "cache", local_copy=True)
    assert forced.copied and forced.path.is_relative_to(tmp_path / "cache")
    # sharedml.prepared_model_for still returns a prepared model itself (no stamp confusion).
    assert sharedml.prepared_model_for(local, cache_dir=tmp_path / "cache") == local


def test_unprepared_model_on_shared_storage_is_prepared_onto_local_disk(
    shared_storage: Path, tmp_path: Path
) -> None:
    src = save_model(build_model(["initializer"], dim=64), shared_storage / "m.onnx")
    node = prepare_on_node(src, cache_dir=tmp_path / "cache")
    assert node.path.is_relative_to(tmp_path / "cache") and not node.copied


def test_a_cache_on_shared_storage_is_warned_about(shared_storage: Path, tmp_path: Path) -> None:
    src = save_model(build_model(["initializer"], dim=64), tmp_path / "m.onnx")
    with pytest.warns(RuntimeWarning, match=r"network file system \(nfs4\).*SHAREDML_CACHE_DIR"):
        prepare_on_node(src, cache_dir=shared_storage / "cache")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare_on_node(src, cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------------------------
# The replica's pool


def test_create_pool_shares_the_replicas_cpus_and_batches_where_it_can(
    mlp_model: Path, tmp_path: Path
) -> None:
    def pool(model: Path, **options: Any) -> sharedml.SessionPool:
        return create_pool(model, cache_dir=tmp_path, **options)[0]

    with pool(mlp_model, sessions=2, cpus=4) as shared:
        assert shared.recipe.template.intra_op_num_threads == 2
        assert shared.batching == sharedml.Batching()
        x = np.ones((3, 512), np.float32)
        assert shared.run(None, {"input": x})[0].shape == (3, 512)
    with pool(mlp_model, sessions=3, cpus=0.5) as shared:
        assert shared.recipe.template.intra_op_num_threads == 1  # at least one each
    with pool(mlp_model, sessions=1, batching=False) as shared:
        assert shared.recipe.template is None  # outside Ray, no CPU share: the pool's default
        assert shared.batching is None
    fixed = save_model(build_model(["initializer"], dim=16), tmp_path / "fixed.onnx")
    with pool(fixed, sessions=1) as shared:  # axis 0 fixed at 1: not batchable
        assert shared.batching is None
    with pytest.raises(sharedml.NotBatchableError):
        pool(fixed, sessions=1, batching=True)


def test_in_a_ray_worker_the_replicas_cpus_are_shared(
    mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Context:
        def get_assigned_resources(self) -> dict[str, float]:
            return {"CPU": 6.0}  # what Ray gives a replica with ray_actor_options num_cpus=6

    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=Context)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    pool, _ = create_pool(mlp_model, sessions=2, cache_dir=tmp_path)
    with pool:
        assert pool.recipe.template.intra_op_num_threads == 3


@pytest.mark.parametrize("cpus", [6.0, 3.5])
def test_an_auto_replica_splits_the_cpus_ray_gave_it_by_measuring(
    mlp_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: float
) -> None:
    class Context:
        def get_assigned_resources(self) -> dict[str, float]:
            return {"CPU": cpus}

    fake_ray = types.SimpleNamespace(is_initialized=lambda: True, get_runtime_context=Context)
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    pool, _ = create_pool(mlp_model, sessions="auto", cache_dir=tmp_path)
    with pool:
        calibration = pool.stats().calibration
        assert calibration is not None and calibration.decided, calibration
        whole = int(cpus)  # a fraction of a CPU runs no thread of its own
        splits = {(c.sessions, c.threads) for c in calibration.candidates}
        assert splits == set(candidate_splits(whole))
        assert calibration.sessions * calibration.threads <= whole
        assert pool.max_sessions == calibration.sessions
        with pool.session() as sess:
            assert sess.get_session_options().intra_op_num_threads == calibration.threads
        x = np.ones((2, 512), np.float32)
        assert pool.run(None, {"input": x})[0].shape == (2, 512)


@pytest.mark.parametrize(
    ("arguments", "error"),
    [({"no_such_argument": 1}, TypeError), ({"prepacking": True}, ValueError)],
)
def test_a_pool_argument_is_refused_before_the_node_prepares_anything(
    mlp_model: Path, tmp_path: Path, arguments: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        create_pool(mlp_model, cache_dir=tmp_path / "cache", **arguments)
    assert not (tmp_path / "cache").exists()  # no turn taken, nothing prepared


def test_an_auto_pool_given_one_cpu_measures_nothing(mlp_model: Path, tmp_path: Path) -> None:
    pool, _ = create_pool(mlp_model, sessions="auto", cpus=1, cache_dir=tmp_path)
    with pool:
        calibration = pool.stats().calibration
        assert calibration is not None and not calibration.decided
        assert (calibration.sessions, calibration.threads) == (1, 1)
        assert "one usable core" in calibration.reason


def test_node_model_is_a_frozen_record() -> None:
    node = NodeModel("m", Path("/c/m.onnx"), Path("/c/m.weights"), Path("/c"))
    assert not node.built and node.to_dict()["published"] == []
    with pytest.raises(AttributeError):
        node.built = True  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Where a replica's internal gRPC server listens


@pytest.fixture
def replica_grpc(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any]]:
    """Ray's replica module and a real gRPC server; Ray's helper is restored afterwards."""
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    grpc = pytest.importorskip("grpc")
    import ray._common.tls_utils as tls_utils
    import ray.serve._private.replica as replica

    for module in (tls_utils, replica):
        monkeypatch.setattr(module, "add_port_to_grpc_server", module.add_port_to_grpc_server)
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=1))
    yield replica, server
    server.stop(0)


def listening_addresses(port: int) -> set[str]:
    """The addresses this process listens on at ``port`` (IPv4-mapped IPv6 ones as IPv4)."""
    found = set()
    for c in psutil.Process().net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            address = ipaddress.ip_address(c.laddr.ip)
            mapped = getattr(address, "ipv4_mapped", None)
            found.add(str(mapped or address))
    return found


def test_replica_grpc_server_listens_on_the_node_address_only(
    replica_grpc: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray.util

    replica, server = replica_grpc
    # A node started on loopback: Ray records 127.0.0.1 for it, and its routers dial that.
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")
    assert sharedml.ray.restrict_replica_grpc() == "127.0.0.1"
    port = replica.add_port_to_grpc_server(server, "[::]:0")  # the call Serve's replica makes
    server.start()
    assert listening_addresses(port) == {"127.0.0.1"}


def test_replica_grpc_keeps_rays_default_where_the_node_address_is_not_this_hosts(
    replica_grpc: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray.util

    replica, server = replica_grpc
    ray_default = replica.add_port_to_grpc_server
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "203.0.113.7")  # TEST-NET-3
    with pytest.warns(RuntimeWarning, match=r"cannot listen on '203\.0\.113\.7'"):
        assert sharedml.ray.restrict_replica_grpc() is None
    assert replica.add_port_to_grpc_server is ray_default
    assert sharedml.ray.restrict_replica_grpc(None) is None  # asked for Ray's default
    assert replica.add_port_to_grpc_server is ray_default
    # The worker setup hook is the user's explicit choice: a replica keeps it.
    sharedml.ray.bind_to_loopback()
    assert sharedml.ray.restrict_replica_grpc() == "127.0.0.1"
    port = replica.add_port_to_grpc_server(server, "[::]:0")
    server.start()
    assert listening_addresses(port) == {"127.0.0.1"}


# --------------------------------------------------------------------------------------------
# Pool stats as Ray metrics (recorded calls; the cluster test scrapes the real exporter)


def test_pool_metrics_add_each_difference_once(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    from sharedml.ray import PoolMetrics

    calls: list[tuple[str, str, float]] = []
    for cls, method in ((metrics.Counter, "inc"), (metrics.Gauge, "set")):
        monkeypatch.setattr(
            cls,
            method,
            lambda self, value, tags=None, _m=method: calls.append((_m, self.info["name"], value)),
        )
    monkeypatch.setattr(
        metrics.Histogram,
        "observe",
        lambda self, value, tags=None: calls.append(("observe", self.info["name"], value)),
    )
    exporter = PoolMetrics({"model": "m", "replica": "r1"})
    base = dict(
        sessions=2, busy=0, waiting=0, max_sessions=2, created=2, replaced=0, create_seconds=0.1
    )
    zero = sharedml.PoolStats(runs=0, failed_runs=0, waits=0, wait_seconds=0.0, **base)
    exporter.record(zero)
    assert not [c for c in calls if c[0] == "inc"]  # Ray counters refuse 0 increments
    calls.clear()
    later = sharedml.PoolStats(
        runs=5, failed_runs=1, waits=2, wait_seconds=0.25, batches=3, batched_rows=7,
        max_batch_rows=4, run_seconds=0.5, **base
    )  # fmt: skip
    exporter.record(later, latency_s=0.01)
    incs = {name: value for kind, name, value in calls if kind == "inc"}
    assert incs == {
        "sharedml_requests": 5,
        "sharedml_failed_requests": 1,
        "sharedml_queued_requests": 2,
        "sharedml_queue_seconds": 0.25,
        "sharedml_batches": 3,
        "sharedml_batched_rows": 7,
        "sharedml_run_seconds": 0.5,
    }
    gauges = {name: value for kind, name, value in calls if kind == "set"}
    assert gauges["sharedml_sessions"] == 2 and gauges["sharedml_max_batch_rows"] == 4
    assert ("observe", "sharedml_request_seconds", 0.01) in calls
    calls.clear()
    exporter.record(dataclasses.replace(later, runs=6))
    assert [(n, v) for k, n, v in calls if k == "inc"] == [("sharedml_requests", 1)]
