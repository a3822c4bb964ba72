"""sharedml.ray on a real Ray Serve: a local cluster of two nodes, four replicas, on loopback.

One module-scoped cluster serves every test (starting one costs seconds on 2 cores): a head node
and a worker node on 127.0.0.1, each with its own cache folder (``SHAREDML_CACHE_DIR`` of its
raylet, inherited by its workers), so that each node prepares and maps its own copy of the
model, as separate machines would. The deployment runs 2 replicas per node, 2 sessions each,
over a ~96 MiB MLP.

Everything is bounded: handle calls and HTTP requests have timeouts, threads are joined with
one, and a watchdog kills the cluster and fails the run if the module takes longer than
:data:`WATCHDOG_S` (``serve.run`` can wait forever when a replica can never start).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil
import pytest

import sharedml

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
serve = pytest.importorskip("ray.serve", reason="the ray extra is not installed")

import sharedml.ray  # noqa: E402  (after the skip: its deployment() needs Ray)

pytestmark = [
    pytest.mark.ray,
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PSS and maps are Linux's"),
]

WATCHDOG_S = 420  # seconds for the whole module: it takes about 1-2 minutes here
REQUEST_TIMEOUT_S = 20  # seconds any single request may take
JOIN_S = 60
APP, PREFIX, NAME = "mlp", "/mlp", "mlp"
REPLICAS, PER_NODE, SESSIONS = 4, 2, 2
WIDTH, WEIGHTS_MIB = 2048, 96  # six 2048x2048 float32 MatMul weights
CLIENTS = 16
NODES = ("node_a", "node_b")
SERVE_OPTIONS: dict[str, Any] = {
    "num_replicas": REPLICAS,
    "max_replicas_per_node": PER_NODE,  # 2 + 2 over the two nodes
    "ray_actor_options": {"num_cpus": 0.5},
    "health_check_period_s": 1,  # a dead replica is noticed within a second
    "graceful_shutdown_timeout_s": 2,
    "graceful_shutdown_wait_loop_s": 0.5,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class LocalCluster:
    cluster: Any
    port: int
    caches: dict[str, Path]  # node name -> its cache folder
    node_ids: dict[str, str]  # Ray node id -> node name
    grpc_port: int = 0  # Serve's gRPC proxy

    def processes(self) -> list[psutil.Process]:
        """Every process the cluster's nodes started (raylets, GCS, agents, workers...)."""
        found: dict[int, psutil.Process] = {}
        for node in self.cluster.list_all_nodes():
            for infos in node.all_processes.values():
                for info in infos:
                    try:
                        proc = psutil.Process(info.process.pid)
                        for p in [proc, *proc.children(recursive=True)]:
                            found[p.pid] = p
                    except psutil.NoSuchProcess:
                        pass
        return list(found.values())

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{PREFIX}{path}"


def _watchdog(get_cluster: Callable[[], LocalCluster | None]) -> threading.Timer:
    def fire() -> None:
        print(f"\nWATCHDOG: the Ray tests ran past {WATCHDOG_S} s; killing the cluster.")
        faulthandler.dump_traceback(all_threads=True)
        cluster = get_cluster()
        for proc in cluster.processes() if cluster else []:
            proc.kill()
        os._exit(3)

    timer = threading.Timer(WATCHDOG_S, fire)
    timer.daemon = True
    timer.start()
    return timer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("ray")
    caches = {name: root / f"cache-{name}" for name in NODES}
    holder: list[LocalCluster] = []
    timer = _watchdog(lambda: holder[0] if holder else None)
    common = {
        "node_ip_address": "127.0.0.1",
        "object_store_memory": 100 * 2**20,
        "dashboard_host": "127.0.0.1",
        "num_cpus": 4,  # logical: room for 3 deployments of 2 replicas x 0.5 CPU per node
    }
    head = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            **common,
            "resources": {"node_a": 1000},
            "env_vars": {"SHAREDML_CACHE_DIR": str(caches["node_a"])},
            "include_dashboard": False,
            "dashboard_port": free_port(),  # fixed defaults would collide with other clusters
            "dashboard_agent_listen_port": free_port(),
            "_system_config": {"metrics_report_interval_ms": 1000},
        },
    )
    try:
        head.add_node(
            **common,
            resources={"node_b": 1000},
            env_vars={"SHAREDML_CACHE_DIR": str(caches["node_b"])},
        )
        # No worker setup hook: sharedml's replicas keep their gRPC servers on the nodes'
        # address (127.0.0.1) by themselves; only the plain deployments below need the hook.
        ray.init(address=head.address, log_to_driver=False)
        head.wait_for_nodes()
        ids = {
            n["NodeID"]: next(name for name in NODES if name in n["Resources"])
            for n in ray.nodes()
            if n["Alive"]
        }
        port, grpc_port = free_port(), free_port()
        serve.start(
            proxy_location="HeadOnly",
            http_options={"host": "127.0.0.1", "port": port},
            # The Open Inference Protocol over gRPC, through Serve's gRPC proxy.
            grpc_options={
                "port": grpc_port,
                "grpc_servicer_functions": [sharedml.ray.GRPC_SERVICER],
            },
        )
        holder.append(LocalCluster(head, port, caches, ids, grpc_port))
        yield holder[0]
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            head.shutdown()
            timer.cancel()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("model")
    return Path(mlp(folder / f"{NAME}.onnx", target_bytes=WEIGHTS_MIB * 2**20, width=WIDTH).path)


