"""Helpers for the server tests: a pool stand-in, and a real uvicorn server on a free port."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np


class Arg:
    """What ``pool.get_inputs()`` returns, as far as the servers read it."""

    def __init__(self, name: str, type_: str, shape: Sequence[Any]) -> None:
        self.name, self.type, self.shape = name, type_, list(shape)


class HoldingPool:
    """A pool stand-in whose runs wait until released: admitted requests stay in flight.

    ``run_async`` echoes its one input as ``y``. ``held`` counts the runs waiting now.
    """

    def __init__(self, columns: int = 256) -> None:
        self.columns = columns
        self.held = 0
        self.closed = False
        self._release = threading.Event()

    def get_inputs(self) -> list[Arg]:
        return [Arg("x", "tensor(float)", ["batch", self.columns])]

    def stats(self) -> Any:
        import types

        return types.SimpleNamespace(sessions=1, busy=0, replaced=0)

    def close(self, timeout_s: float | None = None) -> None:
        self.closed = True

    def get_outputs(self) -> list[Arg]:
        return [Arg("y", "tensor(float)", ["batch", self.columns])]

    def release(self) -> None:
        self._release.set()

    async def run_async(self, names: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.held += 1
        try:
            while not self._release.is_set():
                await asyncio.sleep(0.005)
        finally:
            self.held -= 1
        return [np.asarray(feed["x"][:1])]


def free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue until the server accepts them
    return sock


@contextlib.contextmanager
def uvicorn_thread(app: Any, **config: Any) -> Iterator[int]:
    """``app`` served by uvicorn in a thread of this process; yields its port."""
    import uvicorn

    sock = free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, **config)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def typed_model(path: Any, *, dim: int = 8, seed: int = 0) -> Any:
    """A model of four inputs and outputs, one per kind of wire data, rows independent.

    ``x: float32[batch, dim]`` -> ``y = Relu(x @ W + b)``; ``ids: int64[batch]`` ->
    ``twice = 2 * ids``; ``text: string[batch]`` -> ``same = text``; ``mask: bool[batch]`` ->
    ``flipped = not mask``.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32)
    b = (rng.standard_normal(dim) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["mm"]),
            helper.make_node("Add", ["mm", "b"], ["add"]),
            helper.make_node("Relu", ["add"], ["y"]),
            helper.make_node("Mul", ["ids", "two"], ["twice"]),
            helper.make_node("Identity", ["text"], ["same"]),
            helper.make_node("Not", ["mask"], ["flipped"]),
        ],
        "typed",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("text", TensorProto.STRING, ["batch"]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch"]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim]),
            helper.make_tensor_value_info("twice", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("same", TensorProto.STRING, ["batch"]),
            helper.make_tensor_value_info("flipped", TensorProto.BOOL, ["batch"]),
        ],
        initializer=[
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(b, "b"),
            numpy_helper.from_array(np.array(2, np.int64), "two"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def mixing_model(path: Any, *, dim: int = 8) -> Any:
    """``y = x - mean(x over rows)``: every output row depends on every input row.

    Merged with another caller's rows, a caller would get a wrong answer: the row analysis
    must refuse it, and a server must run it unbatched.
    """
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["x"], ["mean"], axes=[0], keepdims=1),
            helper.make_node("Sub", ["x", "mean"], ["y"]),
        ],
        "mixing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@contextlib.contextmanager
def serving(server: Any) -> Iterator[Any]:
    """A ``sharedml.serve`` server serving in a thread of this process until the block ends."""
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(server.serve())
        except BaseException as exc:  # raised in the test's thread below
            errors.append(exc)
            server.started.set()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert server.started.wait(timeout=60), "the server did not start"
    if errors:
        raise errors[0]
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"
        if errors:
            raise errors[0]
