"""sharedml.ray's ModelServer without a cluster: its HTTP routes, formats, limits and 4xx.

The server's routing is driven with real starlette requests on a :class:`ModelServer` created
in this process (needs the ray extra: starlette and ``ray.util.metrics``, which do nothing
without a cluster). The codecs themselves are tested in ``tests/protocol``.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from sharedml.protocol._numpy import NPY, NPZ

ROOT = Path(__file__).resolve().parents[2]
JS = "application/json"


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# The server's routes, in this process (no cluster)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    pytest.importorskip("starlette", reason="the ray extra is not installed")
    from sharedml.ray import ModelServer
    from tools.realistic_models import mlp

    folder = tmp_path_factory.mktemp("server")
    info = mlp(folder / "tiny.onnx", size="tiny")
    server = ModelServer(info.path, sessions=2, cache_dir=folder / "cache")
    yield server
    server.pool.close()


def call(server: Any, method: str, path: str, body: bytes = b"", **headers: str) -> Any:
    """One request through ``server.__call__`` as Serve delivers it (root_path = the prefix)."""
    return asyncio.run(server(starlette_request(method, path, body, **headers)))


def starlette_request(method: str, path: str, body: bytes = b"", **headers: str) -> Any:
    """A starlette request as Serve hands it to the replica."""
    from starlette.requests import Request

    path, _, query = path.partition("?")
    scope = {
        "type": "http",
        "method": method,
        "root_path": "/app",
        "path": "/app" + path,
        "query_string": query.encode(),
        "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
    }
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        more, sent = sent, True
        return {"type": "http.request", "body": b"" if more else body, "more_body": False}

    return Request(scope, receive)


def reference(path: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": x})[0])


def test_server_routes_and_formats(server: Any) -> None:
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    expected = reference(Path(server.node.source), x)
    kserve = {
        "inputs": [
            {"name": "input", "shape": [2, 256], "datatype": "FP32", "data": x.ravel().tolist()}
        ]
    }
    for path in ("/", "/v2/models/tiny/infer", "/v2/models/tiny/versions/1/infer"):
        reply = call(
            server, "POST", path, json.dumps(kserve).encode(), content_type="application/json"
        )
        assert reply.status_code == 200, reply.body
        out = json.loads(reply.body)["outputs"][0]
        assert out["name"] == "output" and out["shape"] == [2, 256]
        np.testing.assert_allclose(
            np.reshape(out["data"], (2, 256)), expected, rtol=1e-4, atol=1e-5
        )
    plain = {"inputs": {"input": x.tolist()}}
    reply = call(server, "POST", "/", json.dumps(plain).encode(), content_type="application/json")
    np.testing.assert_allclose(
        json.loads(reply.body)["outputs"]["output"], expected, rtol=1e-4, atol=1e-5
    )
    reply = call(server, "POST", "/?output=output", _npy(x), content_type=NPY)
    assert reply.status_code == 200 and reply.media_type == NPY
    np.testing.assert_allclose(np.load(io.BytesIO(reply.body)), expected, rtol=1e-4, atol=1e-5)

    meta = json.loads(call(server, "GET", "/v2/models/tiny").body)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 256]}]
    assert call(server, "GET", "/v2/models/tiny/ready").status_code == 200
    assert call(server, "GET", "/v2/health/live").status_code == 200
    assert call(server, "GET", "/v2/health/ready").status_code == 200

    handle_out = asyncio.run(server({"input": x}))
    np.testing.assert_allclose(handle_out["output"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    [
        ("POST", "/", b"{oops", 400, "not valid JSON"),
        ("POST", "/", b'{"inputs": {"inputx": [[1.0]]}}', 400, "unknown input(s) 'inputx'"),
        ("POST", "/", b'{"inputs": {"input": [[1.0, 2.0]]}}', 400, "must have 256 on axis 1"),
        ("POST", "/", b'{"inputs": {"input": [1.0]}}', 400, "must have rank 2"),
        (
            "POST",
            "/v2/models/tiny/infer",
            b'{"inputs": [{"name": "input", "shape": [1, 256], "datatype": "INT32", "data": '
            + json.dumps([1] * 256).encode()
            + b"}]}",
            400,
            "FP32 in the model",
        ),
        ("POST", "/v2/models/other/infer", b"{}", 404, "'other' is not served here"),
        ("POST", "/nowhere", b"{}", 404, "No route '/nowhere'"),
        ("GET", "/v2/models/tiny/infer", b"", 405, "Use POST"),
        ("GET", "/", b"", 405, "Use POST"),
        ("POST", "/v2/health/live", b"", 405, "Use GET"),
    ],
)
def test_server_refuses_bad_requests_with_4xx(
    server: Any, method: str, path: str, body: bytes, status: int, needle: str
) -> None:
    before = server.pool.stats()
    reply = call(server, method, path, body, content_type="application/json")
    assert reply.status_code == status, reply.body
    assert needle in json.loads(reply.body)["error"]
    after = server.pool.stats()
    assert (after.sessions, after.replaced, after.busy) == (before.sessions, 0, 0)


def test_bodies_are_parsed_off_the_event_loop(server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a large body is being parsed, the replica's event loop (and Serve's health check)
    runs (bodies under 64 KiB are parsed on the loop: a thread hand-off costs more)."""
    parsing, checked = threading.Event(), threading.Event()
    waited: list[bool] = []
    real_loads = json.loads

    def slow_loads(*args: Any, **kwargs: Any) -> Any:
        parsing.set()
        # Parsed on the event loop, this would wait in vain: the health check could not run.
        waited.append(checked.wait(timeout=10))
        return real_loads(*args, **kwargs)

    monkeypatch.setattr(json, "loads", slow_loads)
    body = json.dumps({"inputs": {"input": [[0.5] * 256] * 64}}).encode()
    assert len(body) > 64 * 1024

    async def main() -> Any:
        reply = asyncio.ensure_future(server(starlette_request("POST", "/", body)))
        deadline = time.monotonic() + 10
        while not parsing.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        server.check_health()  # what Serve runs on the replica's loop
        checked.set()
        return await reply

    reply = asyncio.run(main())
    assert reply.status_code == 200, reply.body
    assert waited == [True]


