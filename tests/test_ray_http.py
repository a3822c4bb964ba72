"""sharedml.ray's HTTP layer without a cluster: bodies to feeds, outputs to bodies, routes, 4xx.

The codec (``sharedml.ray._http``) is pure; the server's routing is driven with real starlette
requests on a :class:`ModelServer` created in this process (needs the ray extra: starlette and
``ray.util.metrics``, which do nothing without a cluster).
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from sharedml.ray import _http
from sharedml.ray._http import NPY, NPZ, HttpError, parse_request


class _Arg:
    def __init__(self, name: str, type_: str, shape: list[Any]) -> None:
        self.name, self.type, self.shape = name, type_, shape


INPUTS = _http.tensor_infos(
    [
        _Arg("x", "tensor(float)", ["batch", 3]),
        _Arg("ids", "tensor(int64)", ["batch"]),
        _Arg("mask", "tensor(bool)", ["batch"]),
        _Arg("text", "tensor(string)", ["batch"]),
        _Arg("small", "tensor(int8)", ["batch"]),
    ]
)
ONE_INPUT = {"x": INPUTS["x"]}
JS = "application/json"


def parse_json(doc: Any, inputs: Any = INPUTS, **kwargs: Any) -> _http.InferRequest:
    return parse_request(json.dumps(doc).encode(), "application/json", inputs, **kwargs)


def refused(
    status: int,
    body: bytes,
    content_type: str = "application/json",
    inputs: Any = INPUTS,
    **kw: Any,
) -> str:
    with pytest.raises(HttpError) as info:
        parse_request(body, content_type, inputs, **kw)
    assert info.value.status == status, info.value.message
    return info.value.message


def test_tensor_infos_map_ort_types_and_dynamic_dims() -> None:
    x = INPUTS["x"]
    assert (x.dtype, x.datatype, x.shape) == (np.float32, "FP32", (-1, 3))
    assert INPUTS["text"].datatype == "BYTES"
    odd = _http.tensor_infos([_Arg("b", "tensor(bfloat16)", [None])])["b"]
    assert (odd.dtype, odd.datatype, odd.shape) == (None, None, (-1,))


def test_open_inference_protocol_request_and_reply_shapes() -> None:
    doc = {
        "id": "42",
        "inputs": [
            {"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3, 4.5, 5, 6]},
            {"name": "ids", "shape": [2], "datatype": "INT64", "data": [[7], [8]]},
        ],
        "outputs": [{"name": "y"}],
    }
    request = parse_json(doc)
    assert request.style == "kserve" and request.request_id == "42"
    assert request.output_names == ["y"]
    np.testing.assert_array_equal(request.feed["x"], [[1, 2, 3], [4.5, 5, 6]])
    assert request.feed["x"].dtype == np.float32 and request.feed["ids"].dtype == np.int64
    assert request.feed["ids"].shape == (2,)

    outputs = {"y": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([b"a", b"b"])}
    body, media = _http.encode_outputs(outputs, request, accept="", model_name="m")
    assert media == _http.JSON
    assert json.loads(body) == {
        "model_name": "m",
        "id": "42",
        "outputs": [
            {"name": "y", "shape": [2, 3], "datatype": "FP32", "data": [0, 1, 2, 3, 4, 5]},
            {"name": "n", "shape": [2], "datatype": "BYTES", "data": ["a", "b"]},
        ],
    }


def test_plain_json_converts_to_the_model_dtypes() -> None:
    request = parse_json(
        {
            "inputs": {"x": [[1, 2, 3]], "ids": [5], "mask": [True], "text": ["hi"], "small": []},
            "outputs": ["y"],
        }
    )
    assert request.style == "json" and request.output_names == ["y"]
    dtypes = {name: a.dtype for name, a in request.feed.items()}
    assert dtypes == {
        "x": np.float32,
        "ids": np.int64,
        "mask": np.bool_,
        "text": np.object_,
        "small": np.int8,
    }
    assert request.feed["small"].shape == (0,)
    body, _ = _http.encode_outputs({"y": np.ones((1, 2))}, request, accept="", model_name="m")
    assert json.loads(body) == {"model_name": "m", "outputs": {"y": [[1.0, 1.0]]}}
    # A name the model does not have is left for the pool to refuse (with its own message).
    assert parse_json({"inputs": {"nope": [1.5]}}).feed["nope"].dtype == np.float64


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"inputs": {"ids": [1.5]}}, "must hold integers"),
        ({"inputs": {"x": [[True, False, True]]}}, "must hold numbers"),
        ({"inputs": {"mask": [1]}}, "must hold true/false"),
        ({"inputs": {"text": [1]}}, "must hold strings"),
        ({"inputs": {"small": [300]}}, "outside the range"),
        ({"inputs": {"x": [[1, 2], [3]]}}, "rectangular"),
        ({"inputs": {"x": [[1, None, 3]]}}, "nulls"),
        ({"inputs": []}, "non-empty list"),
        ({"inputs": {}}, "map each input name"),
        ({"input": [1]}, 'object with "inputs"'),
        ([1, 2], 'object with "inputs"'),
        ({"inputs": {"x": [[1, 2, 3]]}, "outputs": "y"}, "must be a list"),
        ({"inputs": {"x": [[1, 2, 3]]}, "outputs": [3]}, 'must be "<output>"'),
        (
            {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP64", "data": [1, 2, 3]}]},
            "FP32 in the model; the request sends FP64",
        ),
        (
            {"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [1, 2, 3]}]},
            "has 3 values, but its shape [2, 3] needs 6",
        ),
        (
            {"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": [1]}]},
            "non-negative integers",
        ),
        (
            {"inputs": [{"name": "x", "shape": [1], "datatype": "FLOAT", "data": [1]}]},
            "datatype 'FLOAT' is not one of",
        ),
        ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32"}]}, 'has no "data"'),
        ({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}, 'no "name"'),
        ({"inputs": ["x"]}, "must be an object"),
        (
            {"inputs": [{"name": "ids", "shape": [1], "datatype": "INT64", "data": [1]}] * 2},
            "given twice",
        ),
        (
            {
                "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [1, 2, 3]}],
                "outputs": ["y"],
            },
            '{"name": "<output>"}',
        ),
    ],
)
def test_bad_json_is_a_400_naming_the_problem(doc: Any, needle: str) -> None:
    assert needle in refused(400, json.dumps(doc).encode())


def test_float16_overflow_is_refused_not_turned_into_inf() -> None:
    infos = _http.tensor_infos([_Arg("h", "tensor(float16)", ["batch"])])
    with pytest.raises(HttpError, match="too large"):
        parse_json({"inputs": {"h": [1e6]}}, infos)


def test_malformed_bodies_and_content_types() -> None:
    assert "not valid JSON" in refused(400, b"{bad")
    assert "not valid JSON" in refused(400, b"\xff\xfe")
    assert "Unsupported Content-Type 'text/plain'" in refused(415, b"x", "text/plain")
    assert "Unsupported Content-Type" in refused(415, b"garbage", "")
    assert "not a readable .npy" in refused(400, b"\x93NUMPYjunk", NPY, ONE_INPUT)
    assert "not a readable .npz" in refused(400, b"PK\x03\x04junk", NPZ)
    assert "are JSON, not npy" in refused(400, _npy(np.ones((1, 3), np.float32)), NPY, kserve=True)
    # The Open Inference Protocol path wants its shape, not the plain one.
    assert "non-empty list" in refused(400, b'{"inputs": {"x": [[1, 2, 3]]}}', kserve=True)


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def test_npy_and_npz_bodies_and_replies() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for content_type in (NPY, "application/octet-stream", ""):  # sniffed when not declared
        request = parse_request(_npy(x), content_type, ONE_INPUT, output_names=["y"])
        assert request.style == "npy" and request.output_names == ["y"]
        np.testing.assert_array_equal(request.feed["x"], x)
    assert "send an .npz" in refused(400, _npy(x), NPY)  # several inputs: which one?

    request = parse_request(_npz(x=x, ids=np.array([1, 2])), NPZ, INPUTS)
    assert request.style == "npz" and sorted(request.feed) == ["ids", "x"]
    assert parse_request(_npz(x=x), "", INPUTS).style == "npz"
    assert "holds no arrays" in refused(400, _npz(), NPZ)
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert "not a readable .npy" in refused(
        400, pickled.getvalue(), NPY, ONE_INPUT
    )  # never unpickled

    y = {"y": x * 2}
    body, media = _http.encode_outputs(y, request, accept="", model_name="m")  # npz in, npz out
    assert media == NPZ
    with np.load(io.BytesIO(body)) as archive:
        np.testing.assert_array_equal(archive["y"], x * 2)
    for accept in ("*/*", "application/*;q=0.8", "text/html, */*"):  # any: like the request
        assert _http.encode_outputs(y, request, accept=accept, model_name="m")[1] == NPZ
    body, media = _http.encode_outputs(y, request, accept=NPY, model_name="m")
    assert media == NPY
    np.testing.assert_array_equal(np.load(io.BytesIO(body)), x * 2)
    body, media = _http.encode_outputs(
        y, request, accept="text/html, application/json", model_name="m"
    )
    assert media == _http.JSON and json.loads(body)["outputs"]["y"] == (x * 2).tolist()
    with pytest.raises(HttpError, match="pick one with") as info:
        _http.encode_outputs({"a": x, "b": x}, request, accept=NPY, model_name="m")
    assert info.value.status == 406
    with pytest.raises(HttpError) as info:
        _http.encode_outputs(y, request, accept="text/html", model_name="m")
    assert info.value.status == 406


def test_npz_that_unpacks_beyond_the_limit_is_a_413() -> None:
    body = _npz(x=np.zeros((1024, 1024), np.float32))  # 4 MiB of zeros, compressed to ~4 KiB
    assert len(body) < 64 * 1024
    assert "unpacks to" in refused(413, body, NPZ, max_npz_bytes=1 << 20)


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

    return asyncio.run(server(Request(scope, receive)))


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
    reply = call(server, "POST", "/", b'{"inputs": {"input": [[0.0]]}}', content_type=JS)
    assert reply.status_code == 503 and "closed" in json.loads(reply.body)["error"]


def test_deployment_lets_enough_requests_reach_each_pool(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    import sharedml
    from sharedml.ray import deployment

    model = tmp_path / "m.onnx"  # binding reads nothing: each replica opens the model
    app = deployment(model, sessions=3, batching=sharedml.Batching(max_batch_size=4))
    bound = app._bound_deployment  # Ray has no public accessor for a bound application's options
    assert bound.name == "sharedml-m"
    assert bound.max_ongoing_requests == 3 * (4 + 1)  # Serve's default (5) would cap batches
    assert bound.init_args == (str(model),)
    assert bound.init_kwargs["sessions"] == 3 and bound.init_kwargs["pool_options"] == {}
    assert deployment(model, sessions=2, batching=False)._bound_deployment.max_ongoing_requests == 4
    assert deployment(model)._bound_deployment.max_ongoing_requests == 4 * (32 + 1)
    custom = deployment(model, name="x", max_ongoing_requests=7, num_replicas=3)._bound_deployment
    assert (custom.name, custom.max_ongoing_requests, custom.num_replicas) == ("x", 7, 3)
    with pytest.raises(TypeError):
        deployment(model, no_such_serve_option=1)
