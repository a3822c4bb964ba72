"""Hostile requests on every wire format: a 4xx with a clear message, bounded, harmless to others.

Each request below lies in one way (a binary size, a header length, a truncated body, a dtype,
a shape, a tensor declared huge), over HTTP (JSON and the binary tensor extension) and gRPC;
it is sent to ``sharedml serve`` (in this process) while a well-behaved caller keeps calling:
every hostile request gets its 4xx (gRPC: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, NOT_FOUND)
naming the problem, the budget is whole again afterwards, the pool lost no session, and every
good call got the right answer.
"""

from __future__ import annotations

import http.client
import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("grpc", reason="the serve extra is not installed")

import grpc
from _serving import serving, typed_model

from sharedml.protocol import _grpc
from sharedml.protocol._admission import HttpLimits
from sharedml.serve._server import ModelSpec, Server

HEADER = "Inference-Header-Content-Length"
X = np.arange(16, dtype=np.float32).reshape(2, 8)


def binary(
    inputs: list[dict[str, Any]], blobs: list[bytes], *, cut: int = 0, shift: int = 0
) -> tuple[bytes, dict[str, str]]:
    header = json.dumps({"inputs": inputs}).encode()
    body = header + b"".join(blobs)
    return body[: len(body) - cut], {HEADER: str(len(header) + shift)}


def x_input(shape: list[int], size: int, datatype: str = "FP32") -> dict[str, Any]:
    return {
        "name": "x",
        "shape": shape,
        "datatype": datatype,
        "parameters": {"binary_data_size": size},
    }


# (id, body, headers, status, words the error must hold)
CORPUS: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("lying-size", *binary([x_input([2, 8], 60)], [X.tobytes()[:60]]), 400, "takes 64"),
    ("truncated", *binary([x_input([2, 8], 64)], [X.tobytes()], cut=10), 400, "cut short"),
    (
        "header-past-body",
        *binary([x_input([2, 8], 64)], [X.tobytes()], shift=10**6),
        400,
        "past the end",
    ),
    ("header-not-a-number", X.tobytes(), {HEADER: "lots"}, 400, "JSON part's length"),
    (
        "wrong-dtype",
        *binary([x_input([2, 8], 128, "FP64")], [bytes(128)]),
        400,
        "FP32 in the model",
    ),
    ("wrong-shape", *binary([x_input([2, 4], 32)], [bytes(32)]), 400, "must have 8 on axis 1"),
    ("huge-rows", *binary([x_input([2**50, 8], 32 * 2**50)], [bytes(64)]), 413, "rows"),
    ("huge-bytes", *binary([x_input([60_000, 8], 1_920_000)], [bytes(64)]), 413, "more than"),
    (
        "bad-bytes-length",
        *binary(
            [
                {
                    "name": "text",
                    "shape": [1],
                    "datatype": "BYTES",
                    "parameters": {"binary_data_size": 6},
                }
            ],
            [struct.pack("<I", 2**31) + b"ab"],
        ),
        400,
        "declares 2147483648",
    ),
    (
        "bool-not-0-or-1",
        *binary(
            [
                {
                    "name": "mask",
                    "shape": [2],
                    "datatype": "BOOL",
                    "parameters": {"binary_data_size": 2},
                }
            ],
            [b"\x01\x05"],
        ),
        400,
        "other than 0 and 1",
    ),
    ("deep-json", b"[" * 60_000, {"Content-Type": "application/json"}, 400, "too deeply"),
    ("gzip-body", b"\x1f\x8b", {"Content-Encoding": "gzip"}, 415, "uncompressed"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Any, Path]]:
    folder = tmp_path_factory.mktemp("hostile")
    path = typed_model(folder / "typed.onnx")
    limits = HttpLimits(
        max_request_bytes=1024 * 1024, max_inflight_bytes=8 * 1024 * 1024, max_json_bytes=65536
    )
    served = Server(
        [ModelSpec("typed", path)],
        http_port=0,
        grpc_port=0,
        pool_options={"sessions": 2, "cache_dir": folder / "cache"},
        limits=limits,
        say=lambda line: None,
    )
    with serving(served):
        yield served.http_port, served, path


def post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
    status, reply, _ = exchange(port, body, headers)
    return status, reply


def exchange(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v2/models/typed/infer", body, headers)
        reply = conn.getresponse()
        return reply.status, reply.read(), reply.headers
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("body", "headers", "status", "words"), [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS]
)
def test_each_hostile_body_gets_its_4xx(
    server: tuple[int, Any, Path], body: bytes, headers: dict[str, str], status: int, words: str
) -> None:
    port, served, _ = server
    got, reply = post(port, body, headers)
    assert got == status, reply[:300]
    assert words in json.loads(reply)["error"]
    assert served.budget.used_bytes == 0