@pytest.fixture(scope="module")
def reference(model: Path) -> Callable[[np.ndarray], np.ndarray]:
    """The model's outputs from a plain ORT session in this process."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return lambda x: np.asarray(session.run(None, {"input": x})[0])


@pytest.fixture(scope="module")
def app(cluster: LocalCluster, model: Path) -> Any:
    start = time.perf_counter()
    handle = serve.run(
        sharedml.ray.deployment(
            model, sessions=SESSIONS, batching=sharedml.Batching(max_batch_size=8), **SERVE_OPTIONS
        ),
        name=APP,
        route_prefix=PREFIX,
    )
    print(f"\nserve.run: {REPLICAS} replicas up in {time.perf_counter() - start:.1f} s")
    return handle


def replicas(app_name: str = APP) -> dict[int, str]:
    """PID -> Ray node id of the alive replicas of an application."""
    prefix = f"ServeReplica:{app_name}:"
    return {
        a["Pid"]: a["Address"]["NodeID"]
        for a in ray._private.state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"].startswith(prefix)
    }


def replica_infos(handle: Any, pids: set[int]) -> dict[int, dict[str, Any]]:
    """``info()`` of every replica in ``pids`` (calls are routed at random: ask until all did)."""
    found: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + JOIN_S
    while not pids <= found.keys():
        assert time.monotonic() < deadline, f"replicas {pids - found.keys()} never answered"
        info = handle.info.remote().result(timeout_s=REQUEST_TIMEOUT_S)
        found[info["pid"]] = info
    return {pid: found[pid] for pid in pids}


def entry_files(cache: Path) -> list[Path]:
    """The files of a node cache's prepared and prepacked entries."""
    return sorted(p for kind in ("models", "prepacked") for p in (cache / kind).rglob("*"))


def pss(pid: int) -> int:
    return int(psutil.Process(pid).memory_full_info().pss)


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = JOIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------
# Clients


