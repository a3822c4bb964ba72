"""Real clients, unchanged and with their defaults, against sharedml's Open Inference Protocol.

tritonclient (HTTP: binary tensors by default, in and out) talks to the HTTP routes that both
``sharedml serve`` and ``sharedml.ray`` answer with, here over a real uvicorn in this process;
outputs are compared with a plain ONNX Runtime session. 16 callers started together on one
pool each get their own rows back; a model whose rows mix is served unbatched and stays
correct.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
tritonhttp = pytest.importorskip("tritonclient.http", reason="tritonclient is not installed")

from _serving import mixing_model, typed_model, uvicorn_thread  # noqa: E402

import sharedml  # noqa: E402
from sharedml.serve._http import InferenceHttp  # noqa: E402
from sharedml.serve._models import ServedModel  # noqa: E402

DATATYPES = {"x": "FP32", "ids": "INT64", "text": "BYTES", "mask": "BOOL"}


class Served:
    def __init__(self, port: int, paths: dict[str, Path], pools: dict[str, Any]) -> None:
        self.port, self.paths, self.pools = port, paths, pools
        self.url = f"127.0.0.1:{port}"

    def reference(self, model: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = ort.InferenceSession(str(self.paths[model]), providers=["CPUExecutionProvider"])
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(None, feed), strict=True))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("clients")
    paths = {"typed": typed_model(folder / "typed.onnx"), "mixing": mixing_model(folder / "m.onnx")}
    pools = {
        name: sharedml.SessionPool(path, sessions=2, batching="auto", cache_dir=folder / "cache")
        for name, path in paths.items()
    }
    models = {name: ServedModel(name, pool) for name, pool in pools.items()}
    try:
        with uvicorn_thread(InferenceHttp(models, version="test")) as port:
            yield Served(port, paths, pools)
    finally:
        for pool in pools.values():
            pool.close()


def typed_feed(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    words = np.array(["a", "bé", "ccc", "", "日本"], dtype=object)
    return {
        "x": rng.standard_normal((rows, 8)).astype(np.float32),
        "ids": rng.integers(-(2**40), 2**40, rows).astype(np.int64),
        "text": words[rng.integers(0, len(words), rows)],
        "mask": rng.integers(0, 2, rows).astype(bool),
    }


def triton_inputs(module: Any, feed: dict[str, np.ndarray], **kw: Any) -> list[Any]:
    inputs = []
    for name, array in feed.items():
        item = module.InferInput(name, list(array.shape), DATATYPES.get(name, "FP32"))
        item.set_data_from_numpy(array, **kw)
        inputs.append(item)
    return inputs


def assert_outputs(result: Any, expected: dict[str, np.ndarray]) -> None:
    for name, want in expected.items():
        got = result.as_numpy(name)
        if want.dtype == object:  # strings come back as UTF-8 bytes (tritonclient's BYTES)
            got = np.array([v.decode() for v in got.ravel()], dtype=object).reshape(got.shape)
        if want.dtype.kind == "f":  # a merged batch may round differently, by an ulp or two
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)


def test_tritonclient_http_with_its_defaults_reaches_every_endpoint(served: Served) -> None:
    client = tritonhttp.InferenceServerClient(served.url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        assert client.is_model_ready("typed") and client.is_model_ready("mixing")
        assert not client.is_model_ready("absent")
        meta = client.get_server_metadata()
        assert meta["name"] == "sharedml" and "binary_tensor_data" in meta["extensions"]
        model = client.get_model_metadata("typed")
        assert model["platform"] == "onnxruntime_onnx" and model["versions"] == ["1"]
        assert [(i["name"], i["datatype"], i["shape"]) for i in model["inputs"]] == [
            ("x", "FP32", [-1, 8]),
            ("ids", "INT64", [-1]),
            ("text", "BYTES", [-1]),
            ("mask", "BOOL", [-1]),
        ]
        feed = typed_feed(np.random.default_rng(0), 3)
        expected = served.reference("typed", feed)
        # The defaults: binary tensors in, binary tensors out.
        assert_outputs(client.infer("typed", triton_inputs(tritonhttp, feed)), expected)
        # JSON in, some outputs out (one JSON, one binary), a request id, a version.
        outputs = [
            tritonhttp.InferRequestedOutput("twice", binary_data=False),
            tritonhttp.InferRequestedOutput("same"),
        ]
        result = client.infer(
            "typed",
            triton_inputs(tritonhttp, feed, binary_data=False),
            outputs=outputs,
            request_id="r-7",
            model_version="1",
        )
        assert result.get_response()["id"] == "r-7"
        assert_outputs(result, {k: expected[k] for k in ("twice", "same")})
        assert result.as_numpy("y") is None
        with pytest.raises(tritonhttp.InferenceServerException, match="not served here"):
            client.infer("absent", triton_inputs(tritonhttp, feed))
        with pytest.raises(tritonhttp.InferenceServerException, match="must have 8 on axis 1"):
            client.infer("typed", triton_inputs(tritonhttp, {**feed, "x": feed["x"][:, :4]}))
    finally:
        client.close()


def _callers(
    served: Served, model: str, make_feed: Any, callers: int = 16, rounds: int = 4
) -> list[str]:
    """``callers`` threads started together, each with its own client and rows; the mismatches."""
    start = threading.Barrier(callers)
    wrong: list[str] = []
    errors: list[BaseException] = []

    def call(index: int) -> None:
        rng = np.random.default_rng(1000 + index)
        client = tritonhttp.InferenceServerClient(served.url)
        try:
            start.wait(timeout=60)
            for round_ in range(rounds):
                feed = make_feed(rng, int(rng.integers(1, 4)))
                result = client.infer(model, triton_inputs(tritonhttp, feed))
                try:
                    assert_outputs(result, served.reference(model, feed))
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
        thread.join(timeout=120)
    assert not errors, errors[:3]
    assert not any(t.is_alive() for t in threads)
    return wrong


def test_sixteen_concurrent_callers_each_get_their_own_rows(served: Served) -> None:
    pool = served.pools["typed"]
    assert pool.batching is not None, pool.batching_reason  # merging: rows could mix
    assert _callers(served, "typed", typed_feed) == []
    # Requests were merged (one request holds at most 3 rows): the rows had a chance to mix.
    assert pool.stats().max_batch_rows > 3, pool.stats()


def test_a_row_mixing_model_is_served_unbatched_and_stays_correct(served: Served) -> None:
    pool = served.pools["mixing"]
    assert pool.batching is None and "row" in pool.batching_reason
    before = pool.stats().runs

    def feed(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
        return {"x": rng.standard_normal((rows, 8)).astype(np.float32)}

    assert _callers(served, "mixing", feed) == []
    assert pool.stats().runs - before == 16 * 4
