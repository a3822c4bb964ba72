"""Clients that hang up mid-request: the others get their results, and nothing stays held.

Over HTTP a client that disconnects while its request waits or runs in a merged batch once
gave another client a 500 and left a third waiting for good, with a request slot stuck. Here
clients that send a request and hang up at once are started together with clients that wait
for their replies, on a batching pool of one session: ``sharedml serve`` cancels a request
whose client left, and a request cancelled before its batch ran never runs.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("tritonclient.http", reason="tritonclient is not installed")

import _clients
from _serving import serving
from _waiting import wait_until

from sharedml.serve._server import ModelSpec, Server

DIM, LAYERS = 256, 24  # a few milliseconds a run: requests queue behind one session
WAITING, HANGING_UP = 8, 8


def _chain(path: Path) -> Path:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for k in range(LAYERS):
        inits.append(
            numpy_helper.from_array(
                (rng.standard_normal((DIM, DIM)) / np.sqrt(DIM)).astype(np.float32), f"w{k}"
            )
        )
        nodes.append(helper.make_node("MatMul", [x, f"w{k}"], [f"h{k}"]))
        nodes.append(helper.make_node("Tanh", [f"h{k}"], [f"t{k}"]))
        x = f"t{k}"
    nodes.append(helper.make_node("Identity", [x], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", DIM])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", DIM])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _hang_up(port: int, row: np.ndarray) -> None:
    """Send an infer request, then close the connection without reading the reply."""
    body = json.dumps(
        {"inputs": [{"name": "x", "shape": [1, DIM], "datatype": "FP32", "data": row.tolist()}]}
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        conn.shutdown(socket.SHUT_RDWR)


def test_clients_that_hang_up_leave_the_others_their_rows_and_hold_nothing(
    tmp_path: Path,
) -> None:
    path = _chain(tmp_path / "chain.onnx")
    server = Server(
        [ModelSpec("m", path)],
        http_port=0,
        grpc_port=None,
        pool_options={"sessions": 1, "cache_dir": tmp_path / "cache"},
        say=lambda line: None,
    )
    t = _clients.triton("http")
    with serving(server):
        pool = server.models["m"].pool
        assert pool.batching is not None, pool.batching_reason
        url = f"127.0.0.1:{server.http_port}"
        # Clients that leave while their requests wait (the only session held here): those
        # requests are cancelled, never run. Under the traffic below whether any still waits
        # when its client leaves is timing; here it is not.
        rng = np.random.default_rng(99)
        with pool.session():
            for _ in range(HANGING_UP):
                _hang_up(server.http_port, rng.standard_normal(DIM).astype(np.float32))
            wait_until(
                lambda: pool.stats().cancelled >= 1,
                what="a request whose client left while it waited to be cancelled",
            )
        start = threading.Barrier(WAITING + HANGING_UP)
        wrong: list[str] = []
        errors: list[BaseException] = []

        def wait_for_reply(index: int) -> None:
            rng = np.random.default_rng(index)
            client = t.InferenceServerClient(url)
            try:
                start.wait(timeout=60)
                for round_ in range(3):
                    feed = {"x": rng.standard_normal((1, DIM)).astype(np.float32)}
                    got = client.infer("m", _clients.triton_inputs(t, feed)).as_numpy("y")
                    want = _clients.reference(path, feed)["y"]
                    if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                        wrong.append(f"caller {index}, round {round_}")
            except BaseException as exc:  # reported below, with the others
                errors.append(exc)
            finally:
                client.close()

        def hang_up(index: int) -> None:
            rng = np.random.default_rng(100 + index)
            try:
                start.wait(timeout=60)
                for _ in range(3):
                    _hang_up(server.http_port, rng.standard_normal(DIM).astype(np.float32))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait_for_reply, args=(i,)) for i in range(WAITING)]
        threads += [threading.Thread(target=hang_up, args=(i,)) for i in range(HANGING_UP)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in threads), "a client never got a reply"
        assert not errors, errors[:3]
        assert wrong == [], wrong[:3]
        # Whatever the hung-up requests did (ran, or were cancelled before they ran), nothing
        # of theirs stays held: no session busy, no request queued, no byte of the budget.
        wait_until(
            lambda: (
                pool.stats().busy == 0
                and pool.stats().waiting == 0
                and server.budget.used_bytes == 0
            ),
            what="the pool and the byte budget to be idle",
        )
        feed = {"x": np.ones((1, DIM), np.float32)}
        client = t.InferenceServerClient(url)
        try:
            got = client.infer("m", _clients.triton_inputs(t, feed)).as_numpy("y")
        finally:
            client.close()
        np.testing.assert_allclose(got, _clients.reference(path, feed)["y"], rtol=1e-4, atol=1e-5)
