"""Real clients, unchanged and with their defaults, against ``sharedml serve`` (in-process).

tritonclient (HTTP: binary tensors by default; gRPC: raw contents) and KServe's clients (REST
and gRPC) reach every endpoint; outputs equal a plain ONNX Runtime session's. 16 callers
started together on one pool each get their own rows back; a model whose rows mix is served
unbatched and stays correct. The same checks run against the Ray deployment in
``tests/sharedml_ray/test_ray_serve.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("grpc", reason="the serve extra is not installed")
pytest.importorskip("tritonclient.http", reason="tritonclient is not installed")
pytest.importorskip("tritonclient.grpc", reason="tritonclient is not installed")

import _clients
from _serving import mixing_model, serving, typed_model

from sharedml.serve._server import ModelSpec, Server


class Served:
    def __init__(self, server: Server, paths: dict[str, Path]) -> None:
        self.server, self.paths = server, paths
        self.http = f"127.0.0.1:{server.http_port}"
        self.grpc = f"127.0.0.1:{server.grpc_port}"

    def url(self, protocol: str) -> str:
        return self.http if protocol == "http" else self.grpc

    def pool(self, name: str) -> object:
        return self.server.models[name].pool


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("clients")
    paths = {"typed": typed_model(folder / "typed.onnx"), "mixing": mixing_model(folder / "m.onnx")}
    server = Server(
        [ModelSpec(name, path) for name, path in paths.items()],
        http_port=0,
        grpc_port=0,
        pool_options={"sessions": 2, "cache_dir": folder / "cache"},
        say=lambda line: None,
    )
    with serving(server):
        yield Served(server, paths)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tritonclient_with_its_defaults_reaches_every_endpoint(
    served: Served, protocol: str
) -> None:
    _clients.check_triton_endpoints(protocol, served.url(protocol), served.paths["typed"])


def test_kserve_clients_with_their_defaults_reach_every_endpoint(served: Served) -> None:
    _clients.check_kserve_clients_in_a_child(served.http, served.grpc, served.paths["typed"])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sixteen_concurrent_callers_each_get_their_own_rows(served: Served, protocol: str) -> None:
    pool = served.pool("typed")
    assert pool.batching is not None, pool.batching_reason  # type: ignore[attr-defined]
    # The server encodes each caller's outputs at once: views of its rows, not copies.
    assert pool.batching.copy_outputs is False  # type: ignore[attr-defined]
    wrong = _clients.concurrent_callers(
        protocol, served.url(protocol), "typed", served.paths["typed"], _clients.typed_feed
    )
    assert wrong == []
    # Requests were merged (one request holds at most 3 rows): the rows had a chance to mix.
    assert pool.stats().max_batch_rows > 3, pool.stats()  # type: ignore[attr-defined]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_row_mixing_model_is_served_unbatched_and_stays_correct(
    served: Served, protocol: str
) -> None:
    pool = served.pool("mixing")
    assert pool.batching is None and "row" in pool.batching_reason  # type: ignore[attr-defined]
    before = pool.stats().runs  # type: ignore[attr-defined]
    wrong = _clients.concurrent_callers(
        protocol, served.url(protocol), "mixing", served.paths["mixing"], _clients.mixing_feed
    )
    assert wrong == []
    assert pool.stats().runs - before == 16 * 4  # type: ignore[attr-defined]