def test_zero_row_requests_pass_through(server: Any) -> None:
    empty = np.zeros((0, 256), np.float32)
    kserve = {"inputs": [{"name": "input", "shape": [0, 256], "datatype": "FP32", "data": []}]}
    reply = call(
        server, "POST", "/v2/models/tiny/infer", json.dumps(kserve).encode(), content_type=JS
    )
    assert reply.status_code == 200, reply.body
    assert json.loads(reply.body)["outputs"][0]["shape"] == [0, 256]
    reply = call(server, "POST", "/", _npy(empty), content_type=NPY)
    assert reply.status_code == 200, reply.body
    assert np.load(io.BytesIO(reply.body)).shape == (0, 256)
    reply = call(server, "POST", "/", _npz(input=empty), content_type=NPZ)
    assert reply.status_code == 200, reply.body
    with np.load(io.BytesIO(reply.body)) as archive:
        assert archive["output"].shape == (0, 256)
    assert server.inflight.used_bytes == 0


def test_server_refuses_what_its_limits_do_not_allow(tmp_path: Path) -> None:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    from sharedml.ray import HttpLimits, ModelServer
    from tools.realistic_models import mlp

    path = mlp(tmp_path / "tiny.onnx", size="tiny").path
    limits = HttpLimits(max_request_bytes=64 * 1024, max_inflight_bytes=256 * 1024)
    server = ModelServer(path, sessions=1, cache_dir=tmp_path / "cache", http_limits=limits)
    try:
        x = _npy(np.ones((8, 256), np.float32))  # 8 KiB
        assert call(server, "POST", "/", x, content_type=NPY).status_code == 200
        big = _npy(np.ones((80, 256), np.float32))  # 80 KiB
        reply = call(server, "POST", "/", big, content_type=NPY)
        assert reply.status_code == 413 and "64 KiB" not in json.loads(reply.body)["error"]
        reply = call(server, "POST", "/", big, content_type=NPY, content_length=str(len(big)))
        error = json.loads(reply.body)["error"]
        assert reply.status_code == 413 and "declares 82048 bytes" in error
        held = server.inflight.reserve(250 * 1024)  # the requests in flight take the budget
        reply = call(server, "POST", "/", x, content_type=NPY)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        held.release()
        assert call(server, "POST", "/", x, content_type=NPY).status_code == 200
        assert server.inflight.used_bytes == 0  # every request gave its bytes back
    finally:
        server.pool.close()