def inputs(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((1 + seed % 3, WIDTH)).astype(np.float32)


def post(url: str, body: bytes, content_type: str, accept: str = "") -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST")
    request.add_header("content-type", content_type)
    if accept:
        request.add_header("accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return int(reply.status), bytes(reply.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), bytes(exc.read())


class HttpStatusError(Exception):
    """A reply other than 200 to a request that should have succeeded."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


def post_ok(url: str, body: bytes, content_type: str) -> bytes:
    status, reply = post(url, body, content_type)
    if status != 200:
        raise HttpStatusError(status, reply)
    return reply


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The header of an ``.npy`` of float32 ``shape``, with none of its data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": "<f4", "fortran_order": False, "shape": shape}
    )
    return buf.getvalue()


def infer(client: int, x: np.ndarray, handle: Any, cluster: LocalCluster) -> np.ndarray:
    """One request, the way client ``client`` sends them: 8 clients use the handle, 8 HTTP."""
    kind = client % 8 if client >= 8 else -1
    if kind == -1:
        return np.asarray(handle.remote({"input": x}).result(timeout_s=REQUEST_TIMEOUT_S)["output"])
    if kind < 3:  # plain JSON
        doc: dict[str, Any] = {"inputs": {"input": x.tolist()}}
        body = post_ok(cluster.url("/"), json.dumps(doc).encode(), "application/json")
        return np.asarray(json.loads(body)["outputs"]["output"], np.float32)
    if kind < 6:  # the Open Inference Protocol
        tensor = {"name": "input", "shape": list(x.shape), "datatype": "FP32"}
        doc = {"id": str(client), "inputs": [{**tensor, "data": x.ravel().tolist()}]}
        url = cluster.url(f"/v2/models/{NAME}/infer")
        reply = json.loads(post_ok(url, json.dumps(doc).encode(), "application/json"))
        assert reply["model_name"] == NAME and reply["id"] == str(client)
        (out,) = reply["outputs"]
        assert out["datatype"] == "FP32" and out["shape"] == list(x.shape)
        return np.reshape(np.asarray(out["data"], np.float32), out["shape"])
    body = post_ok(cluster.url("/"), npy(x), "application/x-npy")  # .npy in, .npy out
    return np.asarray(np.load(io.BytesIO(body)))


@dataclasses.dataclass
class Outcome:
    client: int
    started: float
    ended: float
    result: str  # "ok", "wrong", or the error


def run_clients(
    work: Callable[[int, int], None],
    *,
    requests_each: int | None,
    stop: threading.Event | None = None,
) -> tuple[list[threading.Thread], list[Outcome]]:
    """CLIENTS threads, each calling ``work(client, i)`` in turn; returns threads and outcomes."""
    outcomes: list[Outcome] = []

    def client(c: int) -> None:
        i = 0
        while (requests_each is None or i < requests_each) and not (stop and stop.is_set()):
            started = time.monotonic()
            try:
                work(c, i)
                result = "ok"
            except AssertionError as exc:
                result = f"wrong: {exc}"
            except HttpStatusError as exc:
                result = f"HTTP {exc.status}"
            except Exception as exc:
                result = type(exc).__name__
                if isinstance(exc, urllib.error.URLError):
                    result = f"URLError {exc.reason}"
            outcomes.append(Outcome(c, started, time.monotonic(), result))
            i += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    return threads, outcomes


def join(threads: list[threading.Thread]) -> None:
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not [t for t in threads if t.is_alive()], f"clients still waiting after {JOIN_S} s"


# --------------------------------------------------------------------------------------------
# Tests (in file order: the last one kills a replica)


def test_every_node_prepares_once_and_its_replicas_map_that_file(
    app: Any, cluster: LocalCluster
) -> None:
    pids = replicas()
    assert sorted(list(pids.values()).count(n) for n in cluster.node_ids) == [PER_NODE] * 2
    infos = replica_infos(app, set(pids))
    for node_id, name in cluster.node_ids.items():
        cache = cluster.caches[name]
        here = [i for i in infos.values() if i["node_id"] == node_id]
        entries = {kind: sorted((cache / kind).iterdir()) for kind in ("models", "prepacked")}
        assert [len(e) for e in entries.values()] == [1, 1], entries  # one copy per node
        # One replica of the node prepared (and derived the prepacked form), the other mapped.
        builders = [i for i in here if i["node_model"]["built"]]
        assert len(builders) == 1, [i["node_model"] for i in here]
        assert sorted(builders[0]["node_model"]["published"]) == [
            str(entries["models"][0]),
            str(entries["prepacked"][0]),
        ]
        for info in here:
            node = info["node_model"]
            assert node["cache_dir"] == str(cache)
            assert Path(node["path"]).parent == entries["models"][0]
            assert info["mechanism"] == "prepacked-file"
            assert info["internal_grpc_host"] == "127.0.0.1"  # the node's address
            # Every replica maps its own node's files, and nothing from the other node's cache.
            assert set(info["mapped"]) == {
                node["weights_path"],
                str(entries["prepacked"][0] / "model.data"),
            }


def test_sixteen_concurrent_clients_all_get_correct_outputs(
    app: Any, cluster: LocalCluster, reference: Callable[[np.ndarray], np.ndarray]
) -> None:
    per_client = 6
    expected = {s: reference(inputs(s)) for s in range(CLIENTS * per_client)}

    def work(client: int, i: int) -> None:
        seed = client * per_client + i
        np.testing.assert_allclose(
            infer(client, inputs(seed), app, cluster), expected[seed], rtol=1e-4, atol=1e-4
        )

    before = {pid: i["stats"]["runs"] for pid, i in replica_infos(app, set(replicas())).items()}
    threads, outcomes = run_clients(work, requests_each=per_client)
    join(threads)
    assert len(outcomes) == CLIENTS * per_client
    assert [o for o in outcomes if o.result != "ok"] == []
    after = replica_infos(app, set(replicas()))
    served = {pid: i["stats"]["runs"] - before[pid] for pid, i in after.items()}
    assert sum(served.values()) == CLIENTS * per_client
    assert all(i["stats"]["failed_runs"] == 0 for i in after.values())
    print(
        f"\nrequests per replica: {sorted(served.values())}; batches (rows): "
        f"{[(i['stats']['batches'], i['stats']['batched_rows']) for i in after.values()]}"
    )


def v2_body(datatype: str, shape: list[int]) -> bytes:
    data = [0.5] * int(np.prod(shape))
    tensor = {"name": "input", "shape": shape, "datatype": datatype, "data": data}
    return json.dumps({"inputs": [tensor]}).encode()


JS, V2 = "application/json", f"/v2/models/{NAME}/infer"
BAD_REQUESTS = [
    # (path, body, content type, status, words of the error)
    ("/", b'{"inputs": ', JS, 400, "not valid JSON"),
    ("/", b'{"inputs": {"x": [[1.0]]}}', JS, 400, "unknown input(s) 'x'"),
    ("/", b'{"inputs": {"input": [[1.0, 2.0]]}}', JS, 400, "must have 2048 on axis 1"),
    ("/", b'{"inputs": {"input": [[true]]}}', JS, 400, "must hold numbers"),
    (V2, v2_body("FP64", [1, WIDTH]), JS, 400, "FP32 in the model; the request sends FP64"),
    (V2, v2_body("FP32", [1, 7]), JS, 400, "must have 2048 on axis 1"),
    (V2, b'{"inputs": [{"name": "input"}]}', JS, 400, 'has no "data"'),
    ("/", npy(np.ones((1, WIDTH), np.float64)), "application/x-npy", 400, "must be tensor(float)"),
    ("/v2/models/bert/infer", b"{}", JS, 404, "'bert' is not served here"),
    ("/", b"hello", "text/plain", 415, "Unsupported Content-Type"),
    ("/", b"[" * 100_000 + b"]" * 100_000, JS, 400, "too deeply"),
    ("/", npy(np.ones((1, WIDTH + 1), np.float32)), "application/x-npy", 400, "on axis 1"),
    ("/", npy_header((2**40, WIDTH)), "application/x-npy", 413, "rows"),  # declares 8 PiB
]


def test_bad_requests_get_4xx_and_break_nothing(
    app: Any, cluster: LocalCluster, reference: Callable[[np.ndarray], np.ndarray]
) -> None:
    pids = set(replicas())
    for path, body, content_type, status, words in BAD_REQUESTS:
        got, reply = post(cluster.url(path), body, content_type)
        assert got == status, (path, body[:80], got, reply)
        assert words in json.loads(reply)["error"], (path, body[:80], reply)
    # Through a handle: the pool's InvalidInputError itself (wrapped by Ray, still one).
    with pytest.raises(sharedml.InvalidInputError, match="unknown input"):
        app.remote({"nope": np.ones((1, WIDTH), np.float32)}).result(timeout_s=REQUEST_TIMEOUT_S)
    with pytest.raises(sharedml.InvalidInputError, match="must be tensor"):
        app.remote({"input": np.ones((1, WIDTH), np.int64)}).result(timeout_s=REQUEST_TIMEOUT_S)

    # Nothing broke: the same replicas, every session still there, and good requests work.
    assert set(replicas()) == pids
    for info in replica_infos(app, pids).values():
        assert info["stats"]["sessions"] == SESSIONS and info["stats"]["replaced"] == 0
    for client in (0, 8, 11, 14):
        x = inputs(client)
        np.testing.assert_allclose(
            infer(client, x, app, cluster), reference(x), rtol=1e-4, atol=1e-4
        )


def scrape(cluster: LocalCluster, metric: str) -> float:
    """The sum over every node's exporter of ``metric`` samples of this application."""
    total = 0.0
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
        with urllib.request.urlopen(url, timeout=REQUEST_TIMEOUT_S) as reply:
            text = reply.read().decode()
        for line in text.splitlines():
            if line.startswith(metric + "{") and f'application="{APP}"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_pool_stats_are_exported_as_ray_metrics(app: Any, cluster: LocalCluster) -> None:
    for client in range(8):
        infer(client, inputs(client), app, cluster)
    stats = [i["stats"] for i in replica_infos(app, set(replicas())).values()]
    runs = sum(s["runs"] for s in stats)
    wait_until(
        lambda: scrape(cluster, "ray_sharedml_requests_total") == runs,
        f"ray_sharedml_requests_total to reach {runs}",
    )
    assert scrape(cluster, "ray_sharedml_request_seconds_count") >= 8
    assert scrape(cluster, "ray_sharedml_sessions") == REPLICAS * SESSIONS
    rows = sum(s["batched_rows"] for s in stats)
    wait_until(lambda: scrape(cluster, "ray_sharedml_batched_rows_total") == rows, "batch rows")
    assert scrape(cluster, "ray_sharedml_batches_total") == sum(s["batches"] for s in stats)


def _batch_statistic(path: Path) -> Path:
    """``y = x - mean(x over axis 0)``: a layer that mixes rows (one caller's rows: all 0)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], name="batch_mean"),
            helper.make_node("Sub", ["x", "m"], ["y"]),
        ],
        "batch_statistic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def test_sixteen_http_clients_of_a_row_mixing_model_get_only_their_own_results(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    # sharedml.ray turns batching on by default ("auto"): only where the analysis proves it.
    name = "mixing"
    handle = serve.run(
        sharedml.ray.deployment(
            _batch_statistic(tmp_path / f"{name}.onnx"),
            sessions=1,
            num_replicas=1,
            ray_actor_options={"num_cpus": 0.25},
        ),
        name=name,
        route_prefix=f"/{name}",
    )
    try:
        info = handle.info.remote().result(timeout_s=REQUEST_TIMEOUT_S)
        assert info["batching"] is None and "'batch_mean' (ReduceMean)" in info["batching_reason"]
        url = f"http://127.0.0.1:{cluster.port}/{name}/"

        def work(client: int, i: int) -> None:
            x = np.full((1, 4), 100 * client + i, np.float32)
            body = post_ok(url, json.dumps({"inputs": {"x": x.tolist()}}).encode(), JS)
            y = np.asarray(json.loads(body)["outputs"]["y"], np.float32)
            # Alone, a row minus the mean of its own rows is 0; any other value came from
            # another client's rows.
            assert np.array_equal(y, np.zeros((1, 4), np.float32)), f"client {client}: {y}"

        threads, outcomes = run_clients(work, requests_each=30)
        join(threads)
        assert len(outcomes) == CLIENTS * 30
        assert [o for o in outcomes if o.result != "ok"] == []
        stats = handle.info.remote().result(timeout_s=REQUEST_TIMEOUT_S)["stats"]
        assert stats["runs"] >= CLIENTS * 30 and not stats["batching"]
    finally:
        serve.delete(name)


class PlainOrt:
    """The same deployment without sharedml: each replica holds its own plain ORT sessions."""

    def __init__(self, model: str, sessions: int) -> None:
        import queue

        self.free: Any = queue.Queue()
        for _ in range(sessions):
            so = ort.SessionOptions()
            so.intra_op_num_threads = 1  # as the sharedml replicas get (0.5 CPU, 2 sessions)
            session = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            session.run(None, {"input": np.ones((1, WIDTH), np.float32)})
            self.free.put(session)

    def __call__(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self.free.get()
        try:
            return {"output": session.run(None, feed)[0]}
        finally:
            self.free.put(session)


def test_replicas_on_a_node_hold_at_most_half_the_memory_of_plain_ort(
    app: Any, cluster: LocalCluster, model: Path, reference: Callable[[np.ndarray], np.ndarray]
) -> None:
    # The same deployment with plain sessions (asserted), and with one plain session per
    # replica (reported: the least a plain replica can hold, at half the concurrency).
    plain = {"plain": SESSIONS, "plain1": 1}
    # Workers cannot import this test module: ship PlainOrt by value instead of by name.
    this_module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(this_module)
    try:
        # Plain Serve replicas listen on every interface unless this hook rebinds them.
        hook = {"worker_process_setup_hook": "sharedml.ray.bind_to_loopback"}
        actor = {**SERVE_OPTIONS["ray_actor_options"], "runtime_env": hook}
        options = {**SERVE_OPTIONS, "ray_actor_options": actor}
        handles = {
            name: serve.run(
                serve.deployment(PlainOrt, name=name, **options).bind(str(model), count),
                name=name,
                route_prefix=None,
            )
            for name, count in plain.items()
        }
    finally:
        ray.cloudpickle.unregister_pickle_by_value(this_module)
    try:
        # Every deployment serves the same concurrent load first: every replica ran requests.
        def work(client: int, i: int) -> None:
            x = inputs(client)
            for handle in (app, *handles.values()):
                out = handle.remote({"input": x}).result(timeout_s=REQUEST_TIMEOUT_S)["output"]
                np.testing.assert_allclose(out, reference(x), rtol=1e-4, atol=1e-4)

        threads, outcomes = run_clients(work, requests_each=4)
        join(threads)
        assert [o for o in outcomes if o.result != "ok"] == []
        # Measured at one moment, every group alive: shared libraries count alike for all.
        groups = {name: replicas(name) for name in (APP, *plain)}
        memory = {pid: pss(pid) for group in groups.values() for pid in group}
    finally:
        for name in plain:
            serve.delete(name)
    mib = 2**20
    lines = []
    for node_id, node in cluster.node_ids.items():
        per_node = {
            name: sum(memory[pid] for pid, n in group.items() if n == node_id)
            for name, group in groups.items()
        }
        ours, theirs, single = per_node[APP], per_node["plain"], per_node["plain1"]
        lines.append(
            f"{node}: sharedml {ours / mib:.0f} MiB; plain ORT {theirs / mib:.0f} MiB "
            f"({ours / theirs:.2f}x), with 1 session each {single / mib:.0f} MiB "
            f"({ours / single:.2f}x)"
        )
        # Each plain replica holds its own copies of the weights; sharedml's pair maps one.
        assert theirs > PER_NODE * SESSIONS * WEIGHTS_MIB * mib
        assert ours <= 0.5 * theirs, lines[-1]
    print(
        f"\nsummed PSS of the {PER_NODE} replicas of a node ({SESSIONS} sessions each, "
        f"{WEIGHTS_MIB} MiB of weights): " + "; ".join(lines)
    )


def test_killed_replica_is_replaced_without_preparing_again(
    app: Any, cluster: LocalCluster, reference: Callable[[np.ndarray], np.ndarray]
) -> None:
    pids = replicas()
    infos = replica_infos(app, set(pids))
    node_b = next(i for i, n in cluster.node_ids.items() if n == "node_b")
    victim = next(pid for pid, node in pids.items() if node == node_b)
    cache = cluster.caches["node_b"]
    entries = {p: p.stat().st_ino for p in entry_files(cache)}
    x = inputs(1)
    expected = reference(x)

    def work(client: int, i: int) -> None:
        np.testing.assert_allclose(infer(client, x, app, cluster), expected, rtol=1e-4, atol=1e-4)

    stop = threading.Event()
    threads, outcomes = run_clients(work, requests_each=None, stop=stop)
    try:
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: not psutil.pid_exists(victim), "the replica to die", 10)
        wait_until(
            lambda: len(replicas()) == REPLICAS and victim not in replicas(), "a replacement"
        )
        replaced_at = time.monotonic()
        status = lambda: serve.status().applications[APP].status  # noqa: E731
        wait_until(lambda: str(status()).endswith("RUNNING"), "the application to be RUNNING")
        time.sleep(1.0)  # load on the full set again
    finally:
        stop.set()
        join(threads)  # no client hangs: every request ended, one way or another

    assert all(o.ended - o.started < REQUEST_TIMEOUT_S + 1 for o in outcomes)
    failed = [o for o in outcomes if o.result != "ok"]
    # Only requests in flight on the killed replica fail, and with a clear error.
    assert all(o.result in ("ActorDiedError", "HTTP 500") for o in failed), failed
    assert all(o.started < killed_at + 1.0 for o in failed), failed
    assert len(failed) <= SESSIONS * (8 + 1), failed  # at most what one replica may hold
    # The other replicas kept serving while the victim was being replaced.
    during = [o for o in outcomes if killed_at < o.ended < replaced_at and o.result == "ok"]
    assert during, "no request succeeded while the replica was being replaced"

    (new_pid,) = set(replicas()) - set(pids)
    assert replicas()[new_pid] == node_b  # it took the free slot on the victim's node
    new = replica_infos(app, {new_pid})[new_pid]
    # It mapped the node's prepared file: nothing prepared, derived or rewritten.
    assert new["node_model"]["published"] == [] and not new["node_model"]["built"]
    assert new["node_model"]["weights_path"] == infos[victim]["node_model"]["weights_path"]
    assert new["mapped"] == infos[victim]["mapped"]
    assert {p: p.stat().st_ino for p in entry_files(cache)} == entries
    print(
        f"\nkill -9 of replica {victim}: replaced by {new_pid} in {replaced_at - killed_at:.1f} s "
        f"(start {new['start_seconds']:.2f} s); {len(outcomes)} requests, {len(failed)} failed "
        f"in flight: {sorted({o.result for o in failed})}"
    )


def test_every_listener_stays_on_loopback(app: Any, cluster: LocalCluster) -> None:
    loopback = ("127.0.0.1", "::ffff:127.0.0.1", "::1")
    pids = {p.pid for p in cluster.processes()}
    listening = [
        (c.laddr.ip, c.laddr.port, c.pid)
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in pids
    ]
    assert listening  # the check saw the cluster's sockets at all
    # Serve's gRPC proxy (Ray 2.60) binds [::]:<port> with no host option
    # (serve/_private/grpc_util.py, start_grpc_server): the one listener beyond loopback, and
    # only because this cluster enables it (docs/ray.md, "What listens where", says so).
    wide = [s for s in listening if s[0] not in loopback]
    assert [(ip, port) for ip, port, _ in wide] in ([], [("::", cluster.grpc_port)]), wide


def test_real_clients_reach_the_deployment_over_http_and_grpc(
    cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tritonclient (HTTP, gRPC) and KServe's clients, unchanged, against sharedml.ray.

    The same checks as against ``sharedml serve`` (``tests/serve/test_clients.py``): every
    endpoint, outputs equal to plain ONNX Runtime, 16 concurrent callers per protocol each
    getting their own rows. Serve's gRPC proxy serves several applications here, so gRPC
    calls name theirs in the ``application`` header (Serve's routing; HTTP uses the route
    prefix).
    """
    pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed")
    pytest.importorskip("tritonclient.http", reason="tritonclient is not installed")
    import _clients
    from _serving import typed_model

    path = typed_model(tmp_path_factory.mktemp("typed") / "typed.onnx")
    serve.run(
        sharedml.ray.deployment(
            path, sessions=2, num_replicas=1, ray_actor_options={"num_cpus": 0.5}
        ),
        name="typed",
        route_prefix="/typed",
    )
    try:
        http = f"127.0.0.1:{cluster.port}/typed"
        grpc = f"127.0.0.1:{cluster.grpc_port}"
        route = {"application": "typed"}
        _clients.check_triton_endpoints("http", http, path)
        _clients.check_triton_endpoints("grpc", grpc, path, headers=route)
        _clients.check_kserve_clients_in_a_child(http, grpc, path, application="typed")
        for protocol, url, headers in (("http", http, None), ("grpc", grpc, route)):
            wrong = _clients.concurrent_callers(
                protocol, url, "typed", path, _clients.typed_feed, headers=headers
            )
            assert wrong == [], (protocol, wrong[:3])
    finally:
        serve.delete("typed")
