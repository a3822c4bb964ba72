"""``sharedml serve`` as users run it: a process, its lines, its signals, its errors."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("grpc", reason="the serve extra is not installed")

from _serving import HoldingPool, mixing_model, serving

from sharedml.cli import main
from sharedml.serve._server import ModelSpec, Server, model_specs

SHAREDML = [sys.executable, "-m", "sharedml"]


def start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen[str], list[str], str, str]:
    """``sharedml serve ARGS`` on free ports; its start-up lines and its two addresses."""
    process = subprocess.Popen(
        [
            *SHAREDML,
            "serve",
            *args,
            "--http-port",
            "0",
            "--grpc-port",
            "0",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    lines: list[str] = []
    while not lines or "HTTP on" not in lines[-1]:
        line = process.stderr.readline()
        assert line, f"sharedml serve exited: {lines}"
        lines.append(line.rstrip("\n"))
    found = re.search(r"http://([\d.]+:\d+), gRPC on ([\d.]+:\d+)", lines[-1])
    assert found, lines
    return process, lines, found.group(1), found.group(2)


def post_json(address: str, path: str, doc: Any) -> tuple[int, Any]:
    host, port = address.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, json.dumps(doc), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_says_what_it_opens_serves_and_stops_cleanly_on_a_signal(
    tmp_path: Path, sig: int
) -> None:
    path = mixing_model(tmp_path / "mix.onnx")
    process, lines, http_address, _ = start([f"centered={path}"], tmp_path)
    try:
        assert lines[0].startswith("sharedml serve: opening model 1/1 'centered'")
        assert re.match(r"sharedml serve: 'centered' ready in [\d.]+ s: \d+ session", lines[1])
        assert "batching off" in lines[1] and "row" in lines[1]  # and why
        x = np.arange(16, dtype=np.float32).reshape(2, 8)
        doc = {
            "inputs": [
                {"name": "x", "shape": [2, 8], "datatype": "FP32", "data": x.ravel().tolist()}
            ]
        }
        status, reply = post_json(http_address, "/v2/models/centered/infer", doc)
        assert status == 200, reply
        got = np.reshape(reply["outputs"][0]["data"], (2, 8))
        np.testing.assert_allclose(got, x - x.mean(axis=0))
    finally:
        process.send_signal(sig)
        _, rest = process.communicate(timeout=60)
    assert process.returncode == 0, rest
    assert "draining" in rest and rest.rstrip().endswith("sharedml serve: stopped"), rest
    assert "Traceback" not in rest


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_serve_runs_on_the_event_loop_asked_for(tmp_path: Path, loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is not installed (the serve extra has it)")
    path = mixing_model(tmp_path / "mix.onnx")
    process, lines, http_address, _ = start([f"m={path}", "--loop", loop], tmp_path)
    try:
        assert f"event loop: {loop})" in lines[-1], lines
        x = np.ones((1, 8), np.float32)
        doc = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [1] * 8}]}
        status, reply = post_json(http_address, "/v2/models/m/infer", doc)
        assert status == 200, reply
        np.testing.assert_allclose(reply["outputs"][0]["data"], (x - x.mean(axis=0)).ravel())
    finally:
        process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
    assert process.returncode == 0 and "Traceback" not in rest, rest


def test_a_missing_uvloop_is_a_one_line_error_before_any_pool_opens(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "uvloop.py").write_text("raise ImportError('no uvloop here')\n")
    path = mixing_model(tmp_path / "mix.onnx")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hidden), *sys.path])}
    args = [*SHAREDML, "serve", str(path), "--http-port", "0", "--no-grpc"]
    for loop, status in (("uvloop", 1), ("auto", 0)):
        process = subprocess.Popen(
            [*args, "--loop", loop], env=env, stderr=subprocess.PIPE, text=True
        )
        assert process.stderr is not None
        lines: list[str] = []
        while (line := process.stderr.readline()) and "HTTP on" not in line:
            lines.append(line)
        if line:  # auto: asyncio's loop serves
            assert "event loop: asyncio)" in line, line
            process.send_signal(signal.SIGTERM)
        _, rest = process.communicate(timeout=60)
        err = "".join(lines) + rest
        assert process.returncode == status, err
        if status:
            assert err.count("sharedml: error:") == 1 and "pip install uvloop" in err, err
            assert "opening model" not in err and "Traceback" not in err, err


def test_serve_help_shows_examples() -> None:
    done = subprocess.run([*SHAREDML, "serve", "--help"], capture_output=True, text=True)
    assert done.returncode == 0
    assert "examples:" in done.stdout and "tritonclient" in done.stdout
    assert "--max-inflight-bytes" in done.stdout and "--providers" in done.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["missing.onnx"], "missing.onnx"),
        (["a=x.onnx", "a=y.onnx"], "Two models are named 'a'"),
        (["bad/name=x.onnx"], "must be letters, digits"),
        (["x.onnx", "y.onnx", "--name", "z"], "--name names one model"),
        (["x.onnx", "--ep-library", "WebGpuExecutionProvider=/x.so"], "--providers NAME too"),
        (["x.onnx", "--providers", "P", "--ep-device", "P"], "expected NAME=VALUE"),
    ],
)
def test_serve_errors_are_one_line_and_a_non_zero_exit(
    tmp_path: Path, args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["serve", *args, "--http-port", "0", "--no-grpc"])
    err = capsys.readouterr().err
    assert status == 1, err
    error_lines = [line for line in err.splitlines() if line.startswith("sharedml: error:")]
    assert len(error_lines) == 1 and words in error_lines[0], err
    assert "Traceback" not in err


def test_a_plugin_library_that_cannot_load_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = mixing_model(tmp_path / "m.onnx")
    missing = tmp_path / "libmissing_ep.so"
    status = main(
        [
            "serve",
            str(model),
            "--providers",
            "WebGpuExecutionProvider",
            "--ep-library",
            f"WebGpuExecutionProvider={missing}",
            "--http-port",
            "0",
            "--no-grpc",
            "--cache-dir",
            str(tmp_path / "cache"),
        ]
    )
    err = capsys.readouterr().err
    assert status == 1, err
    error_lines = [line for line in err.splitlines() if line.startswith("sharedml: error:")]
    assert len(error_lines) == 1 and "libmissing_ep.so" in error_lines[0], err
    assert "Traceback" not in err


def test_a_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    path = mixing_model(tmp_path / "mix.onnx")
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                *SHAREDML,
                "serve",
                str(path),
                "--http-port",
                str(port),
                "--no-grpc",
                "--cache-dir",
                str(tmp_path / "cache"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr
    assert "sharedml: error:" in done.stderr and "Traceback" not in done.stderr


def test_model_names_come_from_the_path_or_name_equals_path(tmp_path: Path) -> None:
    specs = model_specs([str(tmp_path / "m.onnx"), "e=x/y.onnx"])
    assert [(s.name, s.path) for s in specs] == [
        ("m", tmp_path / "m.onnx"),
        ("e", Path("x/y.onnx")),
    ]
    assert model_specs(["x/y.onnx"], "named")[0].name == "named"
    odd = tmp_path / "a=b.onnx"  # an existing file whose name holds '=' is a path...
    odd.write_bytes(b"")
    with pytest.raises(ValueError, match="Write NAME=PATH"):  # ...whose stem is no URL name
        model_specs([str(odd)])
    assert model_specs([f"ab={odd}"])[0] == ModelSpec("ab", odd)


def test_a_stop_drains_the_request_in_flight_then_closes_the_pool() -> None:
    pool = HoldingPool(columns=8)
    server = Server(
        [ModelSpec("held", Path("unused.onnx"))],
        http_port=0,
        grpc_port=None,
        open_pool=lambda spec: pool,
        drain_timeout_s=30,
        say=lambda line: None,
    )
    replies: list[int] = []
    with serving(server):
        address = f"127.0.0.1:{server.http_port}"
        doc = {"inputs": [{"name": "x", "shape": [1, 8], "datatype": "FP32", "data": [0] * 8}]}
        client = threading.Thread(
            target=lambda: replies.append(post_json(address, "/v2/models/held/infer", doc)[0])
        )
        client.start()
        deadline = time.monotonic() + 30
        while pool.held == 0:  # the request is in flight, its run waiting
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.stop()  # as SIGTERM does
        deadline = time.monotonic() + 30
        while server.models["held"].ready:  # readiness turns false at once
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not pool.closed and replies == []  # the pool waits for the request
        pool.release()
        client.join(timeout=30)
    assert replies == [200]
    assert pool.closed
