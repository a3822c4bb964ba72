"""Real clients (tritonclient, KServe's), unchanged and with their defaults: shared checks.

Used against ``sharedml serve`` (``tests/serve/test_clients.py``) and against the Ray
deployment (``tests/sharedml_ray/test_ray_serve.py``).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

DATATYPES = {"x": "FP32", "ids": "INT64", "text": "BYTES", "mask": "BOOL"}
_WORDS = np.array(["a", "bé", "ccc", "", "日本"], dtype=object)


def typed_feed(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """A feed for ``_serving.typed_model``: every kind of wire data, distinct per caller."""
    return {
        "x": rng.standard_normal((rows, 8)).astype(np.float32),
        "ids": rng.integers(-(2**40), 2**40, rows).astype(np.int64),
        "text": _WORDS[rng.integers(0, len(_WORDS), rows)],
        "mask": rng.integers(0, 2, rows).astype(bool),
    }


def mixing_feed(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    return {"x": rng.standard_normal((rows, 8)).astype(np.float32)}


def reference(path: Path | str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The outputs of a plain ONNX Runtime session."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feed), strict=True))


def same(got: Any, want: np.ndarray, name: str) -> None:
    got = np.asarray(got)
    if want.dtype == object:  # strings: tritonclient gives UTF-8 bytes, KServe str or bytes
        got = np.array(
            [v.decode() if isinstance(v, bytes) else v for v in got.ravel()], dtype=object
        ).reshape(got.shape)
    if want.dtype.kind == "f":  # a merged batch may round differently, by an ulp or two
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    else:
        np.testing.assert_array_equal(got, want, err_msg=name)


class _Headers:
    """A tritonclient client whose every call sends ``headers`` (None: as it is)."""

    def __init__(self, client: Any, headers: dict[str, str] | None) -> None:
        self._client, self._headers = client, headers

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)
        if self._headers is None or name == "close":
            return method
        return lambda *args, **kwargs: method(*args, headers=self._headers, **kwargs)


def triton(protocol: str) -> Any:
    """``tritonclient.http`` or ``tritonclient.grpc``."""
    return importlib.import_module(f"tritonclient.{protocol}")


def triton_inputs(module: Any, feed: dict[str, np.ndarray], **kw: Any) -> list[Any]:
    inputs = []
    for name, array in feed.items():
        item = module.InferInput(name, list(array.shape), DATATYPES.get(name, "FP32"))
        item.set_data_from_numpy(array, **kw)
        inputs.append(item)
    return inputs


def check_triton_endpoints(
    protocol: str,
    url: str,
    typed_path: Path,
    model: str = "typed",
    headers: dict[str, str] | None = None,
) -> None:
    """Every endpoint of the protocol through tritonclient, with its defaults.

    ``headers``: sent with every call (Ray Serve's gRPC proxy routes by an ``application``
    header where it serves several applications).
    """
    t = triton(protocol)
    client = _Headers(t.InferenceServerClient(url), headers)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready(model)
        assert not client.is_model_ready("absent")
        meta = client.get_server_metadata()
        meta = (
            meta if isinstance(meta, dict) else {"name": meta.name, "extensions": meta.extensions}
        )
        assert meta["name"] == "sharedml" and "binary_tensor_data" in meta["extensions"]
        model_meta = (
            client.get_model_metadata(model, as_json=True)
            if protocol == "grpc"
            else (client.get_model_metadata(model))
        )
        assert model_meta["platform"] == "onnxruntime_onnx" and model_meta["versions"] == ["1"]
        described = [
            (i["name"], i["datatype"], [int(d) for d in i["shape"]]) for i in model_meta["inputs"]
        ]
        assert described == [
            ("x", "FP32", [-1, 8]),
            ("ids", "INT64", [-1]),
            ("text", "BYTES", [-1]),
            ("mask", "BOOL", [-1]),
        ]
        feed = typed_feed(np.random.default_rng(0), 3)
        expected = reference(typed_path, feed)
        result = client.infer(model, triton_inputs(t, feed))  # the defaults: binary/raw tensors
        for name, want in expected.items():
            same(result.as_numpy(name), want, name)
        outputs = [t.InferRequestedOutput("twice"), t.InferRequestedOutput("same")]
        result = client.infer(
            model, triton_inputs(t, feed), outputs=outputs, request_id="r-7", model_version="1"
        )
        response = (
            result.get_response(as_json=True) if protocol == "grpc" else (result.get_response())
        )
        assert response["id"] == "r-7"
        same(result.as_numpy("twice"), expected["twice"], "twice")
        same(result.as_numpy("same"), expected["same"], "same")
        assert result.as_numpy("y") is None
        if protocol == "http":  # JSON tensors, both ways
            outputs = [t.InferRequestedOutput("y", binary_data=False)]
            json_inputs = triton_inputs(t, feed, binary_data=False)
            same(
                client.infer(model, json_inputs, outputs=outputs).as_numpy("y"), expected["y"], "y"
            )
        try:
            client.infer("absent", triton_inputs(t, feed))
            raise AssertionError("an absent model was served")
        except t.InferenceServerException as exc:
            assert "not served here" in str(exc), exc
            assert protocol == "http" or "NOT_FOUND" in str(exc.status()), exc.status()
        narrow = {**feed, "x": np.ascontiguousarray(feed["x"][:, :4])}
        try:
            client.infer(model, triton_inputs(t, narrow))
            raise AssertionError("a wrong shape was accepted")
        except t.InferenceServerException as exc:
            assert "must have 8 on axis 1" in str(exc), exc
            assert protocol == "http" or "INVALID_ARGUMENT" in str(exc.status()), exc.status()
    finally:
        client.close()


def check_kserve_clients(
    http_url: str, grpc_url: str | None, expected_npz: Path, application: str = ""
) -> None:
    """KServe's InferenceRESTClient (protocol v2) and InferenceGRPCClient, their defaults.

    ``http_url`` may hold a path (a Ray Serve route prefix); ``application``, where given, is
    sent as gRPC metadata (Ray Serve's proxy routes by it).
    """
    metadata = (("application", application),) if application else None
    from kserve import (
        InferenceGRPCClient,
        InferenceRESTClient,
        InferInput,
        InferRequest,
        RESTConfig,
    )

    feed = typed_feed(np.random.default_rng(1), 2)
    with np.load(expected_npz, allow_pickle=True) as saved:  # written by the parent
        expected = {name: saved[name] for name in saved.files}

    def request() -> Any:
        inputs = []
        for name, array in feed.items():
            item = InferInput(name, list(array.shape), DATATYPES[name])
            item.set_data_from_numpy(array)  # binary_data=True: its default
            inputs.append(item)
        return InferRequest(model_name="typed", infer_inputs=inputs, request_id="k-1")

    async def main() -> None:
        # protocol="v2" is the one setting: the client's default is KServe's v1 protocol.
        rest = InferenceRESTClient(RESTConfig(protocol="v2"))
        base = f"http://{http_url}"
        try:
            assert await rest.is_server_live(base) and await rest.is_server_ready(base)
            assert await rest.is_model_ready(base, "typed")
            assert not await rest.is_model_ready(base, "absent")
            result = await rest.infer(base, request(), model_name="typed")
            assert result.id == "k-1"
            for output in result.outputs:
                same(output.as_numpy(), expected[output.name], output.name)
        finally:
            await rest.close()
        if grpc_url is None:
            return
        grpc_client = InferenceGRPCClient(grpc_url)
        try:
            assert await grpc_client.is_server_live(headers=metadata)
            assert await grpc_client.is_server_ready(headers=metadata)
            assert await grpc_client.is_model_ready("typed", headers=metadata)
            result = await grpc_client.infer(request(), headers=metadata)
            for output in result.outputs:
                same(output.as_numpy(), expected[output.name], output.name)
        finally:
            await grpc_client.close()

    asyncio.run(main())


def check_kserve_clients_in_a_child(
    http_url: str, grpc_url: str | None, typed_path: Path, application: str = ""
) -> None:
    """:func:`check_kserve_clients` in another process; skipped where kserve is not installed.

    The child runs ``$SHAREDML_KSERVE_PYTHON`` (an environment with only ``kserve``: it pins
    ``psutil<6`` and pulls kubernetes and pandas, which CI keeps out of the test environment),
    else this interpreter. A process of its own in any case: KServe's and tritonclient's
    generated modules both register ``inference.ServerLiveRequest`` (and the rest) in
    protobuf's default pool, and the second one imported in a process fails ("duplicate
    symbol"). The expected outputs are computed here, so the child needs no onnxruntime.
    """
    import os
    import tempfile

    import pytest

    python = os.environ.get("SHAREDML_KSERVE_PYTHON") or sys.executable
    probe = subprocess.run(
        [python, "-c", "import importlib.util as u; print(u.find_spec('kserve') is not None)"],
        capture_output=True,
        text=True,
    )
    if probe.stdout.strip() != "True":
        pytest.skip(f"KServe's client is not installed for {python} (SHAREDML_KSERVE_PYTHON)")
    feed = typed_feed(np.random.default_rng(1), 2)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _clients; "
        "_clients.check_kserve_clients(sys.argv[2], sys.argv[3] or None, sys.argv[4], "
        "sys.argv[5])"
    )
    with tempfile.TemporaryDirectory() as folder:
        expected = Path(folder) / "expected.npz"
        np.savez(expected, **reference(typed_path, feed))  # type: ignore[arg-type]
        done = subprocess.run(
            [python, "-c", code, str(Path(__file__).parent), http_url, grpc_url or "",
             str(expected), application],
            capture_output=True,
            text=True,
            timeout=300,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]


def concurrent_callers(
    protocol: str,
    url: str,
    model: str,
    path: Path,
    make_feed: Any,
    callers: int = 16,
    rounds: int = 4,
    headers: dict[str, str] | None = None,
) -> list[str]:
    """``callers`` threads started together, each its own client and rows; the mismatches."""
    t = triton(protocol)
    start = threading.Barrier(callers)
    wrong: list[str] = []
    errors: list[BaseException] = []

    def call(index: int) -> None:
        rng = np.random.default_rng(1000 + index)
        client = _Headers(t.InferenceServerClient(url), headers)
        try:
            start.wait(timeout=60)
            for round_ in range(rounds):
                feed = make_feed(rng, int(rng.integers(1, 4)))
                result = client.infer(model, triton_inputs(t, feed))
                try:
                    for name, want in reference(path, feed).items():
                        same(result.as_numpy(name), want, name)
                except AssertionError as exc:
                    wrong.append(f"caller {index}, round {round_}: {exc}")
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    return wrong