def _gather_reshape_model(path: Path) -> Path:
    """``out = Reshape(Gather(table[4, 3], ids), shape)``: ORT refuses bad ids (InvalidArgument)
    and fails a Reshape to the wrong size (Fail)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "table")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["rows"]),
            helper.make_node("Reshape", ["rows", "shape"], ["out"]),
        ],
        "gather_reshape",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["n"]),
            helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        initializer=[table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def documented_statuses() -> dict[int, str]:
    """docs/ray.md's table of HTTP statuses: status -> its "when" text."""
    text = (ROOT / "docs" / "ray.md").read_text()
    table = text[text.index("| status | when |") :].split("\n\n")[0]
    rows = [line.split("|") for line in table.splitlines()[2:]]
    return {int(row[1]): row[2] for row in rows}


def test_the_documented_status_table_is_what_the_server_answers(tmp_path: Path) -> None:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    from sharedml.ray import HttpLimits, ModelServer

    path = _gather_reshape_model(tmp_path / "gather.onnx")
    limits = HttpLimits(max_request_bytes=1024, max_inflight_bytes=64 * 1024, body_timeout_s=0.2)
    server = ModelServer(path, sessions=1, cache_dir=tmp_path / "cache", http_limits=limits)

    def stalled() -> Any:  # a body that stops arriving
        from starlette.requests import Request

        scope = starlette_request("POST", "/", content_type=JS, content_length="100").scope
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                await asyncio.Event().wait()
            sent = True
            return {"type": "http.request", "body": b"{", "more_body": True}

        return asyncio.run(server(Request(scope, receive)))

    def infer(ids: list[int], shape: list[int], **headers: str) -> Any:
        doc = {"inputs": {"ids": ids, "shape": shape}}
        return call(server, "POST", "/", json.dumps(doc).encode(), content_type=JS, **headers)

    def held() -> Any:
        hold = server.inflight.reserve(server.inflight.limit_bytes)
        try:
            return infer([1], [1, 3])
        finally:
            hold.release()

    assert infer([1, 2], [2, 3]).status_code == 200
    # (status, a request that gets it, words its row of the table must hold)
    cases = [
        (400, lambda: call(server, "POST", "/", b"{bad", content_type=JS), "malformed"),
        (400, lambda: infer([9], [1, 3]), "InvalidArgument"),  # ORT: index out of range
        (400, lambda: infer([1.5], [1, 3]), "losslessly"),
        (404, lambda: call(server, "GET", "/nowhere"), "unknown path"),
        (405, lambda: call(server, "GET", "/"), "method"),
        (406, lambda: infer([1], [1, 3], accept="text/html"), "Accept"),
        (408, stalled, "stopped arriving"),
        (413, lambda: infer([0] * 200, [200, 3]), "max_request_bytes"),
        (415, lambda: call(server, "POST", "/", b"x", content_type="text/plain"), "content type"),
        (429, held, "max_inflight_bytes"),
        (500, lambda: infer([1], [2, 3]), "RunError"),  # ORT: Reshape to the wrong size
    ]
    table = documented_statuses()
    answered = set()
    for status, request, words in cases:
        reply = request()
        assert reply.status_code == status, (status, words, reply.body)
        assert words in table.get(status, ""), (status, words, table.get(status))
        answered.add(status)
    server.pool.close()
    reply = infer([1], [1, 3])
    assert reply.status_code == 503 and "shutting down" in table[503]
    assert set(table) == answered | {503}