def test_hostile_bodies_leave_a_concurrent_caller_and_the_pool_unharmed(
    server: tuple[int, Any, Path],
) -> None:
    port, served, path = server
    pool = served.models["typed"].pool
    before = pool.stats()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {
        "x": X,
        "ids": np.array([1, 2], np.int64),
        "text": np.array(["a", "b"], dtype=object),
        "mask": np.array([True, False]),
    }
    expected = session.run(["y"], feed)[0]
    good_header = json.dumps(
        {
            "inputs": [x_input([2, 8], 64)]
            + [
                {"name": n, "shape": [2], "datatype": d, "data": v}
                for n, d, v in (
                    ("ids", "INT64", [1, 2]),
                    ("text", "BYTES", ["a", "b"]),
                    ("mask", "BOOL", [True, False]),
                )
            ],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
        }
    ).encode()
    start = threading.Barrier(2)
    good: list[bool] = []

    def well_behaved() -> None:
        start.wait()
        for _ in range(20):
            status, reply, headers = exchange(
                port, good_header + X.tobytes(), {HEADER: str(len(good_header))}
            )
            if status != 200:
                good.append(False)
                continue
            y = np.frombuffer(reply[int(headers[HEADER]) :], np.float32).reshape(2, 8)
            good.append(np.allclose(y, expected, rtol=1e-5, atol=1e-6))

    thread = threading.Thread(target=well_behaved)
    thread.start()
    start.wait()
    try:
        for _ in range(3):
            for _, body, headers, status, _ in CORPUS:
                assert post(port, body, headers)[0] == status
            for _, message, code, _ in GRPC_CORPUS:
                assert call_grpc(served.grpc_port, message())[0] == code
    finally:
        thread.join(timeout=120)
    assert good == [True] * 20
    after = pool.stats()
    assert (after.sessions, after.replaced, after.busy) == (before.sessions, 0, 0)
    assert served.budget.used_bytes == 0


def infer_request(
    *tensors: tuple[str, str, list[int]], raw: list[bytes], model: str = "typed"
) -> Any:
    message = _grpc.message("ModelInferRequest")(model_name=model)
    for name, datatype, shape in tensors:
        message.inputs.add(name=name, datatype=datatype, shape=shape)
    message.raw_input_contents.extend(raw)
    return message


# (id, the request, its status code, words its details must hold)
GRPC_CORPUS: list[tuple[str, Any, Any, str]] = [
    (
        "lying-size",
        lambda: infer_request(("x", "FP32", [2, 8]), raw=[bytes(60)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "takes 64",
    ),
    (
        "raw-count",
        lambda: infer_request(("x", "FP32", [2, 8]), ("ids", "INT64", [2]), raw=[bytes(64)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "raw_input_contents",
    ),
    (
        "wrong-dtype",
        lambda: infer_request(("x", "FP64", [2, 8]), raw=[bytes(128)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "FP32 in the model",
    ),
    (
        "wrong-shape",
        lambda: infer_request(("x", "FP32", [2, 4]), raw=[bytes(32)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "must have 8 on axis 1",
    ),
    (
        "huge-rows",
        lambda: infer_request(("x", "FP32", [2**50, 8]), raw=[bytes(64)]),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "rows",
    ),
    (
        "huge-bytes",
        lambda: infer_request(("x", "FP32", [60_000, 8]), raw=[bytes(64)]),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "more than",
    ),
    (
        "bad-bytes",
        lambda: infer_request(("text", "BYTES", [1]), raw=[struct.pack("<I", 2**31) + b"ab"]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "declares 2147483648",
    ),
    (
        "message-too-large",
        lambda: infer_request(("x", "FP32", [40_000, 8]), raw=[bytes(40_000 * 32)]),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "larger than max",
    ),
    (
        "absent-model",
        lambda: infer_request(("x", "FP32", [1, 8]), raw=[bytes(32)], model="nope"),
        grpc.StatusCode.NOT_FOUND,
        "not served here",
    ),
]


def call_grpc(port: int | None, message: Any) -> tuple[Any, str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(
            f"/{_grpc.SERVICE}/ModelInfer",
            request_serializer=type(message).SerializeToString,
            response_deserializer=_grpc.message("ModelInferResponse").FromString,
        )
        try:
            infer(message, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


@pytest.mark.parametrize(
    ("message", "code", "words"), [c[1:] for c in GRPC_CORPUS], ids=[c[0] for c in GRPC_CORPUS]
)
def test_each_hostile_grpc_request_gets_its_status(
    server: tuple[int, Any, Path], message: Any, code: Any, words: str
) -> None:
    _, served, _ = server
    got, details = call_grpc(served.grpc_port, message())
    assert got == code, details
    assert words in details
    assert served.budget.used_bytes == 0
