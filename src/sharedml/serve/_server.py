"""``sharedml serve``: one process, one pool per model, HTTP (uvicorn) and gRPC (grpcio).

Decisions:

- **uvicorn** serves HTTP: the most used ASGI server, already installed with Ray Serve (whose
  proxy runs on it), with flow control, keep-alive and graceful shutdown of its own; the routes
  are :class:`sharedml.serve._http.InferenceHttp`, the code ``sharedml.ray`` answers with too.
  **grpcio**'s asyncio server serves gRPC (:mod:`sharedml.serve._grpc`): the reference
  implementation, also what Ray Serve's proxy uses. Both run on one event loop, so a request
  of either kind awaits the same pools; parsing and encoding happen in worker threads.
- One :class:`~sharedml.SessionPool` per model, shared by every request of both protocols, with
  ``batching="auto"`` by default: a server holds many callers' requests at once, and the pool
  merges them wherever the row-independence analysis proves it safe (the pool says why not
  otherwise, and the start-up line shows it).
- A merged request's outputs are views of its own rows (``Batching(copy_outputs=False)``,
  :func:`served_batching`): the server encodes them at once and lets go, so a copy per caller
  would be work for nothing, made on the leader's thread before the event loop hears of the
  batch (async callers have no thread of their own to copy in).
- One byte budget (:class:`~sharedml.protocol._admission.InflightBytes`) for both protocols:
  HTTP bodies are reserved before they are read, gRPC messages as they arrive.
- SIGINT (Ctrl-C) and SIGTERM drain: readiness turns false, the listeners close, requests in
  flight finish (up to ``drain_timeout_s``), then the pools close. A second signal stops at
  once. uvicorn's own signal handling is turned off: it would take SIGINT and SIGTERM for its
  HTTP server alone while gRPC kept taking requests, and re-raise them once HTTP had stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sharedml.protocol._admission import HttpLimits, InflightBytes
from sharedml.serve._http import InferenceHttp
from sharedml.serve._models import ServedModel

if TYPE_CHECKING:  # the pool (numpy, onnxruntime) loads once a server opens one
    from sharedml.pool._options import PoolOptions

__all__ = ["LOOPS", "ModelSpec", "Server", "loop_runner", "model_specs", "served_batching"]

_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model to serve: the name clients use and its file."""

    name: str
    path: Path


def model_specs(models: Sequence[str], name: str | None = None) -> list[ModelSpec]:
    """``PATH`` or ``NAME=PATH`` arguments as specs (a path's name is its file's stem).

    Raises:
        ValueError: a name that is not a URL path segment, a name given twice, or ``name``
            with several models.
    """
    if name is not None and len(models) != 1:
        raise ValueError(
            f"--name names one model, but {len(models)} were given: write NAME=PATH for each."
        )
    specs: list[ModelSpec] = []
    for item in models:
        given, sep, path = item.partition("=")
        if not sep or not given or os.path.exists(item):
            given, path = "", item
        chosen = name or given or Path(path).stem
        if not chosen or not set(chosen) <= _NAME_OK:
            raise ValueError(
                f"Model name {chosen!r} (from {item!r}) must be letters, digits, '.', '_' or "
                "'-': it is part of the URL /v2/models/<name>. Write NAME=PATH."
            )
        if any(s.name == chosen for s in specs):
            raise ValueError(
                f"Two models are named {chosen!r}: give one another name with NAME=PATH."
            )
        specs.append(ModelSpec(chosen, Path(path)))
    return specs


def served_batching(setting: Any) -> Any:
    """A pool's ``batching=`` as the server opens it: ``"auto"`` and ``True`` hand out views.

    ``"auto"`` becomes ``Batching(copy_outputs=False, required=False)`` and ``True``
    ``Batching(copy_outputs=False)``: each caller's outputs are views of its own rows of the
    batch, which the server encodes and drops (no other caller's rows are reachable from
    them). A ``Batching`` given is kept as it is, and so is ``False``.
    """
    from sharedml.pool._batching import Batching

    if isinstance(setting, str) and setting == "auto":
        return Batching(copy_outputs=False, required=False)
    if setting is True:
        return Batching(copy_outputs=False)
    return setting