def test_server_handle_calls_raise_invalid_input(server: Any) -> None:
    import sharedml

    with pytest.raises(sharedml.InvalidInputError, match="unknown input"):
        asyncio.run(server({"nope": np.ones((1, 256), np.float32)}))
    with pytest.raises(sharedml.InvalidInputError, match="must be tensor\\(float\\)"):
        asyncio.run(server.infer({"input": np.ones((1, 256), np.float64)}))
    with pytest.raises(sharedml.InvalidInputError, match="takes a feed"):
        asyncio.run(server(np.ones((1, 256), np.float32)))
    assert server.info()["node_model"]["path"].endswith("model.onnx")


def test_a_model_given_as_bytes_and_a_closed_pool(tmp_path: Path) -> None:
    pytest.importorskip("ray.util.metrics", reason="the ray extra is not installed")
    import sharedml
    from sharedml.ray import ModelServer
    from tools.realistic_models import mlp

    data = Path(mlp(tmp_path / "tiny.onnx", size="tiny").path).read_bytes()
    server = ModelServer(data, sessions=1, cache_dir=tmp_path / "cache")
    assert server.model_name == "model" and server.node.source == "<model bytes>"
    assert call(server, "GET", "/v2/models/model").status_code == 200
    server.check_health()
    server.pool.close()
    with pytest.raises(sharedml.PoolClosedError):
        server.check_health()  # Serve replaces a replica whose pool is closed
    good = json.dumps({"inputs": {"input": [[0.0] * 256]}}).encode()
    reply = call(server, "POST", "/", good, content_type=JS)
    assert reply.status_code == 503 and "closed" in json.loads(reply.body)["error"]


