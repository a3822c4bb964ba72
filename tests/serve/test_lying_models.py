"""Models whose declared shapes lie, served over HTTP: 16 clients each get their own rows.

The corpus of ``tests/_lying.py`` (each model joins callers' rows when ONNX Runtime runs it as
declared) behind ``sharedml serve`` with its defaults (batching wherever the analysis proves
it): 16 tritonclient callers started together first send harmless rows (zeros: merged, they
pass any check), then rows of their own; every reply equals a plain session's run of that
caller's row alone, and no merge check had to step in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("tritonclient.http", reason="tritonclient is not installed")

import _clients
import onnx
from _lying import LYING
from _serving import serving

from sharedml.serve._server import ModelSpec, Server

CALLERS, ROUNDS = 16, 3


def _name(case: str) -> str:
    return "m" + str(sorted(LYING).index(case))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, Path]]]:
    folder = tmp_path_factory.mktemp("lying")
    paths = {}
    for case, (build, _feeds) in LYING.items():
        paths[_name(case)] = folder / f"{_name(case)}.onnx"
        onnx.save(build(), paths[_name(case)])
    server = Server(
        [ModelSpec(name, path) for name, path in paths.items()],
        http_port=0,
        grpc_port=None,
        pool_options={"sessions": 1, "cache_dir": folder / "cache"},
        say=lambda line: None,
    )
    with serving(server):
        yield server, paths


@pytest.mark.parametrize("case", sorted(LYING))
def test_sixteen_http_clients_each_get_their_own_rows_after_a_primed_batch(
    served: tuple[Server, dict[str, Path]], case: str
) -> None:
    server, paths = served
    name = _name(case)
    pool = server.models[name].pool
    assert pool.batching is not None, pool.batching_reason
    t = _clients.triton("http")
    url = f"127.0.0.1:{server.http_port}"
    start = threading.Barrier(CALLERS)
    wrong: list[str] = []
    errors: list[BaseException] = []

    def call(index: int) -> None:
        rng = np.random.default_rng(index)
        client = t.InferenceServerClient(url)
        try:
            start.wait(timeout=60)
            zeros = {"x": np.zeros((1, 4), np.float32)}
            client.infer(name, _clients.triton_inputs(t, zeros))
            start.wait(timeout=60)  # every client's harmless row served before any real one
            for round_ in range(ROUNDS):
                feed = {"x": (rng.standard_normal((1, 4)) + 8 * index).astype(np.float32)}
                got = client.infer(name, _clients.triton_inputs(t, feed)).as_numpy("y")
                want = _clients.reference(paths[name], feed)["y"]  # one row: the lie holds
                if not np.allclose(got, want, rtol=1e-5, atol=1e-4):
                    wrong.append(f"caller {index}, round {round_}: {got} != {want}")
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not errors, errors[:3]
    assert wrong == [], wrong[:3]
    stats = pool.stats()
    assert stats.max_batch_rows > 1, stats  # callers met in merged runs
    assert stats.batch_mismatches == 0, stats  # the proof held: no check had to step in