def _describe(pool: Any) -> str:
    """``4 session(s), CPUExecutionProvider, batching on (why)`` for a start-up line."""
    sessions = pool.stats().sessions
    providers: list[str] = getattr(pool, "get_providers", list)()
    merging = "batching on" if getattr(pool, "batching", None) is not None else "batching off"
    reason = getattr(pool, "batching_reason", "")
    return f"{sessions} session(s), {', '.join(providers[:1]) or 'no provider'}, {merging}" + (
        f" ({reason})" if reason else ""
    )


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (IPv6 where ``host`` is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    # Accepted connections inherit it (Linux): a reply's headers and body go out as written.
    # Without it, Nagle's algorithm held the body until the client acknowledged the headers,
    # which its delayed ACK does after ~40 ms: every request took 40 ms or more.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Server:
    """``sharedml serve`` in a process: pools opened, then HTTP and gRPC served until stopped.

    Args:
        models: What to serve.
        host: The address both protocols listen on (default: loopback only).
        http_port: HTTP's port (0: any free port; :attr:`http_port` says which).
        grpc_port: gRPC's port (0: any free port), or None for no gRPC.
        pool_options: Every model's pool: ``SessionPool`` arguments by name (``sessions``,
            ``batching``, ``providers``, ``cache_dir``...; ``batching`` defaults to
            ``"auto"``, and ``"auto"`` and ``True`` hand out views: :func:`served_batching`),
            or a :class:`~sharedml.pool._options.PoolOptions` built already.
        limits: What requests may hold (:class:`HttpLimits`).
        drain_timeout_s: How long a stop waits for requests in flight.
        say: Where progress lines go (default: standard error).
        open_pool: Opens a model's pool (default: the ``SessionPool`` ``pool_options`` describe):
            anything with the pool's ``run_async``, ``get_inputs``, ``get_outputs``,
            ``stats``, ``closed`` and ``close`` serves (the benchmark puts N plain ONNX Runtime
            sessions behind the same server this way).

    Raises:
        SharedMLError: a model cannot be opened (the pools opened so far are closed).
    """

    def __init__(
        self,
        models: Sequence[ModelSpec],
        *,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int | None = 8001,
        pool_options: PoolOptions | Mapping[str, Any] | None = None,
        limits: HttpLimits | None = None,
        drain_timeout_s: float = 30.0,
        say: Callable[[str], None] | None = None,
        open_pool: Callable[[ModelSpec], Any] | None = None,
    ) -> None:
        self.host = host
        self.limits = limits or HttpLimits()
        self.budget = InflightBytes(self.limits.max_inflight_bytes)
        self.drain_timeout_s = drain_timeout_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self._requested_ports = (http_port, grpc_port)
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._force = False
        self.models: dict[str, ServedModel] = {}
        from sharedml.pool._options import PoolOptions

        if not isinstance(pool_options, PoolOptions):  # checked once, for every model
            given = {"batching": "auto", **(pool_options or {})}
            given["batching"] = served_batching(given["batching"])
            pool_options = PoolOptions.from_arguments(**given)
        self._open(models, pool_options, open_pool)
        from sharedml.serve._metrics import ServerMetrics

        self.metrics = ServerMetrics(self.models, lambda: self.budget.used_bytes)
        self.http = InferenceHttp(
            self.models,
            version=_version(),
            limits=self.limits,
            budget=self.budget,
            observer=self.metrics.observe,
            extra_routes={"/metrics": self.metrics.render},
        )

    def _open(
        self,
        models: Sequence[ModelSpec],
        options: PoolOptions,
        open_pool: Callable[[ModelSpec], Any] | None,
    ) -> None:
        from sharedml.pool import _pool

        if open_pool is None:

            def open_pool(spec: ModelSpec) -> Any:
                return _pool.open_pool(spec.path, options)

        try:
            for index, spec in enumerate(models, 1):
                self.say(
                    f"sharedml serve: opening model {index}/{len(models)} '{spec.name}' "
                    f"({spec.path})..."
                )
                start = time.perf_counter()
                pool = open_pool(spec)
                self.models[spec.name] = ServedModel(spec.name, pool)
                self.say(
                    f"sharedml serve: '{spec.name}' ready in {time.perf_counter() - start:.1f} s:"
                    f" {_describe(pool)}"
                )
        except BaseException:
            self.close_pools()
            raise

    # ----------------------------------------------------------------------------------------
    # Lifecycle

    def close_pools(self) -> None:
        """Close every pool, waiting for runs in flight up to ``drain_timeout_s``."""
        for model in self.models.values():
            model.draining = True
            model.pool.close(timeout_s=self.drain_timeout_s)

    def stop(self) -> None:
        """Ask the server to drain and stop (thread-safe; a second call stops at once)."""
        loop, stop = self._loop, self._stop
        if loop is None or stop is None:
            return
        if stop.is_set():
            self._force = True
        loop.call_soon_threadsafe(stop.set)

    async def serve(self, on_started: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`stop` (or a signal, under :meth:`run`); then drain and close.

        Args:
            on_started: Called once both protocols listen.
        """
        import uvicorn

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        http_port, grpc_port = self._requested_ports
        sock = _listen(self.host, http_port)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.http,
            lifespan="off",
            log_level="warning",
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=max(1, round(self.drain_timeout_s)),
        )
        http = _uvicorn_server(config)
        http_task = asyncio.ensure_future(http.serve(sockets=[sock]))
        grpc_server = None
        try:
            if grpc_port is not None:
                from sharedml.serve._grpc import start_grpc

                grpc_server, self.grpc_port = await start_grpc(
                    self.models,
                    _grpc_address(self.host, grpc_port),
                    limits=self.limits,
                    budget=self.budget,
                    version=_version(),
                    observer=self.metrics.observe,
                )
            while not http.started:
                if http_task.done():  # it failed to start: its exception says why
                    await http_task
                await asyncio.sleep(0.01)
            self.started.set()
            if on_started is not None:
                on_started()
            await self._stop.wait()
        finally:
            for model in self.models.values():
                model.draining = True  # readiness false from now on
            http.should_exit = True
            if self._force:
                http.force_exit = True
            waits: list[Any] = [http_task]
            if grpc_server is not None:
                waits.append(grpc_server.stop(0 if self._force else self.drain_timeout_s))
            await asyncio.gather(*waits, return_exceptions=True)
            sock.close()
            await asyncio.to_thread(self.close_pools)

    def run(self, loop: str = "auto") -> None:
        """Serve in the foreground until SIGINT or SIGTERM, then drain and close.

        Args:
            loop: The event loop: ``"uvloop"``, ``"asyncio"`` (the standard library's), or
                ``"auto"`` (default): uvloop where it is installed, as uvicorn chooses. Every
                request's Python (parsing, the pool's queueing, the results' hand-over) runs
                on it: uvloop's cost per request is lower (docs/serve.md).

        Raises:
            ValueError: ``"uvloop"`` where it is not installed, or another name.
        """
        runner = loop_runner(loop)

        def on_signal(*_: Any) -> None:
            if self._stop is not None and self._stop.is_set():
                self.say("sharedml serve: stopping now")
            else:
                self.say(
                    f"sharedml serve: draining (up to {self.drain_timeout_s:g} s; again to stop "
                    "now)"
                )
            self.stop()

        async def main() -> None:
            with _signals(asyncio.get_running_loop(), on_signal):
                await self.serve(on_started=lambda: self.say(self.listening()))

        runner(main())
        self.say("sharedml serve: stopped")

    def listening(self) -> str:
        """The line saying where the server listens."""
        where = f"http://{_grpc_address(self.host, self.http_port or 0)}"
        grpc = (
            f", gRPC on {_grpc_address(self.host, self.grpc_port)}"
            if self.grpc_port is not None
            else ""
        )
        loop = type(self._loop).__module__.split(".")[0] if self._loop is not None else "none"
        return (
            f"sharedml serve: HTTP on {where}{grpc} "
            f"({', '.join(self.models)}; event loop: {loop}); Ctrl-C drains and stops"
        )


LOOPS = ("auto", "asyncio", "uvloop")


def loop_runner(loop: str) -> Callable[[Any], Any]:
    """``asyncio.run`` or uvloop's, for :meth:`Server.run`'s ``loop``."""
    if loop not in LOOPS:
        raise ValueError(f"loop must be one of {', '.join(LOOPS)}, not {loop!r}.")
    if loop == "asyncio":
        return asyncio.run
    try:
        import uvloop
    except ImportError:
        if loop == "uvloop":
            raise ValueError(
                "loop='uvloop' needs uvloop (pip install uvloop; not on Windows)."
            ) from None
        return asyncio.run
    return uvloop.run


def _uvicorn_server(config: Any) -> Any:
    """Uvicorn's server without its signal handlers (the process's are :meth:`Server.run`'s)."""
    import uvicorn

    class Quiet(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Quiet(config)


@contextlib.contextmanager
def _signals(loop: asyncio.AbstractEventLoop, handler: Callable[..., None]) -> Iterator[None]:
    """SIGINT and SIGTERM call ``handler`` on the loop while the block runs."""
    names = [signal.SIGINT, signal.SIGTERM]
    installed: list[Any] = []
    try:
        for sig in names:
            try:
                loop.add_signal_handler(sig, handler)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):  # Windows: no loop signal handlers
                previous = signal.signal(sig, lambda *a: loop.call_soon_threadsafe(handler))
                installed.append((sig, previous))
        yield
    finally:
        for item in installed:
            if isinstance(item, tuple):
                signal.signal(*item)
            else:
                loop.remove_signal_handler(item)


def _version() -> str:
    from sharedml import __version__

    return __version__