def test_deployment_lets_enough_requests_reach_each_pool(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    import sharedml
    import sharedml.ray
    from sharedml.ray import deployment

    model = tmp_path / "m.onnx"  # binding reads nothing: each replica opens the model
    app = deployment(model, sessions=3, batching=sharedml.Batching(max_batch_size=4))
    bound = app._bound_deployment  # Ray has no public accessor for a bound application's options
    assert bound.name == "sharedml-m"
    assert bound.max_ongoing_requests == 3 * (4 + 1)  # Serve's default (5) would cap batches
    assert bound.init_args == (str(model),)
    assert bound.init_kwargs["sessions"] == 3 and bound.init_kwargs["pool_options"] == {}
    # Each replica's gRPC server on the node's address, and the default HTTP limits.
    assert bound.init_kwargs["internal_grpc_host"] == "node"
    assert bound.init_kwargs["http_limits"] is None
    limits = sharedml.ray.HttpLimits(max_rows=8)
    assert (
        deployment(model, http_limits=limits)._bound_deployment.init_kwargs["http_limits"] == limits
    )
    assert deployment(model, sessions=2, batching=False)._bound_deployment.max_ongoing_requests == 4
    assert deployment(model)._bound_deployment.max_ongoing_requests == 4 * (32 + 1)
    custom = deployment(model, name="x", max_ongoing_requests=7, num_replicas=3)._bound_deployment
    assert (custom.name, custom.max_ongoing_requests, custom.num_replicas) == ("x", 7, 3)
    # sessions="auto": up to a session per CPU of the replica, at least the default count.
    auto = deployment(model, sessions="auto", ray_actor_options={"num_cpus": 8})._bound_deployment
    assert auto.init_kwargs["sessions"] == "auto"
    assert auto.max_ongoing_requests == 8 * (32 + 1)
    assert deployment(model, sessions="auto")._bound_deployment.max_ongoing_requests == 4 * 33
    with pytest.raises(TypeError):
        deployment(model, no_such_serve_option=1)
    # The pool's arguments are checked here, once, not by every replica as it starts.
    with pytest.raises(TypeError, match="no_such_pool_argument"):
        deployment(model, pool_options={"no_such_pool_argument": 1})
    with pytest.raises(ValueError, match="prepacking=True is not a setting"):
        deployment(model, pool_options={"prepacking": True})


# --------------------------------------------------------------------------------------------
# What the docs tell users to type


def test_install_lines_name_the_checkout_not_an_index() -> None:
    """sharedml is on no package index: ``pip install "sharedml[ray]"`` fails."""
    for path in (
        ROOT / "README.md",
        ROOT / "docs" / "ray.md",
        ROOT / "src/sharedml/ray/__init__.py",
    ):
        lines = re.findall(r"pip install [^\n`]*", path.read_text())
        assert lines, path
        assert [line for line in lines if "sharedml[" in line] == [], path
    assert "pip install '.[ray]'" in (ROOT / "docs" / "ray.md").read_text()


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _recipes() -> list[tuple[str, str]]:
    ray_md = (ROOT / "docs" / "ray.md").read_text()
    readme = (ROOT / "README.md").read_text()
    one_node = ray_md[ray_md.index("### One node") :]
    ray_section = readme[readme.index("## Ray Serve") :]
    return [
        ("docs/ray.md, top", _python_blocks(ray_md)[0]),
        ("docs/ray.md, One node", _python_blocks(one_node)[0]),
        (
            "README.md, Ray Serve (one node: ray.init(), then these lines)",
            _python_blocks(ray_section)[0],
        ),
    ]


@pytest.mark.parametrize(("where", "code"), _recipes(), ids=lambda v: v if " " not in v else None)
def test_one_node_recipes_fit_a_two_cpu_node(
    where: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray places a replica only where its CPUs are free: on 2 CPUs, 4 x 1 never starts."""
    from unittest import mock

    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    serve = pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    apps: list[Any] = []
    monkeypatch.setattr(ray, "init", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve, "run", lambda app, **kwargs: apps.append(app) or mock.MagicMock())
    exec(compile(code, where, "exec"), {"batch": np.zeros((1, 4), np.float32)})
    (app,) = apps
    bound = app._bound_deployment  # Ray has no public accessor for a bound application's options
    cpus = bound.ray_actor_options.get("num_cpus", 1)  # Serve gives a replica 1 CPU by default
    per_node = bound._replica_config.max_replicas_per_node or bound.num_replicas
    assert bound.num_replicas * cpus <= 2, (where, bound.num_replicas, cpus)
    assert per_node >= bound.num_replicas, (where, per_node)  # all of them on the one node


def test_grpc_methods_answer_and_set_the_status_code_on_serves_context(server: Any) -> None:
    """What Serve's gRPC proxy calls: the RPC-named methods, failures as gRPC codes."""
    grpc = pytest.importorskip("grpc", reason="grpcio is not installed")
    from sharedml.protocol import _grpc

    class Context:  # what Serve passes as grpc_context, as far as the replica uses it
        code_set: Any = None
        details_set = ""

        def set_code(self, code: Any) -> None:
            self.code_set = code

        def set_details(self, details: str) -> None:
            self.details_set = details

    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    request = _grpc.message("ModelInferRequest")(model_name="tiny", id="g")
    request.inputs.add(name="input", datatype="FP32", shape=[2, 256])
    request.raw_input_contents.append(x.tobytes())
    reply = asyncio.run(server.ModelInfer(request, grpc_context=Context()))
    got = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(2, 256)
    np.testing.assert_allclose(got, reference(Path(server.node.source), x), rtol=1e-4, atol=1e-5)
    assert reply.id == "g" and reply.outputs[0].name == "output"
    ready = asyncio.run(server.ModelReady(_grpc.message("ModelReadyRequest")(name="tiny")))
    assert ready.ready
    context = Context()
    request.inputs[0].shape[:] = [2, 128]
    with pytest.raises(Exception, match="must have 256 on axis 1"):
        asyncio.run(server.ModelInfer(request, grpc_context=context))
    assert context.code_set == grpc.StatusCode.INVALID_ARGUMENT
    assert "must have 256" in context.details_set
    assert server.inflight.used_bytes == 0
