"""``/metrics``: Prometheus text whose numbers are the server's and the pools' own."""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
pytest.importorskip("grpc", reason="the serve extra is not installed")

from _serving import mixing_model, serving
from prometheus_client.parser import text_string_to_metric_families

from sharedml.pool._stats import COUNTERS
from sharedml.protocol import _grpc
from sharedml.serve._server import ModelSpec, Server


def get(port: int, path: str, method: str = "GET", body: Any = None) -> tuple[int, str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(
            method,
            path,
            None if body is None else json.dumps(body),
            {"Content-Type": "application/json"},
        )
        reply = conn.getresponse()
        return reply.status, reply.headers["content-type"], reply.read()
    finally:
        conn.close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_metrics_count_requests_errors_and_read_the_pools_counters(tmp_path: Path) -> None:
    import grpc

    path = mixing_model(tmp_path / "m.onnx")
    server = Server(
        [ModelSpec("m", path)],
        http_port=0,
        grpc_port=0,
        pool_options={"sessions": 2, "cache_dir": tmp_path / "cache"},
        say=lambda line: None,
    )
    good = {"inputs": [{"name": "x", "shape": [2, 8], "datatype": "FP32", "data": [0.5] * 16}]}
    bad = {"inputs": [{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [0.5] * 8}]}
    with serving(server):
        port = server.http_port
        assert port is not None
        for _ in range(3):
            assert get(port, "/v2/models/m/infer", "POST", good)[0] == 200
        assert get(port, "/v2/models/m/infer", "POST", bad)[0] == 400
        request = _grpc.message("ModelInferRequest")(model_name="m")
        request.inputs.add(name="x", datatype="FP32", shape=[1, 8])
        request.raw_input_contents.append(np.ones(8, np.float32).tobytes())
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            infer = channel.unary_unary(
                f"/{_grpc.SERVICE}/ModelInfer",
                request_serializer=type(request).SerializeToString,
                response_deserializer=_grpc.message("ModelInferResponse").FromString,
            )
            infer(request, timeout=60)
        status, media, body = get(port, "/metrics")
        stats = server.models["m"].pool.stats()
    assert status == 200 and media.startswith("text/plain")
    found = samples(body.decode())

    def value(name: str, **labels: str) -> float:
        return found[(name, tuple(sorted(labels.items())))]

    assert value("sharedml_requests_total", model="m", protocol="http", code="200") == 3
    assert value("sharedml_requests_total", model="m", protocol="http", code="400") == 1
    assert value("sharedml_requests_total", model="m", protocol="grpc", code="OK") == 1
    assert value("sharedml_request_errors_total", model="m", protocol="http", code="400") == 1
    assert value("sharedml_request_seconds_count", model="m", protocol="http") == 4
    assert value("sharedml_pool_requests_total", model="m") == stats.runs == 4  # the bad: no run
    for field, (stem, _help) in COUNTERS.items():  # one table: every field exported
        assert value(f"sharedml_pool_{stem}_total", model="m") == getattr(stats, field), field
    assert value("sharedml_pool_sessions", model="m") == stats.sessions
    assert value("sharedml_pool_batching", model="m") == 0  # its rows mix: never merged
    assert value("sharedml_pool_waiting_requests", model="m") == 0
    assert value("sharedml_inflight_bytes") == 0
